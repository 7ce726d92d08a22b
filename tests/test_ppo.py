"""python -m jaxrlhf.ppo and python -m jaxrlhf.train on tiny models: exact resume, outputs, bad configs,
and (slow) the built-in task end to end: PPO raises the gold reward above the Step 1 model's."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from jaxrlhf.checkpoint import load_hf
from jaxrlhf.data import DataConfig
from jaxrlhf.optim import OptimConfig
from jaxrlhf.ppo import PPOConfig, main, run
from jaxrlhf.rl import HybridEngine, ModelSide
from jaxrlhf.sharding import make_mesh
from jaxrlhf.train import builtin_model

TIMES = ("_s", "samples_per_s", "tflops")  # wall-clock figures, not expected to repeat
ONE = make_mesh(1, jax.devices()[:1])  # the engine's mesh behaviour is test_engine's; one device compiles faster


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    text = root / "unsup.txt"
    text.write_text(" ".join(f"Sort these letters: {' '.join('abcdefgh'[i % 5 : i % 5 + 3])}" for i in range(60)))
    return builtin_model(root / "actor", seed=0), builtin_model(root / "critic", seed=1, value_head=True), text


def ppo_config(folders, tmp_path, **kw):
    actor, critic, text = folders
    optim = OptimConfig(learning_rate=1e-3, warmup_steps=1)
    data = DataConfig(
        data_path=("synthetic:300",),
        data_split="1,1,1",
        max_prompt_len=24,
        cache_dir=str(tmp_path / "cache"),
        unsupervised_data_path=(str(text),),
        unsupervised_block_size=16,
    )
    base = dict(
        actor=ModelSide(model=str(actor), optim=optim),
        critic=ModelSide(model=str(critic), optim=optim),
        output_dir=str(tmp_path / "out"),
        batch_size=8,
        max_steps=4,
        max_answer_len=6,
        precision="fp32",
        enable_ema=True,
        unsup_coef=0.1,
        old_logprobs="generation",
        data=data,
    )
    return PPOConfig(**{**base, **kw})


def figures(records):
    return [{k: v for k, v in r.items() if k != "split" and not k.endswith(TIMES)} for r in records]


@pytest.fixture(scope="module")
def whole(folders, tmp_path_factory):
    """Four uninterrupted iterations (LoRA-free actor and critic, EMA, mixture loss, reused log-probs)."""
    tmp = tmp_path_factory.mktemp("whole")
    return run(ppo_config(folders, tmp), log=lambda _: None, mesh=ONE), tmp / "out"


@pytest.mark.slow
def test_resume_after_a_crash_equals_an_uninterrupted_run(folders, whole, tmp_path, monkeypatch):
    whole, _ = whole
    real = HybridEngine.generate_experience
    calls = []

    def crash_in_iteration_3(self, batch, *rest):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated crash")
        return real(self, batch, *rest)

    monkeypatch.setattr(HybridEngine, "generate_experience", crash_in_iteration_3)
    cfg = ppo_config(folders, tmp_path / "b", save_every=2)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, log=lambda _: None, mesh=ONE)
    monkeypatch.setattr(HybridEngine, "generate_experience", real)
    resumed = run(dataclasses.replace(cfg, resume=True), log=lambda _: None, mesh=ONE)
    assert [r["step"] for r in resumed["records"]] == [3, 4]
    got, want = figures(resumed["records"]), figures(whole["records"][2:])
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        np.testing.assert_allclose([g[k] for k in sorted(g)], [w[k] for k in sorted(w)], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(whole["engine"].state), jax.tree.leaves(resumed["engine"].state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert whole["records"][-1]["gold_reward"] >= 0 and whole["records"][-1]["unsup_loss"] > 0


@pytest.mark.slow
def test_outputs_are_hf_folders_and_metrics(whole):
    out, folder = whole
    engine = out["engine"]
    assert set(out["folders"]) == {"actor", "critic", "actor_ema"}
    for name, params in (
        ("actor", engine.actor_params()),
        ("critic", engine.critic_params()),
        ("actor_ema", engine.state["ema"]),
    ):
        _, loaded = load_hf(out["folders"][name])
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(jax.device_get(params))):
            np.testing.assert_array_equal(a, b)
    assert "value_head" in load_hf(out["folders"]["critic"])[1]
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    phases = {
        "reshard_s",
        "generate_s",
        "score_s",
        "actor_step_s",
        "critic_step_s",
        "reshard_bytes",
        "samples_per_s",
        "tflops",
        "reward",
        "kl",
        "answer_len",
        "gold_reward",
        "actor_loss",
        "critic_loss",
        "unsup_loss",
        # the diagnostics: PPO's ratio to the old policy (generation's own log-probs: 1 before the step, up to
        # float noise), the truncated share
        "clip_frac",
        "approx_kl",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "truncated",
    }
    assert phases <= lines[0].keys()
    assert lines[0]["clip_frac"] == 0 and 1 - 1e-4 < lines[0]["ratio_min"] <= lines[0]["ratio_max"] < 1 + 1e-4
    assert 0 <= lines[0]["truncated"] <= 1
    assert abs(lines[0]["kl"]) < 1e-4 and 0 < lines[0]["answer_len"] <= 6 and lines[0]["reshard_bytes"] > 0
    assert list((folder / "tb").glob("events.out.tfevents.*"))


def test_the_eval_report_shows_the_step3_diagnostics():
    """jaxrlhf.eval reads the diagnostics from metrics.jsonl: their means over the logged iterations (the ratio's min
    and max), a line of the report, and their shares as a third panel of the training plot (none without them)."""
    from jaxrlhf.eval import markdown, plot_training, training_diagnostics

    records = [
        {"step": 1, "kl": 0.1, "reward": 0.2, "clip_frac": 0.1, "ratio_min": 0.9, "ratio_max": 1.2, "zero_spread": 0.5},
        {"step": 2, "kl": 0.2, "reward": 0.3, "clip_frac": 0.3, "ratio_min": 0.7, "ratio_max": 1.1, "zero_spread": 0.3},
        {"step": 3, "kl": 0.3, "reward": 0.4, "truncated": 0.5},
    ]
    got = training_diagnostics(records)
    assert got == pytest.approx(
        {"clip_frac": 0.2, "ratio_min": 0.7, "ratio_max": 1.2, "zero_spread": 0.4, "truncated": 0.5}
    )
    fig = plot_training({"training": records})
    assert len(fig.axes) == 3 and [x.get_label() for x in fig.axes[2].lines] == [
        "clip fraction",
        "groups of zero reward spread",
        "truncated answers",
    ]
    assert len(plot_training({"training": [{"step": 1, "kl": 0.1, "reward": 0.2}]}).axes) == 2
    settings = dict(prompts=4, data=["synthetic"], temperature=1.0, max_answer_len=8, seed=0, ngram=3, samples=0)
    report = dict(
        settings=settings, models=[], reward_model={}, training=records, metrics_log="m.jsonl", baseline="sft"
    )
    md = markdown({**report, "per_prompt": {"prompts": []}}, {})
    assert "Step 3 diagnostics (m.jsonl; " in md and "clip fraction 0.2, ratio min 0.7, ratio max 1.2" in md


def test_bad_configs_are_refused_before_compiling(folders, tmp_path, capsys):
    actor, critic, _ = folders
    models = [
        f"actor.model={actor}",
        f"critic.model={critic}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.data_path=[synthetic:300]",
        "data.max_prompt_len=24",
        "precision=fp32",
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: 8\nkl_coeff: 0.2\n")
    negative = tmp_path / "negative.yaml"
    negative.write_text("kl_target: -1.0\n")
    for args, message in [
        (
            [str(bad)],
            f"{bad}:2: unknown key 'kl_coeff' (did you mean kl_coef, kl_target, kl_horizon, kl_loss, kl_loss_coef?)",
        ),
        ([str(negative)], f"{negative}:1: PPOConfig: kl_target: expected > 0, got -1.0"),
        (["actor.lora.only_optimize_lora=true"], "LoRAConfig.only_optimize_lora: needs LoRA on (dim > 0)"),
        ([*models, "batch_size=12"], "batch_size 12 does not split over the 8 devices; use a multiple of 8"),
        (
            [*models, "batch_size=16", "actor.optim.gradient_accumulation_steps=4"],
            "micro-batch of 4 sequences (batch_size / actor.optim.gradient_accumulation_steps) "
            "does not split over 8 devices",
        ),
        ([*models, "inference_tp_size=3"], "inference_tp_size 3 must be >= 1 and divide the number of devices (8)"),
        (
            [*models, "max_answer_len=48"],
            "data.max_prompt_len (24) + max_answer_len (48) exceeds the actor's 64 positions",
        ),
        (["critic.model=x"], "actor.model: required"),
    ]:
        with pytest.raises(SystemExit):
            main(args)
        assert message in capsys.readouterr().err


def test_train_flags_presets_and_nested_defaults():
    from jaxrlhf.train import parse

    cfg = parse(
        [
            "--actor-model",
            "/m/opt-1.3b",
            "--deployment-type",
            "single_gpu",
            "--step",
            "2",
            "3",
            "--output-dir",
            "runs/x",
            "ppo.critic.optim.weight_decay=0.1",
        ]
    )
    assert (cfg.actor_model, cfg.steps, cfg.output_dir) == ("/m/opt-1.3b", (2, 3), "runs/x")
    assert cfg.ppo.actor.lora.dim == 128 and cfg.ppo.enable_ema and cfg.data.data_path == ("Dahoas/rm-static",)
    # Setting one field of a section keeps the section's other defaults (the critic's own learning rate).
    assert (cfg.ppo.critic.optim.weight_decay, cfg.ppo.critic.optim.learning_rate) == (0.1, 5e-6)
    with pytest.raises(ValueError, match="steps: expected increasing numbers among 1, 2, 3"):
        parse(["--step", "3", "1"])


@pytest.mark.slow
def test_the_builtin_pipeline_aligns(tmp_path):
    """`python -m jaxrlhf.train` with no arguments: Steps 1, 2 and 3 on the built-in task; the final actor's
    gold reward on held-out prompts is clearly above the Step 1 model's, at a bounded KL."""
    from jaxrlhf.train import parse
    from jaxrlhf.train import run as run_train

    # One device, as the command sees a CPU machine (8 virtual devices on 2 cores would double the time).
    result = run_train(parse(["--output-dir", str(tmp_path / "run"), f"data.cache_dir={tmp_path / 'cache'}"]), mesh=ONE)
    c = result["comparison"]
    print({k: v for k, v in c.items() if k != "examples"}, f"{result['seconds']:.0f} s")
    assert c["actor_gold_reward_sampled"] > c["step1_gold_reward_sampled"] + 0.05
    assert c["actor_gold_reward_greedy"] > c["step1_gold_reward_greedy"]
    assert 0 < c["kl_actor_to_step1"] < 10
    for name in ("actor", "critic", "actor_ema"):
        assert (tmp_path / "run" / "step3-models" / name / "config.json").is_file()
