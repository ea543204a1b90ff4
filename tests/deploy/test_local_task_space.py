"""``make spaces TASK=number_guess`` through a local Hub (``tools/local_hub``, Spaces run as local
processes from their Dockerfiles): the example task's own Space is created public with its key
as a secret, built from ``examples/number_guess/space`` and RUNNING; the printed ``make train``
line names the task, the Space's URL and the key's file; the Space answers its health check to
anyone, refuses its other routes without the key, and plays a game with it.

``SPACES_ARGS="--only env"`` leaves out the rollout (vLLM) and dashboard Spaces, whose deploys
test_journey.py runs; the plan of all three is test_task_space.py's."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import httpx
import pytest

from examples.number_guess.env import NumberGuessEnv, parse_reply
from tools.local_hub.process import HubProcess

from .conftest import REPO_ROOT

pytestmark = pytest.mark.slow
STATE = os.path.join(REPO_ROOT, "runs", "spaces")  # where the deploy keeps its secrets


@pytest.fixture
def hub(tmp_path):
    hub = HubProcess(tmp_path / "hub").start()
    try:
        yield hub
    finally:
        hub.stop()


def test_make_spaces_task_deploys_the_tasks_space(hub, tmp_path):
    import huggingface_hub as hf

    prefix = f"ng{os.getpid()}"
    made = [
        os.path.join(STATE, f"me--{prefix}-{name}")
        for name in (
            "number-guess.number_guess_api_key",
            "rollout.control_token",
            "rollout.rollout_api_key",
        )
    ]
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": hub.tokens["me-write"],
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    env.pop("HF_HUB_OFFLINE", None)
    spaces_args = f"--only env --public --prefix {prefix} --timeout-s 150 --check-every-s 1"
    # -o setup: the venv as it is (the test does not install anything)
    cmd = f"make -s -o setup spaces TASK=number_guess BUCKET=me/{prefix} SPACES_ARGS={shlex.quote(spaces_args)}"
    try:
        done = subprocess.run(
            cmd, shell=True, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:] + hub.log_tail()
        out = done.stdout
        line = next(x.strip() for x in out.splitlines() if "make train " in x)
        # the rollout Space was left out: no key of its own was made
        shown = re.fullmatch(
            r'WORDLE_API_KEY="\$\(cat (\S+)\)" make train TASK=number_guess .*', line
        )
        assert shown, line
        key_file = os.path.join(REPO_ROOT, shown.group(1))
        assert os.path.samefile(key_file, made[0])
        url = re.search(r"ENV_URL=(\S+)", line).group(1)
        assert url.startswith("http://127.0.0.1:"), line  # the local Hub's domain of the Space
        assert "the Space is RUNNING" in out and f"VLLM_URL=https://me-{prefix}-rollout" in line
        with open(key_file) as f:
            key = f.read().strip()

        api = hf.HfApi(endpoint=hub.url, token=hub.tokens["me-write"])
        repo_id = f"me/{prefix}-number-guess"
        assert api.get_space_runtime(repo_id).stage == "RUNNING"
        assert api.space_info(repo_id).private is False
        assert set(api.get_space_secrets(repo_id)) == {"NUMBER_GUESS_API_KEY"}
        # only the environment Space was deployed
        with pytest.raises(hf.errors.RepositoryNotFoundError):
            api.get_space_runtime(f"me/{prefix}-rollout")

        # public: anyone reaches it, but every route past the health check needs its key
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        refused = httpx.get(f"{url}/stats", timeout=10)
        assert refused.status_code == 401 and "NUMBER_GUESS_API_KEY" in refused.json()["detail"]
        headers = {"Authorization": f"Bearer {key}"}
        with NumberGuessEnv(url, headers) as game:
            game.reset(seed=3)
            low, high = 1, 100
            while not game.done:
                guess = (low + high) // 2
                feedback, _ = parse_reply(game.guess(guess))
                low, high = (guess + 1, high) if feedback == "higher" else (low, guess - 1)
            assert game.get_reward() == 1.0
        stats = httpx.get(f"{url}/stats", headers=headers, timeout=10).json()
        assert stats["games"] == 1 and stats["solved"] == 1 and stats["moves"] == len(game.moves)
        assert not any(os.path.exists(p) for p in made[1:])  # none for the rollout Space
    finally:
        for path in made:  # this test's secrets, not a deploy of the user's
            if os.path.exists(path):
                os.unlink(path)
