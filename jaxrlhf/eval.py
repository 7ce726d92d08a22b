"""`python -m jaxrlhf.eval`: what RLHF did to the models, as a report (Markdown table, PNG plots, raw JSON).

    python -m jaxrlhf.eval --models runs/train/actor-models/model runs/train/step3-models/actor \\
        runs/train/step3-models/actor_ema --reward-model runs/train/reward-models/model --prompts synthetic:6000 \\
        [CONFIG.yaml] [key=value ...]
    python -m jaxrlhf.eval --models runs/sft/model runs/grpo/actor --prompts arithmetic:6000 \
        'reward.functions=[jaxrlhf.rewards:math_verify]'          # no reward model: Step 3's reward functions judge

    held-out Step 3 prompts ──each model answers (same sampling keys; and greedily)──► answers [N, G]
        ──reward (Step 3's: reward model and/or reward functions, jaxrlhf.rewards)──► per answer, each part too
        ──► mean (a 0/1 part's: its accuracy), win rate vs the first model (Wilson 95% interval)
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
from typing import Literal, NamedTuple

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
from jaxrlhf.tokenizer import decode_rows, load_tokenizer, stop_ids

Z95 = 1.959963984540054


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    #: the models to compare (HF folders); the first is the baseline of the win rates (e.g. the Step 1 model)
    models: tuple[str, ...] = ()
    #: their names in the report (default: the folder names)
    names: tuple[str, ...] = ()
    #: the reward model that judges the answers (the Step 2 output); none where reward.functions alone score them
    reward_model: str = ""
    #: the answers' reward, as Step 3's (jaxrlhf.rewards): the reward model's score (reward.model_weight), reward
    #: functions' (e.g. [jaxrlhf.rewards:math_verify]) or a weighted sum; each part is reported, a 0/1 one as accuracy
    reward: rewards.RewardConfig = rewards.RewardConfig()
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
    #: every model also answers greedily (temperature 0): its reward and gold reward beside the sampled ones
    greedy: bool = True
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


def answer(cfg: EvalConfig, model, ids, mask, max_new: int, eos_id: tuple[int, ...], pad_id: int, greedy=False):
    """Every prompt's sampled answer (`greedy`: its greedy one): tokens and mask [N, G]; batch i is sampled with key
    fold_in(seed, i)."""
    sampling = {k: getattr(cfg, k) for k in ("temperature", "top_k", "top_p")}
    sampling["temperature"] = 0.0 if greedy else cfg.temperature

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
    model_dir: str | None = None,
    **sampling,
) -> tuple[dict, dict]:
    """The Step 1 model against the final actor (`models`: {"step1": (config, params), "actor": ...}) on left-padded
    prompts ids, mask [N, P]: the mean gold reward (`gold(prompt index, answer text)`) of each one's answers, sampled
    `samples` times per prompt (`sampling`: generate's temperature, top_k, top_p) and greedy once; and the KL from the
    actor to the Step 1 model on the actor's sampled answers (nats per answer). Returns (figures, {(model, "sampled" or
    "greedy"): answer texts}). Answers stop at stop_ids(tok, chat_template, model_dir) (data.chat_template; the Step 1
    folder's generation_config.json)."""
    rows = {
        "sampled": (np.tile(ids, (samples, 1)), np.tile(mask, (samples, 1)), sampling),
        "greedy": (ids, mask, {**sampling, "temperature": 0.0}),
    }
    out, texts, sampled = {}, {}, None
    kw = dict(max_new_tokens=max_new_tokens, eos_id=stop_ids(tok, chat_template, model_dir), pad_id=tok.pad_token_id)
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


class Judge(NamedTuple):
    """What scores an answer, Step 3's reward (jaxrlhf.rewards): reward = Σ weights[part] × part, the parts being the
    reward model's score ("reward model", where one is given) and each reward function's (by its name)."""

    rm: tuple | None  # (config, params) of the reward model, or None
    weights: dict  # {part: its weight}: "reward model" -> reward.model_weight as used; a function -> reward.weights
    functions: dict  # {function name: a HostRewards of it alone (weight 1), run on the host as Step 3 runs it}


class Held(NamedTuple):
    """The held-out Step 3 prompts every model answers, and what the rewards read of them."""

    ids: np.ndarray  # [N, P] left-padded
    mask: np.ndarray  # [N, P]
    texts: list  # N prompts as the reward functions get them (BOS dropped)
    references: list  # N reference answers or None (the gold reward's GSM8K "#### N")
    metadata: list  # N dicts (the reward functions'; GSM8K's {"reference": ...})


def load_judge(cfg: EvalConfig, dtype, log) -> Judge:
    """The reward model (where given) and the reward functions; a ValueError where nothing would score."""
    if cfg.reward.model_scale and not cfg.reward_model:
        raise ValueError(
            "reward_model: required (--reward-model RM_DIR, the Step 2 output), or score the answers with reward "
            "functions alone: reward.functions=[jaxrlhf.rewards:math_verify] (any of Step 3's)"
        )
    rm = load_hf(cfg.reward_model, dtype=dtype) if cfg.reward_model else None
    if rm is not None and "value_head" not in rm[1]:
        raise ValueError(f"{cfg.reward_model}: no value head; expected a reward model (the Step 2 output)")
    weights = {"reward model": cfg.reward.model_scale} if rm else {}
    weights.update(zip(cfg.reward.functions, cfg.reward.weights or (1.0,) * len(cfg.reward.functions)))
    one = lambda spec: dataclasses.replace(cfg.reward, functions=(spec,), weights=(), model_weight=0.0)
    return Judge(rm, weights, {spec: rewards.HostRewards(one(spec), log) for spec in cfg.reward.functions})


def held_prompts(cfg: EvalConfig, tok, arrays) -> Held:
    n = min(cfg.num_prompts, len(arrays["offsets"]) - 1)
    if n == 0:
        raise ValueError(
            f"no held-out Step 3 prompts in {list(cfg.data.data_path)} (data.eval_fraction, data.data_split)"
        )
    batch = make_batch(arrays, range(n), 3, cfg.data, tok.pad_token_id)
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    records = step_records(cfg.data, 3)[0]["eval"]  # the reference answers, for a gold reward (GSM8K's "#### N")
    references = [reference_text(records[i]) for i in arrays["record_index"][:n]]
    return Held(ids, mask, decode_rows(tok, ids, mask, skip_first=True), references, batch["metadata"])


def judged(cfg: EvalConfig, ctx, eos, tokens, amask) -> dict:
    """Answers [N, G] decoded and judged: their texts, reward ("scores") and its parts, and gold reward (or None).
    The functions get what Step 3 gives them (ppo.reward_starter): token_ids (the stop token included) and truncated;
    an answer a function leaves out (None, or past reward.timeout) gets 0 from it."""
    judge, held = ctx.judge, ctx.held
    texts = decode_rows(ctx.tok, tokens, amask, stops=eos)
    parts = {}
    if judge.rm is not None:
        rows = [held.ids, held.mask, tokens, amask]
        (parts["reward model"],) = _in_batches(lambda i, *x: [_scores(*judge.rm, *x)], rows, cfg.batch_size)
    token_ids = answer_rows(tokens, amask)
    truncated = [not set(eos) & set(r) for r in token_ids]
    for spec, host in judge.functions.items():
        parts[spec] = host(held.texts, texts, held.metadata, token_ids=token_ids, truncated=truncated).scores
    reward = sum(w * np.asarray(parts[k], np.float64) for k, w in judge.weights.items())
    return {
        "answers": texts,
        "scores": reward.tolist(),
        "parts": {k: np.asarray(v, np.float64).tolist() for k, v in parts.items()},
        "gold": gold_rewards(held.texts, held.references, texts),
    }


def means(answers: dict, suffix: str = "") -> dict:
    """A model's mean reward, parts and gold reward over its answers (`judged`), the keys ending in `suffix`."""
    gold = answers["gold"]
    return {
        f"reward{suffix}": float(np.mean(answers["scores"])),
        f"parts{suffix}": {k: float(np.mean(v)) for k, v in answers["parts"].items()},
        f"gold_reward{suffix}": None if gold is None else float(np.mean(gold)),
    }


class Context(NamedTuple):
    """What every model's row reads: the prompts, the judge, the KL reference, the answers' length."""

    tok: object
    judge: Judge
    held: Held
    reference: tuple  # (config, params): the KL reference
    sequences: dict | None  # the held-out Step 1 sequences (the perplexity's), or None
    G: int  # tokens per answer at most
    dtype: object


def model_row(cfg: EvalConfig, ctx: Context, name: str, path) -> tuple[dict, dict]:
    """One model's row of the report and its answers (per_prompt's): sampled, and greedy too (cfg.greedy)."""
    tok, held, G, pad = ctx.tok, ctx.held, ctx.G, ctx.tok.pad_token_id
    model = load_hf(path, dtype=ctx.dtype)
    eos = stop_ids(tok, cfg.data.chat_template, path)  # end-of-turn, EOS, the model's generation_config.json ids
    tokens, amask = answer(cfg, model, held.ids, held.mask, G, eos, pad)
    forward = lambda i, *x: [_answer_logprobs(*model, *x), _answer_logprobs(*ctx.reference, *x)]
    logp, ref_logp = _in_batches(forward, [held.ids, held.mask, tokens, amask], cfg.batch_size)
    mine, lengths = judged(cfg, ctx, eos, tokens, amask), amask.sum(1)
    row = {
        "name": name,
        "path": str(path),
        **means(mine),
        **answer_figures(tokens, amask, logp, eos_id=eos, ngram=cfg.alarms.ngram),
        "kl": float(((logp - ref_logp) * amask).sum(1).mean()),
        "answer_len_percentiles": {str(q): float(np.percentile(lengths, q)) for q in (10, 50, 90)},
        "answer_len_hist": np.bincount(lengths, minlength=G + 1).tolist(),
        "truncated": float(np.mean([not r or r[-1] not in eos for r in answer_rows(tokens, amask)])),
        "perplexity": perplexity(cfg, model, ctx.sequences, pad),
        "step3": step3_run(path),
    }
    mine["lengths"] = lengths.tolist()
    if cfg.greedy:
        mine["greedy"] = judged(cfg, ctx, eos, *answer(cfg, model, held.ids, held.mask, G, eos, pad, greedy=True))
        row.update(means(mine["greedy"], "_greedy"))
    return row, mine


def model_alarms(cfg: EvalConfig, row: dict, first: dict, mine: dict, base: dict) -> list[str]:
    """The alarms' bounds against the first model, and reward hacking: a reward significantly above the first
    model's with a gold reward significantly below it."""
    out = [m for _, m in check(row, first, cfg.alarms)]
    z = cfg.alarms.z
    if mine["gold"] and paired_t(mine["scores"], base["scores"]) > z and paired_t(mine["gold"], base["gold"]) < -z:
        out.append(f"higher reward but lower gold reward than {first['name']}: reward hacking?")
    return out


def evaluate(cfg: EvalConfig, log=print) -> dict:
    """Every number of the report (see the module docstring), as a JSON-ready dict."""
    if not cfg.models:
        raise ValueError("models: required (--models SFT_DIR PPO_DIR ...)")
    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else np.float32
    names = list(cfg.names) or [Path(m).name for m in cfg.models]
    if len(set(names)) < len(names):  # e.g. .../actor-models/model and .../reward-models/model
        names = [f"{Path(m).parent.name}/{Path(m).name}" for m in cfg.models]
    tok = load_tokenizer(cfg.tokenizer or cfg.models[0])
    judge = load_judge(cfg, dtype, log)
    steps = held_out(cfg.data, tok, log)
    held = held_prompts(cfg, tok, steps[3])
    reference = load_hf(cfg.reference or cfg.models[0], dtype=dtype)  # a value head in a model folder goes unused
    G = min(cfg.max_answer_len, reference[0].max_position_embeddings - held.ids.shape[1])
    if G < 1:
        raise ValueError(f"data.max_prompt_len {held.ids.shape[1]} leaves no positions for an answer")
    log(f"eval: {len(held.ids)} held-out prompts, answers of up to {G} tokens, {len(cfg.models)} models")
    ctx = Context(tok, judge, held, reference, steps[1], G, dtype)
    rows, per_prompt = [], {"prompts": held.texts}
    for name, path in zip(names, cfg.models):
        row, per_prompt[name] = model_row(cfg, ctx, name, path)
        rows.append(row)
        row.update(win_rate(per_prompt[name]["scores"], per_prompt[names[0]]["scores"]))  # the first: all ties
        row["alarms"] = model_alarms(cfg, row, rows[0], per_prompt[name], per_prompt[names[0]])
        greedy = f" (greedy {row['reward_greedy']:.3f})" if cfg.greedy else ""
        log(
            f"eval: {name}: reward {row['reward']:.3f}{greedy}"
            + (f", gold {row['gold_reward']:.3f}" if row["gold_reward"] is not None else "")
            + f", KL {row['kl']:.3f}, length {row['answer_len']:.1f}, repetition {row['repetition']:.3f}"
        )
    metrics = find_metrics(cfg)
    judged_by = judge.rm is not None and steps[2] and rm_accuracy(cfg, judge.rm, steps[2], tok.pad_token_id)
    return {
        "models": rows,
        "baseline": names[0],
        "reference": str(cfg.reference or cfg.models[0]),
        "reward": {"weights": judge.weights, "binary": binary_parts(per_prompt, names)},
        "reward_model": {"path": str(cfg.reward_model) if cfg.reward_model else None, **(judged_by or {})},
        "training": training_records(metrics) if metrics else [],
        "metrics_log": str(metrics) if metrics else None,
        "settings": {
            "prompts": len(held.ids),
            "max_answer_len": G,
            **{k: getattr(cfg, k) for k in ("temperature", "top_k", "top_p", "seed", "samples", "greedy")},
            "ngram": cfg.alarms.ngram,
            "data": list(cfg.data.data_path),
        },
        "per_prompt": per_prompt,
    }


def binary_parts(per_prompt: dict, names: list[str]) -> list[str]:
    """The reward's parts that scored every answer of every model 0 or 1 (a verifier: its mean is an accuracy)."""
    answers = [a for n in names for a in (per_prompt[n], per_prompt[n].get("greedy")) if a]
    parts = answers[0]["parts"]
    return [k for k in parts if all(set(a["parts"][k]) <= {0.0, 1.0} for a in answers)]


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
    for key, label in (("reward", "reward"), ("gold_reward", "gold reward")):
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
    for ax, key, title in zip(axes, ("reward", "gold_reward"), ("reward", "gold reward")):
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
    ax.set(ylim=(0, 1), ylabel=f"win rate vs {report['baseline']}", title="judged by the reward")
    return fig


PLOTS = {"training": plot_training, "win_rates": plot_win_rates, "frontier": plot_frontier, "lengths": plot_lengths}


# ----------------------------------------------------------------------------------------------- report


def _fmt(x, spec=".3f"):
    return "–" if x is None else format(x, spec)


def _table(report: dict) -> list[str]:
    """The models' table: one row per model, the greedy answers' columns beside the sampled ones'."""
    models, greedy = report["models"], report["settings"].get("greedy", False)
    timed = any(m.get("step3") for m in models)  # Step 3 runs' algorithm and time, side by side
    also = lambda *names: list(names) if greedy else []  # noqa: E731
    columns = ["model", "reward", *also("greedy reward"), "win rate (95% CI)", "gold reward", *also("greedy gold")]
    columns += ["KL", "length mean (p10/p50/p90)", "truncated", "repetition", "entropy", "perplexity"]
    columns += ["Step 3", "Step 3 time (s)"] if timed else []
    lines = ["| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * (len(columns) - 1)]
    for i, m in enumerate(models):
        p, run = m["answer_len_percentiles"], m.get("step3") or {}
        win = "baseline" if i == 0 else f"{m['win_rate']:.3f} ({m['win_ci'][0]:.3f}–{m['win_ci'][1]:.3f})"
        cells = [m["name"], _fmt(m["reward"]), *also(_fmt(m.get("reward_greedy"))), win, _fmt(m["gold_reward"])]
        cells += also(_fmt(m.get("gold_reward_greedy")))
        cells += [f"{m['kl']:.3f}", f"{m['answer_len']:.1f} ({p['10']:.0f}/{p['50']:.0f}/{p['90']:.0f})"]
        cells += [f"{m[k]:.3f}" for k in ("truncated", "repetition", "entropy")] + [_fmt(m["perplexity"], ".2f")]
        if timed:
            n = run.get("samples_per_prompt", 1)
            cells += [run.get("algorithm", "–") + (f" (n={n})" if n > 1 else ""), _fmt(run.get("seconds"), ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _parts(report: dict) -> list[str]:
    """Each part of the reward per model (where reward functions score): a 0/1 part's mean is its accuracy."""
    weights, binary = report.get("reward", {}).get("weights", {}), report.get("reward", {}).get("binary", [])
    if list(weights) in ([], ["reward model"]):
        return []
    greedy = report["settings"].get("greedy", False)
    names = [f"{k} ({'accuracy' if k in binary else 'mean'})" for k in weights]
    lines = [
        f"\nThe reward's parts{' (sampled / greedy)' if greedy else ''}; a part that scored every answer 0 or 1 (a "
        "verifier) shows its accuracy.\n",
        "| model | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    for m in report["models"]:
        cells = [f"{m['parts'][k]:.3f}" + (f" / {m['parts_greedy'][k]:.3f}" if greedy else "") for k in weights]
        lines.append(f"| {m['name']} | " + " | ".join(cells) + " |")
    return lines


def _samples(report: dict) -> list[str]:
    """The first `samples` prompts with every model's (sampled) answer, its reward and gold reward."""
    pp, names = report["per_prompt"], [m["name"] for m in report["models"]]
    k = min(report["settings"]["samples"], len(pp["prompts"]))
    lines = ["\n## Sample answers\n"] if k else []
    for i in range(k):
        lines.append(f"**Prompt {i + 1}:** `{pp['prompts'][i].strip()!r}`\n")
        lines += ["| model | answer | reward | gold |", "| --- | --- | ---: | ---: |"]
        for n in names:
            g = pp[n]["gold"][i] if pp[n]["gold"] else None
            text = pp[n]["answers"][i].replace("|", "\\|").replace("\n", "⏎")
            lines.append(f"| {n} | `{text}` | {pp[n]['scores'][i]:.3f} | {_fmt(g)} |")
        lines.append("")
    return lines


def markdown(report: dict, plots: dict) -> str:
    s, weights = report["settings"], report.get("reward", {}).get("weights", {"reward model": 1.0})
    formula = " + ".join(f"{w:g} × `{k}`" for k, w in weights.items())
    timed = any(m.get("step3") for m in report["models"])
    lines = [
        "# Evaluation report\n",
        f"{s['prompts']} held-out prompts of {', '.join(s['data'])}, answers sampled (temperature {s['temperature']}, "
        f"up to {s['max_answer_len']} tokens, seed {s['seed']}, the same keys for every model)"
        + (" and greedy" if s.get("greedy") else "")
        + f". Reward = {formula}. Win rates (by the reward) and KL against `{report['baseline']}`; KL in nats per "
        f"answer; repetition = share of repeated {s['ngram']}-grams; perplexity on held-out Step 1 text."
        + (
            " Step 3: the run's algorithm (n answers per prompt) and its time, iterations x the median logged "
            "iteration (compilation left out)."
            if timed
            else ""
        )
        + "\n",
        *_table(report),
        *_parts(report),
    ]
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
        lines += ["\n## Plots\n"] + [f"![{name}]({file})" for name, file in plots.items()]
    return "\n".join(lines + _samples(report)) + "\n"


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
    folders ppo.run wrote) on held-out prompts, sampled as Step 3 sampled (ppo: its PPOConfig) and judged by Step 3's
    reward (ppo.reward: the Step 2 reward model's score, the reward functions' or both; `reward_model` None where
    the functions alone score, e.g. a --step 1 3 run); returns the report's path. Process 0 alone evaluates (on its
    first device)."""
    if jax.process_index() != 0:
        return None
    names = ["step1"] + [n for n in ("actor", "actor_ema") if n in step3]
    cfg = EvalConfig(
        models=(str(step1), *(str(step3[n]) for n in names[1:])),
        names=tuple(names),
        reward_model=str(reward_model or ""),
        reward=ppo.reward,
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
