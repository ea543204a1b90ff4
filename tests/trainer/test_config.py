"""``trainer.config.from_args``: flags, else the variables the ``TrainConfig`` fields declare
(``metadata["env"]``), else the fields' defaults. The expectations come from the declarations.
Adapter settings a run cannot use are refused with what was expected, found and the fix. A hub
model without CUDA gets settings sized for 2 cores, and a warm start only if it never saw a tool."""

from __future__ import annotations

import typing
from dataclasses import Field, fields

import pytest

from trainer.config import AdapterConfigError, TrainConfig, from_args

HINTS = typing.get_type_hints(TrainConfig)
DECLARED = [f for f in fields(TrainConfig) if "env" in f.metadata]


def _sample(f: Field) -> tuple[str, object]:
    """A valid value for field ``f`` other than its default: (the variable's text, the value)."""
    if f.name == "adapter":  # a choice: its one kind
        return "lora", "lora"
    if HINTS[f.name] is int:
        return str(f.default + 7), f.default + 7
    return f"x-{f.name}", f"x-{f.name}"


@pytest.fixture()
def env(monkeypatch):
    """No declared variable set; ``env(NAME=value)`` sets some."""
    for f in DECLARED:
        monkeypatch.delenv(f.metadata["env"], raising=False)

    def setenv(**kw: str) -> None:
        for name, value in kw.items():
            monkeypatch.setenv(name, value)

    return setenv


def test_the_makefile_variables_and_secrets_are_declared():
    declared = {f.metadata["env"] for f in DECLARED}
    assert {"BUCKET", "MODEL", "VLLM_URL", "ENV_URL", "RUN_ID", "STEPS"} <= declared
    assert {"HF_TOKEN", "ROLLOUT_API_KEY"} <= declared


@pytest.mark.parametrize("f", DECLARED, ids=lambda f: f.metadata["env"])
def test_each_declared_variable_is_read_by_the_field_type(env, f: Field):
    text, value = _sample(f)
    env(**{f.metadata["env"]: text})
    assert getattr(from_args([]), f.name) == value


@pytest.mark.parametrize("blank", [None, "", " "])
def test_unset_or_blank_variables_keep_the_declared_defaults(env, blank):
    if blank is not None:
        env(**{f.metadata["env"]: blank for f in DECLARED})
    assert from_args([]) == TrainConfig()


def test_flags_win_over_variables_and_secrets_have_no_flag(env, capsys):
    env(STEPS="5", MODEL="m", HF_TOKEN="hf_secret")
    cfg = from_args(["--max-steps", "9", "--learning-rate", "1e-3", "--bf16", "yes"])
    assert (cfg.max_steps, cfg.model, cfg.learning_rate, cfg.bf16) == (9, "m", 1e-3, True)
    assert cfg.hf_token == "hf_secret" and "hf_secret" not in repr(cfg)
    for secret in ("--hf-token", "--rollout-api-key"):
        with pytest.raises(SystemExit):
            from_args([secret, "x"])
    with pytest.raises(SystemExit):
        from_args(["--help"])
    assert f"default: $STEPS, else {TrainConfig.max_steps}" in capsys.readouterr().out.replace(
        "\n", " "
    )


def test_run_id_defaults_to_the_bucket_name(env):
    env(BUCKET="me/wordle-7/")
    assert from_args([]).run_id == "wordle-7"
    assert from_args(["--run-id", "r"]).run_id == "r"
    env(RUN_ID="from-env")
    assert from_args([]).run_id == "from-env"


def test_a_variable_that_does_not_parse_is_named(env, capsys):
    env(STEPS="many")
    with pytest.raises(SystemExit) as e:
        from_args([])
    assert e.value.code == 2
    assert "STEPS: expected an integer, found 'many'" in capsys.readouterr().err


def test_adapter_settings_are_read_from_flags_and_the_variable(env):
    env(ADAPTER="lora")
    argv = ["--lora-rank", "16", "--lora-alpha", "32", "--lora-target-modules", "q_proj, v_proj"]
    cfg = from_args([*argv, "--adapter-name", "wordle-lora"])
    assert (cfg.adapter, cfg.lora_rank, cfg.lora_alpha) == ("lora", 16, 32)
    assert (cfg.target_modules(), cfg.adapter_name) == (["q_proj", "v_proj"], "wordle-lora")
    assert TrainConfig().adapter is None  # the default: full weights


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"adapter": "qlora"}, "ADAPTER: expected one of lora"),
        ({"lora_rank": 0}, "--lora-rank: expected 1..512"),
        ({"lora_rank": 1024}, "--lora-rank: expected 1..512"),
        ({"lora_alpha": 0}, "--lora-alpha: expected a positive number"),
        ({"lora_target_modules": " , "}, "--lora-target-modules: expected"),
        ({"lora_target_modules": "q_proj,lm_head"}, "remove ['lm_head']"),
        ({"lora_target_modules": "q_proj,model.*"}, "remove ['model.*']"),
        ({"adapter_name": "me/policy"}, "--adapter-name: expected 1-64 letters"),
        ({"adapter_name": "-policy"}, "the first a letter or digit"),
        ({"adapter_name": "policy-v3"}, "not ending in -v<N>"),
    ],
)
def test_bad_adapter_settings_are_refused(env, capsys, settings, expected):
    with pytest.raises(AdapterConfigError, match="found") as e:
        TrainConfig(**{"adapter": "lora", **settings})
    assert expected in str(e.value)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    with pytest.raises(SystemExit) as exit_:
        from_args(flags)
    assert exit_.value.code == 2 and expected in capsys.readouterr().err.replace("\n", " ")


def test_an_evaluation_larger_than_the_held_out_set_is_refused():
    """Every evaluation game plays a held-out word: asking for more games than there are held-out
    seeds fails before anything starts, naming the limit."""
    from trainer.config import EvalConfigError
    from trainer.task.wordle_task import EVAL_SEED_COUNT, eval_seeds, held_out_targets
    from wordle_env import wordlists

    cfg = TrainConfig()
    played = {wordlists.target_for_seed(s) for s in eval_seeds(count=cfg.eval_episodes)}
    assert played <= held_out_targets()  # the default evaluation's words are all held out
    TrainConfig(eval_episodes=EVAL_SEED_COUNT)
    for field in ("eval_episodes", "eval_curve_episodes"):
        with pytest.raises(
            EvalConfigError, match=f"{field}={EVAL_SEED_COUNT + 1}.*{EVAL_SEED_COUNT}"
        ):
            TrainConfig(**{field: EVAL_SEED_COUNT + 1})


def test_a_hub_model_without_cuda_gets_settings_sized_for_two_cores_unless_given():
    from trainer.config import HUB_CPU_DEFAULTS, hub_cpu_defaults

    assert hub_cpu_defaults({}, cuda=False) == {}  # the local model keeps its own
    given = {"model": "runs/models/smollm2-135m-instruct", "eval_episodes": 8}
    sized = TrainConfig(**hub_cpu_defaults(given, cuda=False))
    assert sized.eval_episodes == 8  # given on the command line: kept
    assert sized.token_budget == HUB_CPU_DEFAULTS["token_budget"] < TrainConfig.token_budget
    assert sized.num_generations == HUB_CPU_DEFAULTS["num_generations"]
    assert hub_cpu_defaults(given, cuda=True) == given  # a GPU trains the usual sizes
    with_bucket = hub_cpu_defaults({"bucket": "user/run"}, cuda=False)  # Qwen3-0.6B by default
    assert with_bucket["token_budget"] == HUB_CPU_DEFAULTS["token_budget"]


def test_a_hub_model_is_warm_started_only_when_it_never_saw_a_tool_unless_asked():
    from trainer.config import HUB_WARM_START_GAMES

    cfg = TrainConfig(model="some/model")
    assert cfg.hub_warm_start_game_count(template_swapped=True) == HUB_WARM_START_GAMES
    assert cfg.hub_warm_start_game_count(template_swapped=False) == 0
    asked = TrainConfig(model="some/model", hub_warm_start_games=7)
    assert asked.hub_warm_start_game_count(template_swapped=False) == 7
