"""Benchmark one Step 1 training step (forward, backward, AdamW) on one GPU, against HF PyTorch.

    PYTHONPATH=. python tools/bench_sft.py --model opt-1.3b --batch 8 --seq 512 [--out DIR]

Ours: jaxrlhf.trainer's jitted train_step (state donated) with the SFT loss, for the precision recipes
"bf16" (bf16 compute, fp32 master weights and AdamW state) and "pure_bf16", with and without remat.
Theirs, in the same run: transformers' OPTForCausalLM in bf16 with torch.optim.AdamW (fused), the same
shapes. Figures: seconds per step (median), tokens/s, TFLOP/s by 6·N·tokens, and MFU against the bf16
matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrlhf.lora import LoRAConfig  # noqa: E402
from jaxrlhf.models import Backend, OPTConfig, init_params  # noqa: E402
from jaxrlhf.models.opt import PRESETS  # noqa: E402
from jaxrlhf.optim import OptimConfig, create_state, make_optimizer, state_shardings  # noqa: E402
from jaxrlhf.sft import sft_loss  # noqa: E402
from jaxrlhf.sharding import make_mesh  # noqa: E402
from jaxrlhf.trainer import make_train_step  # noqa: E402
from tools import common  # noqa: E402
from tools.bench_forward import matmul_ceiling  # noqa: E402


def ours(name, B, T, precision, remat, repeats, unroll=0):
    mesh = make_mesh(1, jax.devices()[:1])
    dtype = jnp.bfloat16 if precision == "pure_bf16" else jnp.float32
    config = OPTConfig(
        **PRESETS[name], dtype="bfloat16", remat=remat, dropout=0.0, backend=Backend.detect(scan_unroll=unroll)
    )
    params = jax.jit(lambda k: init_params(config, k, dtype=dtype))(jax.random.key(0))
    tx = make_optimizer(OptimConfig(learning_rate=1e-5), 1000)
    state = create_state(params, LoRAConfig(), tx, jax.random.key(1), mesh)
    del params
    shardings = state_shardings(state, mesh)
    step = jax.jit(
        make_train_step(sft_loss(config), tx, LoRAConfig()), out_shardings=(shardings, None), donate_argnums=0
    )
    ids = jax.random.randint(jax.random.key(2), (1, B, T), 3, config.vocab_size)
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "loss_mask": jnp.ones_like(ids)}
    holder = {"state": state}

    def run():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"]

    return common.timeit(run, repeats)


def theirs(name, B, T, repeats):
    import torch
    from transformers import OPTConfig as HFConfig
    from transformers import OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(HFConfig(**PRESETS[name], attn_implementation="sdpa", dropout=0.0)).to(
        "cuda", torch.bfloat16
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=True)
    ids = torch.randint(3, 50272, (B, T), device="cuda")

    def step():
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    result = common.timeit(step, repeats, warmup=3, block=lambda _: torch.cuda.synchronize())
    model = opt = None  # the closures hold them: free the GPU memory before the next run
    torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-1.3b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--recipes", nargs="+", default=["bf16", "pure_bf16"], choices=["bf16", "pure_bf16", "fp32"])
    ap.add_argument("--remat", nargs="+", type=int, default=[0, 1], help="1: with per-layer remat, 0: without")
    ap.add_argument("--unroll", nargs="+", type=int, default=[0], help="Backend.scan_unroll values (0: auto)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    B, T = args.batch, args.seq
    n = sum(
        x.size
        for x in jax.tree.leaves(
            jax.eval_shape(lambda: init_params(OPTConfig(**PRESETS[args.model]), jax.random.key(0)))
        )
    )
    flops = 6 * n * B * T
    ceiling = matmul_ceiling()
    result = {
        "benchmark": "sft_step",
        **common.environment(),
        "model": args.model,
        "params": n,
        "batch": B,
        "seq": T,
        "matmul_ceiling_flops": ceiling,
        "runs": {},
    }
    variants = {
        f"ours_{p}{'_remat' if r else ''}{f'_unroll{u}' if u else ''}": (p, bool(r), u)
        for p in args.recipes
        for r in args.remat
        for u in args.unroll
    }
    result["xla_flags"] = __import__("os").environ.get("XLA_FLAGS", "")
    for key, (precision, remat, unroll) in variants.items():
        try:
            result["runs"][key] = ours(args.model, B, T, precision, remat, args.repeats, unroll)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: keep the other figures
            result["runs"][key] = {"error": str(e).splitlines()[0][:300]}
    if not args.no_hf:
        result["runs"]["hf_torch_bf16_adamw"] = theirs(args.model, B, T, args.repeats)
    for key, t in result["runs"].items():
        if "median_s" in t:
            t.update(
                tokens_per_s=B * T / t["median_s"],
                tflops=flops / t["median_s"] / 1e12,
                mfu=flops / t["median_s"] / ceiling,
            )
            print(
                f"{key:24s} {t['median_s'] * 1e3:8.1f} ms  {t['tokens_per_s']:9.0f} tok/s  "
                f"{t['tflops']:6.0f} TFLOP/s  MFU {t['mfu']:.2f}",
                flush=True,
            )
        else:
            print(f"{key:24s} {t['error']}", flush=True)
    common.write("sft", f"sft-{args.model}", result, args.out)


if __name__ == "__main__":
    main()
