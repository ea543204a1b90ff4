"""Each Space's image as the deploy tests see it, without Docker: its Dockerfile parsed and its file
tree built.

For spaces/{dashboard,vllm-rollout,wordle-env}/Dockerfile, ``parse_dockerfile`` reads ``FROM``,
``ARG``, ``ENV``, ``WORKDIR``, ``COPY``, ``RUN pip install``, ``HEALTHCHECK``, ``ENTRYPOINT`` and
``CMD``; ``build_image`` builds the image's file tree under a temporary root from what the COPY
lines copy (so a file the image lacks is missing here too), and ``Image`` maps image paths in ENV
values onto that root, stands in for ``pip install .[extra]`` by putting the copied package on
``PYTHONPATH`` (this checkout's editable ``deltasync`` is taken off ``sys.path`` by a
``sitecustomize``, so only the copied files can be imported), and maps the CMD's executable, which
must be one the base image provides, to the interpreter running the tests. Used by
test_space_dockerfiles.py and test_space_images_run.py (the ``image`` fixture is in conftest.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import re
import shlex
import shutil
import sys
from fnmatch import fnmatch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from .conftest import REPO_ROOT

SPACES = {
    "dashboard": "spaces/dashboard",
    "rollout": "spaces/vllm-rollout",
    "wordle": "spaces/wordle-env",
}
# What each base image is known to provide. vLLM's image has python3 but is not known to have a
# `python` command, and its entrypoint (`vllm serve`) must be reset for a CMD of our own.
BASE_IMAGES = {
    "python": {"executables": {"python", "python3", "pip", "pip3"}, "entrypoint": None},
    "vllm/vllm-openai": {
        "executables": {"python3", "pip", "vllm"},
        "entrypoint": ["vllm", "serve"],
    },
}
# Files the Dockerfile.dockerignore leaves out of every COPY (the same as the deploy's staging).
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.nbi", "*.nbc")


@dataclasses.dataclass
class Copy:
    sources: list[str]
    dest: str  # absolute image path
    dest_is_dir: bool


@dataclasses.dataclass
class Dockerfile:
    """The instructions of one Dockerfile that decide what its container runs."""

    path: str
    base: str = ""
    args: dict[str, str] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    workdir: str = "/"
    copies: list[Copy] = dataclasses.field(default_factory=list)
    runs: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (workdir, command)
    cmd: list[str] | None = None
    cmd_is_exec_form: bool = True
    entrypoint: list[str] | None = None
    healthcheck: str | None = None  # the shell-form command

    @property
    def base_facts(self) -> dict:
        name = self.base.split("@")[0].rsplit(":", 1)[0] if ":" in self.base else self.base
        assert name in BASE_IMAGES, (
            f"{self.path}: expected a base image in {sorted(BASE_IMAGES)}, found {self.base!r}; "
            "add what it provides to BASE_IMAGES"
        )
        return BASE_IMAGES[name]


def _logical_lines(text: str) -> list[str]:
    """Instructions with ``\\`` continuations joined and comments dropped."""
    lines, buf = [], ""
    for raw in text.splitlines():
        s = raw.strip()
        if s.startswith("#") or (not s and not buf):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        lines.append((buf + s).strip())
        buf = ""
    if buf.strip():
        lines.append(buf.strip())
    return lines


def _substitute(value: str, names: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: names.get(m.group(1) or m.group(2), ""), value)


def parse_dockerfile(path: str) -> Dockerfile:
    """Parse the instructions of ``path`` that this test needs (single stage)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    df = Dockerfile(path)
    for line in _logical_lines(text):
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ARG":
            name, _, default = rest.partition("=")
            df.args[name] = default
        elif op == "FROM":
            df.base = _substitute(rest.split()[0], df.args)
        elif op == "ENV":
            tokens = shlex.split(rest)
            if "=" in tokens[0]:
                for t in tokens:
                    k, _, v = t.partition("=")
                    df.env[k] = _substitute(v, df.env)
            else:  # legacy ENV KEY VALUE
                df.env[tokens[0]] = " ".join(tokens[1:])
        elif op == "WORKDIR":
            df.workdir = posixpath.normpath(posixpath.join(df.workdir, rest))
        elif op in ("COPY", "ADD"):
            tokens = [t for t in shlex.split(rest) if not t.startswith("--")]
            *sources, dest = tokens
            is_dir = dest.endswith(("/", ".")) or len(sources) > 1
            df.copies.append(
                Copy(sources, posixpath.normpath(posixpath.join(df.workdir, dest)), is_dir)
            )
        elif op == "RUN":
            df.runs.append((df.workdir, rest))
        elif op in ("CMD", "ENTRYPOINT"):
            exec_form = rest.startswith("[")
            value = json.loads(rest) if exec_form else ["/bin/sh", "-c", rest]
            if op == "CMD":
                df.cmd, df.cmd_is_exec_form = value, exec_form
            else:
                df.entrypoint = value
        elif op == "HEALTHCHECK":
            m = re.match(r"^(?:--\S+\s+)*CMD\s+(.*)$", rest)
            assert m, f"{path}: expected HEALTHCHECK [options] CMD command, found {line}"
            df.healthcheck = m.group(1).strip()
    return df


def dockerfile(key: str) -> Dockerfile:
    return parse_dockerfile(os.path.join(REPO_ROOT, SPACES[key], "Dockerfile"))


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether a .dockerignore with ``patterns`` leaves ``path`` out (the last match wins)."""
    excluded = False
    for p in patterns:
        negate = p.startswith("!")
        p = p.lstrip("!").rstrip("/")
        base = p[3:] if p.startswith("**/") else None
        if fnmatch(path, p) or (base and fnmatch(posixpath.basename(path), base)):
            excluded = not negate
    return excluded


@dataclasses.dataclass
class Image:
    """A Dockerfile's file tree under ``root``, ready to run its CMD."""

    df: Dockerfile
    root: str
    package_dirs: list[str]  # what `pip install .[extra]` would install, as PYTHONPATH entries
    installs: list[tuple[str, list[str]]]  # (project folder, extras) of each `pip install`

    def host_path(self, image_path: str) -> str:
        return os.path.join(self.root, image_path.lstrip("/"))

    @property
    def cwd(self) -> str:
        return self.host_path(self.df.workdir)

    def env(self, **space_env: str) -> dict[str, str]:
        """The container's environment: the image's ENV (image paths mapped under ``root``), HOME
        of uid 1000, the package on PYTHONPATH after the image's own entries, and ``space_env``
        (what the Space sets) on top. Nothing of this process's environment but PATH."""
        env = {
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "LANG": "C.UTF-8",
            "HOME": self.host_path("/home/user"),
        }
        for k, v in self.df.env.items():
            parts = v.split(os.pathsep)
            env[k] = os.pathsep.join(self.host_path(p) if p.startswith("/") else p for p in parts)
        os.makedirs(env["HOME"], exist_ok=True)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (env.get("PYTHONPATH"), *self.package_dirs, self._hide_checkout()) if p
        )
        env.update(space_env)
        return env

    def _hide_checkout(self) -> str:
        """A folder with a ``sitecustomize`` that drops this checkout's ``shared/`` and
        ``spaces/`` (the editable install's path entries) from ``sys.path``."""
        folder = os.path.join(os.path.dirname(self.root), "hide-checkout")
        os.makedirs(folder, exist_ok=True)
        hidden = [os.path.realpath(os.path.join(REPO_ROOT, d)) for d in ("shared", "spaces")]
        with open(os.path.join(folder, "sitecustomize.py"), "w", encoding="utf-8") as f:
            f.write(
                "import os, sys\n"
                f"_HIDDEN = {hidden!r}\n"
                "sys.path[:] = [p for p in sys.path if not any(\n"
                "    os.path.realpath(p or '.') == h or os.path.realpath(p or '.').startswith(h + os.sep)\n"
                "    for h in _HIDDEN)]\n"
            )
        return folder

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` with its executable checked against the base image and mapped to this venv's
        interpreter."""
        exe = argv[0]
        provided = self.df.base_facts["executables"]
        assert exe in provided, (
            f"{self.df.path}: runs {exe!r}, which the base image {self.df.base} is not known to "
            f"provide (it has {sorted(provided)}); use one of those"
        )
        assert exe.startswith("python"), f"{self.df.path}: expected a python command, found {exe}"
        return [sys.executable, *argv[1:]]


def build_image(df: Dockerfile, root: str) -> Image:
    """Copy what the Dockerfile COPYs from its build context into ``root`` (its image paths), and
    find the packages each ``RUN pip install <dir>[extras]`` installs."""
    context = build_context(df)
    for c in df.copies:
        for src in c.sources:
            host_src = os.path.normpath(os.path.join(context, src))
            dest = os.path.join(root, c.dest.lstrip("/"))
            if os.path.isdir(host_src):
                shutil.copytree(host_src, dest, ignore=IGNORED, dirs_exist_ok=True)
            else:
                if c.dest_is_dir:
                    dest = os.path.join(dest, os.path.basename(src))
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.copy2(host_src, dest)
    package_dirs, installs = [], []
    for workdir, command in df.runs:
        m = re.search(r"pip3? install\s+(?:-\S+\s+)*[\"']?([^\"'\s\[]+)(?:\[([^\]]*)\])?", command)
        if not m:
            continue
        project = os.path.join(root, posixpath.join(workdir, m.group(1)).lstrip("/"))
        meta = _pyproject(project)
        package_dirs.append(_import_root(project, meta["tool"]["setuptools"], root))
        installs.append((project, [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]))
        readme = meta["project"].get("readme")
        if isinstance(readme, str):
            assert os.path.isfile(os.path.join(project, readme)), (
                f"{df.path}: pyproject.toml's readme {readme} is not copied next to it"
            )
    return Image(df, root, package_dirs, installs)


def build_context(df: Dockerfile) -> str:
    """The folder a Dockerfile builds from: its own folder when it copies ``.`` (a Space that is
    its own context, as `openenv push` builds it), else the repository root."""
    own = any(src in (".", "./") for c in df.copies for src in c.sources)
    return os.path.dirname(df.path) if own else REPO_ROOT


def _pyproject(project: str) -> dict:
    with open(os.path.join(project, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _import_root(project: str, setuptools: dict, root: str) -> str:
    """A PYTHONPATH entry from which the packages ``pip install project`` installs import:
    ``packages.find.where``, or, for a ``package-dir`` mapping (OpenEnv's layout: the folder is
    the package), a folder of links named after the top-level packages."""
    if "package-dir" not in setuptools:
        (where,) = setuptools["packages"]["find"]["where"]
        return os.path.join(project, where)
    site = os.path.join(os.path.dirname(root), "site-" + os.path.basename(project))
    os.makedirs(site, exist_ok=True)
    for name, folder in setuptools["package-dir"].items():
        if "." not in name:
            os.symlink(os.path.normpath(os.path.join(project, folder)), os.path.join(site, name))
    return site
