"""python -m jaxrlhf.eval on tiny models of the built-in task: the report's numbers against direct computation,
the plots, and a degenerate model (one token over and over) caught by the alarms."""

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

import helpers
from jaxrlhf.alarms import AlarmConfig, AlarmTracker, answer_figures
from jaxrlhf.checkpoint import load_hf, save_hf
from jaxrlhf.config import parse_cli
from jaxrlhf.data import DataConfig, arithmetic, make_batch, prepare
from jaxrlhf.data.synthetic import gold_answer, gold_reward
from jaxrlhf.eval import (
    PLOTS,
    EvalConfig,
    final_number,
    flags,
    gold_rewards,
    main,
    markdown,
    plot_frontier,
    plot_training,
    run,
    step3_run,
    win_rate,
)
from jaxrlhf.generate import generate
from jaxrlhf.losses import end_scores, token_logprobs
from jaxrlhf.models import OPTConfig, init_params, logits, values
from jaxrlhf.rewards import RewardConfig, arithmetic_gold
from jaxrlhf.train import BUILTIN_MODEL, builtin_model, builtin_tokenizer

PROMPTS, G, REPEATED = 16, 16, " q"  # one generation batch; answers long enough to double a sorted list
HELD = 10  # held-out Step 1 sequences and Step 2 pairs (synthetic:600 holds 12 and 24)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Step 1-like model `sft`, a perturbed `ppo`, `stuck` (always the token " q"), and a reward model."""
    root = tmp_path_factory.mktemp("eval")
    tok = builtin_tokenizer()
    config = OPTConfig(**BUILTIN_MODEL)
    base = jax.device_get(init_params(config, jax.random.key(0), value_head=True, std=0.1))
    lm = {k: v for k, v in base.items() if k != "value_head"}
    rng = np.random.default_rng(0)
    moved = jax.tree.map(lambda x: x + rng.normal(0, 0.05, x.shape).astype(x.dtype), lm)
    # Degenerate: the final LayerNorm outputs a constant, its bias pointing at one token's (tied) embedding.
    q = tok(REPEATED, add_special_tokens=False)["input_ids"][0]
    stuck = jax.tree.map(np.copy, lm)
    emb = stuck["decoder"]["embed_tokens"]["embedding"]
    stuck["decoder"]["final_layer_norm"] = {
        "scale": np.zeros(64, np.float32),
        "bias": 50 * emb[q] / np.sum(emb[q] ** 2),
    }
    out = {
        name: save_hf(root / name, config, params, tok)
        for name, params in (("sft", lm), ("ppo", moved), ("stuck", stuck), ("rm", base))
    }
    # A Step 3 log as ppo.run writes it (a resumed run repeats step 3: the later line wins).
    lines = [
        {
            "step": s,
            "split": "train",
            "reward": 0.1 * s,
            "gold_reward": 0.5 + 0.01 * s,
            "kl": 0.2 * s,
            "answer_len": 6 + s % 2,
        }
        for s in (1, 2, 3, 3, 4, 5)
    ]
    lines.insert(1, {"step": 1, "split": "eval", "loss": 1.0})
    (root / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return {k: str(v) for k, v in out.items()}, root


@pytest.fixture(scope="module")
def report(folders):
    models, root = folders
    data = DataConfig(data_path=("synthetic:600",), max_seq_len=32, max_prompt_len=24, cache_dir=str(root / "cache"))
    cfg = EvalConfig(
        models=(models["sft"], models["ppo"], models["stuck"]),
        reward_model=models["rm"],
        metrics=str(root / "metrics.jsonl"),
        output_dir=str(root / "report"),
        num_prompts=PROMPTS,
        batch_size=PROMPTS,
        max_answer_len=G,
        ppl_rows=HELD,
        rm_pairs=HELD,
        data=data,
    )
    return cfg, run(cfg, log=lambda _: None)


def curves(fig) -> int:
    """Lines (labelled series) and bars drawn in `fig`: what a reader sees."""
    return sum(len([x for x in ax.lines if not x.get_label().startswith("_")]) + len(ax.patches) for ax in fig.axes)


def prompts_batch(cfg, tok=None):
    tok = tok or builtin_tokenizer()
    return make_batch(
        prepare(cfg.data, 3, tok, log=lambda _: None)["eval"], range(PROMPTS), 3, cfg.data, tok.pad_token_id
    )


@pytest.mark.slow
def test_gold_reward_and_win_rate_agree_with_direct_computation(report):
    cfg, out = report
    tok = builtin_tokenizer()
    batch = prompts_batch(cfg)
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    rm_config, rm = load_hf(cfg.reward_model)
    direct = {}
    for name, path in zip(("sft", "ppo"), cfg.models):
        config, params = load_hf(path)
        gen = generate(
            config,
            params,
            ids,
            mask,
            jax.random.fold_in(jax.random.key(cfg.seed), 0),
            max_new_tokens=G,
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
        )
        tokens, keep = np.asarray(gen.tokens), np.asarray(gen.mask)
        prompts = [tok.decode(r[m.astype(bool)][1:]) for r, m in zip(ids, mask)]
        answers = [tok.decode([t for t in r[k.astype(bool)] if t != tok.eos_token_id]) for r, k in zip(tokens, keep)]
        # The reward model's score, here on right-padded prompt + answer sequences (the report scores left-padded ones).
        seqs = [np.concatenate([r[m.astype(bool)], a[k.astype(bool)]]) for r, m, a, k in zip(ids, mask, tokens, keep)]
        right = np.full((PROMPTS, ids.shape[1] + G), tok.pad_token_id, np.int32)
        right_mask = np.zeros_like(right)
        for b, s in enumerate(seqs):
            right[b, : len(s)], right_mask[b, : len(s)] = s, 1
        scores = np.asarray(end_scores(values(rm_config, rm, right, right_mask), right_mask))
        direct[name] = {"gold": np.mean([gold_reward(p, a) for p, a in zip(prompts, answers)]), "scores": scores}
        row = next(m for m in out["models"] if m["name"] == name)
        assert out["per_prompt"][name]["answers"] == answers
        assert row["gold_reward"] == pytest.approx(direct[name]["gold"], abs=1e-12)
        np.testing.assert_allclose(out["per_prompt"][name]["scores"], scores, atol=1e-5)
        assert row["reward"] == pytest.approx(scores.mean(), abs=1e-5)
        assert row["answer_len"] == pytest.approx(keep.sum(1).mean())
    a, b = direct["sft"]["scores"], direct["ppo"]["scores"]
    ppo = next(m for m in out["models"] if m["name"] == "ppo")
    assert ppo["win_rate"] == pytest.approx(np.mean(b > a) + 0.5 * np.mean(b == a))
    assert ppo["win_ci"][0] < ppo["win_rate"] < ppo["win_ci"][1]
    sft = out["models"][0]
    assert (sft["win_rate"], sft["ties"], sft["kl"]) == (0.5, PROMPTS, 0.0)  # the baseline against itself
    assert ppo["kl"] > 0


def test_wilson_interval_and_ties():
    # 7 wins of 10: the Wilson 95% interval is (0.3968, 0.8922)
    # (by hand: (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)).
    w = win_rate([1] * 7 + [0] * 3, [0.5] * 10)
    assert (w["win_rate"], w["wins"], w["losses"]) == (0.7, 7, 3)
    np.testing.assert_allclose(w["win_ci"], [0.3968, 0.8922], atol=5e-5)
    assert win_rate([1, 1, 0, 0], [1, 0, 1, 0])["win_rate"] == 0.5  # one win, two ties, one loss


def test_gold_reward_of_the_tasks_and_gsm8k_style_references():
    assert [final_number(t) for t in ("so 9 * 2 = 18.\n#### 1,018", "It is 42.", "-3.5 then 7", "none")] == [
        1018,
        42,
        7,
        None,
    ]
    refs = ["9 * 2 = 18\n#### 18", "#### 3"]
    assert gold_rewards(["Q1", "Q2"], refs, ["She makes $18 a day.", "#### 4"]) == [1.0, 0.0]
    assert gold_rewards(["Q1", "Q2"], ["18", None], ["18", "3"]) is None  # no "#### N" references: no gold
    sort = "\n\nHuman: Sort these letters: c a b\n\nAssistant:"
    assert gold_rewards([sort], [None], [" a b c"]) == [1.0]
    story = [
        "\n\nHuman: Tell me a story about a dog.\n\nAssistant:",
        "\n\nHuman: Tell me a story about an apple.\n\nAssistant:",
    ]
    assert gold_rewards(story, [None, None], [" Max the dog ran.", " Tim ate a pineapple."]) == [1.0, 0.0]
    assert gold_rewards([story[0], sort], [None, None], [" dogs", " a b c"]) is None  # one task per report


def test_final_number_reads_whole_numbers_as_the_reward_functions_do():
    """eval's gold reward and rewards.gsm8k read a number alike (rewards.parse_number): "1e3" is 1000, not 3, and
    "1.2.3" (a version, a date) is no number, not 0.3."""
    texts = ["So it is 1e3.", "#### 2.5e2", "version 1.2.3", "#### -$1,234.50", "9 * 2 = 18.\n#### 18 apples"]
    assert [final_number(t) for t in texts] == [1000.0, 250.0, None, -1234.5, 18.0]
    assert gold_rewards(["Q1", "Q2"], ["#### 1000", "#### 3"], ["That is 1e3", "See 1.2.3"]) == [1.0, 0.0]


@pytest.mark.slow
def test_perplexity_and_reward_model_accuracy(report):
    cfg, out = report
    tok = builtin_tokenizer()
    held = {s: prepare(cfg.data, s, tok, log=lambda _: None)["eval"] for s in (1, 2)}
    b = make_batch(held[1], range(HELD), 1, cfg.data, tok.pad_token_id)
    config, params = load_hf(cfg.models[1])
    lp = np.asarray(token_logprobs(logits(config, params, b["input_ids"], b["attention_mask"]), b["input_ids"]))
    m = b["loss_mask"][:, 1:]
    assert out["models"][1]["perplexity"] == pytest.approx(math.exp(-(lp * m).sum() / m.sum()), rel=1e-5)
    p = make_batch(held[2], range(HELD), 2, cfg.data, tok.pad_token_id)
    rm_config, rm = load_hf(cfg.reward_model)
    c, r = (
        np.asarray(end_scores(values(rm_config, rm, p[f"{k}_ids"], p[f"{k}_mask"]), p[f"{k}_mask"]))
        for k in ("chosen", "rejected")
    )
    assert out["reward_model"]["pairs"] == HELD
    assert out["reward_model"]["accuracy"] == pytest.approx(np.mean(c > r))


def test_report_files_and_plots(report):
    from PIL import Image

    cfg, out = report
    folder = Path(cfg.output_dir)
    saved = json.loads((folder / "report.json").read_text())
    assert [m["name"] for m in saved["models"]] == ["sft", "ppo", "stuck"]
    assert [r["step"] for r in saved["training"]] == [1, 2, 3, 4, 5]  # eval lines dropped, step 3 once
    # curves: training = reward + gold + KL; frontier = 2 panels x 3 models (the training iterations are points, not a
    # line); lengths = 3 models + length over training; win rates = 3 bars.
    assert saved["plots"] == {name: f"{name}.png" for name in PLOTS}
    assert {name: curves(plot(saved)) for name, plot in PLOTS.items()} == {
        "training": 3,
        "frontier": 6,
        "lengths": 4,
        "win_rates": 3,
    }
    frontier = plot_frontier(saved)  # per panel: one point per logged iteration, coloured by its iteration
    for ax, key in zip(frontier.axes[:2], ("reward", "gold_reward")):
        (points,) = ax.collections
        np.testing.assert_allclose(points.get_offsets(), [[r["kl"], r[key]] for r in saved["training"]])
        np.testing.assert_array_equal(points.get_array(), [1, 2, 3, 4, 5])
    for name in saved["plots"]:
        with Image.open(folder / f"{name}.png") as im:
            assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 200
            im.verify()
    with Image.open(folder / "training.png") as im:  # the KL curve is drawn in red
        pixels = np.asarray(im.convert("RGB")).reshape(-1, 3).astype(int)
        assert np.sum(np.abs(pixels - [214, 39, 40]).sum(1) < 30) > 100
    md = (folder / "report.md").read_text()
    assert md.count("\n| sft |") == 1 + cfg.samples and "![training](training.png)" in md
    assert f"| {out['models'][1]['reward']:.3f} |" in md
    sft_row = next(line for line in md.splitlines() if line.startswith("| sft |"))
    header = next(line for line in md.splitlines() if line.startswith("| model |")).split(" | ")
    assert header[1:5] == ["reward", "greedy reward", "win rate (95% CI)", "gold reward"]
    assert sft_row.split(" | ")[3] == "baseline"  # not a win rate of 0.500 against itself
    assert "Step 3 time" not in md  # none of these models came from a Step 3 run folder
    assert curves(plot_training({"training": saved["training"][:2]})) == 3


def test_degenerate_model_trips_repetition_and_length_alarms(report):
    cfg, out = report
    tok = builtin_tokenizer()
    stuck = out["models"][2]
    q = tok(REPEATED, add_special_tokens=False)["input_ids"][0]
    assert set(" ".join(out["per_prompt"]["stuck"]["answers"]).split()) == {REPEATED.strip()}
    assert (stuck["answer_len"], stuck["truncated"]) == (G, 1.0)
    assert stuck["repetition"] == pytest.approx(1 - 1 / (G - 2))  # one distinct 3-gram of G - 2
    assert any("repetition" in a for a in stuck["alarms"]) and not out["models"][0]["alarms"]
    # During Step 3: healthy answers (the gold ones, as a trained actor writes them) set the baseline, then the
    # actor turns into the degenerate model.
    batch = prompts_batch(cfg)
    prompts = [tok.decode(r[m.astype(bool)][1:]) for r, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    gold = [tok(gold_answer(p), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for p in prompts]
    tokens = np.full((PROMPTS, G), tok.pad_token_id)
    mask = np.zeros_like(tokens)
    for i, g in enumerate(gold):
        tokens[i, : len(g)], mask[i, : len(g)] = g, 1
    healthy = {**answer_figures(tokens, mask, -2.0 * mask, eos_id=tok.eos_token_id), "kl": 0.1}
    tracker = AlarmTracker(AlarmConfig(baseline_iterations=2))
    assert tracker.update(healthy) == [] and tracker.update(healthy) == [] and tracker.update(healthy) == []
    degenerate = {
        **answer_figures(
            np.full((PROMPTS, G), q), np.ones((PROMPTS, G)), np.zeros((PROMPTS, G)), eos_id=tok.eos_token_id
        ),
        "kl": 0.1,
    }
    alarms = tracker.update(degenerate)
    assert {a.name for a in alarms} == {"repetition", "answer_len", "entropy"} and all(a.new for a in alarms)
    assert [a.new for a in tracker.update(degenerate)] == [False, False, False]


def test_cli_flags_and_errors(folders, tmp_path, capsys):
    models, root = folders
    parse = lambda argv: parse_cli(EvalConfig, "", argv, flags=flags, processes=False)[0]
    cfg = parse(
        [
            "--models",
            "a",
            "b",
            "--reward-model",
            "rm",
            "--prompts",
            "synthetic:600",
            "--output-dir",
            "x",
            "num_prompts=8",
            "alarms.ngram=2",
        ]
    )
    assert (cfg.models, cfg.reward_model, cfg.data.data_path, cfg.output_dir) == (
        ("a", "b"),
        "rm",
        ("synthetic:600",),
        "x",
    )
    assert (cfg.num_prompts, cfg.alarms.ngram) == (8, 2)
    config = tmp_path / "eval.yaml"
    config.write_text("samples: 2\n")
    cfg = parse(["--reward-model", "rm", "--models", "a", "b", str(config), "num_prompts=8"])
    assert (cfg.models, cfg.samples, cfg.num_prompts) == (("a", "b"), 2, 8)
    with pytest.raises(SystemExit):  # a language model is not a reward model
        main(
            [
                "--models",
                models["sft"],
                "--reward-model",
                models["sft"],
                "--prompts",
                "synthetic:600",
                "--output-dir",
                str(tmp_path),
                f"data.cache_dir={root / 'cache'}",
                "data.max_prompt_len=24",
            ]
        )
    assert "no value head" in capsys.readouterr().err


@pytest.mark.slow
def test_step3_raises_alarms_when_the_actor_degenerates(folders, tmp_path, monkeypatch):
    """ppo.run with the actor's answers replaced: short healthy ones for two iterations (the baseline), then one
    token over and over: the repetition and length alarms are logged once each and written to the metrics."""
    import jaxrlhf.rl.engine as engine
    from jaxrlhf.generate import Generation
    from jaxrlhf.optim import OptimConfig
    from jaxrlhf.ppo import PPOConfig
    from jaxrlhf.ppo import run as run_ppo
    from jaxrlhf.rl import ModelSide

    models, root = folders
    tok = builtin_tokenizer()
    q, eos, real = tok(REPEATED, add_special_tokens=False)["input_ids"][0], tok.eos_token_id, engine.generate
    calls = []

    def scripted(config, params, ids, mask, key, **kw):
        gen = real(config, params, ids, mask, key, **kw)
        calls.append(1)
        t = np.asarray(gen.tokens).copy()
        if len(calls) <= 2:  # healthy: two tokens and EOS
            t[:, 2], t[:, 3:] = eos, tok.pad_token_id
            m = (np.arange(t.shape[1]) < 3).astype(np.int32)[None].repeat(len(t), 0)
        else:
            t[:], m = q, np.ones_like(t, np.int32)
        return Generation(jax.numpy.asarray(t), jax.numpy.asarray(m), gen.logprobs, gen.steps)

    monkeypatch.setattr(engine, "generate", scripted)
    data = DataConfig(data_path=("synthetic:600",), max_seq_len=32, max_prompt_len=24, cache_dir=str(root / "cache"))
    optim = OptimConfig(learning_rate=1e-4)
    cfg = PPOConfig(
        actor=ModelSide(model=models["sft"], optim=optim),
        critic=ModelSide(model=models["rm"], optim=optim),
        output_dir=str(tmp_path),
        batch_size=8,
        max_steps=4,
        max_answer_len=8,
        precision="fp32",
        alarms=AlarmConfig(baseline_iterations=2),
        data=data,
    )
    lines = []
    out = run_ppo(cfg, log=lines.append)
    alarms = [line for line in lines if line.startswith("alarm")]
    assert len(alarms) == 2 and "repetition" in alarms[0] + alarms[1] and "answer length" in alarms[0] + alarms[1]
    assert all("iteration 3" in a for a in alarms)  # raised when it started, not again at iteration 4
    records = out["records"]
    assert [r.get("alarms", "") for r in records] == ["", "", "repetition,answer_len", "repetition,answer_len"]
    assert records[0]["repetition"] == 0.0 and records[3]["repetition"] == pytest.approx(5 / 6)


def test_step3_runs_side_by_side_with_their_algorithm_and_time(report, tmp_path):
    """A model exported by a Step 3 run (run_config.json with an algorithm and metrics.jsonl beside it) shows the run's
    algorithm and time: iterations x the median logged iteration, the compiling first one left out."""
    _, out = report
    runs = {}
    for name, algorithm, n, seconds in (
        ("ppo-run", "ppo", 1, [9.0, 0.2, 0.3, 0.25]),
        ("grpo-run", "grpo", 4, [5.0, 0.1, 0.1, 0.2]),
    ):
        folder = tmp_path / name
        (folder / "actor").mkdir(parents=True)
        (folder / "run_config.json").write_text(json.dumps({"algorithm": algorithm, "num_samples_per_prompt": n}))
        lines = [{"step": 10 * (i + 1), "split": "train", "kl": 0.1, "iteration_s": t} for i, t in enumerate(seconds)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        runs[name] = step3_run(folder / "actor")
    assert runs["ppo-run"] == {
        "algorithm": "ppo",
        "samples_per_prompt": 1,
        "iterations": 40,
        "seconds": pytest.approx(40 * 0.275),
    }
    assert runs["grpo-run"] == {
        "algorithm": "grpo",
        "samples_per_prompt": 4,
        "iterations": 40,
        "seconds": pytest.approx(40 * 0.15),
    }
    assert step3_run(tmp_path / "ppo-run") is None  # no Step 3 run_config.json beside it
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "run_config.json").write_text(json.dumps({"batch_size": 8}))  # a Step 1 run: no algorithm
    assert step3_run(tmp_path / "sft" / "model") is None

    models = [{**m, "step3": s} for m, s in zip(out["models"], (None, runs["ppo-run"], runs["grpo-run"]))]
    md = markdown({**out, "models": models}, {})
    lines = md.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("| model |")))
    table = lines[first : lines.index("", first)]  # the models' table (the sample answers' tables follow)
    rows = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ") for line in table}
    header = rows["model"]
    assert header[-2:] == ["Step 3", "Step 3 time (s)"]
    cell = lambda name, column: rows[name][header.index(column)]
    assert [cell(n, "Step 3") for n in ("sft", "ppo", "stuck")] == ["–", "ppo", "grpo (n=4)"]
    assert [cell(n, "Step 3 time (s)") for n in ("sft", "ppo", "stuck")] == ["–", "11", "6"]
    assert [cell(n, "win rate (95% CI)") for n in ("sft", "ppo")] == [
        "baseline",
        f"{out['models'][1]['win_rate']:.3f} ({out['models'][1]['win_ci'][0]:.3f}–{out['models'][1]['win_ci'][1]:.3f})",
    ]
    assert (
        cell("stuck", "gold reward") == f"{out['models'][2]['gold_reward']:.3f}"
        and cell("ppo", "KL") == f"{out['models'][1]['kl']:.3f}"
    )


VERIFIER, DIGIT, GRADED = "jaxrlhf.rewards:math_verify", "helpers:shares_a_digit", "helpers:graded"


def test_without_a_reward_model_the_reward_functions_judge(tmp_path):
    """GRPO on a verifiable task trained with rule rewards alone is evaluated with those rules: no reward model; each
    model's reward (the functions' weighted sum), each function's mean (a 0/1 one's is its accuracy) and the gold
    reward, sampled and greedy, equal a direct computation from answers generated here; the win rate is the reward's."""
    tok = builtin_tokenizer("arithmetic")
    models = [str(builtin_model(tmp_path / f"m{seed}", seed, task="arithmetic")) for seed in (0, 1)]
    data = DataConfig(
        data_path=("arithmetic:600",), max_seq_len=32, max_prompt_len=24, cache_dir=str(tmp_path / "cache")
    )
    functions, weights = (VERIFIER, DIGIT, GRADED), (1.0, 0.5, 0.25)
    fields = dict(models=tuple(models), names=("base", "trained"), data=data, num_prompts=PROMPTS, batch_size=PROMPTS)
    with pytest.raises(ValueError, match=r"reward_model: required .*reward.functions=\[jaxrlhf.rewards:math_verify\]"):
        run(EvalConfig(**fields), log=lambda _: None)  # nothing would judge the answers
    reward = RewardConfig(functions=functions, weights=weights)
    cfg = EvalConfig(**fields, reward=reward, max_answer_len=G, output_dir=str(tmp_path / "report"))
    out = run(cfg, log=lambda _: None)
    batch = prompts_batch(cfg, tok)
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    prompts = [tok.decode(r[m.astype(bool)][1:]) for r, m in zip(ids, mask)]
    metadata = [{"reference": str(arithmetic.gold_answer(p))} for p in prompts]  # the question's own answer
    eos, scores = tok.eos_token_id, {}
    for row, path in zip(out["models"], models):
        config, params = load_hf(path)
        for suffix, temperature in (("", 1.0), ("_greedy", 0.0)):
            key = jax.random.fold_in(jax.random.key(cfg.seed), 0)
            kw = dict(max_new_tokens=G, eos_id=eos, pad_id=tok.pad_token_id, temperature=temperature)
            gen = generate(config, params, ids, mask, key, **kw)
            token_ids = [r[k.astype(bool)].tolist() for r, k in zip(np.asarray(gen.tokens), np.asarray(gen.mask))]
            answers = [tok.decode([t for t in r if t != eos]) for r in token_ids]
            truncated = [eos not in r for r in token_ids]
            parts = {
                VERIFIER: [arithmetic_gold(p, a) for p, a in zip(prompts, answers)],
                DIGIT: helpers.shares_a_digit(prompts, answers, metadata),
                GRADED: helpers.graded(prompts, answers, metadata, token_ids=token_ids, truncated=truncated),
            }
            want = sum(w * np.asarray(parts[f]) for f, w in zip(functions, weights))
            got = out["per_prompt"][row["name"]]
            got = got["greedy"] if suffix else got
            assert got["answers"] == answers
            np.testing.assert_allclose(got["scores"], want, atol=1e-6)
            assert row[f"reward{suffix}"] == pytest.approx(want.mean(), abs=1e-6)
            assert row[f"parts{suffix}"] == pytest.approx({f: np.mean(parts[f]) for f in functions}, abs=1e-6)
            assert row[f"gold_reward{suffix}"] == pytest.approx(np.mean(parts[VERIFIER]))  # gold: the verifier
            scores[row["name"], suffix] = want
    base, trained = scores["base", ""], scores["trained", ""]
    assert out["models"][1]["win_rate"] == pytest.approx(np.mean(trained > base) + 0.5 * np.mean(trained == base))
    assert out["reward"] == {"weights": dict(zip(functions, weights)), "binary": [VERIFIER, DIGIT]}
    assert out["reward_model"] == {"path": None}
    assert 0 < out["models"][0]["parts"][DIGIT] < 1  # the 0/1 part really varies
    md = Path(out["report"]).read_text()
    assert f"Reward = 1 × `{VERIFIER}` + 0.5 × `{DIGIT}` + 0.25 × `{GRADED}`." in md
    assert f"| {VERIFIER} (accuracy) | {DIGIT} (accuracy) | {GRADED} (mean) |" in md
    p, q = out["models"][1]["parts"], out["models"][1]["parts_greedy"]
    assert f"| trained | {p[VERIFIER]:.3f} / {q[VERIFIER]:.3f} | {p[DIGIT]:.3f} / {q[DIGIT]:.3f} |" in md
    assert "Reward model `" not in md
