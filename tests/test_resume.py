"""Trusting a real run: a finished run started again is skipped, a killed one finishes, a changed setting, a foreign
folder and a missing value head are refused, and a run driven to NaN stops non-zero with nothing exported."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from jaxrlhf.checkpoint import EXPORT_MANIFEST, CheckpointError, export_manifest, load_hf, save_hf
from jaxrlhf.config import ConfigError
from jaxrlhf.data import DataConfig
from jaxrlhf.optim import OptimConfig
from jaxrlhf.sft import SFTConfig
from jaxrlhf.sft import run as run_sft
from jaxrlhf.sharding import make_mesh
from jaxrlhf.train import builtin_model

ONE = make_mesh(1, jax.devices()[:1])  # the mesh's behaviour is test_train's; one device compiles faster


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The built-in tiny OPT (64 words), as an HF folder without a value head (a Step 1 starting point)."""
    return builtin_model(tmp_path_factory.mktemp("base") / "model", seed=0)


def sft_config(base, tmp_path, **kw):
    data = DataConfig(
        data_path=("synthetic:300",), data_split="1,1,1", max_seq_len=32, cache_dir=str(tmp_path / "cache")
    )
    return SFTConfig(
        **{
            **dict(
                model=str(base),
                output_dir=str(tmp_path / "out"),
                batch_size=8,
                max_steps=3,
                log_every=1,
                precision="fp32",
                sample_prompts=0,
                data=data,
                optim=OptimConfig(learning_rate=1e-3, warmup_steps=1),
            ),
            **kw,
        }
    )


def no_loading(monkeypatch):
    """Make any model load fail the test: what is refused or skipped must be decided before that."""
    import jaxrlhf.ppo
    import jaxrlhf.trainer

    for module in (jaxrlhf.trainer, jaxrlhf.ppo):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("loaded a model"))


def steps(records):
    return [r["step"] for r in records if r["split"] == "train"]


@pytest.mark.slow
def test_a_finished_run_started_again_is_skipped_and_a_changed_setting_is_refused(base, tmp_path, monkeypatch):
    cfg = sft_config(base, tmp_path)
    first = run_sft(cfg, log=lambda _: None, mesh=ONE)
    assert steps(first["records"]) == [1, 2, 3]
    assert export_manifest(first["model_dir"])["settings"]["optim.learning_rate"] == 1e-3
    with monkeypatch.context() as m:
        no_loading(m)
        lines = []
        again = run_sft(dataclasses.replace(cfg, log_every=2), log=lines.append, mesh=ONE)  # log_every: bookkeeping
        assert again["skipped"] and again["model_dir"] == first["model_dir"]
        assert any("finished already with these settings (model complete); skipping it" in line for line in lines), (
            lines
        )
        with pytest.raises(
            ConfigError,
            match=r"run_config.json: the run saved here has other settings \('optim.learning_rate' "
            r"was 0.001, now 0.002\); set them back to continue it",
        ):
            run_sft(
                dataclasses.replace(cfg, optim=OptimConfig(learning_rate=2e-3, warmup_steps=1)),
                log=lambda _: None,
                mesh=ONE,
            )
        with pytest.raises(ConfigError, match="holds a run already .resume=false starts from scratch."):
            run_sft(dataclasses.replace(cfg, resume=False), log=lambda _: None, mesh=ONE)
    # A run that starts from this one's model (as Step 3 starts from Step 1's).
    child = sft_config(first["model_dir"], tmp_path / "child", max_steps=1)
    run_sft(child, log=lambda _: None, mesh=ONE)
    # A longer run continues the saved one to its new end (the saved state is step 3's).
    longer = run_sft(dataclasses.replace(cfg, max_steps=4), log=lambda _: None, mesh=ONE)
    assert steps(longer["records"]) == [4]
    assert export_manifest(longer["model_dir"])["settings"]["max_steps"] == 4
    # The child's starting model was trained again since: not finished, but changed.
    with pytest.raises(ConfigError, match='other settings .\'input_id.model\' was "[0-9a-f]{32}", now "[0-9a-f]{32}"'):
        run_sft(child, log=lambda _: None, mesh=ONE)
    with pytest.raises(ConfigError, match="the saved run is at step 4, past this run's 3 steps"):
        run_sft(dataclasses.replace(cfg, max_steps=3, log_every=3), log=lambda _: None, mesh=ONE)


@pytest.mark.slow
def test_a_run_killed_while_it_writes_finishes_when_started_again(base, tmp_path, monkeypatch):
    import os

    import safetensors.numpy

    import jaxrlhf.checkpoint as checkpoint

    cfg = sft_config(base, tmp_path, save_every=2)
    out = tmp_path / "out"
    real_save_file, real_replace = safetensors.numpy.save_file, os.replace

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    # 1. Killed while writing the export's weights: the state is saved, the export is not there.
    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        run_sft(cfg, log=lambda _: None, mesh=ONE)
    monkeypatch.setattr(safetensors.numpy, "save_file", real_save_file)
    assert not (out / "model").exists() and sorted(os.listdir(out / "state")) == ["2", "3"]
    # 2. Killed hard (no clean-up ran) in a later attempt: a half-written folder beside the missing export.
    (out / ".model.tmp-x1y2").mkdir()
    (out / ".model.tmp-x1y2" / "config.json").write_text('{"model_ty')
    # 3. Killed in the middle of an Orbax save: its temporary step folder is left behind.
    (out / "state" / "4.orbax-checkpoint-tmp-1234").mkdir()
    done = run_sft(cfg, log=lambda _: None, mesh=ONE)
    assert steps(done["records"]) == [] and export_manifest(out / "model") is not None  # nothing trained again
    load_hf(out / "model")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []

    # 4. Killed between moving the old export aside and the new one into place (a longer run's export).
    def killed_before_the_new_one_moves_in(src, dst):
        if dst == out / "model":
            assert not (out / "model").exists()  # the old one is aside already
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", killed_before_the_new_one_moves_in)
    longer = dataclasses.replace(cfg, max_steps=4)
    with pytest.raises(KeyboardInterrupt):
        run_sft(longer, log=lambda _: None, mesh=ONE)
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    assert not (out / "model").exists()
    done = run_sft(longer, log=lambda _: None, mesh=ONE)
    assert steps(done["records"]) == [] and export_manifest(out / "model")["settings"]["max_steps"] == 4
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    _, params = load_hf(out / "model")
    want = jax.device_get(done["state"]["trainable"]["params"])
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_foreign_folder_is_never_deleted(base, tmp_path, monkeypatch):
    mine = tmp_path / "out" / "model"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my own notes")
    no_loading(monkeypatch)
    with pytest.raises(
        CheckpointError,
        match=f"{mine}: exists and is a folder without {EXPORT_MANIFEST}, so jaxrlhf did "
        "not write it and will not replace it; move it away",
    ):
        run_sft(sft_config(base, tmp_path), log=lambda _: None, mesh=ONE)
    config, params = load_hf(base)
    with pytest.raises(CheckpointError, match="exists and is a folder without"):
        save_hf(mine, config, params)
    assert (mine / "notes.txt").read_text() == "my own notes" and sorted(p.name for p in mine.iterdir()) == [
        "notes.txt"
    ]
    save_hf(tmp_path / "ours", config, params)
    save_hf(tmp_path / "ours", config, params)  # ours: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours", "out"]


@pytest.mark.slow
def test_no_export_holds_a_non_finite_weight(base, tmp_path):
    config, params = load_hf(base)
    params["decoder"]["layers"]["fc1"]["bias"][1, 3] = np.nan
    with pytest.raises(
        CheckpointError, match=r"tensor model.decoder.layers.1.fc1.bias holds NaN or inf values; refusing"
    ):
        save_hf(tmp_path / "nan", config, params)
    assert not (tmp_path / "nan").exists()


@pytest.mark.slow
def test_a_run_driven_to_nan_stops_non_zero_and_exports_nothing(base, tmp_path, capsys):
    from jaxrlhf.sft import main

    cfg = sft_config(base, tmp_path)
    with pytest.raises(SystemExit) as e:
        main(
            [
                f"model={base}",
                f"output_dir={cfg.output_dir}",
                f"data.cache_dir={cfg.data.cache_dir}",
                "data.data_path=[synthetic:300]",
                "data.max_seq_len=32",
                "batch_size=8",
                "precision=fp32",
                "max_steps=12",
                "log_every=4",
                "sample_prompts=0",
                "max_skipped_steps=3",
                "optim.learning_rate=1e30",
                "optim.warmup_steps=0",
            ]
        )
    assert e.value.code != 0
    captured = capsys.readouterr()
    assert "steps in a row had a non-finite loss or gradient norm, so the run stops and exports nothing" in captured.err
    assert captured.err.strip().splitlines()[-1].startswith("error: step ") and "Traceback" not in captured.err
    assert "(epoch 0, batch 1): step skipped, its loss or gradient norm is not finite" in captured.out
    assert not (tmp_path / "out" / "model").exists()
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["skipped"] >= 1


def test_step3_and_scoring_need_a_trained_value_head(base, tmp_path, monkeypatch, capsys):
    import jaxrlhf.ppo as ppo
    from jaxrlhf.ppo import PPOConfig
    from jaxrlhf.ppo import run as run_ppo
    from jaxrlhf.reward import main as reward_main
    from jaxrlhf.rl import ModelSide

    loaded = []
    real = ppo.load_model
    monkeypatch.setattr(ppo, "load_model", lambda run, **k: loaded.append(run.model) or real(run, **k))
    cfg = PPOConfig(
        actor=ModelSide(model=str(base)),
        critic=ModelSide(model=str(base)),
        output_dir=str(tmp_path / "ppo"),
        batch_size=8,
        max_steps=1,
        max_answer_len=4,
        precision="fp32",
        data=DataConfig(data_path=("synthetic:300",), max_prompt_len=24, cache_dir=str(tmp_path / "cache")),
    )
    with pytest.raises(
        ConfigError,
        match=f"{base}: no value_head.safetensors, so no trained value head; a reward model or "
        "critic must be a Step 2 output",
    ):
        run_ppo(cfg, log=lambda _: None, mesh=ONE)
    assert loaded == [str(base)]  # refused before the actor loads
    rows = tmp_path / "pairs.jsonl"
    rows.write_text(json.dumps({"prompt": "Sort these letters: b a", "chosen": " a b", "rejected": " b a"}) + "\n")
    with pytest.raises(SystemExit):
        reward_main([f"model={base}", f"score_file={rows}", "precision=fp32"])
    assert f"error: {base}: no value_head.safetensors" in capsys.readouterr().err


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """`python -m jaxrlhf.train`'s three steps, shortened: (its arguments, its result)."""
    from jaxrlhf.train import parse
    from jaxrlhf.train import run as run_train

    out = tmp_path_factory.mktemp("pipeline")
    args = [
        "--output-dir",
        str(out),
        f"data.cache_dir={out / 'cache'}",
        "data.data_path=[synthetic:600]",
        "sft.max_steps=2",
        "reward.max_steps=2",
        "ppo.max_steps=1",
        "sft.sample_prompts=0",
        "eval_prompts=8",
        "eval_samples=1",
    ]
    return args, run_train(parse(args), mesh=ONE, log=lambda _: None)


@pytest.mark.slow
def test_the_pipeline_started_again_skips_its_finished_steps(pipeline, monkeypatch):
    from jaxrlhf.train import parse
    from jaxrlhf.train import run as run_train

    args, first = pipeline
    no_loading(monkeypatch)
    lines = []
    again = run_train(parse(args), mesh=ONE, log=lines.append)
    skipped = [line.split(":")[0] for line in lines if "finished already with these settings" in line]
    assert [s.rsplit("/", 1)[-1] for s in skipped] == ["actor-models", "reward-models", "step3-models"], lines
    assert any(line.startswith("evaluation: these models were evaluated already") for line in lines), lines
    assert again["step3"] == first["step3"] and again["comparison"] == first["comparison"]


@pytest.mark.slow
def test_another_step3_on_the_same_steps_1_and_2_goes_to_a_folder_of_its_own(pipeline):
    from pathlib import Path

    from jaxrlhf.train import parse
    from jaxrlhf.train import run as run_train

    args, first = pipeline
    out = Path(args[args.index("--output-dir") + 1])
    ppo_ids = {name: export_manifest(folder)["id"] for name, folder in first["step3"].items()}
    with pytest.raises(
        ConfigError,
        match=r"step3-models/run_config.json: the run saved here has other settings \('algorithm' was \"ppo\", now "
        r"\"grpo\".*; set them back to continue it, or give step3_dir=NAME to run this Step 3 into .*/NAME beside it",
    ):
        run_train(parse([*args, "--step", "3", "algorithm=grpo"]), mesh=ONE, log=lambda _: None)
    lines = []
    grpo = run_train(
        parse([*args, "--step", "3", "algorithm=grpo", "step3_dir=step3-grpo"]), mesh=ONE, log=lines.append
    )
    assert lines[0] == f"=== Step 3: GRPO -> {out / 'step3-grpo'}"  # Steps 1 and 2 are the PPO run's
    assert {name: Path(p) for name, p in grpo["step3"].items()} == {
        "actor": out / "step3-grpo" / "actor",
        "actor_ema": out / "step3-grpo" / "actor_ema",
    }
    assert export_manifest(out / "step3-grpo" / "actor")["settings"]["algorithm"] == "grpo"
    assert {name: export_manifest(folder)["id"] for name, folder in first["step3"].items()} == ppo_ids  # untouched
    # Its evaluation beside it; the PPO run's summary stays.
    assert json.loads((out / "step3-grpo" / "summary.json").read_text())["step3"] == grpo["step3"]
    assert json.loads((out / "summary.json").read_text())["step3"] == first["step3"]
    assert (out / "step3-grpo" / "eval" / "report.json").is_file()


@pytest.mark.slow
def test_a_ppo_run_driven_to_nan_stops_and_exports_nothing(pipeline, tmp_path):
    from jaxrlhf.loop import NonFiniteError
    from jaxrlhf.ppo import run as run_ppo
    from jaxrlhf.train import parse

    args, first = pipeline
    ppo = parse(args).ppo
    cfg = dataclasses.replace(
        ppo,
        actor=dataclasses.replace(ppo.actor, model=first["step1"], optim=OptimConfig(learning_rate=1e30)),
        critic=dataclasses.replace(ppo.critic, model=first["step2"]),
        output_dir=str(tmp_path / "ppo"),
        data=parse(args).data,
        max_steps=4,
        max_skipped_steps=2,
    )
    lines = []
    with pytest.raises(
        NonFiniteError, match=r"iteration \d, PPO epoch 1, batch 1, actor: 2 steps in a row had a non-finite"
    ):
        run_ppo(cfg, mesh=ONE, log=lines.append)
    assert any("actor: step skipped, its loss or gradient norm is not finite" in line for line in lines), lines
    assert [p.name for p in (tmp_path / "ppo").iterdir() if p.name in ("actor", "critic", "actor_ema")] == []
