"""The Space's deployment files agree with each other and with the server's configuration.

Covers: the README front matter (``sdk: docker``, ``app_port``), ``openenv.yaml`` and the
Dockerfile (port, entry module, uid 1000, ``/health`` check, this folder as build context) name
the same port and app the server really serves, and the word lists ship as package data.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path
from types import ModuleType

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
SPACE = REPO / "spaces" / "wordle-env"


def _front_matter(readme: Path) -> dict[str, object]:
    text = readme.read_text(encoding="utf-8")
    match = re.match(r"---\n(.*?)\n---\n", text, re.DOTALL)
    assert match, f"{readme} must start with a --- front matter block"
    return yaml.safe_load(match.group(1))


def test_ports_and_entry_points_agree(space_server: ModuleType) -> None:
    config = importlib.import_module(f"{space_server.__name__}.config").load_config({})
    front = _front_matter(SPACE / "README.md")
    manifest = yaml.safe_load((SPACE / "openenv.yaml").read_text())
    dockerfile = (SPACE / "Dockerfile").read_text()
    assert front["sdk"] == "docker"
    assert front["app_port"] == manifest["port"] == config.port
    assert f"EXPOSE {config.port}" in dockerfile
    # openenv.yaml's app (relative to this folder, the package root ``wordle_env``) is the module
    # the Dockerfile runs, and that module assigns it at top level (read with ast: importing it
    # would build the whole app).
    module, attribute = manifest["app"].split(":")
    assert f'"-m", "wordle_env.{module}"' in dockerfile
    tree = ast.parse((SPACE / (module.replace(".", "/") + ".py")).read_text())
    assigned = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    assert attribute in assigned


def test_dockerfile_runs_as_uid_1000_with_a_health_check() -> None:
    dockerfile = (SPACE / "Dockerfile").read_text()
    assert re.search(r"^USER 1000\b", dockerfile, re.MULTILINE)
    healthcheck = re.search(r"^HEALTHCHECK .*?/health", dockerfile, re.MULTILINE | re.DOTALL)
    assert healthcheck is not None
    # Built from this folder alone (what `openenv push` uploads): every COPY source is in it.
    for source in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", dockerfile, re.MULTILINE):
        for path in source.split():
            assert (SPACE / path).exists(), f"Dockerfile copies {path}, missing in {SPACE}"


def test_word_lists_ship_as_package_data() -> None:
    pyproject = tomllib.loads((SPACE / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["package-dir"]["wordle_env"] == "."
    patterns = pyproject["tool"]["setuptools"]["package-data"]["wordle_env.words"]
    package = SPACE / pyproject["tool"]["setuptools"]["package-dir"]["wordle_env.words"]
    shipped = {p.name for pattern in patterns for p in package.glob(pattern)}
    assert {"answers.txt", "allowed.txt", "SOURCE.md", "SCOWL-COPYRIGHT.txt"} <= shipped


def test_openenv_validate_passes_and_push_finds_its_files(tmp_path) -> None:
    """``openenv validate`` (openenv's own CLI) accepts the folder, and the folder has what
    ``openenv push`` packages (an env root with its client, manifest, project and Dockerfile)."""
    import shutil
    import subprocess

    # A copy without build leftovers: validate refuses anything but regular files.
    copy = tmp_path / "wordle-env"
    shutil.copytree(SPACE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    cli = Path(sys.executable).with_name("openenv")
    out = subprocess.run(
        [str(cli), "validate", str(copy), "--level", "static"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"openenv validate failed:\n{out.stdout}\n{out.stderr}"
    assert "FAIL" not in out.stdout, out.stdout
    for name in (
        "openenv.yaml",
        "__init__.py",
        "client.py",
        "README.md",
        "pyproject.toml",
        "Dockerfile",
    ):
        assert (SPACE / name).is_file(), f"openenv push needs {name} at the env root"
    # push turns the shared web UI on unless the Dockerfile names the switch itself
    assert "ENABLE_WEB_INTERFACE=false" in (SPACE / "Dockerfile").read_text()
