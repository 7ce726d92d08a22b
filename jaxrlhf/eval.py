"""`python -m jaxrlhf.eval`: what RLHF did to the models, as a report (Markdown table, PNG plots, raw JSON).

    python -m jaxrlhf.eval --models runs/train/actor-models/model runs/train/step3-models/actor \\
        runs/train/step3-models/actor_ema --reward-model runs/train/reward-models/model --prompts synthetic:6000 \\
        [CONFIG.yaml] [key=value ...]

    held-out Step 3 prompts ──each model answers (same sampling keys)──► answers [N, G]
        ──reward model──► score per answer ──► mean, win rate vs the first model (Wilson 95% interval)
        ──gold reward (built-in task, story task; GSM8K-style "#### N")──► mean;   ──reference forward──► KL per answer
        ──answers themselves──► length (mean, distribution), repetition (repeated n-grams), entropy
    held-out Step 1 text ──► perplexity per model;   held-out Step 2 pairs ──► the reward model's accuracy
    Step 3 metrics.jsonl (found beside a model, or `metrics=`) ──► reward / KL / length over training

Writes OUTPUT_DIR/report.md (table, plots, side-by-side answers), report.json (every number, every answer)
and training.png, frontier.png, lengths.png, win_rates.png. The held-out sets are the eval splits of the
`data` settings: pass the ones the models were trained with, so no prompt was seen in training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from functools import partial
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import rewards
from jaxrlhf.alarms import AlarmConfig, answer_figures, answer_rows, check, training_records
from jaxrlhf.checkpoint import load_hf
from jaxrlhf.config import check_fields, run_cli
from jaxrlhf.data import DataConfig, DataError, arithmetic, make_batch, prepare, step_records, stories, synthetic
from jaxrlhf.data.messages import content
from jaxrlhf.generate import generate
from jaxrlhf.losses import end_scores
from jaxrlhf.models import head_logprobs, hidden, next_token_logprobs, values
from jaxrlhf.tokenizer import decode_rows, load_tokenizer, stop_id

Z95 = 1.959963984540054


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    #: the models to compare (HF folders); the first is the baseline of the win rates (e.g. the Step 1 model)
    models: tuple[str, ...] = ()
    #: their names in the report (default: the folder names)
    names: tuple[str, ...] = ()
    #: the reward model that judges the answers (the Step 2 output)
    reward_model: str = ""
    #: the KL reference (default: the first model)
    reference: str | None = None
    #: tokenizer folder (default: the first model's)
    tokenizer: str | None = None
    #: Step 3 metrics.jsonl for the training curves (default: one found beside a model)
    metrics: str | None = None
    #: where report.md, report.json and the PNG plots go
    output_dir: str = "runs/eval"
    #: held-out prompts answered by every model
    num_prompts: int = 128
    #: rows per generation / forward batch
    batch_size: int = 32
    #: tokens per answer at most (cut to the positions the models have left after the prompt)
    max_answer_len: int = 256
    #: sampling of the answers (the KL and entropy estimates assume temperature 1)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    #: seed of the sampling: every model gets the same keys
    seed: int = 1234
    #: held-out Step 1 sequences for the perplexity, and Step 2 pairs for the reward model's accuracy
    ppl_rows: int = 256
    rm_pairs: int = 256
    #: prompts shown with every model's answer side by side
    samples: int = 4
    #: parameter and compute dtype
    dtype: Literal["float32", "bfloat16"] = "float32"
    #: n of the repeated n-grams, and the bounds that flag a model against the first
    alarms: AlarmConfig = AlarmConfig()
    data: DataConfig = DataConfig()

    def __post_init__(self):
        if self.names and len(self.names) != len(self.models):
            raise ValueError(f"names: expected one per model ({len(self.models)}), got {len(self.names)}")
        sizes = dict.fromkeys(("num_prompts", "batch_size", "max_answer_len"), ">= 1")
        check_fields(self, **sizes, **dict.fromkeys(("ppl_rows", "rm_pairs", "samples"), ">= 0"))


# ---------------------------------------------------------------------------------------------- numbers


def win_rate(scores, baseline) -> dict:
    """Share of prompts where `scores` beats `baseline` (a tie counts half), with its Wilson 95% interval."""
    scores, baseline = np.asarray(scores, np.float64), np.asarray(baseline, np.float64)
    wins, ties = int(np.sum(scores > baseline)), int(np.sum(scores == baseline))
    n = len(scores)
    p = (wins + 0.5 * ties) / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return {
        "win_rate": p,
        "win_ci": [centre - half, centre + half],
        "wins": wins,
        "ties": ties,
        "losses": n - wins - ties,
    }


def paired_t(a, b) -> float:
    """t-statistic of the mean of a - b (0 when every difference is 0)."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    se = d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    return 0.0 if se == 0 else float(d.mean() / se)


_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")  # a GSM8K-style reference's final answer


def final_number(text: str) -> float | None:
    """GSM8K's final answer: the first number after the last "####", else the text's last number, each read as the
    reward functions read numbers (rewards.parse_number: "1,018" -> 1018, "1e3" -> 1000, "1.2.3" none)."""
    _, mark, tail = text.rpartition("####")
    found = rewards.parse_number(tail, last=False) if mark else None
    return rewards.parse_number(text) if found is None else found


def gold_rewards(prompts: list[str], references: list[str | None], answers: list[str]) -> list[float] | None:
    """The gold reward of each answer where the task has one, else None: the built-in sorting task's
    (jaxrlhf.data.synthetic.gold_reward), the story task's (jaxrlhf.data.stories.gold_reward) or the arithmetic
    task's (the math verifier's accuracy, jaxrlhf.rewards.arithmetic_gold) when every prompt is one of theirs, or
    1.0 / 0.0 for a right / wrong final number where every reference answer ends GSM8K-style with "#### N"."""
    tasks = (
        (synthetic.prompt_items, synthetic.gold_reward),
        (stories.prompt_word, stories.gold_reward),
        (arithmetic.gold_answer, rewards.arithmetic_gold),
    )
    for parse, gold in tasks:
        try:
            for p in prompts:
                parse(p)
        except ValueError:
            continue
        return [gold(p, a) for p, a in zip(prompts, answers)]
    if references and all(r and _FINAL.search(r) for r in references):
        return [float(final_number(a) == final_number(r)) for r, a in zip(references, answers)]
    return None


def _in_batches(fn, arrays: list[np.ndarray], size: int) -> list[np.ndarray]:
    """fn(batch index, *chunks) over fixed-size chunks of `arrays` (the last padded with its final row), the
    outputs concatenated and cut back to the rows given: one compilation whatever the number of rows."""
    n = len(arrays[0])
    size = min(size, n)
    outs = []
    for i, start in enumerate(range(0, n, size)):
        chunk = [a[start : start + size] for a in arrays]
        short = size - len(chunk[0])
        if short:
            chunk = [np.concatenate([c, np.repeat(c[-1:], short, 0)]) for c in chunk]
        outs.append(jax.device_get(fn(i, *chunk)))
    return [np.concatenate([o[k] for o in outs])[:n] for k in range(len(outs[0]))]


@partial(jax.jit, static_argnums=0)
def _answer_logprobs(config, params, ids, mask, tokens, answer_mask):
    """[B, G]: log p of each answer token given the prompt and the answer before it (0 past the answer), the LM head
    on the answer's positions only, in chunks (models.head_logprobs)."""
    seq, seq_mask = jnp.concatenate([ids, tokens], 1), jnp.concatenate([mask, answer_mask], 1)
    h = hidden(config, params, seq, seq_mask)[:, -tokens.shape[1] - 1 : -1]  # the positions that predict the answer
    return head_logprobs(config, params, h, tokens) * answer_mask


@partial(jax.jit, static_argnums=0)
def _scores(config, params, ids, mask, tokens, answer_mask):
    """[B]: the reward model's value at each answer's last real token (its EOS if it ended), as in Step 3."""
    v = values(config, params, jnp.concatenate([ids, tokens], 1), jnp.concatenate([mask, answer_mask], 1))
    last = ids.shape[1] + jnp.sum(answer_mask, axis=1) - 1
    return jnp.take_along_axis(v, last[:, None], axis=1)[:, 0]


@partial(jax.jit, static_argnums=0)
def _row_nll(config, params, input_ids, attention_mask, loss_mask):
    """[B] each row's summed next-token loss over its targets, and [B] the number of targets."""
    m = loss_mask[:, 1:].astype(jnp.float32)
    return -jnp.sum(next_token_logprobs(config, params, input_ids, attention_mask) * m, axis=1), m.sum(1)


@partial(jax.jit, static_argnums=0)
def _pair_scores(config, params, chosen_ids, chosen_mask, rejected_ids, rejected_mask):
    score = lambda ids, mask: end_scores(values(config, params, ids, mask), mask)
    return score(chosen_ids, chosen_mask), score(rejected_ids, rejected_mask)


def answer(cfg: EvalConfig, model, ids, mask, max_new: int, eos_id: int, pad_id: int):
    """Every prompt's sampled answer: tokens and mask [N, G]; batch i is sampled with key fold_in(seed, i)."""
    sampling = {k: getattr(cfg, k) for k in ("temperature", "top_k", "top_p")}

    def run(i, ids, mask):
        key = jax.random.fold_in(jax.random.key(cfg.seed), i)
        gen = generate(*model, ids, mask, key, max_new_tokens=max_new, eos_id=eos_id, pad_id=pad_id, **sampling)
        return gen.tokens, gen.mask

    return _in_batches(run, [ids, mask], cfg.batch_size)


def gold_and_kl(
    models: dict,
    tok,
    ids,
    mask,
    gold,
    *,
    samples: int,
    max_new_tokens: int,
    seed: int = 0,
    chat_template: str = "auto",
    **sampling,
) -> tuple[dict, dict]:
    """The Step 1 model against the final actor (`models`: {"step1": (config, params), "actor": ...}) on left-padded
    prompts ids, mask [N, P]: the mean gold reward (`gold(prompt index, answer text)`) of each one's answers, sampled
    `samples` times per prompt (`sampling`: generate's temperature, top_k, top_p) and greedy once; and the KL from the
    actor to the Step 1 model on the actor's sampled answers (nats per answer). Returns (figures, {(model, "sampled" or
    "greedy"): answer texts}). Answers stop at stop_id(tok, chat_template) (data.chat_template)."""
    rows = {
        "sampled": (np.tile(ids, (samples, 1)), np.tile(mask, (samples, 1)), sampling),
        "greedy": (ids, mask, {**sampling, "temperature": 0.0}),
    }
    out, texts, sampled = {}, {}, None
    kw = dict(max_new_tokens=max_new_tokens, eos_id=stop_id(tok, chat_template), pad_id=tok.pad_token_id)
    for name, model in models.items():
        for mode, (ids_m, mask_m, s) in rows.items():
            gen = generate(*model, ids_m, mask_m, jax.random.key(seed), **kw, **s)
            texts[name, mode] = decode_rows(tok, gen.tokens, gen.mask)
            out[f"{name}_gold_reward_{mode}"] = float(
                np.mean([gold(i % len(ids), a) for i, a in enumerate(texts[name, mode])])
            )
            sampled = gen if (name, mode) == ("actor", "sampled") else sampled
    lp = {
        name: _answer_logprobs(c, p, *rows["sampled"][:2], sampled.tokens, sampled.mask)
        for name, (c, p) in models.items()
    }
    out["kl_actor_to_step1"] = float(jnp.sum(lp["actor"] - lp["step1"]) / len(sampled.tokens))
    return out, texts


def perplexity(cfg: EvalConfig, model, arrays, pad_id: int) -> float | None:
    """exp(mean next-token loss) over the first `ppl_rows` held-out Step 1 sequences (None without any)."""
    n = 0 if arrays is None else min(cfg.ppl_rows, len(arrays["offsets"]) - 1)
    if n == 0:
        return None
    b = make_batch(arrays, range(n), 1, cfg.data, pad_id)
    rows = [b[k] for k in ("input_ids", "attention_mask", "loss_mask")]
    total, count = _in_batches(lambda i, *x: _row_nll(*model, *x), rows, cfg.batch_size)
    return math.exp(min(float(total.sum() / max(count.sum(), 1)), 50.0))


def rm_accuracy(cfg: EvalConfig, rm, arrays, pad_id: int) -> dict | None:
    n = min(cfg.rm_pairs, len(arrays["chosen_offsets"]) - 1)
    if n == 0:
        return None
    b = make_batch(arrays, range(n), 2, cfg.data, pad_id)
    rows = [b[k] for k in ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")]
    chosen, rejected = _in_batches(lambda i, *x: _pair_scores(*rm, *x), rows, cfg.batch_size)
    return {
        "pairs": n,
        "accuracy": float(np.mean(chosen > rejected)),
        "chosen_score": float(chosen.mean()),
        "rejected_score": float(rejected.mean()),
    }


def step3_run(model) -> dict | None:
    """The Step 3 run that exported `model` (ppo.run's folder: run_config.json with an algorithm, metrics.jsonl, beside
    the model), or None: its algorithm, answers per prompt, iterations and time, iterations x the median logged
    iteration's seconds (the compiling first iteration left out), so runs of different algorithms compare."""
    folder = Path(model).parent
    config = json.loads((folder / "run_config.json").read_text()) if (folder / "run_config.json").is_file() else {}
    if "algorithm" not in config:
        return None
    timed = [r for r in training_records(folder / "metrics.jsonl") if "iteration_s" in r]
    run = {"algorithm": config["algorithm"], "samples_per_prompt": config.get("num_samples_per_prompt", 1)}
    if timed:
        run.update(
            iterations=timed[-1]["step"],
            seconds=timed[-1]["step"] * float(np.median([r["iteration_s"] for r in timed])),
        )
    return run


def find_metrics(cfg: EvalConfig) -> Path | None:
    candidates = [Path(cfg.metrics)] if cfg.metrics else [Path(m).parent / "metrics.jsonl" for m in cfg.models]
    for path in candidates:
        if path.is_file() and any("kl" in r for r in training_records(path)):
            return path
    if cfg.metrics:
        raise ValueError(f"{cfg.metrics}: not a Step 3 metrics log (no train records with a kl figure)")
    return None


def held_out(data: DataConfig, tok, log) -> dict:
    """{step: its eval split} for Steps 1, 2 and 3; None for Step 1 or 2 where the data cannot feed it: prompt +
    response data (e.g. GSM8K) has no pairs (no reward-model accuracy), prompt-only data (a GRPO prompt set) no
    answers either (no perplexity). Every number that needs only prompts is still reported."""
    held = {3: prepare(data, 3, tok, log=lambda _: None)["eval"]}
    for step, what in ((1, "sequences (no perplexity)"), (2, "pairs (no reward-model accuracy)")):
        try:
            held[step] = prepare(data, step, tok, log=lambda _: None)["eval"]
        except DataError as e:
            log(f"eval: no held-out Step {step} {what}: {e}")
            held[step] = None
    return held


def reference_text(record) -> str | None:
    """A Step 3 record's reference answer, for the gold reward: its chosen answer (a conversational one's content),
    else its metadata's "reference" (GSM8K's answer; a prompt-only row may carry one)."""
    if record.chosen is not None:
        return content(record.chosen)
    reference = (record.metadata or {}).get("reference")
    return None if reference is None else str(reference)


def evaluate(cfg: EvalConfig, log=print) -> dict:
    """Every number of the report (see the module docstring), as a JSON-ready dict."""
    if not cfg.models or not cfg.reward_model:
        raise ValueError("models and reward_model are required (--models SFT_DIR PPO_DIR ... --reward-model RM_DIR)")
    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else np.float32
    names = list(cfg.names) or [Path(m).name for m in cfg.models]
    if len(set(names)) < len(names):  # e.g. .../actor-models/model and .../reward-models/model
        names = [f"{Path(m).parent.name}/{Path(m).name}" for m in cfg.models]
    tok = load_tokenizer(cfg.tokenizer or cfg.models[0])
    eos, pad = stop_id(tok, cfg.data.chat_template), tok.pad_token_id  # a chat model's answers end at its end-of-turn
    rm = load_hf(cfg.reward_model, dtype=dtype)
    if "value_head" not in rm[1]:
        raise ValueError(f"{cfg.reward_model}: no value head; expected a reward model (the Step 2 output)")
    held = held_out(cfg.data, tok, log)
    n = min(cfg.num_prompts, len(held[3]["offsets"]) - 1)
    if n == 0:
        raise ValueError(
            f"no held-out Step 3 prompts in {list(cfg.data.data_path)} (data.eval_fraction, data.data_split)"
        )
    batch = make_batch(held[3], range(n), 3, cfg.data, pad)
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    prompts = decode_rows(tok, ids, mask, skip_first=True)
    records = step_records(cfg.data, 3)[0]["eval"]  # the reference answers, for a gold reward (GSM8K's "#### N")
    references = [reference_text(records[i]) for i in held[3]["record_index"][:n]]
    reference = load_hf(cfg.reference or cfg.models[0], dtype=dtype)  # a value head in a model folder goes unused
    G = min(cfg.max_answer_len, reference[0].max_position_embeddings - ids.shape[1])
    if G < 1:
        raise ValueError(f"data.max_prompt_len {ids.shape[1]} leaves no positions for an answer")
    log(f"eval: {n} held-out prompts, answers of up to {G} tokens, {len(cfg.models)} models")
    rows, per_prompt = [], {"prompts": prompts}
    for name, path in zip(names, cfg.models):
        model = load_hf(path, dtype=dtype)
        tokens, amask = answer(cfg, model, ids, mask, G, eos, pad)
        forward = lambda i, *x: [_answer_logprobs(*model, *x), _answer_logprobs(*reference, *x), _scores(*rm, *x)]
        logp, ref_logp, scores = _in_batches(forward, [ids, mask, tokens, amask], cfg.batch_size)
        texts = decode_rows(tok, tokens, amask)
        lengths = amask.sum(1)
        row = {
            "name": name,
            "path": str(path),
            "reward": float(scores.mean()),
            **answer_figures(tokens, amask, logp, eos_id=eos, ngram=cfg.alarms.ngram),
            "kl": float(((logp - ref_logp) * amask).sum(1).mean()),
            "answer_len_percentiles": {str(q): float(np.percentile(lengths, q)) for q in (10, 50, 90)},
            "answer_len_hist": np.bincount(lengths, minlength=G + 1).tolist(),
            "truncated": float(np.mean([not r or r[-1] != eos for r in answer_rows(tokens, amask)])),
            "perplexity": perplexity(cfg, model, held[1], pad),
            "step3": step3_run(path),
        }
        golds = gold_rewards(prompts, references, texts)
        row["gold_reward"] = float(np.mean(golds)) if golds else None
        per_prompt[name] = {"answers": texts, "scores": scores.tolist(), "gold": golds, "lengths": lengths.tolist()}
        rows.append(row)
        mine, base = per_prompt[name], per_prompt[names[0]]  # the first model is its own baseline
        row.update(win_rate(mine["scores"], base["scores"]))
        row["alarms"] = [m for _, m in check(row, rows[0], cfg.alarms)]
        if (
            golds
            and paired_t(mine["scores"], base["scores"]) > cfg.alarms.z
            and paired_t(golds, base["gold"]) < -cfg.alarms.z
        ):
            row["alarms"].append(f"higher reward but lower gold reward than {names[0]}: reward hacking?")
        log(
            f"eval: {name}: reward {row['reward']:.3f}"
            + (f", gold {row['gold_reward']:.3f}" if golds else "")
            + f", KL {row['kl']:.3f}, length {row['answer_len']:.1f}, repetition {row['repetition']:.3f}"
        )
    metrics = find_metrics(cfg)
    return {
        "models": rows,
        "baseline": names[0],
        "reference": str(cfg.reference or cfg.models[0]),
        "reward_model": {"path": str(cfg.reward_model), **((held[2] and rm_accuracy(cfg, rm, held[2], pad)) or {})},
        "training": training_records(metrics) if metrics else [],
        "metrics_log": str(metrics) if metrics else None,
        "settings": {
            "prompts": n,
            "max_answer_len": G,
            **{k: getattr(cfg, k) for k in ("temperature", "top_k", "top_p", "seed", "samples")},
            "ngram": cfg.alarms.ngram,
            "data": list(cfg.data.data_path),
        },
        "per_prompt": per_prompt,
    }


# ------------------------------------------------------------------------------------------------ plots
#
# Each function returns a matplotlib Figure (no pyplot: no global state, no display).


def _figure(panels: int):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * panels, 4), layout="constrained")
    return fig, list(np.atleast_1d(fig.subplots(1, panels)))


#: Step 3's diagnostics in metrics.jsonl (jaxrlhf.rl.losses.ratio_figures, rl.experience.advantages,
#: ppo.sampled_batch) and how the report names them; the shares among them are plotted beside reward and KL
DIAGNOSTICS = {
    "clip_frac": "clip fraction",
    "approx_kl": "approx. KL to the old policy",
    "ratio_min": "ratio min",
    "ratio_max": "ratio max",
    "zero_spread": "groups of zero reward spread",
    "truncated": "truncated answers",
    "dropped_groups": "groups dropped (dynamic sampling)",
}
SHARES = ("clip_frac", "zero_spread", "truncated", "dropped_groups")


def training_diagnostics(records: list[dict]) -> dict:
    """Each Step 3 diagnostic (DIAGNOSTICS) over the logged iterations that have it: the mean, ratio_min's min and
    ratio_max's max."""
    reduce = {"ratio_min": min, "ratio_max": max}
    return {
        k: float(reduce.get(k, np.mean)([r[k] for r in records if k in r]))
        for k in DIAGNOSTICS
        if any(k in r for r in records)
    }


def plot_training(report: dict):
    """Reward (and gold reward) and KL over the Step 3 iterations, and the diagnostics' shares where logged."""
    records = report["training"]
    shares = [k for k in SHARES if any(k in r for r in records)]
    fig, (left, right, *rest) = _figure(3 if shares else 2)
    steps = [r["step"] for r in records]
    for key, label in (("reward", "reward model score"), ("gold_reward", "gold reward")):
        if all(key in r for r in records):
            left.plot(steps, [r[key] for r in records], label=label)
    right.plot(steps, [r["kl"] for r in records], color="tab:red", label="KL to reference")
    for key in shares:
        logged = [r for r in records if key in r]
        rest[0].plot([r["step"] for r in logged], [r[key] for r in logged], label=DIAGNOSTICS[key])
    for ax, title in zip((left, right, *rest), ("reward", "KL per answer (nats)", "diagnostics (shares)")):
        ax.set(xlabel="Step 3 iteration", title=title)
        ax.legend()
    return fig


def plot_frontier(report: dict):
    """Reward vs KL: the logged training iterations (points coloured by iteration: as a line the noisy per-iteration
    figures zigzag) and each model; a second panel for the gold reward."""
    gold = report["models"][0]["gold_reward"] is not None
    fig, axes = _figure(2 if gold else 1)
    for ax, key, title in zip(axes, ("reward", "gold_reward"), ("reward model score", "gold reward")):
        training = [(r["kl"], r[key], r["step"]) for r in report["training"] if key in r]
        if training:
            kl, y, steps = zip(*training)
            points = ax.scatter(kl, y, c=steps, cmap="viridis", s=12, alpha=0.7)
            fig.colorbar(points, ax=ax, label="Step 3 iteration")
        for m in report["models"]:
            ax.plot([m["kl"]], [m[key]], marker="o", linestyle="none", label=m["name"])
        ax.set(xlabel="KL to reference (nats per answer)", title=f"{title} vs KL")
        ax.legend()
    return fig


def plot_lengths(report: dict):
    """Answer-length distribution per model, and the mean length over training."""
    fig, axes = _figure(2 if report["training"] else 1)
    for m in report["models"]:
        hist = np.asarray(m["answer_len_hist"], np.float64)
        axes[0].step(np.arange(len(hist)), hist / hist.sum(), where="mid", label=m["name"])
    axes[0].set(xlabel="answer length (tokens)", ylabel="share of answers", title="answer lengths")
    axes[0].legend()
    if report["training"]:
        records = [r for r in report["training"] if "answer_len" in r]
        axes[1].plot([r["step"] for r in records], [r["answer_len"] for r in records], label="mean answer length")
        axes[1].set(xlabel="Step 3 iteration", title="length drift")
        axes[1].legend()
    return fig


def plot_win_rates(report: dict):
    """Win rate against the baseline per model, with the 95% interval."""
    fig, (ax,) = _figure(1)
    models = report["models"]
    err = np.array([[m["win_rate"] - m["win_ci"][0], m["win_ci"][1] - m["win_rate"]] for m in models]).T
    ax.bar([m["name"] for m in models], [m["win_rate"] for m in models], yerr=err, capsize=4, color="tab:blue")
    ax.axhline(0.5, color="0.5", linestyle="--", linewidth=1, label="_tie")
    ax.set(ylim=(0, 1), ylabel=f"win rate vs {report['baseline']}", title="judged by the reward model")
    return fig


PLOTS = {"training": plot_training, "win_rates": plot_win_rates, "frontier": plot_frontier, "lengths": plot_lengths}


# ----------------------------------------------------------------------------------------------- report


def _fmt(x, spec=".3f"):
    return "–" if x is None else format(x, spec)


def markdown(report: dict, plots: dict) -> str:
    s = report["settings"]
    timed = any(m.get("step3") for m in report["models"])  # Step 3 runs' algorithm and time, side by side
    lines = [
        "# Evaluation report\n",
        f"{s['prompts']} held-out prompts of {', '.join(s['data'])}, answers sampled (temperature {s['temperature']}, "
        f"up to {s['max_answer_len']} tokens, seed {s['seed']}, the same keys for every model). Win rates and KL "
        f"against `{report['baseline']}`; KL in nats per answer; repetition = share of repeated {s['ngram']}-grams; "
        f"perplexity on held-out Step 1 text."
        + (
            " Step 3: the run's algorithm (n answers per prompt) and its time, iterations x the median logged "
            "iteration (compilation left out)."
            if timed
            else ""
        )
        + "\n",
        "| model | RM score | win rate (95% CI) | gold reward | KL | length mean (p10/p50/p90) | truncated "
        "| repetition | entropy | perplexity |" + (" Step 3 | Step 3 time (s) |" if timed else ""),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" --- | ---: |" if timed else ""),
    ]
    for i, m in enumerate(report["models"]):
        p, run = m["answer_len_percentiles"], m.get("step3") or {}
        win = "baseline" if i == 0 else f"{m['win_rate']:.3f} ({m['win_ci'][0]:.3f}–{m['win_ci'][1]:.3f})"
        algorithm = run.get("algorithm", "–") + (
            f" (n={run['samples_per_prompt']})" if run.get("samples_per_prompt", 1) > 1 else ""
        )
        lines.append(
            f"| {m['name']} | {m['reward']:.3f} | {win} | {_fmt(m['gold_reward'])} | {m['kl']:.3f} "
            f"| {m['answer_len']:.1f} ({p['10']:.0f}/{p['50']:.0f}/{p['90']:.0f}) | {m['truncated']:.2f} "
            f"| {m['repetition']:.3f} | {m['entropy']:.3f} | {_fmt(m['perplexity'], '.2f')} |"
            + (f" {algorithm} | {_fmt(run.get('seconds'), '.0f')} |" if timed else "")
        )
    r = report["reward_model"]
    if "accuracy" in r:
        lines.append(
            f"\nReward model `{r['path']}`: accuracy {r['accuracy']:.3f} on {r['pairs']} held-out pairs "
            f"(mean chosen score {r['chosen_score']:.3f}, rejected {r['rejected_score']:.3f})."
        )
    diagnostics = training_diagnostics(report["training"])
    if diagnostics:
        lines.append(
            f"\nStep 3 diagnostics ({report['metrics_log']}; means over the logged iterations, the ratio's extremes): "
            + ", ".join(f"{DIAGNOSTICS[k]} {v:.3g}" for k, v in diagnostics.items())
            + "."
        )
    flagged = [(m["name"], a) for m in report["models"] for a in m["alarms"]]
    if flagged:
        lines += ["\n## Alarms\n"] + [f"- **{n}**: {a}" for n, a in flagged]
    train_alarms = [(r["step"], r["alarms"]) for r in report["training"] if r.get("alarms")]
    if train_alarms:
        lines.append(
            f"\nDuring Step 3 ({report['metrics_log']}): alarms at {len(train_alarms)} logged iterations, first at "
            f"iteration {train_alarms[0][0]}: {train_alarms[0][1]}."
        )
    if plots:
        lines.append("\n## Plots\n")
        lines += [f"![{name}]({file})" for name, file in plots.items()]
    pp, names = report["per_prompt"], [m["name"] for m in report["models"]]
    k = min(s["samples"], len(pp["prompts"]))
    if k:
        lines.append("\n## Sample answers\n")
        for i in range(k):
            lines.append(f"**Prompt {i + 1}:** `{pp['prompts'][i].strip()!r}`\n")
            lines += ["| model | answer | RM score | gold |", "| --- | --- | ---: | ---: |"]
            for n in names:
                g = pp[n]["gold"][i] if pp[n]["gold"] else None
                text = pp[n]["answers"][i].replace("|", "\\|").replace("\n", "⏎")
                lines.append(f"| {n} | `{text}` | {pp[n]['scores'][i]:.3f} | {_fmt(g)} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out) -> Path:
    """report.md, report.json and the PNG plots under `out`; returns the Markdown file."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = {name: f"{name}.png" for name in PLOTS if name != "training" or report["training"]}
    for name, file in plots.items():
        PLOTS[name](report).savefig(out / file, dpi=100)
    report = {**report, "plots": plots}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report, plots))
    return out / "report.md"


def run(cfg: EvalConfig, log=print) -> dict:
    """Evaluate and write the report; returns the numbers and the report's path."""
    report = evaluate(cfg, log=log)
    path = write_report(report, cfg.output_dir)
    log(f"eval: report in {path}")
    return {**report, "report": str(path)}


def pipeline_report(
    step1, reward_model, step3: dict, metrics, out_dir, data: DataConfig, ppo, num_prompts: int, log=print
) -> str | None:
    """The report `python -m jaxrlhf.train` ends with: the Step 1 model, the final actor and its EMA (step3: the
    folders ppo.run wrote) on held-out prompts, sampled as Step 3 sampled (ppo: its PPOConfig), judged by the
    Step 2 reward model; returns the report's path. Process 0 alone evaluates (on its first device)."""
    if jax.process_index() != 0:
        return None
    names = ["step1"] + [n for n in ("actor", "actor_ema") if n in step3]
    cfg = EvalConfig(
        models=(str(step1), *(str(step3[n]) for n in names[1:])),
        names=tuple(names),
        reward_model=str(reward_model),
        metrics=str(metrics),
        output_dir=str(out_dir),
        num_prompts=num_prompts,
        dtype="float32" if ppo.precision == "fp32" else "bfloat16",
        data=data,
        **{k: getattr(ppo, k) for k in ("max_answer_len", "temperature", "top_k", "top_p", "alarms")},
    )
    return run(cfg, log=log)["report"]


def flags(parser):
    """The options, the same as the settings of their names (--prompts: data.data_path)."""
    parser.add_argument("--models", nargs="+", metavar="DIR")
    parser.add_argument("--names", nargs="+")
    parser.add_argument("--reward-model", "--reward_model", dest="reward_model", metavar="DIR")
    parser.add_argument(
        "--prompts",
        dest="data.data_path",
        type=lambda s: [s],
        help="the dataset of the held-out prompts (data.data_path), e.g. synthetic:6000",
    )
    parser.add_argument("--reference", metavar="DIR")
    parser.add_argument("--metrics", metavar="FILE")
    parser.add_argument("--output-dir", "--output_dir", dest="output_dir", metavar="DIR")


def main(argv=None):
    return run_cli(EvalConfig, __doc__, "python -m jaxrlhf.eval", run, argv, flags=flags, processes=False)


if __name__ == "__main__":
    main()
