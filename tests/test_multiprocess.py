"""Two real processes on the CPU (gloo collectives, a coordinator on 127.0.0.1) behave as one."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from test_train import sft_config, tiny_model  # noqa: F401 - the fixture

from jaxrlhf.distributed import initialize
from jaxrlhf.sft import run as run_sft
from jaxrlhf.trainer import OptimConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_overrides(cfg) -> list[str]:
    """The same settings as key=value arguments."""
    d = cfg.data
    return [f"model={cfg.model}", f"output_dir={cfg.output_dir}", f"batch_size={cfg.batch_size}",
            f"max_steps={cfg.max_steps}", "log_every=1", f"save_every={cfg.save_every}", "precision=fp32",
            "sample_prompts=0", f"optim.learning_rate={cfg.optim.learning_rate}",
            f"optim.warmup_steps={cfg.optim.warmup_steps}", f"optim.schedule={cfg.optim.schedule}",
            f"data.data_path={json.dumps(list(d.data_path))}", f"data.data_split={d.data_split}",
            f"data.max_seq_len={d.max_seq_len}", f"data.cache_dir={d.cache_dir}"]


def train_losses(out_dir) -> list[float]:
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return [r["loss"] for r in rows if r["split"] == "train"]


@pytest.mark.slow
def test_two_processes_train_like_one_and_their_checkpoint_restores_in_one(tiny_model, tmp_path):  # noqa: F811
    constant = OptimConfig(learning_rate=1e-3, warmup_steps=2, schedule="constant")  # the same at any length
    one = run_sft(sft_config(tiny_model, tmp_path / "one", max_steps=8, optim=constant), log=lambda _: None)
    want = [r["loss"] for r in one["records"] if r["split"] == "train"]

    cfg = sft_config(tiny_model, tmp_path / "two", max_steps=6, save_every=3, optim=constant)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxrlhf.sft", *cli_overrides(cfg),
                               f"--coordinator-address=127.0.0.1:{port}", "--num-processes=2", f"--process-id={i}"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        assert f"8 devices, 2 process(es), this is process {i}" in out  # they did join
    # 2 processes x 4 devices, each loading its half of every batch: the losses of 1 process x 8 devices.
    np.testing.assert_allclose(train_losses(cfg.output_dir), want[:6], rtol=2e-5)
    assert os.path.isfile(os.path.join(cfg.output_dir, "model", "config.json"))  # written once, by process 0

    # The checkpoint the two processes wrote together continues in one process, exactly.
    resumed = run_sft(sft_config(tiny_model, tmp_path / "two", max_steps=8, optim=constant, resume=True),
                      log=lambda _: None)
    got = [r["loss"] for r in resumed["records"] if r["split"] == "train"]
    np.testing.assert_allclose(got, want[6:], rtol=2e-5)


def test_incomplete_multiprocess_flags_are_refused():
    with pytest.raises(ValueError, match="also give --num-processes, --process-id"):
        initialize("127.0.0.1:1234")
    with pytest.raises(ValueError, match="outside 0 .. 1"):
        initialize("127.0.0.1:1234", 2, 2)
    assert initialize() is False  # no flags, no environment, no SLURM: one process
