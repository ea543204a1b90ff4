"""Each Space's image as the deploy tests see it, without Docker: its Dockerfile parsed and its file
tree built.

The general part (parsing, the image's file tree, its environment and command) lives in
``tools/local_hub/docker_image.py``, which the local Hub's Space runner uses too; this module names
the Spaces of this repository (and of the example task) and their build contexts. ``build_image`` builds the image's
file tree under a temporary root from what the COPY lines copy (so a file the image lacks is
missing here too), and hides this checkout's editable ``deltasync`` (and ``spaces/``) from the
processes run in it (a ``sitecustomize`` takes them off ``sys.path``), so only the copied files can
be imported. Used by test_space_dockerfiles.py and test_space_images_run.py (the ``image`` fixture
is in conftest.py).
"""

from __future__ import annotations

import os

from tools.local_hub import docker_image
from tools.local_hub.docker_image import (  # noqa: F401  (re-exported for the tests)
    BASE_IMAGES,
    IGNORED,
    Copy,
    Dockerfile,
    Image,
    dockerignore_excludes,
    parse_dockerfile,
)
from tools.local_hub.docker_image import pyproject as _pyproject  # noqa: F401

from .conftest import REPO_ROOT

SPACES = {
    "dashboard": "spaces/dashboard",
    "rollout": "spaces/vllm-rollout",
    "wordle": "spaces/wordle-env",
    "number_guess": "examples/number_guess/space",  # the example task's own Space
}
# This checkout's editable install: hidden from the image's processes.
CHECKOUT_PATHS = [os.path.join(REPO_ROOT, d) for d in ("shared", "spaces")]


def dockerfile(key: str) -> Dockerfile:
    return parse_dockerfile(os.path.join(REPO_ROOT, SPACES[key], "Dockerfile"))


def build_image(df: Dockerfile, root: str) -> Image:
    """Copy what the Dockerfile COPYs from its build context (:func:`build_context`) into
    ``root`` and find the packages each ``RUN pip install <dir>[extras]`` installs."""
    return docker_image.build_image(df, root, build_context(df), hidden_paths=CHECKOUT_PATHS)


def build_context(df: Dockerfile) -> str:
    """The folder a Dockerfile builds from: its own folder when it copies ``.`` (a Space that is
    its own context, as `openenv push` builds it), else the repository root."""
    own = any(src in (".", "./") for c in df.copies for src in c.sources)
    return os.path.dirname(df.path) if own else REPO_ROOT
