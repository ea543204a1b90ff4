"""Static checks of each Space's Dockerfile, no process started: every COPY source exists and
reaches the build context past its .dockerignore, the start command and HEALTHCHECK are ones the
base image can run (exec-form CMD, ENTRYPOINT reset where the base image sets one, PORT 7860), every
requirement of the image's ``pip install`` is installed in this venv at a version it accepts, and
`make spaces` sets the Space variables the images read.
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex

import pytest

from tools.deploy_spaces import Deployer
from tools.space_config import DeployConfig

from .dockerfile_image import SPACES, _pyproject, build_context, dockerfile, dockerignore_excludes


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
    assert {"BUCKET", "MODEL"} <= set(specs["rollout"].variables)
    assert specs["wordle"].variables == {}
