"""The one training loop of every step: iterations, logging, metrics, checkpoints, resume, progress bar, evaluation.

An algorithm plugs in as a step function and a few hooks (Steps 1 and 2: trainer.train; Step 3: ppo.run):

    step(state, i) -> (state, metrics, skips)    iteration i (1-based): reads its own batches from the sources;
                                                 `skips` lists (model, skipped flag, where) of the non-finite guard
    summarise(window) -> figures                 the metrics of the iterations since the last log -> the floats
                                                 written (the one host sync of a log step)
    evaluate(state) -> figures | None            optional, every eval_every iterations and at the end

`fit` resumes from the newest Orbax state in output_dir/state (with the data positions of every source; the metrics
logged past it are dropped, so each iteration is logged once), raises where the saved run is past this one's end, logs
every cfg.log_every iterations (metrics.jsonl, trackers, the bar), stops after cfg.max_skipped_steps skipped steps of
one model in a row (NonFiniteError), saves every cfg.save_every iterations, every cfg.save_minutes minutes and at the
end. SIGINT (Ctrl-C) or SIGTERM: the iteration under way finishes, its state is saved, one line says where and how to
resume, and `Interrupted` (exit status 130 or 143 from the entry points) ends the run; a second signal ends the
process at once. The state's own counter `counter` = (key, per iteration) keys the
checkpoints: Steps 1 and 2 count optimizer steps ("step", 1), Step 3 generation batches ("iteration", batches).
Before anything is loaded, `start_run` checks the run folder: a finished run is skipped, a changed one refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from jaxrlhf.checkpoint import check_replaceable, export_manifest
from jaxrlhf.config import ConfigError, check_fields
from jaxrlhf.metrics import check_trackers


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The run-level settings of every step, declared once: Steps 1 and 2's RunConfig and Step 3's PPOConfig inherit
    them (top-level keys in YAML and on the command line); fit, start_run and the run's folder read them. A "step" is
    an optimizer step in Steps 1 and 2 and an iteration (generation batches and their PPO epochs) in Step 3."""

    #: tokenizer folder (default: the model's folder; Step 3: the actor's)
    tokenizer: str | None = None
    #: where the HF models, Orbax state (state/), metrics.jsonl and TensorBoard events (tb/) go
    output_dir: str = "runs/step"
    #: passes over the training set (Step 3: over the prompts)
    epochs: int = 1
    #: stop after this many steps (0: run the epochs)
    max_steps: int = 0
    #: print and write metrics every this many steps
    log_every: int = 10
    #: where metrics go besides metrics.jsonl: tensorboard, wandb, mlflow (see jaxrlhf/metrics.py)
    report_to: tuple[str, ...] = ("tensorboard",)
    #: save the training state every this many steps (0: only at the end)
    save_every: int = 0
    #: also save it when this many minutes have passed since the last save (0: never by the clock); SIGINT/SIGTERM
    #: save it too, after the step under way
    save_minutes: float = 30.0
    #: training states kept on disk (the newest)
    keep_checkpoints: int = 2
    #: continue the run saved in output_dir (its newest state), or skip it if it is finished; false: start from
    #: scratch, refused where output_dir already holds a run
    resume: bool = True
    #: stop the run after this many steps in a row of one model skipped for a non-finite loss or gradient norm
    max_skipped_steps: int = 10

    def __post_init__(self):
        check_fields(
            self,
            **dict.fromkeys(("epochs", "log_every", "keep_checkpoints", "max_skipped_steps"), ">= 1"),
            **dict.fromkeys(("max_steps", "save_every", "save_minutes"), ">= 0"),
        )
        check_trackers(self.report_to)


def checkpoint_manager(out_dir: Path, keep: int):
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager((out_dir / "state").absolute(), options=options)


def save_state(manager, state, meta: dict, step: int):
    """Save `state` as step `step`, unless that step is saved already: a finished run started again (nothing trained
    since its restore) must not fail on Orbax's "already exists"."""
    if step not in manager.all_steps():
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        manager.save(step, args=args, force=True)


# --------------------------------------------------------------------------------------------- run folders

RUN_SETTINGS = "run_config.json"
# Settings that may differ between the starts of one run: they steer logging, saving and evaluation, not the weights.
BOOKKEEPING = (
    "resume",
    "output_dir",
    "log_every",
    "save_every",
    "save_minutes",
    "keep_checkpoints",
    "max_skipped_steps",
    "eval_every",
    "eval_batches",
    "sample_prompts",
    "sample_tokens",
    "score_file",
    "print_answers",
    "alarms",
    "device_memory_gib",
    "data.cache_dir",
    "report_to",
)
# The run's length may change too: the saved state then continues to the new end (a finished run is extended).
LENGTH = ("max_steps", "epochs")


def settings(cfg, inputs: tuple[str, ...] = ("model",)) -> dict:
    """A run's config as flat dotted keys with JSON values: what run_config.json and its exports' manifests hold.

    `inputs` name the fields that hold model folders; the id in each one's export manifest is a setting too
    ("input_id.<field>"), so a run is not taken as finished after the model it started from was trained again."""

    def flat(tree, prefix=""):
        out = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    out = flat(json.loads(json.dumps(dataclasses.asdict(cfg))))
    return {**out, **{f"input_id.{k}": (export_manifest(out[k]) or {}).get("id") for k in inputs if out[k]}}


def changed(old: dict, new: dict, ignore=()) -> list[str]:
    """The dotted keys whose values differ between two `settings`, except those under `ignore`."""
    ignored = lambda k: any(k == i or k.startswith(i + ".") for i in ignore)
    return [k for k in sorted(old.keys() | new.keys()) if not ignored(k) and old.get(k) != new.get(k)]


def start_run(
    cfg: LoopConfig, exports: list[Path], saved_step: int | None, inputs: tuple[str, ...] = ("model",), log=print
) -> bool:
    """Check cfg.output_dir against `cfg` before anything is loaded; True when the run there is finished (skip it).

    Finished: every folder in `exports` was written by jaxrlhf (checkpoint.save_hf's manifest) with these settings.
    Refused: an export folder that is not ours (never replaced), a setting that differs from the run saved here
    (output_dir/run_config.json), and resume=false over a saved run. Otherwise the settings are written down for
    the next start to compare, and the caller trains (from `saved_step`, the newest Orbax state, if any).
    """
    out, now = Path(cfg.output_dir), settings(cfg, inputs)
    for path in exports:
        check_replaceable(path)
    manifests = [export_manifest(path) for path in exports]
    saved = saved_step is not None or any(m is not None for m in manifests)
    if saved and not cfg.resume:
        raise ConfigError(
            f"{out}: holds a run already (resume=false starts from scratch); choose another output_dir "
            "or delete this one, or leave resume=true to continue that run"
        )
    if saved and (out / RUN_SETTINGS).is_file():
        try:
            before = json.loads((out / RUN_SETTINGS).read_text())
        except ValueError:
            before = None
        if not isinstance(before, dict):
            raise ConfigError(
                f"{out / RUN_SETTINGS}: not the settings jaxrlhf wrote (a JSON object); delete that file "
                "to continue the run saved here with the settings given now"
            )
        if diff := changed(before, now, BOOKKEEPING + LENGTH):
            what = "; ".join(f"'{k}' was {json.dumps(before.get(k))}, now {json.dumps(now.get(k))}" for k in diff)
            raise ChangedRunError(out, what)
    if saved and all(m is not None and not changed(m.get("settings", {}), now, BOOKKEEPING) for m in manifests):
        log(
            f"{out}: finished already with these settings ({', '.join(p.name for p in exports)} complete); "
            f"skipping it (delete {out} to train it again)"
        )
        return True
    if jax.process_index() == 0:  # written aside and renamed, so a reader never sees half of it
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{RUN_SETTINGS}.tmp"
        tmp.write_text(json.dumps(now, indent=1) + "\n")
        os.replace(tmp, out / RUN_SETTINGS)
    return False


class ChangedRunError(ConfigError):
    """output_dir holds a run saved with other settings (`what`: which, before and now); never continued."""

    def __init__(self, out: Path, what: str, elsewhere: str = ""):
        self.out, self.what = out, what
        elsewhere = elsewhere or f"choose another output_dir (or delete {out}) to start over"
        super().__init__(
            f"{out / RUN_SETTINGS}: the run saved here has other settings ({what}); set them back to continue it, "
            f"or {elsewhere}"
        )


class NonFiniteError(ConfigError):
    """Too many training steps in a row had a non-finite loss or gradient norm: the run stops, nothing exported."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM ended the run after the iteration under way, whose state was saved. The entry points exit
    with `code`, 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a process that the
    signal ended."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.code = 128 + signum


class Signals:
    """A context in which the first SIGINT or SIGTERM is only noted (`received`, its number) for the loop to stop
    after the iteration under way; both signals then get their default action back, so a second one ends the process
    at once, even inside a long computation. A signal the process ignores (SIGINT in a background job) stays ignored;
    off the main thread, where Python handles no signal, nothing changes."""

    def __enter__(self):
        self.received, self.before = 0, {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self.before[s] = signal.signal(s, self.note)
        return self

    def note(self, signum, frame):
        self.received = self.received or signum
        for s in self.before:
            signal.signal(s, signal.SIG_DFL)

    def __exit__(self, *exc):
        for s, handler in self.before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: a handler set outside Python


def agreed(*flags: int) -> tuple[int, ...]:
    """Each flag's largest value over all processes (one all-gather; one process: the flags as they are). Saving is
    collective: the processes stop or save at the same iteration, whichever of them the signal or the clock reached."""
    if jax.process_count() == 1:
        return flags
    from jax.experimental import multihost_utils

    gathered = np.asarray(multihost_utils.process_allgather(np.asarray(flags, np.int32)))
    return tuple(int(x) for x in gathered.reshape(-1, len(flags)).max(axis=0))


def restore(cfg: LoopConfig, manager, state, shardings, named: dict, counter: tuple[str, int], total: int, log):
    """(state, its iteration): with cfg.resume, the newest saved state, restored straight into `shardings`, and every
    source's data position set back; a ConfigError where the saved run is past `total`."""
    key, per = counter
    unit = "step" if key == "step" else "iteration"
    if cfg.resume and manager.latest_step() is not None:
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        restored = manager.restore(manager.latest_step(), args=args)
        state = restored["state"]
        for name, batches in named.items():
            saved = restored["meta"][name] if name else restored["meta"]
            batches.epoch, batches.position = saved["epoch"], saved["position"]
        where = "; ".join(f"{n + ': ' if n else ''}epoch {b.epoch}, batch {b.position}" for n, b in named.items())
        log(f"resumed from {unit} {int(state[key]) // per} ({where})")
    start = int(state[key]) // per
    if start > total:
        raise ConfigError(
            f"{Path(cfg.output_dir) / 'state'}: the saved run is at {unit} {start}, past this run's "
            f"{total} {unit}s (max_steps, epochs); give at least as many, or another output_dir"
        )
    return state, start


def guard(skipped: list, in_a_row: dict, limit: int, log):
    """The non-finite guard at a log step: each skipped step of `skipped` ((model, skipped flag, where) per step) is
    logged; `limit` skipped steps in a row of one model (counted in `in_a_row` across logs) stop the run."""
    for model, flag, where in skipped:
        in_a_row[model] = in_a_row.get(model, 0) + 1 if float(flag) else 0
        if in_a_row[model]:
            log(f"{where}: step skipped, its loss or gradient norm is not finite (weights and optimizer unchanged)")
        if in_a_row[model] >= limit:
            raise NonFiniteError(
                f"{where}: {in_a_row[model]} steps in a row had a non-finite loss or gradient norm, so the run stops "
                "and exports nothing; lower the learning rate (optim.learning_rate), check the data, or raise "
                "max_skipped_steps"
            )


def interrupted(signum: int, output_dir: str, unit: str, i: int, total: int) -> Interrupted:
    """The one line of a run stopped by a signal after its iteration `i`: where its state is, how to go on."""
    then = f"continues it from {unit} {i + 1}" if i < total else "finishes it"
    return Interrupted(
        f"{signal.Signals(signum).name}: stopped after {unit} {i} of {total}, its state saved in "
        f"{Path(output_dir) / 'state'}; the same command {then}: {shlex.join(sys.orig_argv)}",
        signum,
    )


def fit(
    cfg: LoopConfig,
    state,
    step,
    summarise,
    sources,
    *,
    total: int,
    manager,
    metrics_log,
    shardings,
    evaluate=None,
    eval_every: int = 0,
    counter: tuple[str, int] = ("step", 1),
    shown: tuple[str, ...] = (),
    desc: str = "train",
    log=print,
):
    """Run iterations up to `total` (see the module docstring) -> (the final state, the logged records). `evaluate`
    runs every `eval_every` iterations (0: never) and at the end; `sources`: a data.Batches or a dict of them by name
    (their positions ride along in each checkpoint); `shown`: the bar's figures; `metrics_log` is closed at the end."""
    key, unit = counter[0], "step" if counter[0] == "step" else "iteration"
    named = sources if isinstance(sources, dict) else {"": sources}
    try:
        state, start = restore(cfg, manager, state, shardings, named, counter, total, log)
    except ConfigError:
        metrics_log.close()
        raise
    metrics_log.resume(start)  # what was logged past the saved state goes: those iterations run again
    saved_at = time.monotonic()

    def save():
        nonlocal saved_at
        meta = {name: b.state() for name, b in named.items()} if isinstance(sources, dict) else sources.state()
        save_state(manager, state, meta, int(state[key]))
        saved_at = time.monotonic()

    bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True, disable=jax.process_index() != 0)
    logs = _Logs(metrics_log, summarise, bar, shown, cfg.max_skipped_steps, partial(beside_bar, log))

    def stop_or_save(i, logged: bool, signum: int):  # after iteration i < total
        due = bool(cfg.save_minutes) and time.monotonic() - saved_at >= 60 * cfg.save_minutes
        if jax.process_count() > 1:  # decided together where the processes meet anyway: at the log steps
            signum, due = agreed(signum, due) if logged else (0, False)
        if signum and logs.window:  # the figures of the iterations since the last log are kept too
            logs.log_window(i)
        if signum or due or (cfg.save_every and i % cfg.save_every == 0):
            save()
        if signum:
            raise interrupted(signum, cfg.output_dir, unit, i, total)

    try:  # a crash or a second signal still finishes the checkpoint being written
        with Signals() as signals:
            for i in range(start + 1, total + 1):
                state, metrics, skips = step(state, i)
                logs.window.append(metrics)
                logs.skipped.extend(skips)
                if logged := i % cfg.log_every == 0 or i == total:
                    logs.log_window(i)
                bar.update(1)
                if eval_every and i % eval_every == 0 and i != total:
                    logs.evaluate(i, evaluate, state)
                if i != total:
                    stop_or_save(i, logged, signals.received)
            if start < total:  # else a finished run started again: evaluated and saved already
                logs.evaluate(total, evaluate, state)
            save()
            if (signum := agreed(signals.received)[0]) and start < total:
                raise interrupted(signum, cfg.output_dir, unit, total, total)
    except Interrupted as e:  # said once the bar has ended its line and the state is on disk
        bar.close()
        manager.wait_until_finished()
        log(e.args[0])
        raise
    finally:  # the bar ends its line first, so an error message starts on its own
        bar.close()
        manager.wait_until_finished()
        metrics_log.close()
    return state, logs.records


def beside_bar(log, message: str):
    """`log(message)` on a line of its own while a progress bar is drawn: the bar is cleared first and drawn again
    after (else the message is glued to the bar's line)."""
    with tqdm.external_write_mode():
        log(message)


class _Logs:
    """fit's figures: the metrics of the iterations since the last log (`window`) and their non-finite guard flags
    (`skipped`), written with the evaluations to `metrics_log` and kept as `records`; the bar shows `shown`."""

    def __init__(self, metrics_log, summarise, bar, shown: tuple[str, ...], max_skipped: int, log):
        self.metrics_log, self.summarise, self.bar, self.shown, self.max_skipped, self.log = (
            metrics_log, summarise, bar, shown, max_skipped, log
        )  # fmt: skip
        self.records, self.window, self.skipped, self.in_a_row = [], [], [], {}  # in_a_row: per model, skips in a row

    def write(self, i: int, split: str, figures: dict):
        self.metrics_log.write(i, split, figures)
        self.records.append({"step": i, "split": split, **figures})

    def log_window(self, i: int):
        """The figures of the iterations since the last log; the non-finite guard after the write (a stopped run's
        log shows its skips)."""
        figures = self.summarise(self.window)
        self.write(i, "train", figures)
        postfix = {k: f"{figures[k]:.4g}" for k in self.shown if k in figures}
        self.bar.set_postfix(postfix | ({"ALARM": figures["alarms"]} if "alarms" in figures else {}))
        guard(self.skipped, self.in_a_row, self.max_skipped, self.log)
        self.window.clear()
        self.skipped.clear()

    def evaluate(self, i: int, evaluate, state):
        if evaluate is not None and (figures := evaluate(state)) is not None:
            self.write(i, "eval", figures)
            shown = (f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
            self.log(f"eval @ {i}: " + ", ".join(shown))
