"""A Dockerfile's image without Docker: its instructions parsed and its file tree laid out from a
build context folder, ready to run its CMD with this interpreter.

``parse_dockerfile`` reads ``FROM``, ``ARG``, ``ENV``, ``WORKDIR``, ``COPY``/``ADD``, ``RUN``,
``HEALTHCHECK``, ``ENTRYPOINT`` and ``CMD`` of a single-stage Dockerfile; ``build_image`` copies
what the COPY lines copy from the build context into a folder standing for the image's ``/`` (so a
file the image lacks is missing here too) and finds what each ``RUN pip install <dir>[extras]``
installs; :class:`Image` maps image paths in ENV values onto that folder, stands in for those
``pip install``s by putting the copied packages on ``PYTHONPATH``, and maps the CMD's executable
(one the base image is known to provide) to the interpreter running this code.

What this does not do: build anything. No Docker, no base image (its system packages, its Python
version and its installed libraries are this machine's and this venv's), no ``RUN`` line is
executed (``pip install`` of the copied packages is replaced by ``PYTHONPATH`` entries; their
dependencies must already be installed here), no ``USER`` switch, no ``.dockerignore`` beyond the
patterns in :data:`IGNORED`, no multi-stage builds.

Used by the local Hub's Space runner (``tools/local_hub/space_runner.py``) and by the deploy tests
(``tests/deploy/dockerfile_image.py``).
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


class DockerImageError(ValueError):
    """A Dockerfile this module cannot stand in for, or one whose image would not run (an unknown
    base image, a CMD the base image cannot run, a COPY source missing from the context...)."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise DockerImageError(message)


@dataclasses.dataclass
class Copy:
    """One ``COPY``/``ADD``: its sources (relative to the build context) and its destination."""

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
        """What the base image provides (:data:`BASE_IMAGES`).

        Raises:
            DockerImageError: a base image not in :data:`BASE_IMAGES`.
        """
        name = self.base.split("@")[0].rsplit(":", 1)[0] if ":" in self.base else self.base
        _check(
            name in BASE_IMAGES,
            f"{self.path}: expected a base image in {sorted(BASE_IMAGES)}, found {self.base!r}; "
            "add what it provides to BASE_IMAGES",
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
    """Parse the instructions of the Dockerfile at ``path`` that decide what its container runs
    (single stage).

    Raises:
        OSError: no such file.
        DockerImageError: a HEALTHCHECK without ``CMD``.
    """
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
            _check(bool(m), f"{path}: expected HEALTHCHECK [options] CMD command, found {line}")
            df.healthcheck = m.group(1).strip()
    return df


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
    """A Dockerfile's file tree under ``root``, ready to run its CMD.

    ``hidden_paths``: folders taken off ``sys.path`` of the processes run with :meth:`env` (e.g.
    a checkout's editable install of the packages the image copies), so that only the image's
    copies import.
    """

    df: Dockerfile
    root: str
    package_dirs: list[str]  # what `pip install .[extra]` would install, as PYTHONPATH entries
    installs: list[tuple[str, list[str]]]  # (project folder, extras) of each `pip install`
    hidden_paths: list[str] = dataclasses.field(default_factory=list)

    def host_path(self, image_path: str) -> str:
        """Where the image path ``image_path`` lies on this machine."""
        return os.path.join(self.root, image_path.lstrip("/"))

    @property
    def cwd(self) -> str:
        """The image's WORKDIR on this machine."""
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
            p for p in (env.get("PYTHONPATH"), *self.package_dirs, self._hide_paths()) if p
        )
        env.update(space_env)
        return env

    def _hide_paths(self) -> str | None:
        """A folder with a ``sitecustomize`` that drops ``hidden_paths`` (and what lies under
        them) from ``sys.path``; None when nothing is hidden."""
        if not self.hidden_paths:
            return None
        folder = os.path.join(os.path.dirname(self.root), "hide-checkout")
        os.makedirs(folder, exist_ok=True)
        hidden = [os.path.realpath(d) for d in self.hidden_paths]
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
        interpreter.

        Raises:
            DockerImageError: an executable the base image is not known to provide, or one that
                is not Python.
        """
        exe = argv[0]
        provided = self.df.base_facts["executables"]
        _check(
            exe in provided,
            f"{self.df.path}: runs {exe!r}, which the base image {self.df.base} is not known to "
            f"provide (it has {sorted(provided)}); use one of those",
        )
        _check(exe.startswith("python"), f"{self.df.path}: expected a python command, found {exe}")
        return [sys.executable, *argv[1:]]

    def start_command(self) -> list[str]:
        """The container's start command (ENTRYPOINT + CMD) mapped by :meth:`command`.

        Raises:
            DockerImageError: no CMD, a shell-form one, or what :meth:`command` refuses.
        """
        _check(bool(self.df.cmd), f"{self.df.path}: expected a CMD, found none")
        _check(
            self.df.cmd_is_exec_form,
            f'{self.df.path}: expected an exec-form CMD ["python3", ...], found shell form',
        )
        return self.command([*(self.df.entrypoint or []), *self.df.cmd])


def build_image(
    df: Dockerfile, root: str, context: str, hidden_paths: list[str] | None = None
) -> Image:
    """Copy what the Dockerfile COPYs from the build context folder ``context`` into ``root`` (its
    image paths), and find the packages each ``RUN pip install <dir>[extras]`` installs.

    Raises:
        DockerImageError: a COPY source missing from ``context`` or leaving it, or a project whose
            pyproject.toml names a readme that is not copied next to it.
        OSError, KeyError, tomllib.TOMLDecodeError: an installed project without a readable
            ``pyproject.toml`` with a setuptools package layout.
    """
    context = os.path.abspath(context)
    for c in df.copies:
        for src in c.sources:
            host_src = os.path.normpath(os.path.join(context, src))
            _check(
                host_src == context or host_src.startswith(context + os.sep),
                f"{df.path}: COPY {src} leaves the build context",
            )
            _check(
                os.path.exists(host_src),
                f"{df.path}: COPY {src} expects {src} in the build context, found none",
            )
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
        meta = pyproject(project)
        package_dirs.append(_import_root(project, meta["tool"]["setuptools"], root))
        installs.append((project, [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]))
        readme = meta["project"].get("readme")
        if isinstance(readme, str):
            _check(
                os.path.isfile(os.path.join(project, readme)),
                f"{df.path}: pyproject.toml's readme {readme} is not copied next to it",
            )
    return Image(df, root, package_dirs, installs, list(hidden_paths or []))


def pyproject(project: str) -> dict:
    """The parsed ``pyproject.toml`` of the project folder ``project``."""
    with open(os.path.join(project, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _import_root(project: str, setuptools: dict, root: str) -> str:
    """A PYTHONPATH entry from which the packages ``pip install project`` installs import:
    ``packages.find.where``; for a ``package-dir`` mapping (OpenEnv's layout: the folder is
    the package), a folder of links named after the top-level packages; for top-level modules
    (``py-modules``, e.g. ``examples/number_guess/space``), the project folder itself."""
    if "py-modules" in setuptools and "packages" not in setuptools:
        return project
    if "package-dir" not in setuptools:
        (where,) = setuptools["packages"]["find"]["where"]
        return os.path.join(project, where)
    site = os.path.join(os.path.dirname(root), "site-" + os.path.basename(project))
    os.makedirs(site, exist_ok=True)
    for name, folder in setuptools["package-dir"].items():
        if "." not in name:
            link = os.path.join(site, name)
            if os.path.islink(link):
                os.unlink(link)
            os.symlink(os.path.normpath(os.path.join(project, folder)), link)
    return site
