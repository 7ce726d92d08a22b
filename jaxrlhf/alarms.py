"""Reward-hacking alarms: the usual signs that PPO is exploiting the reward model instead of learning the task.

    per iteration: answer_len, repetition, entropy, kl, reward[, gold_reward]   (answer_figures + the engine's)
        ──first `baseline_iterations`──► baseline (means)
        ──check(figures, baseline, bounds)──► answer length / entropy drifted from the baseline by a factor,
                                              repetition or KL past an absolute bound
        ──proxy_vs_gold(rewards, golds, bounds)──► over the last `window` iterations the learned reward rises
                                                   while the gold reward falls, each by a t-statistic past `z`

The checks are pure functions; `AlarmTracker` only keeps the history (a resumed run replays its logged figures)
and says which alarms are new, so the loop logs an alarm when it starts (not again while it flickers on and off
within `window` iterations) and keeps it on the progress bar while it lasts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class AlarmConfig:
    #: raise reward-hacking alarms during Step 3 (progress bar and log)
    enabled: bool = True
    #: iterations whose mean is the baseline of the relative bounds
    baseline_iterations: int = 5
    #: answer length outside [min_len_ratio, max_len_ratio] x its baseline
    min_len_ratio: float = 0.5
    max_len_ratio: float = 2.0
    #: share of repeated n-grams in the answers above this (DeepSpeed-Chat users' "collapse into repetition")
    max_repetition: float = 0.3
    #: n of the n-grams counted by the repetition rate
    ngram: int = 3
    #: entropy of the sampled tokens below this share of its baseline (a collapse; a task with one right answer,
    #: like the built-in one, rightly lowers it to a tenth: 0.53 -> 0.05 nats in the demo run)
    min_entropy_ratio: float = 0.05
    #: KL to the reference per answer (nats) above this
    max_kl: float = 20.0
    #: iterations over which the learned and the gold reward trends are fitted; an alarm raised again within
    #: this many iterations of its last raise is not logged again (it stays on the progress bar)
    window: int = 20
    #: |t-statistic| of both slopes past which "reward up, gold down" raises the alarm
    z: float = 3.0

    def __post_init__(self):
        if self.baseline_iterations < 1 or self.ngram < 1 or self.window < 3:
            raise ValueError("baseline_iterations and ngram must be >= 1, window >= 3")
        if not 0 <= self.min_len_ratio <= 1 <= self.max_len_ratio or self.min_entropy_ratio < 0 or self.z <= 0:
            raise ValueError("expected min_len_ratio <= 1 <= max_len_ratio, min_entropy_ratio >= 0 and z > 0")


def repetition_rate(rows: list[list[int]], n: int = 3) -> float:
    """Share of repeated n-grams: over all rows, (n-grams that already occurred earlier in the same row) /
    (all n-grams); rows shorter than n count nothing. 0 for distinct n-grams, -> 1 for one token repeated."""
    total = repeated = 0
    for row in rows:
        grams = [tuple(row[i : i + n]) for i in range(len(row) - n + 1)]
        total += len(grams)
        repeated += len(grams) - len(set(grams))
    return repeated / total if total else 0.0


def answer_rows(tokens, mask, eos_id: int | tuple[int, ...] | None = None) -> list[list[int]]:
    """Each answer's real tokens (mask 1), its final stop token (eos_id: one or several) dropped."""
    ends = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    rows = [[int(t) for t in row[m.astype(bool)]] for row, m in zip(np.asarray(tokens), np.asarray(mask))]
    return [row[:-1] if row and row[-1] in ends else row for row in rows]


def answer_figures(tokens, mask, logprobs, *, eos_id: int | None = None, ngram: int = 3) -> dict[str, float]:
    """A batch of answers [B, G] (mask 1 up to and including EOS) and their sampled tokens' log-probs ->
    answer_len (tokens, mean), repetition (repetition_rate), entropy (-mean log p of the sampled tokens:
    the per-token entropy's Monte-Carlo estimate at temperature 1)."""
    m = np.asarray(mask, np.float64)
    lp = np.asarray(logprobs, np.float64)
    return {
        "answer_len": float(m.sum(1).mean()),
        "repetition": repetition_rate(answer_rows(tokens, mask, eos_id), ngram),
        "entropy": float(-(lp * m).sum() / max(m.sum(), 1.0)) + 0.0,
    }  # + 0.0: no "-0.000" in reports


def experience_figures(experiences: list[dict], eos_id: int | None, ngram: int = 3) -> dict[str, float]:
    """answer_figures' repetition and entropy of one Step 3 iteration's experience (engine.generate_experience)."""
    G = experiences[0]["mask"].shape[1]
    host = jax.device_get([(e["seq"][:, -G:], e["mask"], e["logprobs"]) for e in experiences])
    tokens, mask, logprobs = (np.concatenate(parts) for parts in zip(*host))
    f = answer_figures(tokens, mask, logprobs, eos_id=eos_id, ngram=ngram)
    return {"repetition": f["repetition"], "entropy": f["entropy"]}


def check(figures: dict, baseline: dict | None, bounds: AlarmConfig) -> list[tuple[str, str]]:
    """(name, message) for each bound that `figures` passes; the relative bounds need a `baseline`."""
    out = []
    if "repetition" in figures and figures["repetition"] > bounds.max_repetition:
        out.append(("repetition", f"repetition {figures['repetition']:.2f} > {bounds.max_repetition:g}"))
    if "kl" in figures and figures["kl"] > bounds.max_kl:
        out.append(("kl", f"KL {figures['kl']:.3g} > {bounds.max_kl:g}"))
    length, base_len = figures.get("answer_len"), (baseline or {}).get("answer_len")
    if length is not None and base_len and not bounds.min_len_ratio <= length / base_len <= bounds.max_len_ratio:
        out.append(
            ("answer_len", f"answer length {length:.3g} is {length / base_len:.2f}x its baseline {base_len:.3g}")
        )
    entropy, base_ent = figures.get("entropy"), (baseline or {}).get("entropy")
    if entropy is not None and base_ent and base_ent > 0 and entropy < bounds.min_entropy_ratio * base_ent:
        out.append(("entropy", f"entropy {entropy:.3g} < {bounds.min_entropy_ratio:g}x its baseline {base_ent:.3g}"))
    return out


def slope_t(y) -> tuple[float, float]:
    """Least-squares slope of y over 0..n-1 and its t-statistic (slope / standard error; +-inf on a perfect fit)."""
    y = np.asarray(y, np.float64)
    x = np.arange(len(y)) - (len(y) - 1) / 2
    slope = float((x * (y - y.mean())).sum() / (x * x).sum())
    resid = y - y.mean() - slope * x
    se = np.sqrt((resid**2).sum() / max(len(y) - 2, 1) / (x * x).sum())
    if se < 1e-12 * max(1.0, abs(slope)):
        return slope, (0.0 if slope == 0 else float(np.sign(slope) * np.inf))
    return slope, slope / se


def proxy_vs_gold(rewards, golds, bounds: AlarmConfig) -> str | None:
    """The message when, over the last `window` points, the learned reward rises and the gold reward falls
    (both slopes' t-statistics past `z`); None otherwise or with fewer points."""
    if len(rewards) < bounds.window or len(golds) < bounds.window:
        return None
    r_slope, r_t = slope_t(rewards[-bounds.window :])
    g_slope, g_t = slope_t(golds[-bounds.window :])
    if r_t > bounds.z and g_t < -bounds.z:
        return (
            f"learned reward rising ({r_slope:+.3g}/it) while gold reward falls ({g_slope:+.3g}/it) over the last "
            f"{bounds.window} iterations: reward hacking?"
        )
    return None


@dataclasses.dataclass
class Alarm:
    name: str
    message: str
    new: bool  # not raised in the last `window` updates: worth a line in the log


def training_records(path, upto: int | None = None) -> list[dict]:
    """The train records of a Step 3 metrics.jsonl, one per iteration (a resumed run's later line wins), in order,
    up to iteration `upto`; [] without the file."""
    path, by_step = Path(path), {}
    if not path.is_file():
        return []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("split") == "train" and (upto is None or r["step"] <= upto):
                by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


class AlarmTracker:
    """The history of one run's figures; `update` returns the alarms raised now. `history`: figures to replay
    first (a resumed run's logged iterations)."""

    def __init__(self, bounds: AlarmConfig = AlarmConfig(), history=()):
        self.bounds = bounds
        self.history: list[dict] = []
        self.last_raised: dict[str, int] = {}  # alarm name -> the update that last raised it
        for figures in history:
            self.update(figures)

    def baseline(self) -> dict | None:
        first = self.history[: self.bounds.baseline_iterations]
        if len(first) < self.bounds.baseline_iterations:
            return None
        return {k: float(np.mean([f[k] for f in first])) for k in first[0] if all(k in f for f in first)}

    def update(self, figures: dict) -> list[Alarm]:
        self.history.append({k: v for k, v in figures.items() if isinstance(v, (int, float))})
        found = check(figures, self.baseline(), self.bounds)
        with_gold = [f for f in self.history if "gold_reward" in f and "reward" in f]
        trend = proxy_vs_gold([f["reward"] for f in with_gold], [f["gold_reward"] for f in with_gold], self.bounds)
        if trend:
            found.append(("proxy_vs_gold", trend))
        now = len(self.history)
        alarms = [
            Alarm(name, message, now - self.last_raised.get(name, -self.bounds.window) > self.bounds.window)
            for name, message in found
        ]
        self.last_raised.update({a.name: now for a in alarms})
        return alarms
