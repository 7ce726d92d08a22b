"""The loop's lines and its progress bar share the terminal: a line logged while the bar is drawn starts a line of its
own (it was glued to the bar's: "train: 50%|█████     | 2/4 [00:00<00:00]eval @ 2: ...")."""

import io
import sys

import jax.numpy as jnp

from jaxrlhf import loop
from jaxrlhf.metrics import MetricsLog


class Source:  # a data source as fit sees it: its position rides along in each checkpoint
    epoch, position = 0, 0

    def state(self):
        return {"epoch": self.epoch, "position": self.position}


def test_an_evaluation_line_is_not_glued_to_the_progress_bar(tmp_path, monkeypatch):
    terminal = io.StringIO()  # the bar (stderr) and the lines (stdout) on one screen
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    cfg = loop.LoopConfig(output_dir=str(tmp_path), log_every=1, report_to=(), save_minutes=0)

    def step(state, i):
        return {"step": state["step"] + 1}, {"loss": 1.0 / i}, []

    _, records = loop.fit(
        cfg,
        {"step": jnp.int32(0)},
        step,
        lambda window: {"loss": float(sum(m["loss"] for m in window) / len(window))},
        Source(),
        total=4,
        manager=loop.checkpoint_manager(tmp_path / "state", 2),
        metrics_log=MetricsLog(tmp_path, ()),
        shardings=None,
        evaluate=lambda state: {"accuracy": float(state["step"]) / 4},
        eval_every=2,
    )
    screen = terminal.getvalue()
    lines = [line.split("\r")[-1] for line in screen.split("\n")]  # what a terminal shows on each line
    assert "eval @ 2: accuracy 0.5" in lines and "eval @ 4: accuracy 1" in lines, screen
    assert [r["accuracy"] for r in records if r["split"] == "eval"] == [0.5, 1.0]
