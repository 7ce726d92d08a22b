"""Two real processes on the CPU (gloo collectives, a coordinator on 127.0.0.1) behave as one.

One pair of processes (4 CPU devices each) runs Step 1 and then Step 3 through their command lines; this
test process runs the same settings alone (Step 1 on 8 devices, Step 3 on one, which compiles in half the
time). Same global batches: the figures agree to float noise (sums over devices and processes may add in
another order). The checkpoint each step wrote with two processes then continues in one process.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from test_train import sft_config, tiny_model  # noqa: F401 - the fixture

from jaxrlhf.checkpoint import load_hf
from jaxrlhf.data import DataConfig
from jaxrlhf.distributed import initialize
from jaxrlhf.optim import OptimConfig
from jaxrlhf.ppo import PPOConfig
from jaxrlhf.ppo import run as run_ppo
from jaxrlhf.rl import ModelSide
from jaxrlhf.sft import run as run_sft
from jaxrlhf.sharding import make_mesh
from jaxrlhf.train import builtin_model

CONSTANT = OptimConfig(learning_rate=1e-3, warmup_steps=2, schedule="constant")  # the same at any run length
# Both command lines in one process, so that the pair starts (JAX, gloo, the coordinator) once.
DRIVER = (
    "import json, sys; from jaxrlhf import ppo, sft; a, flags = json.loads(sys.argv[1]), sys.argv[2:]; "
    "sft.main(a['sft'] + flags); ppo.main(a['ppo'] + flags)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_overrides(cfg, default=None, prefix="") -> list[str]:
    """The settings of `cfg` that differ from its class's defaults, as key=value arguments."""
    default = type(cfg)() if default is None else default
    out = []
    for f in dataclasses.fields(cfg):
        value, base = getattr(cfg, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out += cli_overrides(value, base, f"{prefix}{f.name}.")
        elif value != base:
            out.append(f"{prefix}{f.name}={json.dumps(value)}")
    return out


def launch(args: dict, tmp_path, n: int = 2, timeout: float = 300) -> list[str]:
    """Run DRIVER in `n` processes of 4 CPU devices joined through a coordinator on 127.0.0.1; their outputs.
    One that fails ends the others (they would wait for it in a collective)."""
    # Unoptimised CPU code compiles in about 60 % of the time, and this run is mostly compilation.
    flags = [
        "--xla_force_host_platform_device_count=4",
        "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true",
    ]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    port, logs = free_port(), [tmp_path / f"process{i}.log" for i in range(n)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                DRIVER,
                json.dumps(args),
                f"--coordinator-address=127.0.0.1:{port}",
                f"--num-processes={n}",
                f"--process-id={i}",
            ],
            env=env,
            stdout=open(logs[i], "w"),  # noqa: SIM115 (the child holds it; the file closes when it exits)
            stderr=subprocess.STDOUT,
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    outputs = [log.read_text() for log in logs]
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed (exit {p.returncode}):\n{out[-4000:]}"
    return outputs


def ppo_config(tmp_path, **kw):
    """Step 3 on the built-in task's tiny models, sampling, with the EMA, alarms and gold rewards (not the mixture
    loss: its batches load as the prompts do, and it would lengthen the actor step's compilation)."""
    data = DataConfig(
        data_path=("synthetic:300",), data_split="1,1,1", max_prompt_len=24, cache_dir=str(tmp_path / "cache")
    )
    base = dict(
        actor=ModelSide(model=str(builtin_model(tmp_path / "actor", seed=0)), optim=CONSTANT),
        critic=ModelSide(model=str(builtin_model(tmp_path / "critic", seed=1, value_head=True)), optim=CONSTANT),
        output_dir=str(tmp_path / "out"),
        batch_size=8,
        max_steps=4,
        max_answer_len=6,
        precision="fp32",
        enable_ema=True,
        old_logprobs="generation",
        data=data,
    )
    return PPOConfig(**{**base, **kw})


def train_records(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if r["split"] == "train"]


def figures(record) -> dict:
    """A Step 3 record without its wall-clock figures (seconds, samples/s, TFLOP/s)."""
    return {k: v for k, v in record.items() if not k.endswith(("_s", "samples_per_s", "tflops")) and k != "split"}


@pytest.fixture(scope="module")
def two_processes(tiny_model, tmp_path_factory):  # noqa: F811
    """Step 1 for 6 steps (saving at 3 and 6) and Step 3 for 2 iterations, by two processes."""
    tmp = tmp_path_factory.mktemp("two")
    sft = sft_config(tiny_model, tmp / "sft", max_steps=6, save_every=3, optim=CONSTANT)
    ppo = ppo_config(tmp / "ppo", max_steps=2)
    clock = time.perf_counter()
    outputs = launch({"sft": cli_overrides(sft), "ppo": cli_overrides(ppo)}, tmp)
    print(f"two processes, Steps 1 and 3: {time.perf_counter() - clock:.1f} s")
    return sft, ppo, outputs


@pytest.mark.slow
def test_two_processes_run_step1_like_one_and_their_checkpoint_restores_in_one(two_processes, tmp_path):
    cfg, _, outputs = two_processes
    for i, out in enumerate(outputs):
        assert f"8 devices, 2 process(es), this is process {i}" in out  # they did join
    one = run_sft(dataclasses.replace(cfg, output_dir=str(tmp_path / "one"), max_steps=8), log=lambda _: None)
    want = [r["loss"] for r in one["records"] if r["split"] == "train"]
    # 2 processes x 4 devices, each loading its half of every batch: the losses of 1 process x 8 devices.
    np.testing.assert_allclose([r["loss"] for r in train_records(cfg.output_dir)], want[:6], rtol=2e-5)
    assert os.path.isfile(os.path.join(cfg.output_dir, "model", "config.json"))  # written once, by process 0

    # The checkpoint the two processes wrote together continues in one process, exactly.
    resumed = run_sft(dataclasses.replace(cfg, max_steps=8, resume=True), log=lambda _: None)
    got = [r["loss"] for r in resumed["records"] if r["split"] == "train"]
    np.testing.assert_allclose(got, want[6:], rtol=2e-5)


@pytest.mark.slow
def test_two_processes_run_step3_like_one_and_their_checkpoint_restores_in_one(two_processes, tmp_path):
    _, cfg, _ = two_processes
    one_device = make_mesh(1, jax.devices()[:1])
    one = run_ppo(
        dataclasses.replace(cfg, output_dir=str(tmp_path / "one"), max_steps=4), log=lambda _: None, mesh=one_device
    )
    want = [figures(r) for r in one["records"]]
    got = [figures(r) for r in train_records(cfg.output_dir)]
    assert [r["step"] for r in got] == [1, 2] and {"gold_reward", "repetition", "actor_loss"} <= got[0].keys()

    def close(got, want):  # rewards, KL, losses, grad norms, gold reward, alarms' figures
        # rtol 1e-4: KL, advantages and returns are sums of nearly cancelling terms (seen: at most 2.3e-5 relative).
        for g, w in zip(got, want, strict=True):
            assert g.keys() == w.keys()
            np.testing.assert_allclose([g[k] for k in sorted(g)], [w[k] for k in sorted(w)], rtol=1e-4, atol=1e-6)

    close(got, want[:2])
    for name in ("actor", "critic", "actor_ema"):  # written once, by process 0
        assert os.path.isfile(os.path.join(cfg.output_dir, name, "config.json"))

    # The two processes' checkpoint continues in one process: iterations 3 and 4 as in the uninterrupted run.
    resumed = run_ppo(dataclasses.replace(cfg, max_steps=4, resume=True), log=lambda _: None, mesh=one_device)
    close([figures(r) for r in resumed["records"]], want[2:])
    for name in ("actor", "critic", "actor_ema"):
        (_, a), (_, b) = load_hf(resumed["folders"][name]), load_hf(one["folders"][name])
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            # atol: the k_proj biases get a zero gradient in exact arithmetic (softmax ignores a shift shared by all
            # keys), so Adam moves them by amplified float noise alone: |values| ~ 1e-6 that differ by as much.
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def test_incomplete_multiprocess_flags_are_refused():
    with pytest.raises(ValueError, match="also give --num-processes, --process-id"):
        initialize("127.0.0.1:1234")
    with pytest.raises(ValueError, match="outside 0 .. 1"):
        initialize("127.0.0.1:1234", 2, 2)
    assert initialize() is False  # no flags, no environment, no SLURM: one process


def test_a_generation_group_spanning_processes_is_refused(monkeypatch):
    from jaxrlhf.config import ConfigError
    from jaxrlhf.ppo import check

    monkeypatch.setattr(jax, "process_count", lambda: 2)  # as seen by process 0 of two with 4 devices each
    monkeypatch.setattr(jax, "local_device_count", lambda: 4)
    cfg = PPOConfig(actor=ModelSide(model="a"), critic=ModelSide(model="c"), batch_size=8, inference_tp_size=8)
    with pytest.raises(ConfigError, match=r"inference_tp_size 8 would span processes \(4 devices each\)"):
        check(cfg, make_mesh(8))
    check(dataclasses.replace(cfg, inference_tp_size=4), make_mesh(4))  # a group within each process is fine
