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

ENTRY_POINTS = {"inspect.yaml": InspectConfig, "data.yaml": PrepareConfig,  # shipped config -> its settings
                "ppo.yaml": PPOConfig, "train.yaml": TrainConfig, "eval.yaml": EvalConfig, "sft.yaml": SFTConfig,
                "reward.yaml": RewardConfig, "stories.yaml": TrainConfig}


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


def test_help_lists_every_setting_with_its_comment(capsys):
    assert field_help(Run) == {"out": "where outputs go"}
    with pytest.raises(SystemExit):
        parse_cli(Run, "demo", ["--help"])
    text = capsys.readouterr().out
    assert "optim.lr = 1e-05" in text and "peak learning rate" in text and "steps = 10" in text


def test_cli_errors_exit_with_a_message(capsys):
    with pytest.raises(SystemExit) as e:
        parse_cli(Run, "demo", ["stepz=3"])
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
