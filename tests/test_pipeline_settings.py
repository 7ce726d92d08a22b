"""`python -m jaxrlhf.train` uses every setting it accepts: a step's own model, output folder or data setting, which
train sets itself, is refused with the setting to give instead; step3_dir names Step 3's folder."""

import re

import pytest

from jaxrlhf.config import ConfigError
from jaxrlhf.train import SET_BY_TRAIN, main, parse


@pytest.mark.parametrize(
    "override, remedy",
    [
        ("sft.model=/data/opt-1.3b", "give actor_model (--actor-model), which Step 1 starts from"),
        ("sft.output_dir=runs/step1", "give output_dir (--output-dir): Step 1 writes OUTPUT_DIR/actor-models"),
        ("reward.model=/data/opt-350m", "give reward_model (--reward-model), which Step 2 starts from"),
        ("reward.output_dir=runs/rm", "give output_dir (--output-dir): Step 2 writes OUTPUT_DIR/reward-models"),
        ("reward.score_file=pairs.jsonl", "train only trains; score with python -m jaxrlhf.reward"),
        (
            "ppo.output_dir=runs/step3",
            "give output_dir (--output-dir) and step3_dir: Step 3 writes OUTPUT_DIR/STEP3_DIR",
        ),
        ("ppo.actor.model=runs/sft/model", "Step 3's actor is Step 1's output (OUTPUT_DIR/actor-models/model)"),
        ("ppo.critic.model=runs/rm/model", "Step 3's critic is Step 2's output (OUTPUT_DIR/reward-models/model)"),
    ],
)
def test_a_setting_train_sets_itself_is_refused_naming_what_to_give(override, remedy):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=re.escape(f"{key}: jaxrlhf.train would ignore '{value}'; {remedy}")):
        parse([override])
    assert key in SET_BY_TRAIN


@pytest.mark.parametrize("section", ["sft", "reward", "ppo"])
def test_a_steps_own_data_setting_is_refused_for_the_shared_one(section):
    with pytest.raises(ConfigError, match=rf"{section}.data.max_seq_len: .* one data section.*; set data.max_seq_len"):
        parse([f"{section}.data.max_seq_len=64"])
    assert parse(["data.max_seq_len=64", "sft.max_steps=3"]).sft.max_steps == 3  # the rest of a section is used


def test_the_refusal_is_one_line_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--output-dir", str(tmp_path / "run"), "sft.output_dir=elsewhere"])
    assert e.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.startswith("error: command line: TrainConfig: sft.output_dir: jaxrlhf.train would")


@pytest.mark.parametrize("name", ["a/b", "..", "actor-models", "reward-models", "eval", ""])
def test_step3_dir_is_a_folder_name_of_its_own(name):
    with pytest.raises(ConfigError, match="step3_dir: expected a folder name for OUTPUT_DIR/NAME other than"):
        parse([f"step3_dir={name}"])
    assert parse(["step3_dir=step3-grpo", "algorithm=grpo"]).step3_dir == "step3-grpo"


def test_own_models_on_the_demo_lengths_are_told_how_to_get_real_ones(tmp_path, monkeypatch):
    """--actor-model and --reward-model of one's own with the default deployment (demo) keep the built-in task's
    24-token prompts and 8-token answers: a line says so and names --deployment-type (no such line otherwise)."""
    from jaxrlhf import train

    monkeypatch.setattr(train, "step3", lambda *a, **k: {})  # the note comes first; no step runs here
    monkeypatch.setattr(train, "log_summary", lambda *a: None)
    for argv, told in [
        (["--actor-model", "/m/a", "--reward-model", "/m/r"], True),
        (["--actor-model", "/m/a", "--reward-model", "/m/r", "data.max_prompt_len=256"], False),
        (["--deployment-type", "single_gpu", "--actor-model", "/m/a", "--reward-model", "/m/r"], False),
        ([], False),  # the built-in task
    ]:
        lines = []
        cfg = train.parse([*argv, "--output-dir", str(tmp_path / "run"), "--step", "3"])
        train.run(cfg, log=lines.append)
        note = [line for line in lines if line.startswith("note: deployment_type demo")]
        assert bool(note) == told, (argv, lines)
        assert not note or ("prompts of at most 24 tokens" in note[0] and "--deployment-type single_gpu" in note[0])
