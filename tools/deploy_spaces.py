"""Deploy a run's bucket and its three Spaces to the Hugging Face Hub in one command.

``python -m tools.deploy_spaces`` (``make spaces``) with ``HF_TOKEN`` set:

1. creates the bucket ``<owner>/<bucket>`` (``create_bucket``, private by default);
2. creates the rollout (vLLM, GPU), Wordle and dashboard Spaces in ``<owner>``'s account as Docker
   Spaces (``create_repo``), or duplicates them from ``--from-owner``'s Spaces (``duplicate_repo``),
   private unless ``--public`` is given (clients then send ``Authorization: Bearer $HF_TOKEN``);
3. sets each Space's secrets (``HF_TOKEN``; ``CONTROL_TOKEN`` for the rollout Space) and variables
   (``BUCKET``, ``MODEL``, ``POLL_INTERVAL_S``), then requests its hardware,
   with a sleep time (default 1 hour of inactivity) on paid hardware such as the rollout GPU;
4. uploads each Space in the layout its Dockerfile expects: the Wordle Space's folder as it is (an
   OpenEnv environment, its own build context); the rollout and dashboard Spaces together with the
   ``deltasync`` package they install (the repository root's layout): ``Dockerfile`` and
   ``README.md`` (front matter) at the Space root, ``pyproject.toml``, ``shared/deltasync/`` and
   ``spaces/<space>/``;
5. waits until every Space reports RUNNING, then prints the ``make train ...`` line to run next.

Tokens, least privilege first: ``HF_TOKEN`` (the deploy token) creates everything; the Spaces get
``SPACE_HF_TOKEN`` (``--space-token``) as their ``HF_TOKEN`` secret, and the dashboard
``DASHBOARD_HF_TOKEN`` (``--dashboard-token``, read-only is enough) where given. Without them the
deploy token is reused and a warning says how to make a narrower one.

``--down`` (``make spaces-down``) pauses the rollout Space(s) so that they stop billing, and says
how to restart them.

``--dry-run`` prints every Hub call it would make (secrets masked) and makes none. Secret values are
never printed, logged or written (the generated CONTROL_TOKEN alone is kept, in a 0600 file).
huggingface_hub is imported only when a deploy runs, so importing ``deltasync`` stays light.
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, TextIO

from .space_config import FAILED_STAGES, MASK, DeployConfig, DeployError, SpaceSpec, parse_args
from .space_plan import hub_calls, next_step, space_specs, token_warning
from .space_stage import (
    HubCall,
    check_hardware,
    failure_message,
    hub_api,
    logs_hint,
    mmss,
    runtime_url,
    stage_space,
)


class Deployer:
    """Plans and runs a deploy.

    Args:
        config: :class:`DeployConfig`.
        api: an ``HfApi``-like object (tests pass a recording fake); default: ``hub_api(token)``.
        out: where the plan, progress and next steps are printed.
        sleep: ``time.sleep`` (tests pass a fake clock's).
        clock: ``time.monotonic``.
    """

    def __init__(
        self,
        config: DeployConfig,
        api: Any = None,
        out: TextIO | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = config
        self._api = api
        self.out = out if out is not None else sys.stdout
        self.sleep = sleep
        self.clock = clock
        self.owner: str | None = config.owner
        self.control_token_generated = False
        # the last runtime (``SpaceRuntime.raw``) seen per repo id while waiting
        self.runtimes: dict[str, dict] = {}

    # -------------------------------------------------------------------------------- planning
    def specs(self, owner: str) -> list[SpaceSpec]:
        """The three Spaces with their names, hardware, variables and secrets
        (:func:`space_specs`); a CONTROL_TOKEN is generated on the first call when none was
        given, and kept for the rest of the deploy."""
        if self.cfg.control_token is None:
            self.cfg.control_token = secrets.token_urlsafe(32)
            self.control_token_generated = True
        return space_specs(self.cfg, owner)

    def token_warning(self, owner: str) -> str | None:
        """The warning about a Space given the deploy token itself (:func:`token_warning`)."""
        return token_warning(self.cfg, owner)

    def plan(self, owner: str) -> list[HubCall]:
        """Every Hub call of the deploy, in order (:func:`hub_calls`)."""
        return hub_calls(self.cfg, owner, self.specs(owner))

    def next_step(self, owner: str) -> str:
        """The ``make train ...`` line that trains against the deployed Spaces and bucket, with
        the URLs the Hub reported for them while waiting (:meth:`space_urls`)."""
        return next_step(self.cfg, owner, self.specs(owner), self.space_urls(owner))

    def space_urls(self, owner: str) -> dict[str, str]:
        """Each Space's URL by key: the domain its last runtime reported (``runtime_url``: a
        local Hub's ``http://127.0.0.1:PORT``), else ``https://<owner>-<name>.hf.space``."""
        return {
            s.key: runtime_url(owner, s.name, self.runtimes.get(f"{owner}/{s.name}"))
            for s in self.specs(owner)
        }

    # --------------------------------------------------------------------------------- running
    @property
    def api(self):
        if self._api is None:
            self._api = hub_api(self.cfg.token)
        return self._api

    def _print(self, msg: str = "") -> None:
        print(msg, file=self.out, flush=True)

    def _resolve_owner(self, dry_run: bool) -> str:
        """The account that owns the Spaces: ``--owner``, else ``whoami()`` (a placeholder in a
        dry run, which calls nothing)."""
        if self.owner is None:
            if dry_run:
                self.owner = "<your-username>"
                self._print("would call: whoami()  (pass --owner to name the account)")
            else:
                self._print("whoami()")
                self.owner = self.api.whoami()["name"]
        return self.owner

    def run(self, dry_run: bool = False) -> str:
        """Deploy (or with ``dry_run``, print the calls without making any).

        Returns:
            The ``make train ...`` line to run next.

        Raises:
            DeployError: no HF_TOKEN (except in a dry run), a missing file, or a Space that ended
                in an error stage or did not come up within ``timeout_s``.
            ValueError: an unknown hardware flavor.
            huggingface_hub errors of a refused call (e.g. HfHubHTTPError), unchanged.
        """
        c = self.cfg
        if not c.token and not dry_run:
            raise DeployError(
                "HF_TOKEN is not set: create a token with write access at "
                "https://huggingface.co/settings/tokens and run `HF_TOKEN=hf_... make spaces` "
                "(or export HF_TOKEN)"
            )
        owner = self._resolve_owner(dry_run)
        calls = self.plan(owner)
        check_hardware(self.specs(owner))
        tag = "would call: " if dry_run else ""
        if dry_run:
            self._print(f"dry run: no Hub call is made; HfApi(token={MASK!r})")
        warning = self.token_warning(owner)
        if warning:
            self._print(warning)
        for call in calls:
            if call.stage is None:
                self._print(tag + call.render())
                if not dry_run:
                    getattr(self.api, call.fn)(**call.kwargs)
                continue
            with tempfile.TemporaryDirectory(prefix="deltasync-space-") as tmp:
                staged = stage_space(c.repo_root, call.stage.folder, tmp, call.stage.own_context)
                self._print(tag + call.render(staged))
                if not dry_run:
                    self.api.upload_folder(folder_path=tmp, **call.kwargs)
        specs = self.specs(owner)
        if not dry_run and self.control_token_generated:
            self._save_control_token(owner, specs[0].name)
        if not dry_run and c.wait:
            self.wait_running([f"{owner}/{s.name}" for s in specs])
        line = self.next_step(owner)
        urls = self.space_urls(owner)
        self._print()
        for s in specs:
            self._print(
                f"{s.key:>9}: {urls[s.key]}  (https://huggingface.co/spaces/{owner}/{s.name})"
            )
        self._print(f"   bucket: hf://buckets/{owner}/{c.bucket_name}")
        self._print("\nNext, train against them:\n")
        self._print(f"  {line}\n")
        return line

    def down(self, dry_run: bool = False) -> list[str]:
        """Pause the rollout Space(s) (``pause_space``): a paused Space bills nothing until it is
        restarted. Prints how to restart them.

        Returns:
            The paused Spaces' repo ids.

        Raises:
            DeployError: no HF_TOKEN (except in a dry run), or a Space that does not exist or that
                this token may not pause; the message names the Space and what to check.
        """
        c = self.cfg
        if not c.token and not dry_run:
            raise DeployError(
                "HF_TOKEN is not set: pausing a Space needs a token of its owner with write "
                "access; run `HF_TOKEN=hf_... make spaces-down BUCKET=<owner>/<bucket>`"
            )
        owner = self._resolve_owner(dry_run)
        names = list(c.rollout_spaces) or [f"{c.prefix}-rollout"]
        repo_ids = [f"{owner}/{n}" for n in names]
        tag = "would call: " if dry_run else ""
        if dry_run:
            self._print(f"dry run: no Hub call is made; HfApi(token={MASK!r})")
        for repo_id in repo_ids:
            call = HubCall("pause_space", dict(repo_id=repo_id))
            self._print(tag + call.render())
            if dry_run:
                continue
            try:
                self.api.pause_space(repo_id=repo_id)
            except Exception as e:
                status = getattr(getattr(e, "response", None), "status_code", None)
                if status not in (401, 403, 404) and type(e).__name__ not in (
                    "RepositoryNotFoundError",
                    "GatedRepoError",
                ):
                    raise
                raise DeployError(
                    f"expected Space {repo_id} that this HF_TOKEN may pause, found "
                    f"{status or type(e).__name__}: check --bucket/--owner and --prefix (or "
                    "--rollout-space NAME), and that HF_TOKEN is a write token of the Space's "
                    "owner"
                ) from e
        verb = "would be paused" if dry_run else "paused"
        self._print(f"\n{verb}: {', '.join(repo_ids)} (a paused Space bills nothing).")
        self._print("Restart later (billing resumes; vLLM reloads the model and re-anchors):")
        for repo_id in repo_ids:
            self._print(
                f"  hf spaces restart {repo_id}   (or the Restart button at "
                f"https://huggingface.co/spaces/{repo_id}/settings)"
            )
        return repo_ids

    def _save_control_token(self, owner: str, space: str) -> None:
        """Keep a generated CONTROL_TOKEN in a 0600 file under runs/ (its value is not printed)."""
        folder = self.cfg.state_dir or os.path.join(self.cfg.repo_root, "runs", "spaces")
        path = os.path.join(folder, f"{owner}--{space}.control_token")
        os.makedirs(folder, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.cfg.control_token + "\n")
        self._print(f"CONTROL_TOKEN of {owner}/{space} saved to {path} (mode 0600)")

    def wait_running(self, repo_ids: list[str]) -> None:
        """Poll ``get_space_runtime`` until every Space is RUNNING, printing progress.

        Raises:
            DeployError: a Space reached a failed stage (BUILD_ERROR, RUNTIME_ERROR, ...) or not
                every Space was RUNNING after ``timeout_s``; the message names the Space, its URL
                and how to read its logs.
        """
        c = self.cfg
        start = self.clock()
        stages = {r: "?" for r in repo_ids}
        building_seen = dict.fromkeys(repo_ids, False)
        tty = getattr(self.out, "isatty", lambda: False)()
        last_line, last_print = "", -1e9
        while True:
            elapsed = self.clock() - start
            for r in repo_ids:
                if stages[r] == "RUNNING" and building_seen[r]:
                    continue
                rt = self.api.get_space_runtime(r)
                self.runtimes[r] = getattr(rt, "raw", None) or {}
                stage = str(getattr(rt.stage, "value", rt.stage))
                stages[r] = stage
                if stage not in ("RUNNING", *FAILED_STAGES):
                    building_seen[r] = True
                settled = building_seen[r] or elapsed >= c.grace_s
                if stage in FAILED_STAGES and settled:
                    raise DeployError(failure_message(r, stage, getattr(rt, "raw", {}) or {}))
                if stage == "RUNNING" and settled:
                    building_seen[r] = True  # counts as done from now on
            done = [r for r in repo_ids if stages[r] == "RUNNING" and building_seen[r]]
            line = f"[{mmss(elapsed)}] " + " | ".join(
                f"{r.split('/')[-1]} {stages[r]}" for r in repo_ids
            )
            if tty:
                self.out.write("\r" + line.ljust(len(last_line)))
                self.out.flush()
            elif (
                line.split("] ", 1)[1] != last_line.split("] ", 1)[-1] or elapsed - last_print >= 60
            ):
                self._print(line)
                last_print = elapsed
            last_line = line
            if len(done) == len(repo_ids):
                if tty:
                    self.out.write("\n")
                self._print(f"all {len(repo_ids)} Spaces are RUNNING after {mmss(elapsed)}")
                return
            if elapsed >= c.timeout_s:
                if tty:
                    self.out.write("\n")
                waiting = [f"{r} ({stages[r]})" for r in repo_ids if r not in done]
                raise DeployError(
                    f"expected every Space RUNNING within {c.timeout_s:.0f}s, found still "
                    f"waiting: {', '.join(waiting)}. A vLLM image build can take 30 minutes: "
                    "rerun with a larger --timeout-s (re-running is safe), or read the logs: "
                    + "; ".join(logs_hint(r.split("/")[0], r.split("/")[1]) for r in waiting)
                )
            self.sleep(c.check_every_s)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tools.deploy_spaces``; returns the exit status."""
    cfg, dry_run, down = parse_args(argv)
    try:
        deployer = Deployer(cfg)
        if down:
            deployer.down(dry_run=dry_run)
        else:
            deployer.run(dry_run=dry_run)
    except DeployError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
