"""Metrics from process 0: JSON lines (metrics.jsonl) and TensorBoard events (tb/)."""

import json
from pathlib import Path

import jax


class MetricsLog:
    """Metrics as JSON lines (metrics.jsonl) and TensorBoard events (tb/), from process 0 only."""

    def __init__(self, out_dir: Path):
        self.file = None
        self.tb = None
        if jax.process_index() != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(out_dir / "metrics.jsonl", "a")
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tb"))
        except ImportError:  # the GPU image has no tensorboardX; JSON lines still work
            self.tb = None

    def write(self, step: int, split: str, metrics: dict):
        if self.file is None:
            return
        self.file.write(json.dumps({"step": step, "split": split, **metrics}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{split}/{k}", v, step)

    def close(self):
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
