"""Step 3's reward: the trained reward model's score, Python functions' scores, or a weighted sum of both.

    reward = model_weight * reward model's score + sum_i weights[i] * functions[i](prompts, answers, metadata)

A function is named `module:function` (importable by the user, like the built-ins below) and takes the batch's
prompts and decoded answers (str) and each prompt's metadata from the data (a dict: GSM8K's {"reference": ...}), and
returns one score per answer. It runs on the host in a worker thread (`HostRewards.start`) while the device scores
the answers, so the device does not wait on it. A function that raises, returns the wrong number of scores or a
non-finite score stops the run with a RewardError that names it and the offending row.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from jaxrlhf.config import ConfigError, InputError, check_fields, one_line
from jaxrlhf.data import stories as story_task
from jaxrlhf.data import synthetic as synthetic_task


class RewardError(InputError):
    """A reward function that failed on a batch: the message names the function and the offending row."""


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    #: reward functions `module:function`, each (prompts, answers, metadata) -> one score per answer, run on the host
    #: while the device scores; built in: jaxrlhf.rewards:synthetic, jaxrlhf.rewards:gsm8k, jaxrlhf.rewards:stories
    functions: tuple[str, ...] = ()
    #: weight of each function's score (empty: 1 each)
    weights: tuple[float, ...] = ()
    #: weight of the reward model's score (null: 1 without functions, 0 with them; 0 loads no reward model)
    model_weight: float | None = None

    def __post_init__(self):
        check_fields(self)
        if self.weights and len(self.weights) != len(self.functions):
            raise ConfigError(
                f"weights: expected one weight per function ({len(self.functions)}), got {list(self.weights)}"
            )
        for spec in self.functions:
            load_function(spec)  # a bad name stops the run here, at start-up, before any model loads
        if self.model_scale == 0 and not self.functions:
            raise ConfigError("model_weight: 0 leaves no reward; set functions too, or a weight > 0")

    @property
    def model_scale(self) -> float:
        """The reward model's weight as used: 0 means no reward model is loaded or run."""
        return (0.0 if self.functions else 1.0) if self.model_weight is None else self.model_weight


def load_function(spec: str):
    """The callable named by `spec` ("module:function"); a ConfigError naming the setting (functions) otherwise."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"functions: expected 'module:function' (e.g. jaxrlhf.rewards:gsm8k), got {spec!r}")
    try:
        fn = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure while importing the user's module is the same setting's fault
        raise ConfigError(
            f"functions: cannot import {module!r} for {spec!r} ({type(e).__name__}: "
            f"{one_line(e)}); is it on PYTHONPATH?"
        ) from None
    for part in name.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ConfigError(f"functions: {spec!r}: module {module!r} has no callable {name!r}")
    return fn


def _row(prompts, answers, i: int) -> str:
    return f"row {i} (prompt {one_line(prompts[i], 80)!r}, answer {one_line(answers[i], 80)!r})"


def checked_scores(spec: str, fn, prompts: list[str], answers: list[str], metadata: list[dict]) -> np.ndarray:
    """fn's scores [B] as float64, or a RewardError naming `spec` and the offending row."""
    name = f"reward function {spec}"
    try:
        out = fn(prompts, answers, metadata)
    except Exception as error:  # noqa: BLE001 - whatever the user's function raises stops the run, with its row
        where, first = f"a batch of {len(answers)} rows", error
        for i in range(len(answers)):  # the first row that fails alone (the function is meant to be pure)
            try:
                fn(prompts[i : i + 1], answers[i : i + 1], metadata[i : i + 1])
            except Exception as row_error:  # noqa: BLE001
                where, first = _row(prompts, answers, i), row_error
                break
        raise RewardError(f"{name} raised {type(first).__name__} on {where}: {one_line(first)}") from first
    try:
        scores = np.asarray(out, np.float64)
    except (TypeError, ValueError) as e:
        raise RewardError(f"{name}: expected numbers, got {one_line(repr(out), 80)} ({one_line(e)})") from None
    if scores.shape != (len(answers),):
        raise RewardError(f"{name}: expected {len(answers)} scores (one per answer), got shape {scores.shape}")
    bad = np.flatnonzero(~np.isfinite(scores))
    if bad.size:
        raise RewardError(f"{name}: score {scores[bad[0]]} on {_row(prompts, answers, int(bad[0]))}")
    return scores


class HostRewards:
    """The configured functions' weighted sum, run on the host: `start(prompts, answers, metadata)` returns at once
    with a Future whose `result()` is the scores [B] float32 (or raises the RewardError)."""

    def __init__(self, cfg: RewardConfig):
        weights = cfg.weights or (1.0,) * len(cfg.functions)
        self.functions = [(spec, load_function(spec), w) for spec, w in zip(cfg.functions, weights)]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxrlhf-rewards")

    def __call__(self, prompts: list[str], answers: list[str], metadata: list[dict]) -> np.ndarray:
        total = np.zeros(len(answers))
        for spec, fn, w in self.functions:
            total += w * checked_scores(spec, fn, prompts, answers, metadata)
        return total.astype(np.float32)

    def start(self, prompts: list[str], answers: list[str], metadata: list[dict]) -> Future:
        return self._pool.submit(self, list(prompts), list(answers), list(metadata))


# ------------------------------------------------------------------------------------------ built-in functions


def synthetic(prompts, answers, metadata) -> list[float]:
    """The built-in sorting task's gold reward (jaxrlhf.data.synthetic.gold_reward)."""
    return [synthetic_task.gold_reward(p, a) for p, a in zip(prompts, answers)]


def stories(prompts, answers, metadata) -> list[float]:
    """The story task's rule: 1.0 if the answer uses the word its prompt asks for (jaxrlhf.data.stories)."""
    return [story_task.gold_reward(p, a) for p, a in zip(prompts, answers)]


_NUMBER = re.compile(r"-?\$?(?:\d[\d,]*\.?\d*|\.\d+)")


def parse_number(text: str, last: bool = True) -> float | None:
    """The last (or first) number in `text` ("$1,234.50" -> 1234.5), None if there is none."""
    found = _NUMBER.findall(text)
    return float(found[-1 if last else 0].replace(",", "").replace("$", "")) if found else None


def gsm8k(prompts, answers, metadata) -> list[float]:
    """GSM8K: 1.0 where the last number in the answer equals the number after "#### " in the row's reference
    (metadata["reference"], the dataset's answer field), else 0.0."""
    out = []
    for answer, meta in zip(answers, metadata):
        _, mark, tail = meta["reference"].rpartition("#### ")
        want = parse_number(tail, last=False) if mark else None
        if want is None:
            raise ValueError(f"the reference has no '#### <number>': {one_line(meta['reference'], 80)!r}")
        out.append(float(parse_number(answer) == want))
    return out
