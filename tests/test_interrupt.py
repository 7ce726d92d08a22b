"""Ctrl-C keeps the work: SIGINT or SIGTERM finishes the iteration under way, saves it, says so in one line and ends
the run (exit status 130 / 143); the same command continues from the next iteration, metrics.jsonl and TensorBoard
holding each iteration once; a second signal ends the process at once; a time-based save interval."""

import dataclasses
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import time

import jax
import pytest

from jaxrlhf.checkpoint import export_manifest
from jaxrlhf.data import DataConfig
from jaxrlhf.loop import Interrupted, Signals, checkpoint_manager
from jaxrlhf.metrics import MetricsLog
from jaxrlhf.optim import OptimConfig
from jaxrlhf.ppo import run as run_ppo
from jaxrlhf.rl import ModelSide, PPOConfig
from jaxrlhf.sft import SFTConfig
from jaxrlhf.sft import run as run_sft
from jaxrlhf.sharding import make_mesh
from jaxrlhf.train import builtin_model

ONE = make_mesh(1, jax.devices()[:1])  # one device compiles faster; the mesh's behaviour is test_train's


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The built-in tiny OPT as a Step 1 starting point and, with a value head, as a Step 2 output."""
    tmp = tmp_path_factory.mktemp("models")
    return builtin_model(tmp / "actor", seed=0), builtin_model(tmp / "critic", seed=1, value_head=True)


def data(tmp_path) -> DataConfig:
    return DataConfig(
        data_path=("synthetic:300",), data_split="1,1,1", max_seq_len=32, max_prompt_len=24, cache_dir=str(tmp_path)
    )


@pytest.fixture(autouse=True)
def python_ctrl_c():
    """Ctrl-C as a terminal's Python has it: pytest-xdist's workers ignore SIGINT (SIG_IGN), which the loop keeps."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def when_logged(monkeypatch, step: int, then):
    """Call `then()` right after metrics.jsonl gets iteration `step`'s train line (in the middle of the loop)."""
    real = MetricsLog.write

    def write(self, i, split, metrics):
        real(self, i, split, metrics)
        if i == step and split == "train":
            then()

    monkeypatch.setattr(MetricsLog, "write", write)


def send(signum):
    return lambda: os.kill(os.getpid(), signum)


def logged_steps(out) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["split"] == "train"]


def tensorboard_steps(out, tag: str) -> tuple[list[int], list[int]]:
    """(every step of `tag` in the event files, the steps TensorBoard shows): its reader purges the events of an
    earlier file at or past a later file's SessionLog START step (what SummaryWriter's purge_step writes)."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    written, shown = [], []
    for path in sorted((out / "tb").glob("events.out.tfevents.*")):  # named by their start time: in order
        data, pos = path.read_bytes(), 0
        while pos < len(data):  # TFRecords: length (8 bytes), its CRC (4), the event, its CRC (4)
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            event, pos = Event.FromString(data[pos + 12 : pos + 12 + n]), pos + 16 + n
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                shown = [s for s in shown if s < event.step]
            for value in event.summary.value:
                if value.tag == tag:
                    written.append(event.step)
                    shown.append(event.step)
    return written, shown


def test_the_first_signal_is_noted_and_a_second_one_has_its_default_action():
    before = signal.getsignal(signal.SIGINT)
    with Signals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == signal.SIGTERM
        # a second signal of either kind now ends the process at once (not testable in this process)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is before


def test_step1_crashed_then_stopped_by_sigterm_saves_its_step_and_logs_each_step_once(models, tmp_path, monkeypatch):
    out = tmp_path / "sft"
    cfg = SFTConfig(
        model=str(models[0]),
        output_dir=str(out),
        batch_size=8,
        max_steps=6,
        log_every=1,
        save_every=2,
        save_minutes=0.0,
        precision="fp32",
        sample_prompts=0,
        data=data(tmp_path / "cache"),
        optim=OptimConfig(learning_rate=1e-3, warmup_steps=1),
    )
    saved = lambda: checkpoint_manager(out, 10).all_steps()

    def crash():
        raise RuntimeError("crash")

    with monkeypatch.context() as m:  # a crash after step 3 was logged: the state saved is step 2's
        when_logged(m, 3, crash)
        with pytest.raises(RuntimeError, match="crash"):
            run_sft(cfg, log=lambda _: None, mesh=ONE)
    assert logged_steps(out) == [1, 2, 3] and saved() == [2]

    lines = []
    with monkeypatch.context() as m:
        when_logged(m, 3, send(signal.SIGTERM))  # step 3 again, which no save_every saves
        with pytest.raises(Interrupted) as stopped:
            run_sft(cfg, log=lines.append, mesh=ONE)
    assert stopped.value.code == 143 and saved() == [2, 3]  # step 3 finished and saved, not step 4
    assert lines[-1] == (
        f"SIGTERM: stopped after step 3 of 6, its state saved in {out / 'state'}; the same command continues it "
        f"from step 4: {shlex.join(sys.orig_argv)}"
    )
    assert not (out / "model").exists()
    assert logged_steps(out) == [1, 2, 3]  # step 3 of the crashed run dropped, logged again once

    written, shown = tensorboard_steps(out, "train/loss")  # the same TensorBoard run goes on, step 3 purged once
    assert written == [1, 2, 3, 3] and shown == [1, 2, 3]


def test_step3_stopped_by_sigint_saves_its_iteration_and_the_same_run_finishes(models, tmp_path, monkeypatch):
    out = tmp_path / "ppo"
    cfg = PPOConfig(
        actor=ModelSide(model=str(models[0])),
        critic=ModelSide(model=str(models[1])),
        output_dir=str(out),
        batch_size=8,
        max_steps=4,
        max_answer_len=4,
        precision="fp32",
        save_minutes=0.0,
        data=data(tmp_path / "cache"),
    )
    lines = []
    with monkeypatch.context() as m:
        when_logged(m, 2, send(signal.SIGINT))
        with pytest.raises(Interrupted) as stopped:
            run_ppo(cfg, log=lines.append, mesh=ONE)
    assert stopped.value.code == 130
    assert lines[-1].startswith(
        f"SIGINT: stopped after iteration 2 of 4, its state saved in {out / 'state'}; the same command continues "
        "it from iteration 3: "
    )
    assert checkpoint_manager(out, 2).all_steps() == [2] and not (out / "actor").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the loop gave Ctrl-C back

    # The same run finishes; a save every 1e-9 minutes saves every iteration (3: neither save_every's nor the end).
    lines = []
    done = run_ppo(dataclasses.replace(cfg, save_minutes=1e-9, keep_checkpoints=10), log=lines.append, mesh=ONE)
    assert any(line.startswith("resumed from iteration 2 (prompts: epoch 0, batch 2)") for line in lines), lines
    assert [r["step"] for r in done["records"] if r["split"] == "train"] == [3, 4]
    assert checkpoint_manager(out, 10).all_steps() == [2, 3, 4]
    assert logged_steps(out) == [1, 2, 3, 4]
    assert tensorboard_steps(out, "train/reward")[0] == [1, 2, 3, 4]
    assert all(export_manifest(f) is not None for f in done["folders"].values())


@pytest.mark.slow
def default_sigint():
    """In the child: SIGINT's default action, whatever the test process had (xdist's workers ignore it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_on_the_command_line_exits_130_with_one_line_and_no_traceback(models, tmp_path):
    """A real process and a real signal from outside: what a user sees."""
    out = tmp_path / "sft"
    argv = [sys.executable, "-m", "jaxrlhf.sft", f"model={models[0]}", f"output_dir={out}", "batch_size=8"]
    argv += ["max_steps=300", "log_every=1", "precision=fp32", "sample_prompts=0", "eval_batches=1", "report_to=[]"]
    argv += ["data.data_path=[synthetic:300]", "data.data_split=1,1,1", "data.max_seq_len=32"]
    argv += [f"data.cache_dir={tmp_path / 'cache'}"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint
    )
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stdout + stderr
    [line] = [line for line in stdout.splitlines() if line.startswith("SIGINT: ")]
    k = int(line.split("stopped after step ")[1].split(" ")[0])
    assert line.endswith(f"the same command continues it from step {k + 1}: {shlex.join(argv)}"), line
    assert k < 300 and logged_steps(out) == list(range(1, k + 1))

    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from step {k}" in done.stdout
    assert logged_steps(out) == list(range(1, 301))
