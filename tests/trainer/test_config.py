"""``trainer.config.from_args``: flags, else the variables ``FLAGS`` declares, else the sections'
defaults; each flag lands on its section's field. The expectations come from the declarations.
Adapter settings a run cannot use are refused with what was expected, found and the fix. A hub
model without CUDA gets settings sized for 2 cores (bf16 autocast only where bf16 is native, the
dtype and its reason in the log line and the summary), and a warm start only if it never saw a
tool."""

from __future__ import annotations

import logging
import os
import typing
from dataclasses import fields

import pytest

from trainer.config import FLAGS, AdapterConfigError, GRPOConfigError, TrainConfig, from_args

DECLARED = [(flag, var) for flag, (_, _, var) in FLAGS.items() if var]


def _sample(flag: str) -> tuple[str, object]:
    """A valid value for ``flag`` other than its default: (the variable's text, the value)."""
    if flag == "adapter":  # a choice: its one kind
        return "lora", "lora"
    if flag == "net":  # a link profile (deltasync.link)
        return "slow", "slow"
    if flag == "task":  # a loadable task: the shipped one, by module path
        return "trainer.task.wordle.task:TASK", "trainer.task.wordle.task:TASK"
    section, name, _ = FLAGS[flag]
    hint = typing.get_type_hints(typing.get_type_hints(TrainConfig)[section])[name]
    default = getattr(TrainConfig(), section).__dataclass_fields__[name].default
    if hint is int:
        return str(default + 7), default + 7
    return f"x-{flag}", f"x-{flag}"


@pytest.fixture()
def env(monkeypatch):
    """No declared variable set; ``env(NAME=value)`` sets some."""
    for _, var in DECLARED:
        monkeypatch.delenv(var, raising=False)

    def setenv(**kw: str) -> None:
        for name, value in kw.items():
            monkeypatch.setenv(name, value)

    return setenv


def test_the_makefile_variables_and_secrets_are_declared():
    declared = {var for _, var in DECLARED}
    assert {"BUCKET", "MODEL", "VLLM_URL", "ENV_URL", "RUN_ID", "STEPS", "ADAPTER"} <= declared
    assert {"HF_TOKEN", "ROLLOUT_API_KEY", "WORDLE_API_KEY"} <= declared


def test_every_flag_lands_on_a_field_of_its_section_and_every_field_is_reachable():
    """The flat flags map onto the sections one to one (the reused sections, the publisher's and
    the warm start's, expose only the settings a run has always had as flags)."""
    cfg = TrainConfig()
    targets = [(section, name) for section, name, _ in FLAGS.values()]
    assert len(set(targets)) == len(targets)
    for section, name in targets:
        assert name in {f.name for f in fields(getattr(cfg, section))}, (section, name)
    own = {"run", "secrets", "fleet", "grpo", "eval", "adapter", "local"}
    for section in own:  # the trainer's own sections: every field has its flag
        assert {f.name for f in fields(getattr(cfg, section))} == {
            n for s, n in targets if s == section
        }


def test_help_lists_the_flags_by_section(env, capsys):
    with pytest.raises(SystemExit) as e:
        from_args(["--help"])
    assert e.value.code == 0  # help printed, not an error
    out = capsys.readouterr().out
    order = [out.index(f"\n{s}:\n") for s in ("run", "fleet", "grpo", "publish", "eval", "adapter")]
    assert order == sorted(order)
    grpo, publish = out.index("\ngrpo:\n"), out.index("\npublish:\n")
    assert grpo < out.index("  --max-steps", grpo) < publish  # a flag sits in its section
    assert publish < out.index("  --anchor-every", grpo) < out.index("\nlocal_model:\n")


def test_each_part_gets_its_own_section():
    cfg = TrainConfig.from_flags(warm_start_games=5, model_layers=3, eval_episodes=9, seed=4)
    assert (cfg.local_model.games, cfg.local_model.layers, cfg.local_model.seed) == (5, 3, 4)
    assert cfg.eval.episodes == 9 and cfg.flag("eval_episodes") == 9
    with pytest.raises(TypeError, match="not trainer flags"):
        TrainConfig.from_flags(warm_start_gamez=5)


@pytest.mark.parametrize("flag, var", DECLARED, ids=[v for _, v in DECLARED])
def test_each_declared_variable_is_read_by_the_field_type(env, flag, var):
    text, value = _sample(flag)
    env(**{var: text})
    assert from_args([]).flag(flag) == value


@pytest.mark.parametrize("blank", [None, "", " "])
def test_unset_or_blank_variables_keep_the_declared_defaults(env, blank):
    if blank is not None:
        env(**{var: blank for _, var in DECLARED})
    assert from_args([]) == TrainConfig()


def test_flags_win_over_variables_and_secrets_have_no_flag(env, capsys):
    env(STEPS="5", MODEL="m", HF_TOKEN="hf_secret", WORDLE_API_KEY="wordle_secret")
    cfg = from_args(["--max-steps", "9", "--learning-rate", "1e-3", "--bf16", "yes"])
    got = (cfg.grpo.max_steps, cfg.run.model, cfg.grpo.learning_rate, cfg.grpo.bf16)
    assert got == (9, "m", 1e-3, True)
    assert cfg.secrets.hf_token == "hf_secret" and "hf_secret" not in repr(cfg)
    assert "hf_secret" not in repr(cfg.secrets)
    assert cfg.secrets.env_api_key == "wordle_secret" and "wordle_secret" not in repr(cfg)
    for secret in ("--hf-token", "--rollout-api-key", "--env-api-key"):
        with pytest.raises(SystemExit) as e:
            from_args([secret, "x"])
        assert e.value.code == 2
        assert f"error: unrecognized arguments: {secret} x" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        from_args(["--help"])
    assert e.value.code == 0
    assert f"default: $STEPS, else {TrainConfig().grpo.max_steps}" in " ".join(
        capsys.readouterr().out.split()
    )


def test_run_id_defaults_to_the_bucket_name(env):
    env(BUCKET="me/wordle-7/")
    assert from_args([]).run.run_id == "wordle-7"
    assert from_args(["--run-id", "r"]).run.run_id == "r"
    env(RUN_ID="from-env")
    assert from_args([]).run.run_id == "from-env"


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
    assert (cfg.adapter.kind, cfg.adapter.rank, cfg.adapter.alpha) == ("lora", 16, 32)
    assert (cfg.adapter.modules(), cfg.adapter.name) == (["q_proj", "v_proj"], "wordle-lora")
    assert TrainConfig().adapter.kind is None  # the default: full weights


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
        TrainConfig.from_flags(**{"adapter": "lora", **settings})
    assert expected in str(e.value)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    with pytest.raises(SystemExit) as exit_:
        from_args(flags)
    assert exit_.value.code == 2 and expected in capsys.readouterr().err.replace("\n", " ")


@pytest.mark.parametrize("flags", [["--off-policy", "decoupled"], ["--off-policy-stats", "true"]])
def test_an_adapter_run_is_refused_a_rebuilt_generating_policy(env, capsys, flags):
    """The generating policy is rebuilt from full-weight versions; an adapter run asking for it
    stops before anything starts, saying what to use instead."""
    with pytest.raises(SystemExit) as exit_:
        from_args(["--adapter", "lora", *flags])
    err = capsys.readouterr().err.replace("\n", " ")
    assert exit_.value.code == 2 and "expected a full-weight run, found an adapter run" in err
    assert "Use --off-policy off for adapter runs" in err
    assert from_args(flags).grpo.off_policy_stats == (flags[0] == "--off-policy-stats")


def test_an_evaluation_larger_than_the_held_out_set_is_clamped_and_said(caplog):
    """Every evaluation game plays a held-out word: asking for more games than there are held-out
    seeds plays all of them and no more, and the log names the limit and the flag."""
    from trainer.task.wordle.game_env import EVAL_SEED_COUNT, eval_seeds, held_out_targets
    from wordle_env import wordlists

    cfg = TrainConfig()
    played = {wordlists.target_for_seed(s) for s in eval_seeds(count=cfg.eval.episodes)}
    assert played <= held_out_targets()  # the default evaluation's words are all held out
    assert TrainConfig.from_flags(eval_episodes=EVAL_SEED_COUNT).eval.episodes == EVAL_SEED_COUNT
    for field, attr in (("eval_episodes", "episodes"), ("eval_curve_episodes", "curve_episodes")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainer"):
            cfg = TrainConfig.from_flags(**{field: EVAL_SEED_COUNT + 1})
        assert getattr(cfg.eval, attr) == EVAL_SEED_COUNT
        assert f"{field}={EVAL_SEED_COUNT + 1}: the task holds {EVAL_SEED_COUNT}" in caplog.text
        assert f"--{field.replace('_', '-')}" in caplog.text


# The two kinds of CPU, as ``deltasync.cpu_dtype.native_dtype`` reports them.
NATIVE_BF16 = ("bfloat16", "bf16 native on this CPU: avx512_bf16 yes, amx no, kernels AVX512")
EMULATED_BF16 = ("float32", "bf16 emulated on this CPU: avx512_bf16 no, amx no, kernels AVX2")


def _cpu(monkeypatch, kind: tuple[str, str]) -> None:
    """Make this machine's CPU report ``kind`` (NATIVE_BF16 or EMULATED_BF16)."""
    from deltasync import cpu_dtype

    monkeypatch.setattr(cpu_dtype, "native_dtype", lambda cuda=None: cpu_dtype.DtypeChoice(*kind))


def test_a_hub_model_without_cuda_gets_settings_sized_for_two_cores_unless_given(
    monkeypatch, env, caplog
):
    import logging

    import torch

    from trainer.config import (
        HUB_CPU_DEFAULTS,
        HUB_CPU_FULL_LEARNING_RATE,
        hub_cpu_defaults,
        train_dtype,
    )

    _cpu(monkeypatch, NATIVE_BF16)  # an AVX-512 BF16 (or AMX) processor
    assert hub_cpu_defaults({}, cuda=False) == {}  # the local model keeps its own
    given = {"model": "runs/models/smollm2-135m-instruct", "eval_episodes": 8}
    sized = TrainConfig.from_flags(**hub_cpu_defaults(given, cuda=False))
    assert sized.eval.episodes == 8  # given on the command line: kept
    budget = TrainConfig().grpo.token_budget
    assert sized.grpo.token_budget == HUB_CPU_DEFAULTS["token_budget"] < budget
    assert sized.grpo.num_generations == HUB_CPU_DEFAULTS["num_generations"]
    assert hub_cpu_defaults(given, cuda=True) == given  # a GPU trains the usual sizes
    with_bucket = hub_cpu_defaults({"bucket": "user/run"}, cuda=False)  # Qwen3-0.6B by default
    assert with_bucket["token_budget"] == HUB_CPU_DEFAULTS["token_budget"]
    # the learning run: bf16 autocast, full weights at the measured rate, an adapter its own
    assert sized.grpo.autocast and sized.grpo.learning_rate == HUB_CPU_FULL_LEARNING_RATE
    assert sized.grpo.turn_credit == 1.0 and TrainConfig().grpo.turn_credit == 0.0
    # ... on the game's own reward, where the local model and a GPU keep the task's first
    assert sized.grpo.reward == "game" != TrainConfig().grpo.reward
    gpu = TrainConfig.from_flags(**hub_cpu_defaults(given, cuda=True))
    assert gpu.grpo.reward == gpu.task().rewards[0]
    chosen = TrainConfig.from_flags(**hub_cpu_defaults({**given, "reward": "best"}, cuda=False))
    assert chosen.grpo.reward == "best"  # a flag overrides it
    # a task of your own without per-turn rewards, or without that reward, trains as GRPO does
    # on its own reward, and is not refused for it
    monkeypatch.syspath_prepend(os.path.dirname(__file__))  # letter_task.py, beside this file
    single_turn = hub_cpu_defaults({**given, "task": "letter_task:TASK"}, cuda=False)
    assert "turn_credit" not in single_turn and "reward" not in single_turn
    assert TrainConfig.from_flags(**single_turn).task().name == "letter"
    lora = TrainConfig.from_flags(**hub_cpu_defaults({**given, "adapter": "lora"}, cuda=False))
    assert (
        lora.grpo.learning_rate
        == TrainConfig.from_flags(adapter="lora", model="m").grpo.learning_rate
    )
    assert lora.grpo.autocast
    assert train_dtype(sized.grpo) == ("bfloat16", f"--autocast: bf16 autocast over float32 "
                                       f"master weights; {NATIVE_BF16[1]}")  # fmt: skip
    # where bf16 is emulated (AVX2 alone): float32, unless --autocast is given
    _cpu(monkeypatch, EMULATED_BF16)
    plain = TrainConfig.from_flags(**hub_cpu_defaults(given, cuda=False))
    assert not plain.grpo.autocast and train_dtype(plain.grpo).dtype == "float32"
    assert plain.grpo.token_budget == HUB_CPU_DEFAULTS["token_budget"]  # the rest as sized
    asked = TrainConfig.from_flags(**hub_cpu_defaults({**given, "autocast": True}, cuda=False))
    assert asked.grpo.autocast and train_dtype(asked.grpo).dtype == "bfloat16"
    assert hub_cpu_defaults(given, cuda=True) == given  # a GPU: neither
    # the one log line names the dtype and why: chosen on each CPU, or given by the flag
    if torch.cuda.is_available():
        return
    lines = {}
    for name, kind, argv in (
        ("native", NATIVE_BF16, []),
        ("emulated", EMULATED_BF16, []),
        ("given", EMULATED_BF16, ["--autocast", "true"]),
    ):
        _cpu(monkeypatch, kind)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trainer"):
            from_args(["--model", "runs/models/smollm2-135m-instruct", *argv])
        (lines[name],) = [m for m in caplog.messages if m.startswith("settings chosen")]
    assert "--autocast True" in lines["native"]
    assert lines["native"].endswith(
        "training dtype bfloat16 (--autocast: bf16 autocast over float32 master weights; "
        f"{NATIVE_BF16[1]})"
    )
    assert "--autocast False" in lines["emulated"]
    assert lines["emulated"].endswith(
        f"training dtype float32 (neither --autocast nor --bf16; {EMULATED_BF16[1]})"
    )
    assert "--autocast" not in lines["given"].partition(";")[0]  # the user's, not chosen
    assert "training dtype bfloat16 (--autocast: " in lines["given"]
    assert EMULATED_BF16[1] in lines["given"]


def test_a_hub_model_is_warm_started_only_when_it_never_saw_a_tool_unless_asked():
    from trainer.config import HUB_WARM_START_GAMES

    run = TrainConfig.from_flags(model="some/model").run
    assert run.hub_warm_start_game_count(template_swapped=True) == HUB_WARM_START_GAMES
    assert run.hub_warm_start_game_count(template_swapped=False) == 0
    asked = TrainConfig.from_flags(model="some/model", hub_warm_start_games=7).run
    assert asked.hub_warm_start_game_count(template_swapped=False) == 7


def test_the_warm_starts_turns_reach_its_settings_and_a_bad_count_stops_the_run(capsys):
    """--hub-warm-start-turns sets the calls kept of each teacher game (part of the warm start's
    cache key); a count below 1 stops at the command line with the range."""
    from trainer.task.wordle.hub_warm_start import HubWarmStartConfig
    from trainer.task.wordle.task import hub_config

    default = hub_config(TrainConfig.from_flags(model="some/model").run, 128)
    assert default == HubWarmStartConfig(games=128, turns=6)  # whole games: the learning runs'
    first = hub_config(from_args(["--model", "m", "--hub-warm-start-turns", "3"]).run, 96)
    assert (first.turns, first.games) == (3, 96)
    refused = {
        "--hub-warm-start-turns": "hub_warm_start_turns: expected a count of calls >= 1, found 0",
        "--hub-warm-start-games": "hub_warm_start_games: expected 0 (no warm start) or more games, "
        "found -1",
    }
    for flag, value in (("--hub-warm-start-turns", "0"), ("--hub-warm-start-games", "-1")):
        with pytest.raises(SystemExit) as e:
            from_args(["--model", "m", flag, value])
        assert e.value.code == 2
        assert refused[flag] in " ".join(capsys.readouterr().err.split())


def test_a_simulated_network_and_a_forced_lag_reach_the_local_replica(env, capsys):
    """``NET`` and ``SYNC_EVERY`` (make variables) put the trainer's store behind the link and
    go to every local replica's environment; an unknown profile stops the run at once."""
    from trainer.loop.trained_weights import FullWeights
    from trainer.stack import RunStack

    env(NET="spaces", SYNC_EVERY="4")
    cfg = from_args([])
    assert (cfg.run.net, cfg.local.replica_sync_every) == ("spaces", 4)
    assert RunStack(cfg, FullWeights()).replica_env() == {"NET": "spaces", "SYNC_EVERY": "4"}
    assert RunStack(TrainConfig(), FullWeights()).replica_env() == {}  # the default: neither
    env(NET="moon")
    with pytest.raises(SystemExit) as e:
        from_args([])
    assert e.value.code == 2
    assert "NET='moon': expected local, spaces, slow" in capsys.readouterr().err


def test_every_flag_says_what_it_sets_in_help(capsys):
    """--help gives each flag its field's description (the settings classes' Attributes), then
    its default and the variable it reads."""
    import pytest

    from trainer.config import FLAGS, from_args

    with pytest.raises(SystemExit) as e:
        from_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--learning-rate LEARNING_RATE" in text and "(default: $BUCKET, else None)" in text
    shown = [f for f in FLAGS if f"--{f.replace('_', '-')} " in text]
    undocumented = [f for f in shown if f"--{f.replace('_', '-')} {f.upper()} (default:" in text]
    assert shown and not undocumented, undocumented


def test_the_summary_records_every_setting_but_the_secrets():
    """``summary.json``'s ``settings``: each section's values, e.g. which off-policy correction
    ran (a fresh run's summary did not say), never a token."""
    import json

    from trainer.config import TrainConfig
    from trainer.settings import Secrets

    cfg = TrainConfig.from_flags(off_policy="decoupled", learning_rate=3e-5)
    cfg.secrets = Secrets(hf_token="hf_secret_value", rollout_api_key="key_value")
    record = cfg.record()
    assert record["grpo"]["off_policy"] == "decoupled" and record["grpo"]["learning_rate"] == 3e-5
    assert "secrets" not in record and set(record) >= {"run", "grpo", "publish", "eval"}
    text = json.dumps(record)
    assert "hf_secret_value" not in text and "key_value" not in text


def test_the_summary_records_the_training_dtype_and_why(monkeypatch):
    """``summary.json`` says which dtype the run trained in and why (``train_dtype``,
    ``train_dtype_reason``): the settings, and whether bf16 is native on the machine."""
    from trainer.config import hub_cpu_defaults
    from trainer.summary import build_summary

    start = {"initial_model": "m", "warm_start_s": 0.0, "train_s": 0.0}
    _cpu(monkeypatch, EMULATED_BF16)
    plain = TrainConfig.from_flags(**hub_cpu_defaults({"model": "m"}, cuda=False))
    s = build_summary(plain, start, "digest", [])
    assert s["train_dtype"] == "float32" and s["settings"]["grpo"]["autocast"] is False
    assert s["train_dtype_reason"] == f"neither --autocast nor --bf16; {EMULATED_BF16[1]}"
    _cpu(monkeypatch, NATIVE_BF16)
    native = TrainConfig.from_flags(**hub_cpu_defaults({"model": "m"}, cuda=False))
    s = build_summary(native, start, "digest", [])
    assert s["train_dtype"] == "bfloat16" and s["train_dtype_reason"].endswith(NATIVE_BF16[1])


def test_the_settings_the_model_chose_are_named_once(env, caplog):
    """The log names what the model chose, not the user (HUB_CPU_DEFAULTS for a hub model
    without CUDA, the learning rate by model), each overridable by its flag; a flag given is
    not listed."""
    import logging

    import torch

    from trainer.config import TrainConfig, from_args, model_defaults_line

    tiny = model_defaults_line(TrainConfig.from_flags(), {})
    assert tiny.startswith("settings chosen for the local model: --learning-rate 0.0002")
    assert "HUB_CPU_DEFAULTS" not in tiny
    if torch.cuda.is_available():
        return
    with caplog.at_level(logging.INFO, logger="trainer"):
        from_args(["--model", "Qwen/Qwen3-0.6B", "--token-budget", "2048"])
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("settings")]
    assert "Qwen/Qwen3-0.6B without CUDA (HUB_CPU_DEFAULTS)" in line
    assert "--num-generations 4" in line and "--learning-rate 6e-05" in line
    assert "--reward game" in line
    assert "--token-budget" not in line  # given by the user


def test_the_reward_is_one_the_task_pays_and_defaults_to_its_first(monkeypatch, capsys):
    """``--reward`` picks one of ``Task.rewards``; anything else stops the run at the command line
    naming the rewards there are; a task that pays one reward only has nothing to choose."""
    from trainer.task.wordle.task import TASK

    assert TrainConfig().grpo.reward == TASK.rewards[0]
    assert from_args(["--reward", "game"]).grpo.reward == "game" in TASK.rewards
    with pytest.raises(SystemExit) as e:
        from_args(["--reward", "last"])
    assert e.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error: --reward last: expected one of the rewards task 'wordle' pays" in err
    assert f"({', '.join(TASK.rewards)})" in err
    monkeypatch.syspath_prepend(os.path.dirname(__file__))  # letter_task.py, beside this file
    letter = {"task": "letter_task:TASK", "eval_episodes": 8}
    assert TrainConfig.from_flags(**letter).grpo.reward is None
    with pytest.raises(GRPOConfigError, match="drop --reward"):
        TrainConfig.from_flags(**letter, reward="game")
