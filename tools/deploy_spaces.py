"""Deploy a run's bucket and its three Spaces to the Hugging Face Hub in one command.

``python -m tools.deploy_spaces`` (``make spaces``) with ``HF_TOKEN`` set:

1. creates the bucket ``<owner>/<bucket>`` (``create_bucket``, private by default);
2. creates the rollout (vLLM, GPU), environment and dashboard Spaces in ``<owner>``'s account as
   Docker Spaces (``create_repo``), or duplicates them from ``--from-owner``'s Spaces (``duplicate_repo``),
   private unless ``--public`` is given (clients then send ``Authorization: Bearer $HF_TOKEN``);
3. sets each Space's secrets (``HF_TOKEN``; ``CONTROL_TOKEN`` for the rollout Space) and variables
   (``BUCKET``, ``MODEL``, ``POLL_INTERVAL_S``), then requests its hardware,
   with a sleep time (default 1 hour of inactivity) on paid hardware such as the rollout GPU;
4. uploads each Space in the layout its Dockerfile expects: the environment Space's folder as it
   is (an OpenEnv environment, its own build context: ``spaces/wordle-env``, or with ``--task``
   (``make spaces TASK=...``) the task's ``Task.space``, named ``<prefix>-<task>``:
   ``tools.env_space``); the rollout and dashboard Spaces together with the
   ``deltasync`` package they install (the repository root's layout): ``Dockerfile`` and
   ``README.md`` (front matter) at the Space root, ``pyproject.toml``, ``shared/deltasync/`` and
   ``spaces/<space>/``;
5. waits until every Space reports RUNNING, then prints the ``make train ...`` line to run next.

Tokens, least privilege first: ``HF_TOKEN`` (the deploy token) creates everything; the Spaces get
``SPACE_HF_TOKEN`` (``--space-token``) as their ``HF_TOKEN`` secret, and the dashboard
``DASHBOARD_HF_TOKEN`` (``--dashboard-token``, read-only is enough) where given. Without them the
deploy token is reused and a warning says how to make a narrower one.

``--only env`` (repeatable: rollout, env, dashboard) deploys only those Spaces, e.g. a changed
environment; the bucket is created either way.

``--down`` (``make spaces-down``) pauses the rollout Space(s) so that they stop billing, and says
how to restart them.

``--dry-run`` prints every Hub call it would make (secrets masked) and makes none. Secret values are
never printed, logged or written, except the generated CONTROL_TOKEN, ROLLOUT_API_KEY and the
environment Space's key (WORDLE_API_KEY, or the task's ``<TASK NAME>_API_KEY``), each kept in a
0600 file under ``runs/spaces/`` and reused by every later deploy (a public rollout or environment
Space always gets its key; the printed ``make train`` line reads it from that file into the
variable the trainer reads). Visibility: everything is private unless ``--public``; a deploy that finds a
repo of the other visibility (``exist_ok`` leaves it as it was) sets it and says so.
huggingface_hub is imported only when a deploy runs, so importing ``deltasync`` stays light.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, TextIO

from trainer.task.base import ENV_KEY_VAR  # the trainer's variable of the environment's key

from .space_config import FAILED_STAGES, MASK, DeployConfig, DeployError, SpaceSpec, parse_args
from .space_plan import deployed, hub_calls, next_step, space_specs, token_warning
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
        # the 0600 files of the keys the trainer must send, by variable (ROLLOUT_API_KEY, ...)
        self.key_files: dict[str, str] = {}
        # private Spaces that an earlier public deploy gave a key: (Space name, variable)
        self.stale_keys: list[tuple[str, str]] = []
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
        return next_step(self.cfg, owner, self.specs(owner), self.space_urls(owner), self.key_files)

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
        self._keep_secrets(owner, dry_run)  # saved before the first Hub call that writes
        self._keep_run_key(dry_run)  # RUN_PUBLIC_KEY: replicas serve only what it signed
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
                self._enforce_visibility(call, dry_run)
                self._drop_stale_keys(owner, call, dry_run)
                continue
            with tempfile.TemporaryDirectory(prefix="deltasync-space-") as tmp:
                staged = stage_space(c.repo_root, call.stage.folder, tmp, call.stage.own_context)
                self._print(tag + call.render(staged))
                if not dry_run:
                    self.api.upload_folder(folder_path=tmp, **call.kwargs)
        specs = deployed(c, self.specs(owner))
        if not dry_run and c.wait:
            self.wait_running([f"{owner}/{s.name}" for s in specs])
        line = self.next_step(owner)
        urls = self.space_urls(owner)
        self._print()
        width = max([len("dashboard"), *(len(s.key) for s in specs)])
        for s in specs:
            self._print(
                f"{s.key:>{width}}: {urls[s.key]}  (https://huggingface.co/spaces/{owner}/{s.name})"
            )
        self._print(f"{'bucket':>{width}}: hf://buckets/{owner}/{c.bucket_name}")
        self._print("\nNext, train against them:\n")
        self._print(f"  {line}\n")
        for var, given, key in (
            ("ROLLOUT_API_KEY", "ROLLOUT_API_KEY", c.rollout_api_key),
            (ENV_KEY_VAR, c.env_space.key_variable, c.wordle_api_key),
        ):
            if key and var not in self.key_files:
                self._print(
                    f"(the trainer reads {var} from the environment: "
                    + ("keep the one you gave)" if var == given else f"set it to your {given})")
                )
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

    def _keep_secrets(self, owner: str, dry_run: bool) -> None:
        """Fill in the secrets that were not given, each kept in a 0600 file under the state dir
        so that every deploy reuses it: the rollout Space's CONTROL_TOKEN always; its
        ROLLOUT_API_KEY and the environment Space's key (WORDLE_API_KEY, another task's
        ``<TASK NAME>_API_KEY``) when the Spaces are public; the ``make train`` line hands the
        latter to the trainer as WORDLE_API_KEY. A
        private Space gets no key (the Hub lets only the owner's tokens reach it, and the
        trainer's ``Authorization`` carries the HF token there): one that an earlier public
        deploy gave a key has it deleted (:meth:`_drop_stale_keys`), the file kept for the next
        public deploy. A new one is saved before any Hub call that writes, so a failed deploy
        cannot lose it. A dry run reads saved files and writes none. A Space that ``--only``
        leaves out gets none made: its saved key, if any, is read for the ``make train`` line
        (the rollout's CONTROL_TOKEN, not needed then, is neither read nor saved)."""
        c = self.cfg
        env = c.env_space
        rollout, env_name = f"{c.prefix}-rollout", f"{c.prefix}-{env.key}"
        roles = set(c.only) or {"rollout", "env", "dashboard"}  # the Spaces deployed now
        if c.control_token is None and "rollout" in roles:
            saved = os.path.exists(self._secret_path(owner, rollout, "CONTROL_TOKEN"))
            c.control_token, _ = self._kept_secret(owner, rollout, "CONTROL_TOKEN", True, dry_run)
            self.control_token_generated = not saved
        public = not c.private_spaces
        for attr, role, space, var, trainer_var in (
            ("rollout_api_key", "rollout", rollout, "ROLLOUT_API_KEY", "ROLLOUT_API_KEY"),
            ("wordle_api_key", "env", env_name, env.key_variable, ENV_KEY_VAR),
        ):
            if not public:
                if role in roles and os.path.exists(self._secret_path(owner, space, var)):
                    self.stale_keys.append((space, var))
                setattr(c, attr, None)
            elif getattr(c, attr) is None:
                # a Space not deployed now keeps the key an earlier deploy saved (if any)
                key, path = self._kept_secret(owner, space, var, role in roles, dry_run)
                if key is not None:
                    setattr(c, attr, key)
                    self.key_files[trainer_var] = path

    def _keep_run_key(self, dry_run: bool) -> None:
        """Set ``RUN_PUBLIC_KEY`` from the run key in ``<state_dir>/run_key.pem`` (the trainer's
        default ``RUN_KEY``), made once (mode 0600) and reused by every later deploy; a dry run
        makes none. The private key is never printed.

        Raises:
            deltasync.errors.KeyFileError: the saved key file is readable by group or others
                (fix: ``chmod 600``) or not a key.
        """
        from deltasync.signing import KEY_FILE_NAME, RunKey, load_or_create

        if self.cfg.run_public_key is not None:
            return
        folder = self.cfg.state_dir or os.path.join(self.cfg.repo_root, "runs", "spaces")
        path = os.path.join(folder, KEY_FILE_NAME)
        if dry_run and not os.path.exists(path):
            self._print(f"would save a new run key to {path} (mode 0600)")
            self.cfg.run_public_key = RunKey.generate().public_key
            return
        key, made = (RunKey.load(path), False) if dry_run else load_or_create(path)
        self.cfg.run_public_key = key.public_key
        self._print(
            f"run key {'saved to' if made else 'reused from'} {path} (mode 0600): the trainer "
            f"signs every version with it (RUN_KEY), the rollout Space serves only those "
            f"(RUN_PUBLIC_KEY={key.public_key})"
        )

    def _secret_path(self, owner: str, space: str, var: str) -> str:
        folder = self.cfg.state_dir or os.path.join(self.cfg.repo_root, "runs", "spaces")
        return os.path.join(folder, f"{owner}--{space}.{var.lower()}")

    def _kept_secret(
        self, owner: str, space: str, var: str, create: bool, dry_run: bool
    ) -> tuple[str | None, str]:
        """(value, path) of secret ``var`` of ``owner/space``: the saved file's if there is one
        (made 0600 again if it was not), else with ``create`` a new one, written to the file
        (mode 0600) unless ``dry_run``; else (None, path). Prints where, never the value.

        Raises:
            DeployError: the saved file is empty.
        """
        path = self._secret_path(owner, space, var)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                value = f.read().strip()
            if not value:
                raise DeployError(
                    f"expected the {var} of {owner}/{space} in {path}, found an empty file: "
                    "delete it to generate a new one (then redeploy every Space that uses it)"
                )
            if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
                os.chmod(path, 0o600)
                self._print(f"{path} was readable by others: made it mode 0600")
            self._print(f"{var} of {owner}/{space}: reusing the one saved in {path}")
            return value, path
        if not create:
            return None, path
        value = secrets.token_urlsafe(32)
        if dry_run:
            self._print(f"would save a new {var} of {owner}/{space} to {path} (mode 0600)")
            return value, path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
        self._print(f"{var} of {owner}/{space} saved to {path} (mode 0600)")
        return value, path

    def _drop_stale_keys(self, owner: str, call: HubCall, dry_run: bool) -> None:
        """After a private Space's create call: delete the key secret an earlier public deploy
        set (``delete_space_secret``), so that the trainer, which sends its HF token to a
        private Space, is not refused by the Space's front; one line says so."""
        if call.fn not in ("create_repo", "duplicate_repo"):
            return
        repo_id = call.kwargs.get("repo_id") or call.kwargs["to_id"]
        for space, var in self.stale_keys:
            if repo_id != f"{owner}/{space}":
                continue
            delete = HubCall("delete_space_secret", dict(repo_id=repo_id, key=var))
            self._print(
                ("would call: " if dry_run else "")
                + f"{delete.render()}  (private now: the Hub checks who may call it; "
                f"{var} is kept in {self._secret_path(owner, space, var)} for a public deploy)"
            )
            if not dry_run:
                self.api.delete_space_secret(**delete.kwargs)

    def _enforce_visibility(self, call: HubCall, dry_run: bool) -> None:
        """After ``create_bucket``/``create_repo``/``duplicate_repo`` (``exist_ok``, which leaves
        an existing repo as it is): read the repo's visibility and, where it differs from the
        one asked for, set it (``update_bucket_settings`` / ``update_repo_settings``) and say so
        in one line. So a deploy without ``--public`` makes Spaces an earlier ``--public`` deploy
        left public private again."""
        kw = call.kwargs
        if call.fn == "create_bucket":
            kind, rid, want = "bucket", kw["bucket_id"], kw["private"]
            update = HubCall("update_bucket_settings", dict(bucket_id=rid, private=want))
        elif call.fn in ("create_repo", "duplicate_repo"):
            kind, rid, want = "Space", kw.get("repo_id") or kw["to_id"], kw["private"]
            update = HubCall(
                "update_repo_settings", dict(repo_id=rid, repo_type="space", private=want)
            )
        else:
            return
        wanted = "private" if want else "public"
        if dry_run:
            self._print(f"would check: {kind} {rid} is {wanted}, else {update.render()}")
            return
        if kind == "bucket":
            found = self.api.bucket_info(bucket_id=rid).private
        else:
            found = self.api.space_info(repo_id=rid).private
        if bool(found) == want:
            return
        getattr(self.api, update.fn)(**update.kwargs)
        was = "private" if found else "public"
        self._print(f"{kind} {rid} was {was}: made it {wanted} ({update.render()})")

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
                what = f"all {len(repo_ids)} Spaces are" if len(repo_ids) > 1 else "the Space is"
                self._print(f"{what} RUNNING after {mmss(elapsed)}")
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
