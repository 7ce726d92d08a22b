"""Peak memory of Step 3 per phase against the memory plan (jaxrlhf.plan), on the largest models one GPU holds.

    PYTHONPATH=. python tools/bench_memory.py --actor opt-30b --critic opt-350m --lora 128 --batch 8 \\
        --prompt 256 --new 256 --full-actor opt-6.7b --full-batch 8
    PYTHONPATH=. python tools/bench_memory.py --tiny        # the CPU smoke test: tiny models, same code

Two configurations, each in a process of its own (the peak counter cannot be reset; an out-of-memory error is
recorded and the next one runs):
  lora      --actor with LoRA (--lora, only_optimize_lora, pure bf16 so the frozen base is 2 bytes a weight),
            --critic the same, remat on both
  full      --full-actor fully fine-tuned (bf16 mixed precision: fp32 master weights and Adam moments), with
            the optimizer states, the reference and the reward model offloaded to pinned host memory, remat
Random weights of the real shapes, random prompts of --prompt tokens, answers forced to --new tokens (EOS
off). One warm-up iteration, measured phase by phase (plan.measure: on a GPU the running peak of
memory_stats()['peak_bytes_in_use'] after each phase, which cannot be reset; on the CPU the live arrays
plus each compiled program's memory_analysis()), then --repeats timed iterations for samples/s. Each
phase's measured figure is set beside the plan's figure for that phase and the error of the plan printed;
on a GPU the running peak after a phase compares with the largest planned phase so far.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# JAX takes 75 % of a GPU's memory by default; the largest models need nearly all of it.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
# XLA keeps at most 64 GB of pinned host memory unless told more; offloading a 6.7B model's fp32 Adam moments
# needs more.
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "120")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrlhf import plan as memory_plan  # noqa: E402
from jaxrlhf.lora import LoRAConfig  # noqa: E402
from jaxrlhf.models import Backend, init_params, preset  # noqa: E402
from jaxrlhf.optim import OptimConfig  # noqa: E402
from jaxrlhf.rl import EngineConfig, HybridEngine, ModelSide  # noqa: E402
from jaxrlhf.sharding import make_mesh  # noqa: E402
from tools import common  # noqa: E402

TINY = {
    "tiny-actor": dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        ffn_dim=256,
        max_position_embeddings=128,
        word_embed_proj_dim=64,
    ),
    "tiny-critic": dict(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=128,
        max_position_embeddings=128,
        word_embed_proj_dim=32,
    ),
}


def model(name: str, precision: str):
    dtype = "float32" if precision == "fp32" else "bfloat16"
    from jaxrlhf.models import OPTConfig

    kw = dict(dtype=dtype, dropout=0.0, backend=Backend.detect())
    return OPTConfig(**TINY[name], **kw) if name in TINY else preset(name, **kw)


def engine_config(args, lora: int, precision: str, offload: bool) -> EngineConfig:
    side = lambda lr: ModelSide(
        optim=OptimConfig(learning_rate=lr, warmup_steps=0),
        lora=LoRAConfig(dim=lora, only_optimize_lora=lora > 0),
        remat=True,
        dropout=0.0,
        offload=offload,
    )
    return EngineConfig(
        actor=side(9.65e-6),
        critic=side(5e-6),
        precision=precision,
        max_answer_len=args.new,
        inference_tp_size=args.tp,
        enable_ema=False,
        offload_reference_model=offload,
        offload_reward_model=offload,
    )


def run_one(args, actor: str, batch: int, lora: int, precision: str, offload: bool) -> dict:
    """One configuration: the plan, then the engine's warm-up iteration measured per phase, then timed iterations."""
    import dataclasses

    cfg = engine_config(args, lora, precision, offload)
    configs = [dataclasses.replace(model(name, precision), remat=True) for name in (actor, args.critic)]
    mesh = make_mesh(args.tp)
    p = memory_plan.plan(cfg, *configs, mesh, batch=batch, prompt_len=args.prompt, capacity=memory_plan.capacity())
    print(p.table(), flush=True)
    out = {
        "actor": actor,
        "critic": args.critic,
        "batch": batch,
        "lora": lora,
        "precision": precision,
        "offload": offload,
        "plan_bytes": {ph: p.phase_bytes(ph) for ph in p.phases},
        "plan_peak_bytes": p.peak,
        "plan_fits": p.fits,
    }
    dtype = jnp.bfloat16 if precision == "pure_bf16" else jnp.float32
    params = [
        jax.device_get(jax.jit(lambda k, c=c, h=h: init_params(c, k, value_head=h, dtype=dtype))(jax.random.key(i)))
        for i, (c, h) in enumerate(zip(configs, (False, True)))
    ]
    engine = HybridEngine(
        cfg, mesh, (configs[0], params[0]), (configs[1], params[1]), total_steps=1000, eos_id=-1, pad_id=1
    )
    del params
    rng = np.random.default_rng(0)
    prompts = {
        "prompt_ids": rng.integers(3, configs[0].vocab_size, (batch, args.prompt), dtype=np.int32),
        "prompt_mask": np.ones((batch, args.prompt), np.int32),
    }
    measured = memory_plan.measure(engine, prompts)  # the warm-up iteration (it compiles)
    out["measured_bytes"] = measured
    running = jax.local_devices()[0].memory_stats() is not None  # GPU: running peaks; CPU: per-phase figures
    planned_so_far, errors = 0, {}
    for ph in p.phases:
        planned_so_far = max(planned_so_far, p.phase_bytes(ph)) if running else p.phase_bytes(ph)
        if measured.get(ph):
            errors[ph] = planned_so_far / measured[ph] - 1
    out["plan_error"] = errors
    out["peak_bytes"] = max(measured.values())
    out["peak_error"] = p.peak / out["peak_bytes"] - 1
    times, phases = [], []
    for _ in range(args.repeats):
        engine.timings = {}
        start = time.perf_counter()
        engine.train_rlhf(engine.generate_experience(prompts))
        times.append(time.perf_counter() - start)
        phases.append(dict(engine.timings))
    t = statistics.median(times)
    out.update(
        iteration_s=t,
        samples_per_s=batch / t,
        phases_s={k: statistics.median(x.get(k, 0.0) for x in phases) for k in phases[0]},
        peak_bytes_after=common.peak_bytes(),
    )
    del engine
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actor", default="opt-30b")
    ap.add_argument("--critic", default="opt-350m")
    ap.add_argument("--lora", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--full-actor", default="opt-6.7b", help="the fully fine-tuned actor, run with offload ('' skips it)"
    )
    ap.add_argument("--full-batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--tp", type=int, default=1, help="inference_tp_size (the mesh spans every device)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="tiny models, batch 8, 16 + 16 tokens: the CPU smoke test")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help=argparse.SUPPRESS)  # the child process of one configuration
    ap.add_argument("--row-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:
        args.actor, args.critic, args.full_actor, args.lora = "tiny-actor", "tiny-critic", "tiny-actor", 8
        args.batch, args.full_batch, args.prompt, args.new = 8, 8, 16, 16
    runs = [("lora", args.actor, args.batch, args.lora, "pure_bf16", False)]
    if args.full_actor:
        runs.append(("full_offload", args.full_actor, args.full_batch, 0, "bf16", True))
    if args.only is None:
        # One process per configuration: the device's peak counter cannot be reset, and an out-of-memory error
        # leaves nothing behind for the next configuration.
        result = {"benchmark": "memory", **common.environment(), "args": vars(args), "runs": []}
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name, actor, batch, *_ in runs:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", name, "--row-file", f.name])
                text = Path(f.name).read_text()
            row = (
                json.loads(text)
                if text
                else {
                    "name": name,
                    "actor": actor,
                    "batch": batch,
                    "error": f"the process ended with code {proc.returncode}",
                }
            )
            result["runs"].append(row)
            common.write("memory", "memory", result, args.out, stamp)
        return
    for name, actor, batch, lora, precision, offload in (r for r in runs if r[0] == args.only):
        try:
            row = {"name": name, **run_one(args, actor, batch, lora, precision, offload)}
            errors = " ".join(f"{ph} {e:+.1%}" for ph, e in row["plan_error"].items())
            print(
                f"{name}: {actor} batch {batch}: {row['samples_per_s']:.2f} samples/s, peak "
                f"{row['peak_bytes'] / 2**30:.2f} GiB (plan {row['plan_peak_bytes'] / 2**30:.2f}, error "
                f"{row['peak_error']:+.1%}); plan error per phase: {errors}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - out of memory: record it, keep the other configuration
            row = {"name": name, "actor": actor, "batch": batch, "error": str(e).splitlines()[0][:300]}
            print(f"{name}: {actor} batch {batch}: {row['error']}", flush=True)
        Path(args.row_file).write_text(json.dumps(row, default=str))


if __name__ == "__main__":
    main()
