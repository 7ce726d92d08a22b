"""YAML + dotted overrides into frozen dataclasses, with errors that say where."""

import dataclasses
import os
from pathlib import Path
from typing import Literal

import pytest

from jaxrlhf.config import ConfigError, field_help, load, parse_cli
from jaxrlhf.data.__main__ import PrepareConfig
from jaxrlhf.inspect import InspectConfig
from jaxrlhf.reward import RewardConfig
from jaxrlhf.sft import SFTConfig

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
from jaxrlhf.eval import EvalConfig  # noqa: E402
from jaxrlhf.ppo import PPOConfig  # noqa: E402
from jaxrlhf.train import TrainConfig  # noqa: E402

ENTRY_POINTS = {
    "inspect.yaml": InspectConfig,
    "data.yaml": PrepareConfig,  # shipped config -> its settings
    "ppo.yaml": PPOConfig,
    "train.yaml": TrainConfig,
    "eval.yaml": EvalConfig,
    "sft.yaml": SFTConfig,
    "reward.yaml": RewardConfig,
    "stories.yaml": TrainConfig,
}


@dataclasses.dataclass(frozen=True)
class Optim:
    #: peak learning rate
    lr: float = 1e-5
    schedule: Literal["cosine", "linear"] = "cosine"


@dataclasses.dataclass(frozen=True)
class Run:
    #: where outputs go
    out: str = "runs"
    steps: int = 10
    tags: tuple[str, ...] = ()
    ckpt: str | None = None
    optim: Optim = Optim()


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("out: here\noptim:\n  lr: 3\n  schedule: linear\ntags: [a, b]\n")
    cfg = load(Run, str(f), ["steps=7", "optim.lr=2e-4", "ckpt=null"])
    assert cfg == Run(out="here", steps=7, tags=("a", "b"), optim=Optim(lr=2e-4, schedule="linear"))
    assert isinstance(load(Run, str(f)).optim.lr, float)


def test_errors_name_the_file_line_and_key(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("out: here\noptim:\n  lr: 1e-4\n  sched: linear\n")
    with pytest.raises(ConfigError, match=rf"{f}:4: unknown key 'optim.sched' \(did you mean schedule\?\)"):
        load(Run, str(f))
    with pytest.raises(ConfigError, match="command line: 'steps': expected int, got 'many'"):
        load(Run, None, ["steps=many"])
    with pytest.raises(ConfigError, match=r"'optim.schedule': expected one of \['cosine', 'linear'\], got 'step'"):
        load(Run, None, ["optim.schedule=step"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load(Run, None, ["steps"])
    f.write_text("out: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"{f}:2: not valid YAML"):
        load(Run, str(f))
    with pytest.raises(ConfigError, match="config file not found"):
        load(Run, str(tmp_path / "nope.yaml"))


def test_help_shows_the_main_settings_and_help_all_every_one_by_section(capsys):
    assert field_help(Run) == {"out": "where outputs go"}
    with pytest.raises(SystemExit):
        parse_cli(Run, "demo", ["--help"])
    text = capsys.readouterr().out
    assert "steps = 10" in text and "every setting (--help-all): run (4), optim (2)" in text
    assert "optim.lr" not in text and "tags" not in text
    with pytest.raises(SystemExit):
        parse_cli(Run, "demo", ["--help-all"])
    text = capsys.readouterr().out
    assert " optim:\n  optim.lr = 1e-05\n      peak learning rate\n  optim.schedule = 'cosine'" in text
    assert " run:\n  out = 'runs'\n      where outputs go" in text and "tags = ()" in text


def test_a_config_file_flags_and_overrides_go_in_any_order(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("out: here\nsteps: 3\n")

    def flags(parser):
        parser.add_argument("--steps", dest="steps", type=int)
        parser.add_argument("--tags", dest="tags", nargs="+")

    want = Run(out="here", steps=5, tags=("a",), optim=Optim(lr=2.0))
    for argv in (
        [str(f), "--steps", "5", "optim.lr=2", "--tags", "a"],
        ["optim.lr=2", "--tags", "a", str(f), "--steps", "5"],
        ["--tags", "a", "optim.lr=2", str(f), "--steps", "4", "steps=5"],
    ):  # key=value after the flag wins
        assert parse_cli(Run, "demo", argv, flags=flags)[0] == want, argv


def test_cli_errors_exit_with_a_message(capsys):
    from jaxrlhf.config import run_cli

    with pytest.raises(SystemExit) as e:
        run_cli(Run, "demo", "demo", print, ["stepz=3"])
    assert e.value.code == 2
    assert "unknown key 'stepz' (did you mean steps?)" in capsys.readouterr().err


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    assert path.name in ENTRY_POINTS, f"{path.name}: add it to ENTRY_POINTS with the settings class it configures"
    load(ENTRY_POINTS[path.name], str(path))


def test_default_xla_flags_respect_the_users_own(monkeypatch):
    from jaxrlhf.config import default_xla_flags

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    default_xla_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --xla_gpu_enable_triton_gemm=false"
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    default_xla_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true"


def _one_line_error(match, cls, path=None, overrides=()):
    with pytest.raises(ConfigError, match=match) as e:
        load(cls, None if path is None else str(path), list(overrides))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "out: here\nckpt: !!python/object/apply:os.system ['true']\n",  # was a raw ConstructorError
            r":2: not valid YAML \(could not determine a constructor for the tag '.*python/object/apply:os\.system'\)",
        ),
        ("out: 2001-13-45\n", r":1: not valid YAML \(month must be in 1\.\.12\)"),  # a date slip: was a raw ValueError
        ("out: here\nsteps: 3\n\x07\n", r":3: not valid YAML \(character #x0007 is not allowed\); remove it"),
        ("out: here\nsteps: 3\nout: there\n", r":3: not valid YAML \('out' is set twice \(lines 1 and 3\); keep one\)"),
        ("optim:\n  lr: 1\n  1: 2\n", r":3: not valid YAML \(a key that is not a string \('1'\); quote it\)"),
        ("optim:\n  lr: 1\n  on: 2\n", r":3: not valid YAML \(a key that is not a string \('on'\); quote it\)"),
    ],
)
def test_yaml_slips_tags_and_repeated_keys_are_one_line_errors(tmp_path, text, message):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    _one_line_error(f"{f}{message}", Run, f)


def test_non_utf8_files_and_bad_override_values_are_one_line_errors(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_bytes(b"out: here\nsteps: 3\nckpt: caf\xe9\n")  # was a UnicodeDecodeError without the file's name
    _one_line_error(rf"{f}:3: not UTF-8 \(byte 0xe9\); save the file as UTF-8", Run, f)
    _one_line_error(
        r"command line: 'ckpt': not valid YAML \(could not determine a constructor",
        Run,
        overrides=["ckpt=!!python/name:os.system"],
    )
    _one_line_error(
        r"command line: 'optim': not valid YAML \(a key that is not a string \('1'\)", Run, overrides=["optim={1: 2}"]
    )  # was a TypeError deep in build


@pytest.mark.parametrize(
    "cls, override, message",
    [
        (
            SFTConfig,
            "optim.learning_rate=.nan",
            r"command line: optim: learning_rate: expected a finite number, got nan",
        ),
        (SFTConfig, "optim.eps=-1e-8", r"optim: eps: expected > 0, got -1e-08"),
        (SFTConfig, "batch_size=0", r"command line: SFTConfig: batch_size: expected >= 1, got 0"),
        (SFTConfig, "log_every=0", r"log_every: expected >= 1, got 0"),
        (SFTConfig, "epochs=-1", r"epochs: expected >= 1, got -1"),
        (
            SFTConfig,
            "seed=9223372036854775808",
            r"seed: expected an integer in \[0, 2\*\*32\), got 9223372036854775808",
        ),
        (SFTConfig, "data.seed=-1", r"data: seed: expected an integer in \[0, 2\*\*32\), got -1"),
        (SFTConfig, "data.unsupervised_block_size=1", r"unsupervised_block_size: expected >= 2, got 1"),
        (RewardConfig, "lora.learning_rate=.inf", r"lora: learning_rate: expected a finite number, got inf"),
        (PPOConfig, "kl_coef=.inf", r"kl_coef: expected a finite number, got inf"),
        (PPOConfig, "actor.optim.clip_grad_norm=-1", r"clip_grad_norm: expected >= 0, got -1"),
        (PPOConfig, "keep_checkpoints=0", r"keep_checkpoints: expected >= 1, got 0"),
    ],
)
def test_values_are_checked_before_anything_loads(cls, override, message):
    _one_line_error(message, cls, overrides=[override])


def test_settings_built_in_python_are_checked_too():
    from jaxrlhf.models import LlamaConfig, OPTConfig
    from jaxrlhf.optim import OptimConfig

    with pytest.raises(ConfigError, match="learning_rate: expected a finite number, got nan"):
        OptimConfig(learning_rate=float("nan"))
    with pytest.raises(
        ConfigError, match=r"num_attention_heads: expected \[1, 2147483648\), got 0"
    ):  # was ZeroDivisionError
        OPTConfig(num_attention_heads=0)
    with pytest.raises(ConfigError, match=r"eos_token_id: expected \[0, 64\), got 64"):
        LlamaConfig(vocab_size=64, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, eos_token_id=64)
    with pytest.raises(ConfigError, match=r"rms_norm_eps: expected > 0, got 0.0"):  # eps 0 gives NaN on a zero row
        LlamaConfig(rms_norm_eps=0.0)
