"""Each Space's image, run the way its Dockerfile runs it (no Docker needed).

For spaces/{dashboard,vllm-rollout,wordle-env}/Dockerfile the test parses ``FROM``, ``ARG``,
``ENV``, ``WORKDIR``, ``COPY``, ``RUN pip install``, ``HEALTHCHECK``, ``ENTRYPOINT`` and ``CMD``,
then builds the image's file tree under a temporary root from what the COPY lines copy (so a file
the image lacks is missing here too), maps image paths in ENV values onto that root, stands in
for ``pip install .[extra]`` by putting the copied package on ``PYTHONPATH`` (the extra's
requirements must be installed in this venv; this checkout's editable ``deltasync`` is taken off
``sys.path`` by a ``sitecustomize``, so only the copied files can be imported), and runs the exec-form CMD with the interpreter
running the tests (``.venv/bin/python`` under ``make test``) in the image's working directory with
the image's environment, plus what the Space itself would set (variables, a free ``PORT``, hosts
on 127.0.0.1, ``HF_HUB_OFFLINE``). The CMD's executable must be one the base image provides:
``python`` on vLLM's image would fail on the Space, so it fails here.

The dashboard and Wordle servers must answer 200 (and their HEALTHCHECK must pass); the rollout
launcher must get through its imports to the configuration check; the slow test lets it start
the vLLM child and checks vLLM accepted the command line.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import posixpath
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from fnmatch import fnmatch

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from tools.deploy_spaces import Deployer
from tools.space_config import DeployConfig

from .conftest import REPO_ROOT

SPACES = {"dashboard": "spaces/dashboard", "rollout": "spaces/vllm-rollout",
          "wordle": "spaces/wordle-env"}  # fmt: skip
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
START_TIMEOUT_S = 120.0  # generous: the test machine may be busy


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
            df.copies.append(Copy(sources, posixpath.normpath(posixpath.join(df.workdir, dest)),
                                  is_dir))  # fmt: skip
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
        env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               "LANG": "C.UTF-8", "HOME": self.host_path("/home/user")}  # fmt: skip
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


@pytest.fixture
def image(tmp_path):
    def make(key: str) -> Image:
        return build_image(dockerfile(key), str(tmp_path / "image"))

    return make


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(img: Image, argv: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen(img.command(argv), cwd=img.cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def stop(proc: subprocess.Popen) -> None:
    """Stop the process group we started (SIGTERM, then SIGKILL)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def tail(path: str, n: int = 3000) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-n:]


def wait_http_200(url: str, proc: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    last = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"expected the server to answer {url}, found it exited with code {proc.returncode}:\n"
            + tail(log_path)
        )
        try:
            with urllib.request.urlopen(url, timeout=3) as r:
                if r.status == 200:
                    return
                last = r.status
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            last = e
        time.sleep(0.3)
    raise AssertionError(
        f"{url} did not answer 200 in {START_TIMEOUT_S}s ({last}):\n{tail(log_path)}"
    )


def run_healthcheck(img: Image, env: dict[str, str]) -> None:
    argv = shlex.split(img.df.healthcheck)
    out = subprocess.run(img.command(argv), cwd=img.cwd, env=env, capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    assert out.returncode == 0, f"HEALTHCHECK failed: {out.stdout}{out.stderr}"


# --------------------------------------------------------------------------- static checks
@pytest.mark.parametrize("key", sorted(SPACES))
def test_every_copy_source_exists_and_reaches_the_build(key):
    df = dockerfile(key)
    ignore_file = df.path + ".dockerignore"
    with open(ignore_file, encoding="utf-8") as f:
        patterns = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    assert df.copies, f"{df.path}: no COPY"
    context = build_context(df)
    for c in df.copies:
        for src in c.sources:
            assert os.path.exists(os.path.join(context, src)), (
                f"{df.path}: COPY {src} expects {src} in {context}, found none"
            )
            assert not dockerignore_excludes(patterns, src.rstrip("/")), (
                f"{df.path}: COPY {src}, but {ignore_file} leaves it out of the build context"
            )


@pytest.mark.parametrize("key", sorted(SPACES))
def test_start_command_is_what_the_base_image_can_run(key):
    df = dockerfile(key)
    facts = df.base_facts
    assert df.cmd and df.cmd_is_exec_form, f"{df.path}: expected an exec-form CMD, found {df.cmd}"
    cmd = (df.entrypoint or []) + df.cmd
    assert cmd[0] in facts["executables"], (
        f"{df.path}: CMD runs {cmd[0]!r}; {df.base} provides {sorted(facts['executables'])}"
    )
    if facts["entrypoint"]:
        assert df.entrypoint == [], (
            f"{df.path}: {df.base} has ENTRYPOINT {facts['entrypoint']}; expected `ENTRYPOINT []` "
            "so that the CMD runs by itself"
        )
    assert df.healthcheck, f"{df.path}: expected a HEALTHCHECK"
    hc = shlex.split(df.healthcheck)[0]
    assert hc in facts["executables"], f"{df.path}: HEALTHCHECK runs {hc!r}, not in {df.base}"
    assert df.env.get("PORT") == "7860", f"{df.path}: expected ENV PORT=7860 (app_port)"


@pytest.mark.parametrize("key", sorted(SPACES))
def test_the_images_requirements_exist_and_are_installed_here(key, image):
    """Every requirement of every ``pip install`` in the image (the project's dependencies and
    those of the extras it names) is installed in this venv at a version it accepts."""
    from packaging.requirements import Requirement

    img = image(key)
    assert img.installs, f"{img.df.path}: expected RUN pip install <dir>[extras]"
    for project, extras in img.installs:
        meta = _pyproject(project)["project"]
        optional = meta.get("optional-dependencies", {})
        specs, todo, seen = list(meta.get("dependencies", [])), list(extras), set()
        while todo:
            extra = todo.pop()
            assert extra in optional, f"{img.df.path}: installs extra {extra!r}, not in pyproject"
            seen.add(extra)
            for spec in optional[extra]:
                req = Requirement(spec)
                if req.name == meta["name"]:
                    todo += [e for e in req.extras if e not in seen]
                else:
                    specs.append(spec)
        for spec in specs:
            req = Requirement(spec)
            try:
                version = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                pytest.fail(f"{img.df.path}: needs {spec}; not installed here")
            assert req.specifier.contains(version, prereleases=True), (
                f"{img.df.path}: needs {spec}; found {req.name} {version}"
            )


def test_deploy_sets_the_variables_the_images_read():
    """The Space variables `make spaces` sets are the ones the runs below pass."""
    specs = {s.key: s for s in Deployer(DeployConfig(owner="a"), out=None).specs("a")}
    assert set(specs["dashboard"].variables) == {"BUCKET"}
    assert {"DELTASYNC_STORE", "MODEL"} <= set(specs["rollout"].variables)
    assert specs["wordle"].variables == {}


# ---------------------------------------------------------------------------- run the images
def test_dashboard_image_answers_200(image, tmp_path):
    img = image("dashboard")
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    port = free_port()
    env = img.env(BUCKET=str(bucket), PORT=str(port), GRADIO_SERVER_NAME="127.0.0.1",
                  HF_HUB_OFFLINE="1")  # fmt: skip
    log = str(tmp_path / "dashboard.log")
    proc = start(img, img.df.cmd, env, log)
    try:
        wait_http_200(f"http://127.0.0.1:{port}/", proc, log)
        run_healthcheck(img, env)
        probe = subprocess.run(
            [sys.executable, "-c", "import deltasync; print(deltasync.__file__)"],
            cwd=img.cwd, env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert probe.stdout.startswith(img.root), "expected the image's copy of deltasync"
    finally:
        stop(proc)


def test_wordle_image_answers_health(image, tmp_path):
    img = image("wordle")
    port = free_port()
    env = img.env(PORT=str(port), WORDLE_HOST="127.0.0.1", HF_HUB_OFFLINE="1")
    log = str(tmp_path / "wordle.log")
    proc = start(img, img.df.cmd, env, log)
    try:
        wait_http_200(f"http://127.0.0.1:{port}/health", proc, log)
        run_healthcheck(img, env)
    finally:
        stop(proc)


def rollout_env(img: Image, tmp_path, **extra: str) -> dict[str, str]:
    return img.env(PORT=str(free_port()), HOST="127.0.0.1", VLLM_PORT=str(free_port()),
                   HF_HUB_OFFLINE="1", CONTROL_TOKEN="ctl-secret-test", **extra)  # fmt: skip


def test_rollout_image_gets_through_its_imports_to_the_config_check(image, tmp_path):
    """Without DELTASYNC_STORE the launcher stops at its configuration, after importing the
    front, the sync loop and deltasync from the image's files: a missing module or file, or a
    CMD the image cannot run, fails before that line."""
    img = image("rollout")
    env = rollout_env(img, tmp_path, MODEL="Qwen/Qwen3-0.6B")
    log = str(tmp_path / "rollout.log")
    proc = start(img, img.df.cmd, env, log)
    try:
        code = proc.wait(START_TIMEOUT_S)
    finally:
        stop(proc)
    text = tail(log)
    assert code != 0, text
    assert "ConfigError: expected a bucket URI in DELTASYNC_STORE (or BUCKET), found none" in text
    assert "ModuleNotFoundError" not in text and "No such file" not in text, text


def _children(pid: int) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", encoding="utf-8") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(d))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_rollout_image_starts_vllm_with_a_command_line_vllm_accepts(image, tmp_path):
    """With a configuration the launcher starts the vLLM child (on 127.0.0.1, with the worker
    extension importable from the image's /app, without CONTROL_TOKEN); vLLM parses that command
    line and then fails on the missing model, and the launcher exits with the child."""
    img = image("rollout")
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    env = rollout_env(img, tmp_path, DELTASYNC_STORE=f"file://{bucket}",
                      MODEL=str(tmp_path / "no-such-model"))  # fmt: skip
    log = str(tmp_path / "rollout.log")
    proc = start(img, img.df.cmd, env, log)
    try:
        deadline, child = time.monotonic() + START_TIMEOUT_S, None
        while child is None and time.monotonic() < deadline and proc.poll() is None:
            for pid in _children(proc.pid):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = [a.decode() for a in f.read().split(b"\0") if a]
                if "vllm.entrypoints.openai.api_server" in argv:
                    child = pid
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        child_env = dict(
                            e.decode().partition("=")[::2] for e in f.read().split(b"\0") if e
                        )
                    child_cwd = os.readlink(f"/proc/{pid}/cwd")
                    break
            time.sleep(0.05)
        assert child is not None, "expected the launcher to start vLLM:\n" + tail(log)
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert (
            argv[argv.index("--worker-extension-cls") + 1] == "rollout.extension.DeltaSyncExtension"
        )
        assert "CONTROL_TOKEN" not in child_env
        probe = subprocess.run([sys.executable, "-c", "import rollout.extension as e; print(e.__file__)"],
                               cwd=child_cwd, env=child_env, capture_output=True, text=True)  # fmt: skip
        assert probe.returncode == 0 and probe.stdout.startswith(img.root), probe.stderr
        code = proc.wait(300)  # vLLM imports (~30 s), parses its arguments, finds no model
    finally:
        stop(proc)
    text = tail(log, 20000)
    assert code != 0 and "the server exited with code" in text, text[-3000:]
    for bad in ("unrecognized arguments", "ModuleNotFoundError", "invalid choice"):
        assert bad not in text, text[-3000:]
    # vLLM got past its argument parsing to the model itself
    model_lines = [ln for ln in text.splitlines() if "no-such-model" in ln and "config:" not in ln]
    assert model_lines, text[-3000:]
