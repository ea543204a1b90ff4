"""Fixtures of the trainer's tests: the local model's task tokenizer (built once per worker) and
the real Wordle server (one a module)."""

import uuid

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The local model's tokenizer (``trainer.task.wordle.model.build_tokenizer``) trained on 40
    solver games: every answer and every board item is one token."""
    from trainer.task.char_model import make_char_tokenizer
    from trainer.task.wordle import model as wordle_model
    from trainer.task.wordle import warm_start

    renderer = make_char_tokenizer(wordle_model.chat_template())
    games = warm_start.solver_games(40, seed=5)
    return wordle_model.build_tokenizer([warm_start.render(g, renderer) for g in games])


@pytest.fixture(scope="module")
def wordle_url(tmp_path_factory):
    """The real Wordle server (the task's own ``EnvServer``) on a loopback port, one a module."""
    from trainer.local import children
    from trainer.task.wordle import task as wordle

    child = children.start_env_server(wordle.TASK.server, str(tmp_path_factory.mktemp("logs")))
    try:
        child.wait_healthy(120)
        yield child.url
    finally:
        child.stop()


@pytest.fixture(params=["memory", "file"])
def uri(request, tmp_path):
    """A bucket for a weight-transfer test: memory:// and a folder."""
    if request.param == "memory":
        return f"memory://transfer-{uuid.uuid4().hex[:8]}"
    return str(tmp_path / "bucket")


@pytest.fixture(scope="session")
def tool_model_dir(real_model_dir, tmp_path_factory) -> str:
    """The real model with the tool template a run gives it (TRL's ChatML tool template,
    ``trainer.task.chat_format.with_tool_template``), whose tool calls TRL's response parser
    reads: what a run's evaluation renders and parses with."""
    from trainer.task.chat_format import with_tool_template

    return with_tool_template(real_model_dir, str(tmp_path_factory.mktemp("tools") / "smol"))
