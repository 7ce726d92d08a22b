"""Every entry point's --help: short, grouped by section, naming its main settings; --help-all lists them all."""

import importlib

import pytest

from jaxrlhf.config import _settings

# entry point -> (its settings class, words its short --help must show)
ENTRY_POINTS = {
    "sft": ("SFTConfig", ["model = ", "data.data_path", "optim.learning_rate", "every setting (--help-all)"]),
    "reward": ("RewardConfig", ["model = ", "data.data_path", "optim.learning_rate"]),
    "ppo": (
        "PPOConfig",
        ["actor.model", "critic.model", "data.data_path", "batch_size", "algorithm", "num_samples_per_prompt"],
    ),
    "train": (
        "TrainConfig",
        ["--actor-model", "--step", "actor_model = ", "deployment_type", "sft.optim.learning_rate", "algorithm"],
    ),
    "eval": ("EvalConfig", ["--models", "--prompts", "models = ", "reward_model"]),
    "chat": ("ChatConfig", ["--path", "--max-new-tokens", "path = ", "max_new_tokens"]),
    "plan": ("PPOConfig", ["--devices", "--backend", "actor.model", "critic.model"]),
    "inspect": ("InspectConfig", ["model = ", "prompt"]),
    "data": ("PrepareConfig", ["tokenizer", "data.data_path"]),
    "dpo": ("DPOConfig", ["model = ", "beta = ", "loss_type", "data.data_path"]),
    "convert": (None, ["llama2c"]),
    "stories": (None, ["model", "out", "--n N"]),
}


def _help(name: str, flag: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "120")
    module = importlib.import_module(f"jaxrlhf.{name}" if name != "data" else "jaxrlhf.data.__main__")
    with pytest.raises(SystemExit) as e:
        module.main([flag])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_is_short_and_names_the_main_settings(name, capsys, monkeypatch):
    text = _help(name, "--help", capsys, monkeypatch)
    assert len(text.splitlines()) < 60, text
    for word in ENTRY_POINTS[name][1]:
        assert word in text, f"{name} --help lacks {word!r}:\n{text}"


@pytest.mark.parametrize("name", [n for n, (cls, _) in ENTRY_POINTS.items() if cls])
def test_help_all_lists_every_setting_by_section(name, capsys, monkeypatch):
    text = _help(name, "--help-all", capsys, monkeypatch)
    module = importlib.import_module(f"jaxrlhf.{name}" if name != "data" else "jaxrlhf.data.__main__")
    cls = getattr(module, ENTRY_POINTS[name][0], None) or importlib.import_module("jaxrlhf.ppo").PPOConfig
    rows = list(_settings(cls()))
    for _, key, default, _ in rows:
        assert f"\n  {key} = {default!r}\n" in text, f"{name} --help-all lacks {key}"
    sections = {s for s, *_ in rows if s}
    assert all(f"\n {s}:\n" in text for s in sections)


def test_ci_runs_the_readme_test_command():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text().split("### Tests", 1)[1]
    command = readme.split("```bash\n", 1)[1].split("\n", 1)[0]
    assert command in (root / ".ci" / "run").read_text().splitlines()
