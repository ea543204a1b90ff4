"""What ``make spaces`` uploads and asks of the Hub: one Hub call, a Space's upload folder staged
in the layout its Dockerfile expects, the front matter of its README, the hardware check."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

from .space_config import _STAGE_IGNORE, MASK, DeployError, SpaceSpec


@dataclass
class HubCall:
    """One huggingface_hub ``HfApi`` call: method name and keyword arguments.

    ``secret`` names the arguments whose values are masked when the call is shown; ``stage`` is the
    Space whose upload folder is staged (as ``folder_path``) right before the call runs.
    """

    fn: str
    kwargs: dict[str, Any]
    secret: tuple[str, ...] = ()
    stage: SpaceSpec | None = None

    def render(self, staged: list[str] | None = None) -> str:
        """``fn(k=v, ...)`` with secrets masked; ``staged`` files summarised as ``folder_path``."""
        parts = []
        for k, v in self.kwargs.items():
            parts.append(f"{k}={MASK!r}" if k in self.secret else f"{k}={v!r}")
        if self.stage is not None:
            parts.insert(1, f"folder_path=<{summarize_files(staged or [])}>")
        return f"{self.fn}({', '.join(parts)})"


def space_url(owner: str, name: str) -> str:
    """The public URL of Space ``owner/name``: ``https://<owner>-<name>.hf.space``, lowercased,
    with ``_`` and ``.`` replaced by ``-``."""
    host = re.sub(r"[_.]", "-", f"{owner}-{name}".lower())
    return f"https://{host}.hf.space"


def runtime_url(owner: str, name: str, raw: dict | None = None) -> str:
    """The URL of Space ``owner/name`` as the Hub reports it: the first ``READY`` domain (else
    the first domain) of its runtime ``raw`` (``SpaceRuntime.raw["domains"]``, items
    ``{"domain": ..., "stage": ...}``), ``http://`` for a 127.0.0.1/localhost domain (a local
    Hub's Space) and ``https://`` otherwise; without domains, :func:`space_url`."""
    domains = [d for d in (raw or {}).get("domains") or [] if d.get("domain")]
    if not domains:
        return space_url(owner, name)
    chosen = next((d for d in domains if d.get("stage") == "READY"), domains[0])["domain"]
    host = chosen.rsplit(":", 1)[0] if chosen.count(":") == 1 else chosen
    local = host.strip("[]") in ("127.0.0.1", "localhost", "::1")
    return f"{'http' if local else 'https'}://{chosen}"


def summarize_files(files: list[str]) -> str:
    """'N files: Dockerfile, README.md, shared/ (k), ...' for a list of relative paths."""
    groups: dict[str, int] = {}
    for f in files:
        top = f.split("/", 2)
        key = (
            f if len(top) == 1 else (f"{top[0]}/{top[1]}/" if top[0] == "spaces" else f"{top[0]}/")
        )
        groups[key] = groups.get(key, 0) + 1
    shown = ", ".join(
        k if n == 1 and not k.endswith("/") else f"{k} ({n})" for k, n in groups.items()
    )
    return f"staged {len(files)} files: {shown}"


def read_front_matter(readme_text: str) -> dict[str, str]:
    """Top-level ``key: value`` pairs of a README's YAML front matter ({} without one)."""
    lines = readme_text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    out = {}
    for line in lines[1:]:
        if line.strip() == "---":
            return out
        m = re.match(r"^([A-Za-z_][\w-]*):\s*(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    raise ValueError("README front matter opens with '---' but never closes")


def stage_space(repo_root: str, folder: str, dest: str, own_context: bool = False) -> list[str]:
    """Write the Space repo's layout for ``folder`` (e.g. ``spaces/vllm-rollout``) into ``dest``.

    With ``own_context`` the folder is the build context and becomes the Space root as it is.
    Otherwise the Space's Dockerfile builds from the repository root, so the Space root gets what
    that context has: ``pyproject.toml``, ``shared/deltasync/`` and ``spaces/<space>/``, plus the
    Space's ``Dockerfile``, ``Dockerfile.dockerignore`` and ``README.md`` at the root (the README's
    front matter configures the Space; it also serves as ``pyproject.toml``'s readme).

    Returns:
        The staged files, relative to ``dest`` with ``/``, sorted.

    Raises:
        DeployError: a required file is missing, or the README front matter is not a Docker Space
            on port 7860.
    """
    src = os.path.join(repo_root, folder)
    need = [f"{folder}/Dockerfile", f"{folder}/README.md"]
    if not own_context:
        need += ["pyproject.toml", "shared/deltasync/__init__.py"]
    missing = [p for p in need if not os.path.isfile(os.path.join(repo_root, p))]
    if missing:
        raise DeployError(
            f"expected {missing} under {os.path.abspath(repo_root)}: run from the repository "
            "root (a clone of deltasync) or pass --repo-root"
        )
    with open(os.path.join(src, "README.md"), encoding="utf-8") as f:
        meta = read_front_matter(f.read())
    if meta.get("sdk") != "docker" or meta.get("app_port") != "7860":
        raise DeployError(
            f"{folder}/README.md front matter: expected sdk: docker and app_port: 7860, found "
            f"sdk: {meta.get('sdk')!r}, app_port: {meta.get('app_port')!r}; fix the front matter"
        )
    ignore = shutil.ignore_patterns(*_STAGE_IGNORE)
    if own_context:
        shutil.copytree(src, dest, ignore=ignore, dirs_exist_ok=True)
    else:
        shutil.copy2(
            os.path.join(repo_root, "pyproject.toml"), os.path.join(dest, "pyproject.toml")
        )
        shutil.copytree(
            os.path.join(repo_root, "shared", "deltasync"),
            os.path.join(dest, "shared", "deltasync"),
            ignore=ignore,
        )
        shutil.copytree(src, os.path.join(dest, folder), ignore=ignore)
        for name in ("Dockerfile", "Dockerfile.dockerignore", "README.md"):
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy2(os.path.join(src, name), os.path.join(dest, name))
    files = []
    for root, _, names in os.walk(dest):
        for n in names:
            files.append(os.path.relpath(os.path.join(root, n), dest).replace(os.sep, "/"))
    return sorted(files)


def hub_api(token: str):
    """A ``huggingface_hub.HfApi`` for ``token`` (imported here, not at module import).

    Raises:
        DeployError: huggingface_hub is not installed.
    """
    try:
        from huggingface_hub import HfApi
    except ImportError as e:
        raise DeployError(
            f"deploying needs huggingface_hub ({e}): pip install 'deltasync[hf]'"
        ) from e
    return HfApi(token=token)


def check_hardware(specs: list[SpaceSpec]) -> None:
    """Raise ValueError for a hardware flavor huggingface_hub does not know (when installed)."""
    try:
        from huggingface_hub import SpaceHardware
    except ImportError:
        return  # a dry run without huggingface_hub: nothing to check against
    known = {h.value for h in SpaceHardware}
    for s in specs:
        if s.hardware not in known:
            raise ValueError(
                f"{s.key} Space: unknown hardware {s.hardware!r}; expected one of {sorted(known)}"
            )


def failure_message(repo_id: str, stage: str, raw: dict) -> str:
    """Why Space ``repo_id`` will not come up (its ``stage`` and the Hub's ``errorMessage`` in
    ``raw``), its URL and logs, and what to do."""
    owner, name = repo_id.split("/")
    why = raw.get("errorMessage") or ""
    fix = {
        "BUILD_ERROR": "the Docker image failed to build",
        "RUNTIME_ERROR": "the container exited or failed its health check",
        "CONFIG_ERROR": "the README front matter is invalid",
        "NO_APP_FILE": "the Space has no Dockerfile at its root",
        "PAUSED": f"the Space is paused (make spaces-down): `hf spaces restart {repo_id}` "
        "or restart it from its settings",
        "STOPPED": "the Space is stopped: restart it from its settings",
        "DELETING": "the Space is being deleted",
    }.get(stage, "")
    return (
        f"Space {repo_id} ({space_url(owner, name)}): expected RUNNING, found {stage}"
        + (f" ({fix})" if fix else "")
        + (f": {why}" if why else "")
        + f". See its logs: {logs_hint(owner, name)}; fix and rerun `make spaces` (safe to "
        "repeat: every call is idempotent)"
    )


def logs_hint(owner: str, name: str) -> str:
    return (
        f"`hf spaces logs {owner}/{name} --build` (build) or `hf spaces logs {owner}/{name}` "
        f"(container), or https://huggingface.co/spaces/{owner}/{name}?logs=container"
    )


def mmss(seconds: float) -> str:
    s = int(max(0.0, seconds))
    return f"{s // 60:d}m{s % 60:02d}s"
