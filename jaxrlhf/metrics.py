"""Metrics from process 0: JSON lines (metrics.jsonl, always) and the trackers named in `report_to`:

- `tensorboard`: TensorBoard events under tb/ (tensorboardX);
- `wandb`: Weights & Biases (`pip install 'jaxrlhf[wandb]'`; its own settings from WANDB_PROJECT, WANDB_MODE=offline,
  WANDB_DIR ..., the run files beside metrics.jsonl unless WANDB_DIR says otherwise); the run's id is kept in
  wandb_run_id beside metrics.jsonl, so a resumed run continues the same W&B run (resume="allow");
- `mlflow`: MLflow (`pip install 'jaxrlhf[mlflow]'`; the server from MLFLOW_TRACKING_URI, e.g. file:/tmp/mlruns).
"""

import importlib.util
import json
import os
import sys
import uuid
from pathlib import Path

import jax

from jaxrlhf.config import ConfigError

TRACKERS = ("tensorboard", "wandb", "mlflow")
WANDB_ID_FILE = "wandb_run_id"  # beside metrics.jsonl: the W&B run a resumed run continues


def check_trackers(report_to: tuple[str, ...]):
    """At start-up, before any model loads: a ConfigError for a tracker that is unknown or not installed."""
    for name in report_to:
        if name not in TRACKERS:
            raise ConfigError(f"report_to: unknown tracker {name!r}; expected some of {list(TRACKERS)}")
        if name != "tensorboard" and sys.modules.get(name) is None and importlib.util.find_spec(name) is None:
            raise ConfigError(f"report_to: {name} is not installed; pip install 'jaxrlhf[{name}]' (or leave it out)")


def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; infinite for a line a crash cut short (it goes with those past a state)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def wandb_run_id(out_dir: Path) -> str:
    """The W&B run id of the run in `out_dir`: the one stored in out_dir/wandb_run_id, else a new one, stored there
    (written aside and renamed), so that starting the run again (resume) logs into the same W&B run."""
    path = out_dir / WANDB_ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    (out_dir / f".{WANDB_ID_FILE}.tmp").write_text(run_id + "\n")
    os.replace(out_dir / f".{WANDB_ID_FILE}.tmp", path)
    return run_id


class MetricsLog:
    """Writes each step's scalar metrics to metrics.jsonl and to the trackers in `report_to`; `config` (the run's
    settings, flat) goes to the trackers as the run's parameters."""

    def __init__(self, out_dir: Path, report_to: tuple[str, ...] = ("tensorboard",), config: dict | None = None):
        self.file, self.tb, self.wandb, self.mlflow = None, None, None, None
        # TensorBoard's writer starts at the first write, once `resume` has said where the run continues
        self.tb_dir, self.purge_step = None, None
        if jax.process_index() != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(out_dir / "metrics.jsonl", "a")  # noqa: SIM115 (open for the whole run: close() closes it)
        if "tensorboard" in report_to:
            self.tb_dir = out_dir / "tb"
        if "wandb" in report_to:
            import wandb

            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "jaxrlhf"),
                name=out_dir.name,
                dir=os.environ.get("WANDB_DIR", str(out_dir)),
                config=config,
                id=wandb_run_id(out_dir),  # a resumed run continues the same W&B run
                resume="allow",
            )
        if "mlflow" in report_to:
            import mlflow

            self.mlflow = mlflow
            mlflow.start_run(run_name=out_dir.name)
            if config:
                mlflow.log_params(config)

    def resume(self, step: int):
        """The run continues from its state at `step`: the lines metrics.jsonl holds past it go (a crash after the
        last save logged them; those iterations run again and are logged once), and TensorBoard drops its events
        past it (the writer's purge_step: TensorBoard reads the new event file as the same run going on)."""
        if self.file is None:
            return
        path = Path(self.file.name)
        lines = path.read_text().splitlines()
        kept = [line for line in lines if _logged_step(line) <= step]
        if kept != lines:  # written aside and renamed: a crash now loses nothing
            self.file.close()
            (path.parent / ".metrics.jsonl.tmp").write_text("".join(line + "\n" for line in kept))
            os.replace(path.parent / ".metrics.jsonl.tmp", path)
            self.file = open(path, "a")  # noqa: SIM115
        if self.tb_dir is not None and any(self.tb_dir.glob("events.out.tfevents.*")):
            self.purge_step = step + 1

    def _tensorboard(self):
        if self.tb is None and self.tb_dir is not None:
            try:
                from tensorboardX import SummaryWriter

                # tensorboardX names a file by the second it starts: a resume within that second would overwrite the
                # earlier file; the number of files before it keeps the names apart and in order
                n = len(list(self.tb_dir.glob("events.out.tfevents.*")))
                self.tb = SummaryWriter(str(self.tb_dir), purge_step=self.purge_step, filename_suffix=f".{n:04d}")
            except ImportError:  # a dependency, but an image without it still writes the JSON lines
                self.tb_dir = None
        return self.tb

    def write(self, step: int, split: str, metrics: dict):
        if self.file is None:
            return
        self.file.write(json.dumps({"step": step, "split": split, **metrics}) + "\n")
        self.file.flush()
        scalars = {f"{split}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._tensorboard() is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics(scalars, step=step)

    def close(self):
        for done in (
            self.file and self.file.close,
            self.tb and self.tb.close,
            self.wandb and self.wandb.finish,
            self.mlflow and self.mlflow.end_run,
        ):
            if done:
                done()
