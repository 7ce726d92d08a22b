"""Benchmark the OPT forward (scoring) and forward + backward (training) on one GPU, against HF PyTorch.

    PYTHONPATH=. python tools/bench_forward.py --model opt-1.3b --batch 8 32 --seq 512 [--out DIR]

Random weights of the real shape in bf16, random tokens, no padding. Ours: jitted `logits` reduced to
per-token log-probs (what Step 3 scores with), and `jax.value_and_grad` of the mean log-prob (the core
of a training step), with and without per-layer remat. Theirs, in the same run: transformers'
OPTForCausalLM in bf16 (eager, SDPA attention). TFLOP/s by DeepSpeed-Chat's count: 2·N·tokens forward,
6·N·tokens forward + backward; the bf16 matmul ceiling (8192³) is measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrlhf.models import Backend, OPTConfig, init_params, logits  # noqa: E402
from jaxrlhf.models.opt import PRESETS  # noqa: E402
from tools import common  # noqa: E402


def matmul_ceiling() -> float:
    a = jnp.ones((8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    return 2 * 8192**3 / common.timeit(lambda: mm(a))["median_s"]


def token_logprobs(config, params, ids, mask):
    lp = jax.nn.log_softmax(logits(config, params, ids, mask)[:, :-1])
    return jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]


def ours(config, params, B, T, repeats):
    ids = jax.random.randint(jax.random.key(1), (B, T), 3, config.vocab_size)
    mask = jnp.ones_like(ids)
    fwd = jax.jit(lambda p: token_logprobs(config, p, ids, mask))
    out = {"forward": common.timeit(lambda: fwd(params), repeats)}
    for remat in (False, True):
        cfg = dataclasses.replace(config, remat=remat)
        step = jax.jit(jax.value_and_grad(lambda p: -jnp.mean(token_logprobs(cfg, p, ids, mask))))
        try:
            out[f"forward_backward{'_remat' if remat else ''}"] = common.timeit(lambda: step(params), repeats)
        except Exception as e:  # noqa: BLE001 - out of memory at this batch: record it and go on
            out[f"forward_backward{'_remat' if remat else ''}"] = {"error": str(e).splitlines()[0][:200]}
    return out


def theirs(name, B, T, repeats):

    import torch
    from transformers import OPTConfig as HFConfig
    from transformers import OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(HFConfig(**PRESETS[name], attn_implementation="sdpa")).to("cuda", torch.bfloat16)
    ids = torch.randint(3, 50272, (B, T), device="cuda")

    timed = lambda fn: common.timeit(fn, repeats, block=lambda _: torch.cuda.synchronize())

    def fwd():
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
            return lp.gather(-1, ids[:, 1:, None])

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        lp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
        (-lp.mean()).backward()

    out = {"forward": timed(fwd)}
    try:
        out["forward_backward"] = timed(fwd_bwd)
    except torch.OutOfMemoryError as e:
        out["forward_backward"] = {"error": str(e).splitlines()[0][:200]}
    model = None  # the closures hold it: free the GPU memory before the next run
    torch.cuda.empty_cache()
    return out


def check_against_hf(config, params, folder) -> dict:
    """bf16 token log-probs of ours and of transformers against transformers in float32 (TF32 off), same
    weights, on a batch with left padding: both bf16 implementations should be equally far from it."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from jaxrlhf.checkpoint import save_hf

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    save_hf(folder, config, jax.device_get(params))
    ids = np.array(jax.random.randint(jax.random.key(2), (4, 128), 3, config.vocab_size), np.int32)
    mask = np.ones_like(ids)
    mask[1, :40], mask[3, :100] = 0, 0
    ids[mask == 0] = config.pad_token_id
    t_ids = torch.tensor(ids, device="cuda", dtype=torch.long)

    def hf(dtype):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to("cuda")
        with torch.no_grad():
            out = model(t_ids, attention_mask=torch.tensor(mask, device="cuda")).logits[:, :-1].float()
        return torch.log_softmax(out, -1).gather(-1, t_ids[:, 1:, None])[..., 0].cpu().numpy()

    truth = hf(torch.float32)
    real = mask[:, 1:] == 1
    got = {
        "ours_bf16": np.asarray(token_logprobs(config, params, jnp.asarray(ids), jnp.asarray(mask))),
        "hf_bf16": hf(torch.bfloat16),
    }
    return {
        name: {
            "max_abs_diff": float(np.abs(v - truth)[real].max()),
            "mean_abs_diff": float(np.abs(v - truth)[real].mean()),
        }
        for name, v in got.items()
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-1.3b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "cudnn", "xla"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    config = OPTConfig(**PRESETS[args.model], dtype="bfloat16", dropout=0.0, backend=Backend.detect())
    params = jax.jit(lambda k: init_params(config, k, dtype=jnp.bfloat16))(jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(params))
    ceiling = matmul_ceiling()
    result = {
        "benchmark": "forward",
        **common.environment(),
        "model": args.model,
        "params": n,
        "seq": args.seq,
        "matmul_ceiling_flops": ceiling,
        "runs": [],
    }
    if not args.no_hf:
        import tempfile

        try:
            with tempfile.TemporaryDirectory() as tmp:
                check = check_against_hf(config, params, Path(tmp) / "model")
            result["bf16_logprobs_vs_hf_fp32"] = check
            print(f"bf16 token log-probs against transformers fp32 (left-padded batch): {check}")
        except Exception as e:  # noqa: BLE001 - the timings are still worth having
            result["bf16_logprob_check_error"] = repr(e)[:300]
            print(f"check against transformers failed: {e!r}")
    for B in args.batch:
        run = {"batch": B, "tokens": B * args.seq}
        for attention in args.attention:
            cfg = dataclasses.replace(config, backend=Backend.detect(attention=attention))
            run[f"ours_{attention}"] = ours(cfg, params, B, args.seq, args.repeats)
        if not args.no_hf:
            run["hf_torch"] = theirs(args.model, B, args.seq, args.repeats)
        for impl in [k for k in run if k.startswith("ours")] + ["hf_torch"]:
            for key, t in run.get(impl, {}).items():
                if "median_s" in t:
                    flops = (2 if key == "forward" else 6) * n * B * args.seq
                    t["tflops"] = flops / t["median_s"] / 1e12
                    t["fraction_of_matmul_ceiling"] = flops / t["median_s"] / ceiling
                    print(
                        f"B={B} {impl:10s} {key:22s} {t['median_s'] * 1e3:8.1f} ms  {t['tflops']:6.0f} TFLOP/s",
                        flush=True,
                    )
                else:
                    print(f"B={B} {impl:10s} {key:22s} {t['error']}", flush=True)
        result["runs"].append(run)
    common.write("forward", f"forward-{args.model}", result, args.out)


if __name__ == "__main__":
    main()
