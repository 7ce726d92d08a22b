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
    # train: the steps' settings it refuses (refuse_set_by_train) are not offered
    hidden = (*module.SET_BY_TRAIN, "sft.data", "reward.data", "ppo.data") if name == "train" else ()
    is_hidden = lambda key: any(key == h or key.startswith(h + ".") for h in hidden)
    rows = list(_settings(cls()))
    for _, key, default, _ in rows:
        listed = f"\n  {key} = {default!r}\n" in text
        assert listed != is_hidden(key), f"{name} --help-all {'lists the refused' if listed else 'lacks'} {key}"
    sections = {s for s, key, *_ in rows if s and not is_hidden(key)}
    assert all(f"\n {s}:\n" in text for s in sections)


def test_ci_runs_the_readme_test_command():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text().split("### Tests", 1)[1]
    command = readme.split("```bash\n", 1)[1].split("\n", 1)[0]
    assert command in (root / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("columns", [80, 250])
@pytest.mark.parametrize("name", ["sft", "ppo", "train"])
def test_help_breaks_lines_between_words_at_any_width(name, columns, capsys, monkeypatch):
    """--help-all wraps every setting's help whole at the terminal's width; --help shortens it to one line, at a
    word's end (today's help was cut at 118 characters, mid-word, at any width)."""
    module = importlib.import_module(f"jaxrlhf.{name}")
    cls = getattr(module, ENTRY_POINTS[name][0], None)
    hidden = getattr(module, "HIDDEN", ())  # train: the steps' settings it refuses are not offered
    rows = [
        (f"  {key} = {default!r}", " ".join(doc.split()))
        for _, key, default, doc in _settings(cls())
        if doc and not any(key == h or key.startswith(h + ".") for h in hidden)
    ]
    docs = [doc for _, doc in rows]
    monkeypatch.setenv("COLUMNS", str(columns))
    for flag in ("--help-all", "--help"):
        with pytest.raises(SystemExit):
            module.main([flag])
        text = capsys.readouterr().out
        settings = text.split("\nsettings (", 1)[1]
        assert all(len(line) <= columns - 2 or " " not in line.strip() for line in settings.splitlines()[1:-3]), text
        if flag == "--help-all":
            flat = " ".join(settings.split())
            assert all(doc in flat for doc in docs), [doc for doc in docs if doc not in flat]
            continue
        lines = {line.split(" = ")[0]: line for line in settings.splitlines() if " = " in line}
        for start, doc in [(start, doc) for start, doc in rows if start.split(" = ")[0] in lines]:
            line = lines[start.split(" = ")[0]]  # the setting, then its help whole or its first words and " ..."
            heads = [" ".join(doc.split()[:k]) + " ..." for k in range(1, len(doc.split()))]
            assert line.startswith(start) and line.endswith(tuple(" " + h for h in [doc, *heads])), line


NO_TORCH = """
import importlib.abc, importlib.util, sys
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if name.split(".")[0] == "torch" else _find(name, package)
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, NoTorch())
"""


def test_no_pytorch_advice_on_a_default_install(tmp_path):
    """A default install has no torch (it is a test extra): transformers' "PyTorch was not found" advice at import is
    dropped where jaxrlhf imports it, and only that message (torch hidden here by a sitecustomize)."""
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(NO_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = lambda code: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stderr
    assert "PyTorch was not found" in run("import transformers")  # torch is hidden: transformers says so
    other = "import logging; logging.getLogger('transformers').warning('another warning')"
    err = run(f"import jaxrlhf.train, transformers; {other}")
    assert "PyTorch was not found" not in err and "another warning" in err, err


def test_tensorboard_is_an_extra():
    """Every run writes TensorBoard events (tb/); `pip install -e '.[tensorboard]'` brings the viewer."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert [r.split(">=")[0] for r in project["optional-dependencies"]["tensorboard"]] == ["tensorboard"]
