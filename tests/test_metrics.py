"""Metrics to JSON lines and the trackers named in report_to: TensorBoard, Weights & Biases (offline), MLflow
(file:)."""

import json
import sys
import time
import types

import pytest

from jaxrlhf.config import ConfigError, load
from jaxrlhf.metrics import MetricsLog, check_trackers
from jaxrlhf.ppo import PPOConfig
from jaxrlhf.sft import SFTConfig

STEPS = [
    (1, "train", {"loss": 2.5, "lr": 1e-4, "note": "text"}),
    (1, "eval", {"loss": 2.75}),
    (2, "train", {"loss": 1.25}),
]
SCALARS = [(1, {"train/loss": 2.5, "train/lr": 1e-4}), (1, {"eval/loss": 2.75}), (2, {"train/loss": 1.25})]


def _write(out, report_to, config=None):
    log = MetricsLog(out, report_to, config)
    for step, split, metrics in STEPS:
        log.write(step, split, metrics)
    log.close()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_json_lines_and_tensorboard(tmp_path):
    rows = _write(tmp_path / "run", ("tensorboard",))
    assert rows == [{"step": s, "split": split, **m} for s, split, m in STEPS]
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert not (tmp_path / "bare" / "tb").exists() and _write(tmp_path / "bare", ()) == rows


@pytest.mark.parametrize("cls", [SFTConfig, PPOConfig])
def test_a_tracker_named_but_not_installed_fails_at_start_up(cls, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, as where it is not installed
    with pytest.raises(ConfigError, match=r"report_to: wandb is not installed; pip install 'jaxrlhf\[wandb\]'"):
        load(cls, None, ["report_to=[tensorboard, wandb]"])
    with pytest.raises(
        ConfigError, match=r"report_to: unknown tracker 'comet'; expected some of \['tensorboard', 'wandb', 'mlflow'\]"
    ):
        check_trackers(("comet",))


class _Recorder(types.ModuleType):
    """A stand-in for wandb or mlflow that records every call."""

    def __init__(self, name):
        super().__init__(name)
        self.calls = []

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *args, **kwargs: self.calls.append((attr, args, kwargs)) or self

    def __call__(self, *args, **kwargs):  # wandb.init returns the run, whose log and finish are recorded too
        return self


def test_the_trackers_get_every_scalar_at_its_step(tmp_path, monkeypatch):
    wandb, mlflow = _Recorder("wandb"), _Recorder("mlflow")
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    _write(tmp_path / "run", ("wandb", "mlflow"), {"optim.learning_rate": 1e-4})
    init = wandb.calls[0]
    assert init[0] == "init" and init[2]["config"] == {"optim.learning_rate": 1e-4} and init[2]["name"] == "run"
    assert [(c[2]["step"], c[1][0]) for c in wandb.calls if c[0] == "log"] == SCALARS
    assert wandb.calls[-1][0] == "finish"
    assert mlflow.calls[0][0] == "start_run" and mlflow.calls[1] == ("log_params", ({"optim.learning_rate": 1e-4},), {})
    assert [(c[2]["step"], c[1][0]) for c in mlflow.calls if c[0] == "log_metrics"] == SCALARS
    assert mlflow.calls[-1][0] == "end_run"


def test_weights_and_biases_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _write(tmp_path / "run", ("wandb",), {"seed": 3})
    (run,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")  # what `wandb sync` uploads later
    for _ in range(100):  # wandb's service process may still be writing it after finish()
        if len(records := run.read_bytes()) > 100:
            break
        time.sleep(0.1)
    # protobuf records: the keys are there as text (the values' exactness: the test above)
    assert all(key in records for key in (b"train/loss", b"train/lr", b"eval/loss", b"seed"))
    assert wandb.run is None  # finished


def test_mlflow_to_local_files(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _write(tmp_path / "run", ("mlflow",), {"seed": 3})
    client = mlflow.tracking.MlflowClient()
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_name == "run" and run.data.params == {"seed": "3"}
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.5), (2, 1.25)]
    assert run.info.status == "FINISHED"


def test_a_resumed_run_continues_the_same_weights_and_biases_run(tmp_path, monkeypatch):
    """The W&B run id is stored beside metrics.jsonl at the first start; a resumed run (the same folder) opens W&B
    with that id and resume="allow", another run folder gets its own id."""
    ids = []
    for folder in ("run", "run", "other"):
        wandb = _Recorder("wandb")
        monkeypatch.setitem(sys.modules, "wandb", wandb)
        _write(tmp_path / folder, ("wandb",))
        ((_, _, init),) = [c for c in wandb.calls if c[0] == "init"]
        assert init["resume"] == "allow"
        ids.append(init["id"])
    assert ids[0] == ids[1] != ids[2] and len(set(ids[0])) > 1
    assert (tmp_path / "run" / "wandb_run_id").read_text().strip() == ids[0]


def test_a_resumed_run_continues_one_tensorboard_run(tmp_path):
    """Steps 1-3 logged, the run resumed from its state at step 2 (step 3 runs again, with another loss), then step 4:
    TensorBoard's own reader sees one run with steps 1-4 and the new step 3, though tb/ holds two event files. Both
    writers start within one second: tensorboardX names files by the second, and the second file must not overwrite
    the first."""
    out = tmp_path / "run"
    first = MetricsLog(out, ("tensorboard",))
    for step, loss in ((1, 3.0), (2, 2.0), (3, 1.5)):
        first.write(step, "train", {"loss": loss})
    first.close()
    again = MetricsLog(out, ("tensorboard",))
    again.resume(2)
    for step, loss in ((3, 1.0), (4, 0.5)):
        again.write(step, "train", {"loss": loss})
    again.close()
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 2
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator", reason="TensorBoard is not installed"
    )
    tb = event_accumulator.EventAccumulator(str(out / "tb"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("train/loss")] == [(1, 3.0), (2, 2.0), (3, 1.0), (4, 0.5)]
