"""Step 3's reward: the trained reward model's score, Python functions' scores, or a weighted sum of both.

    reward = model_weight * reward model's score + sum_i weights[i] * functions[i](prompts, answers, metadata)

A function is named `module:function` (importable by the user, like the built-ins below) and takes the batch's
prompts and decoded answers (str) and each prompt's metadata from the data (a dict: GSM8K's {"reference": ...}), and
returns one score per answer, or None for an answer to leave out of the loss. It may also declare the keyword
arguments `token_ids` (each answer's token ids, EOS included where it ended) and `truncated` (True where the answer
hit its length limit without EOS), or take **kwargs (TRL's style), and then gets them. The functions run on the host
in parallel (threads, or processes for CPU-bound checkers: `workers`) while the device scores the answers; one that
takes longer than `timeout` seconds on a batch leaves that batch's answers out of the loss (a warning counts them)
rather than stall or stop the run. A function that raises, returns the wrong number of scores or a non-finite score
stops the run with a RewardError that names it and the offending row.

The reward model's score alone is clipped (clip_score); the functions' scores are used as they are.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import logging
import multiprocessing
import re
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Literal, NamedTuple

import numpy as np

from jaxrlhf.config import ConfigError, InputError, check_fields, one_line
from jaxrlhf.data import arithmetic as arithmetic_task
from jaxrlhf.data import stories as story_task
from jaxrlhf.data import synthetic as synthetic_task

#: the keyword arguments a reward function may declare, beyond (prompts, answers, metadata)
EXTRAS = ("token_ids", "truncated")


class RewardError(InputError):
    """A reward function that failed on a batch: the message names the function and the offending row."""


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    #: reward functions `module:function`, each (prompts, answers, metadata[, token_ids=, truncated=]) -> one score
    #: (or None: left out of the loss) per answer, run on the host while the device scores; built in:
    #: jaxrlhf.rewards:math_verify, :boxed_format, :gsm8k, :synthetic, :stories
    functions: tuple[str, ...] = ()
    #: weight of each function's score (empty: 1 each)
    weights: tuple[float, ...] = ()
    #: weight of the reward model's score (null: 1 without functions, 0 with them; 0 loads no reward model)
    model_weight: float | None = None
    #: seconds each function may take on a batch; past it, that batch's answers are left out of the loss (warned)
    timeout: float = 60.0
    #: where the functions run: threads (I/O, sandboxes, numpy) or processes (pure-Python CPU-bound checkers)
    workers: Literal["threads", "processes"] = "threads"

    def __post_init__(self):
        check_fields(self, timeout="> 0")
        if self.weights and len(self.weights) != len(self.functions):
            raise ConfigError(
                f"weights: expected one weight per function ({len(self.functions)}), got {list(self.weights)}"
            )
        for spec in self.functions:
            load_function(spec)  # a bad name or a missing library stops the run here, before any model loads
        if self.model_scale == 0 and not self.functions:
            raise ConfigError("model_weight: 0 leaves no reward; set functions too, or a weight > 0")

    @property
    def model_scale(self) -> float:
        """The reward model's weight as used: 0 means no reward model is loaded or run."""
        return (0.0 if self.functions else 1.0) if self.model_weight is None else self.model_weight


def figure_names(functions) -> list[str]:
    """The metrics' name of each function's mean score: reward/NAME (the function's name; its whole spec where two
    share a name)."""
    short = [spec.partition(":")[2] for spec in functions]
    return [f"reward/{name if short.count(name) == 1 else spec}" for name, spec in zip(short, functions)]


def load_function(spec: str):
    """The callable named by `spec` ("module:function"); a ConfigError naming the setting (functions) otherwise,
    also where the function's `requires` ((module, pip requirement) pairs) names a library that is not installed."""
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
    for library, requirement in getattr(fn, "requires", ()):
        if importlib.util.find_spec(library) is None:
            raise ConfigError(f"functions: {spec} needs the {library!r} library: pip install {requirement!r}")
    return fn


def extras_of(fn) -> tuple[str, ...]:
    """The EXTRAS that `fn` takes: those it names as parameters, or all of them where it takes **kwargs."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return EXTRAS
    return tuple(p.name for p in params if p.name in EXTRAS)


def _quoted(text: str) -> str:
    """`text` quoted on one line for an error message; an empty or blank one shown as such (not as 'str')."""
    return repr(one_line(text, 80)) if str(text).split() else f"{text!r} (empty)"


def _row(prompts, answers, i: int) -> str:
    return f"row {i} (prompt {_quoted(prompts[i])}, answer {_quoted(answers[i])})"


def checked_scores(spec: str, fn, prompts, answers, metadata, extras: dict | None = None) -> np.ndarray:
    """fn's scores [B] as float64, NaN where it returned None (left out of the loss), or a RewardError naming `spec`
    and the offending row. `extras` holds the EXTRAS fn takes, one entry per answer each."""
    name, extras = f"reward function {spec}", extras or {}
    try:
        out = fn(prompts, answers, metadata, **extras)
    except Exception as error:  # noqa: BLE001 - whatever the user's function raises stops the run, with its row
        where, first = f"a batch of {len(answers)} rows", error
        for i in range(len(answers)):  # the first row that fails alone (the function is meant to be pure)
            try:
                one = slice(i, i + 1)
                fn(prompts[one], answers[one], metadata[one], **{k: v[one] for k, v in extras.items()})
            except Exception as row_error:  # noqa: BLE001
                where, first = _row(prompts, answers, i), row_error
                break
        raise RewardError(f"{name} raised {type(first).__name__} on {where}: {one_line(first)}") from first
    try:
        out = list(out)
        scores = np.asarray([np.nan if v is None else v for v in out], np.float64)
    except (TypeError, ValueError) as e:
        raise RewardError(f"{name}: expected numbers, got {one_line(repr(out), 80)} ({one_line(e)})") from None
    if scores.shape != (len(answers),):
        raise RewardError(f"{name}: expected {len(answers)} scores (one per answer), got shape {scores.shape}")
    bad = np.flatnonzero(~np.isfinite(scores) & np.array([v is not None for v in out]))
    if bad.size:
        raise RewardError(f"{name}: score {scores[bad[0]]} on {_row(prompts, answers, int(bad[0]))}")
    return scores


class HostScores(NamedTuple):
    """The functions' reward of a batch: their weighted sum [B] float32 (0 where left out), scored [B] float32: 1,
    or 0 where a function returned None or timed out (the answer is left out of the loss), and parts [B, F] float32:
    each function's own score, unweighted (NaN where it gave none): what the metrics show per function."""

    scores: np.ndarray
    scored: np.ndarray
    parts: np.ndarray


class HostRewards:
    """The configured functions, run on the host in parallel: `start(prompts, answers, metadata, token_ids=,
    truncated=)` returns at once with a Future whose `result()` is the batch's HostScores (or raises the
    RewardError). A function past `timeout` leaves the batch's answers out and `log`s a warning; its call goes on
    in the background (a thread cannot be stopped) and its late result is dropped."""

    def __init__(self, cfg: RewardConfig, log=print):
        weights = cfg.weights or (1.0,) * len(cfg.functions)
        self.functions = [(spec, load_function(spec), w) for spec, w in zip(cfg.functions, weights)]
        self.timeout, self.log = cfg.timeout, log
        n = max(1, len(self.functions))
        if cfg.workers == "processes":  # spawned, not forked: the parent runs JAX's threads
            self._pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))
        else:  # room for a second batch beside a call that outlived its timeout
            self._pool = ThreadPoolExecutor(2 * n, thread_name_prefix="jaxrlhf-rewards")
        self._collect = ThreadPoolExecutor(1, thread_name_prefix="jaxrlhf-rewards-sum")

    def __call__(self, prompts, answers, metadata, token_ids=None, truncated=None) -> HostScores:
        """The batch scored now, in this thread (the same waits and checks as `start`)."""
        return self._gather(self._submit(prompts, answers, metadata, token_ids, truncated), len(answers))

    def start(self, prompts, answers, metadata, token_ids=None, truncated=None) -> Future:
        calls = self._submit(list(prompts), list(answers), list(metadata), token_ids, truncated)
        return self._collect.submit(self._gather, calls, len(answers))

    def _submit(self, prompts, answers, metadata, token_ids, truncated) -> list:
        given = {"token_ids": token_ids, "truncated": truncated}
        calls = []
        for spec, fn, w in self.functions:
            extras = {k: given[k] for k in extras_of(fn)}
            missing = [k for k, v in extras.items() if v is None]
            if missing:
                raise RewardError(f"reward function {spec} takes {missing} but this caller does not give them")
            future = self._pool.submit(checked_scores, spec, fn, prompts, answers, metadata, extras)
            calls.append((spec, w, future))
        return calls

    def _gather(self, calls: list, B: int) -> HostScores:
        total, scored, parts = np.zeros(B), np.ones(B, bool), np.full((B, len(calls)), np.nan, np.float32)
        deadline = time.monotonic() + self.timeout
        for i, (spec, w, future) in enumerate(calls):
            try:
                scores = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                future.cancel()
                self.log(
                    f"warning: reward function {spec} took over {self.timeout:g} s (reward.timeout) on a batch: "
                    f"its {B} answers are left out of the loss"
                )
                scores = np.full(B, np.nan)
            scored &= ~np.isnan(scores)
            total += w * np.nan_to_num(scores)
            parts[:, i] = scores
        return HostScores(np.where(scored, total, 0.0).astype(np.float32), scored.astype(np.float32), parts)


# ------------------------------------------------------------------------------------------ built-in functions


def synthetic(prompts, answers, metadata) -> list[float]:
    """The built-in sorting task's gold reward (jaxrlhf.data.synthetic.gold_reward)."""
    return [synthetic_task.gold_reward(p, a) for p, a in zip(prompts, answers)]


def stories(prompts, answers, metadata) -> list[float]:
    """The story task's rule: 1.0 if the answer uses the word its prompt asks for (jaxrlhf.data.stories)."""
    return [story_task.gold_reward(p, a) for p, a in zip(prompts, answers)]


# A number is a whole token: not preceded by a digit, "." or "d," and not followed by a digit, ".d" or ",d", so
# "1.2.3" and "v1.2.3" hold no number (not 0.3), and an exponent belongs to its number ("1e3" is 1000.0).
_NUMBER = re.compile(
    r"(?<![\d.])(?<!\d,)(-?)\$?((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+)(?![\d]|[.,]\d)"
)


def parse_number(text: str, last: bool = True) -> float | None:
    """The last (or first) number in `text` ("$1,234.50" -> 1234.5, "1e3" -> 1000.0), None if there is none."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    sign, digits = found[-1 if last else 0]
    return float(sign + digits.replace(",", ""))


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


# ------------------------------------------------------------------------------------------- math verifier

_BOXED = re.compile(r"\\boxed\s*\{")
# math-verify's note that its own (SIGALRM) timeouts are off: reward.timeout bounds the functions instead
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(lambda record: not record.getMessage().startswith("Timeout is disabled"))
MATH_EXTRA = (("math_verify", "jaxrlhf[math]"),)  # load_function's check: the library, and how to install it


def _boxed(text: str) -> list[str]:
    """The contents of every \\boxed{...} in `text`, braces matched (an unclosed one runs to the end)."""
    out = []
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out.append(text[m.end() : i - 1 if depth == 0 else i])
    return out


def final_answer(text: str) -> str | None:
    """The answer a solution marks as final: its last \\boxed{...}, else what follows its last "####" (GSM8K);
    None where it marks none."""
    boxed = _boxed(text)
    if boxed:
        return boxed[-1]
    _, mark, tail = text.rpartition("####")
    return tail.strip() if mark else None


def _parsed(text: str, whole: bool):
    """math-verify's reading of a solution: its marked final answer, else the whole text as one answer (`whole`: a
    reference) or the text's last expression (a model's answer)."""
    from math_verify import parse  # the optional extra: load_function checked it is installed

    final = final_answer(text)
    final = text.strip() if final is None and whole else final
    # math-verify's own timeouts use SIGALRM, which only the main thread may set: reward.timeout bounds the call
    return parse(text if final is None else f"\\boxed{{{final}}}", parsing_timeout=None)


def equivalent(answer: str, reference: str) -> bool:
    """Whether a solution's final answer equals the reference's (its final answer too), by math-verify: numbers
    (1,234 = 1234 = 1234.0), fractions (\\frac{1}{2} = 1/2 = 0.5), LaTeX and symbolic expressions."""
    from math_verify import verify

    gold, got = _parsed(reference, whole=True), _parsed(answer, whole=False)
    return bool(gold and got and verify(gold, got, timeout_seconds=None))


def math_verify(prompts, answers, metadata) -> list[float]:
    """1.0 where the answer's final answer (its last \\boxed{}, else after "####", else its last expression) is
    equivalent to the row's reference (metadata["reference"]: a number, an expression, or a solution ending in
    one), else 0.0.
    Needs the math-verify library: pip install 'jaxrlhf[math]'."""
    for i, meta in enumerate(metadata):
        if not isinstance(meta.get("reference"), str) or not meta["reference"].strip():
            raise ValueError(f'row {i}: expected metadata {{"reference": "<the answer>"}}, got {one_line(meta, 80)}')
    return [float(equivalent(a, m["reference"])) for a, m in zip(answers, metadata)]


def boxed_format(prompts, answers, metadata) -> list[float]:
    """The format reward: 1.0 where the answer gives exactly one final answer, one non-empty \\boxed{...} or one
    "#### <answer>" (not both), else 0.0."""
    out = []
    for a in answers:
        marks = _boxed(a) + [a.rpartition("####")[2]] * a.count("####")
        out.append(float(len(marks) == 1 and bool(marks[0].strip())))
    return out


def arithmetic_gold(prompt: str, answer: str) -> float:
    """The arithmetic task's gold reward (jaxrlhf.data.arithmetic): the math verifier against the value its question
    asks for, which is also the rows' metadata {"reference": ...}."""
    return float(equivalent(answer, str(arithmetic_task.gold_answer(prompt))))


math_verify.requires = arithmetic_gold.requires = MATH_EXTRA
