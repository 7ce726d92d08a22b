"""The one training loop of every step: iterations, logging, metrics, checkpoints, resume, progress bar, evaluation.

An algorithm plugs in as a step function and a few hooks (Steps 1 and 2: trainer.train; Step 3: ppo.run):

    step(state, i) -> (state, metrics, skips)    iteration i (1-based): reads its own batches from the sources;
                                                 `skips` lists (model, skipped flag, where) of the non-finite guard
    summarise(window) -> figures                 the metrics of the iterations since the last log -> the floats
                                                 written (the one host sync of a log step)
    evaluate(state) -> figures | None            optional, every eval_every iterations and at the end

`fit` resumes from the newest Orbax state in output_dir/state (with the data positions of every source), raises
where the saved run is past this one's end, logs every cfg.log_every iterations (metrics.jsonl, trackers, the bar),
stops after cfg.max_skipped_steps skipped steps of one model in a row (NonFiniteError), saves every
cfg.save_every iterations and at the end. The state's own counter `counter` = (key, per iteration) keys the
checkpoints: Steps 1 and 2 count optimizer steps ("step", 1), Step 3 generation batches ("iteration", batches).
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from tqdm import tqdm

from jaxrlhf.config import ConfigError


def checkpoint_manager(out_dir: Path, keep: int):
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager((out_dir / "state").absolute(), options=options)


def save_state(manager, state, meta: dict, step: int | None = None):
    """Save `state` as step `step` (default: its own "step"), unless that step is saved already: a finished run
    started again (nothing trained since its restore) must not fail on Orbax's "already exists"."""
    step = int(state["step"]) if step is None else step
    if step in manager.all_steps():
        return
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)


def restore_state(manager, like_state, shardings):
    """The newest saved state, restored straight into `shardings` (any mesh), and its metadata."""
    step = manager.latest_step()
    if step is None:
        return None, None
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like_state, shardings)
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return restored["state"], restored["meta"]


class NonFiniteError(ConfigError):
    """Too many training steps in a row had a non-finite loss or gradient norm: the run stops, nothing exported."""


class SkipCounter:
    """Counts one model's steps skipped in a row by the non-finite guard (trainer.apply_gradients' "skipped"), logs
    each with where it happened, and stops the run at `limit` in a row."""

    def __init__(self, limit: int, log=print):
        self.limit, self.log, self.in_a_row = limit, log, 0

    def update(self, skipped: float, where: str):
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.log(f"{where}: step skipped, its loss or gradient norm is not finite (weights and optimizer unchanged)")
        if self.in_a_row >= self.limit:
            raise NonFiniteError(f"{where}: {self.in_a_row} steps in a row had a non-finite loss or gradient norm, so "
                                 "the run stops and exports nothing; lower the learning rate (optim.learning_rate), "
                                 "check the data, or raise max_skipped_steps")


def fit(cfg, state, step, summarise, sources, *, total: int, manager, metrics_log, shardings, evaluate=None,
        counter: tuple[str, int] = ("step", 1), shown: tuple[str, ...] = (), desc: str = "train", log=print):
    """Run iterations up to `total` (see the module docstring); returns the final state and the logged records.

    `cfg` holds resume, log_every, save_every, max_skipped_steps and optionally eval_every; `sources` is a
    jaxrlhf.data.Batches or a dict of them by name (their positions ride along in each checkpoint); `shown`: the
    figures on the progress bar. `metrics_log` (jaxrlhf.metrics.MetricsLog) is closed at the end.
    """
    key, per = counter
    named = sources if isinstance(sources, dict) else {"": sources}
    unit = "step" if per == 1 else "iteration"
    if cfg.resume:
        restored, meta = restore_state(manager, state, shardings)
        if restored is not None:
            state = restored
            for name, batches in named.items():
                batches.epoch, batches.position = (meta[name] if name else meta)["epoch"], (meta[name] if name else meta)["position"]
            where = "; ".join(f"{name + ': ' if name else ''}epoch {b.epoch}, batch {b.position}" for name, b in named.items())
            log(f"resumed from {unit} {int(state[key]) // per} ({where})")
    start = int(state[key]) // per
    if start > total:
        raise ConfigError(f"{Path(cfg.output_dir) / 'state'}: the saved run is at {unit} {start}, past this run's {total} "
                          f"{unit}s (max_steps, epochs); give at least as many, or another output_dir")

    def save():
        meta = {name: b.state() for name, b in named.items()} if isinstance(sources, dict) else sources.state()
        save_state(manager, state, meta, step=int(state[key]))

    records, window, skipped = [], [], []
    counters: dict[str, SkipCounter] = {}

    def write(i, split, figures):
        metrics_log.write(i, split, figures)
        records.append({"step": i, "split": split, **figures})

    def run_eval(i):
        if evaluate is not None and (figures := evaluate(state)) is not None:
            write(i, "eval", figures)
            log(f"eval @ {i}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()))

    eval_every = getattr(cfg, "eval_every", 0)
    bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True, disable=jax.process_index() != 0)
    try:  # a crash or Ctrl-C still finishes the checkpoint being written
        for i in range(start + 1, total + 1):
            state, metrics, skips = step(state, i)
            window.append(metrics)
            skipped.extend(skips)
            if i % cfg.log_every == 0 or i == total:
                figures = summarise(window)
                write(i, "train", figures)
                bar.set_postfix({**{k: f"{figures[k]:.4g}" for k in shown if k in figures},
                                 **({"ALARM": figures["alarms"]} if "alarms" in figures else {})})
                for model, flag, where in skipped:  # after the write: a stopped run's log shows its skips
                    counters.setdefault(model, SkipCounter(cfg.max_skipped_steps, log)).update(float(flag), where)
                window, skipped = [], []
            bar.update(1)
            if eval_every and i % eval_every == 0 and i != total:
                run_eval(i)
            if cfg.save_every and i % cfg.save_every == 0 and i != total:
                save()
        if start < total:  # else a finished run started again: evaluated and saved already
            run_eval(total)
        save()
    finally:  # the bar ends its line first, so an error message starts on its own
        bar.close()
        manager.wait_until_finished()
        metrics_log.close()
    return state, records
