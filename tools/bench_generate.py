"""Benchmark KV-cached generation on the GPU against Hugging Face generate (static and dynamic cache).

    PYTHONPATH=. python tools/bench_generate.py --model opt-1.3b --batch 16 64 256 --prompt 256 --new 256 [--tp 1]
    PYTHONPATH=. python tools/bench_generate.py --model llama-7b-gqa --batch 16 64   # Llama-7B shape, 8 KV heads

Random weights of the real shape (bf16), random prompt tokens, sampling at temperature 1, answers forced to
full length (EOS off) so every system does the same work (BENCHMARKS.md item 1). Figures per batch: total
seconds, prefill seconds (a one-token generate), ms per decode step = (total - prefill) / (new - 1),
generated tokens/s, and the fraction of the memory roofline: the bytes one decode step must read (all
weights once plus the KV cache so far, averaged over the steps) over the read bandwidth measured here
(tools.common.read_bandwidth). On one device also the step against XLA reading the same bytes: the device time
of XLA row sums, one kernel per matrix and per layer's K and V (xla_read_time). Read in kernels of tens to
hundreds of MB, the bytes take longer than the roofline says. Hugging Face runs first, in a child process that
keeps JAX off the GPU.
"ours" generates with the decode layout that Step 3 uses (generate.decode_params, its build time reported as
decode_params_s); `--layout model` adds the model's own stacked tree ("ours_model_layout") for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from jaxrlhf.generate import Sampling, _generate, _Loop, decode_params, generate  # noqa: E402
from jaxrlhf.models import Backend, init_params, llama, opt, param_shapes, preset  # noqa: E402
from jaxrlhf.sharding import make_mesh, shardings_for  # noqa: E402
from tools import common  # noqa: E402
from tools.bench_reshard import device_bandwidth  # noqa: E402

PRESETS = {**opt.PRESETS, **llama.PRESETS}


def step_bytes(config, B: int, P: int, G: int) -> float:
    """Bytes one decode step reads on average: the bf16 weights once, and K and V of the cache so far."""
    weights = 2 * sum(x.size for x in jax.tree.leaves(param_shapes(config)))
    heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    kv_per_token = 2 * 2 * config.num_hidden_layers * heads * config.hidden_size // config.num_attention_heads
    return weights + kv_per_token * B * (P + G / 2)


def xla_reads(config, params, B: int, P: int, G: int, min_bytes: int = 2**18):
    """A decode step's reads alone, one XLA row sum (one kernel) per read: each leaf of `params` (the decode
    layout) of at least `min_bytes` (a matrix of a product, the embeddings), and each layer's K and V over the
    slots so far (P + G/2, the steps' average, as step_bytes counts them), here caches of exactly that length,
    so that every read is one contiguous array. Returns (fn() -> the sums, the bytes read)."""
    mats = [x for x in jax.tree.leaves(params) if x.nbytes >= min_bytes]
    heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    L, n = config.num_hidden_layers, P + G // 2
    # K and V of each layer, a row per (row, head); separate arrays, as XLA merges sums of slices of one array
    shape = (B * heads, n * config.hidden_size // config.num_attention_heads)
    cache = [jax.random.normal(jax.random.fold_in(jax.random.key(4), i), shape, jnp.bfloat16) for i in range(2 * L)]

    @jax.jit
    def reads(mats, cache):
        rows = lambda x: jnp.sum(x.reshape(-1, x.shape[-1]), axis=-1, dtype=jnp.float32)
        return [rows(x) for x in mats + cache]

    return lambda: reads(mats, cache), sum(x.nbytes for x in mats + cache)


def xla_read_time(config, params, B: int, P: int, G: int) -> dict:
    """The device time of `xla_reads` (its kernel launches and largest kernels too): a decode step's bytes read by
    XLA's own reduction kernels, one per matrix. The roofline divides those bytes by the bandwidth of one 4 GiB
    read; a kernel of a few to a few hundred MB reads slower than that (a ramp per kernel, docs/benchmarks.md).
    {"ms": None} on the CPU (no device trace)."""
    import tempfile

    fn, nbytes = xla_reads(config, params, B, P, G)
    with tempfile.TemporaryDirectory() as d:
        lines = common.kernel_profile(fn, d, top=10**6)
    line = max(lines.values(), key=lambda v: v["busy_ms"], default={"busy_ms": None, "kernels": []})
    return {
        "ms": line["busy_ms"],
        "bytes": nbytes,
        "launches": sum(k["count"] for k in line["kernels"]),
        "kernels": line["kernels"][:6],
    }


def ours(config, params, mesh, B, Pn, G, repeats, decode, profile_dir=None):
    """Seconds for the whole generation and for its prefill alone; with `profile_dir`, also the kernels of one
    whole generation by device time (common.kernel_profile). `params`: the model's tree or the decode layout."""
    config = dataclasses.replace(config, backend=dataclasses.replace(config.backend, decode_attention=decode))
    ids = jax.random.randint(jax.random.key(1), (B, Pn), 3, config.vocab_size)
    batch = jax.device_put((ids, jnp.ones_like(ids)), NamedSharding(mesh, P("data")))
    run = lambda n: (
        lambda: (
            generate(
                config,
                params,
                *batch,
                jax.random.key(2),
                max_new_tokens=n,
                force_length=True,
                mesh=mesh if mesh.size > 1 else None,
            ).tokens
        )
    )
    result = {"total": common.timeit(run(G), repeats, warmup=1), "prefill": common.timeit(run(1), repeats, warmup=1)}
    if profile_dir:
        result["profile"] = common.kernel_profile(run(G), profile_dir)
        # The optimized HLO of the same program, to tell which instruction each kernel of the profile is.
        B = batch[0].shape[0]  # as generate() builds its loop: one slot per row, refills of B / 8, checks every 8
        loop = _Loop(
            G, Sampling(), (), config.pad_token_id, True, B, max(B // 8, 1), 8, mesh if mesh.size > 1 else None, 1
        )
        lowered = _generate.lower(config, loop, params, *batch, jax.random.key(2), jnp.full((B,), G, jnp.int32))
        with gzip.open(Path(profile_dir) / "generate.hlo.txt.gz", "wt") as f:
            f.write(lowered.compile().as_text())
    return result


def tp_tokens_match(config, params, mesh, B, Pn, G) -> dict:
    """Greedy tokens on the tensor-parallel mesh against one device, same weights and prompts, in bf16 and in
    float32 (with true float32 products: XLA's GPU matmuls otherwise use TF32, and near-ties of random logits
    flip with the summation order): the share of rows that agree over all G tokens and the first step where
    any row departs."""
    ids = jax.random.randint(jax.random.key(3), (B, Pn), 3, config.vocab_size)
    batch = jax.device_put((ids, jnp.ones_like(ids)), NamedSharding(mesh, P("data")))
    greedy = lambda cfg, p, *inputs, **kw: (
        generate(cfg, p, *inputs, jax.random.key(2), max_new_tokens=G, temperature=0.0, force_length=True, **kw).tokens
    )
    result = {}
    for dtype, precision in (("bfloat16", "default"), ("float32", "highest")):
        with jax.default_matmul_precision(precision):
            cfg = dataclasses.replace(config, dtype=dtype)
            cast = jax.tree.map(lambda x: x.astype(dtype), params)
            tp = greedy(cfg, decode_params(cfg, cast, mesh), *batch, mesh=mesh)
            single = greedy(cfg, jax.device_put(cast, jax.devices()[0]), ids, jnp.ones_like(ids))
        same = jax.device_get(tp) == jax.device_get(single)
        departs = [int(i) for i in range(G) if not same[:, i].all()]
        result[dtype] = {
            "rows_equal": float(same.all(axis=1).mean()),
            "first_step_differing": departs[0] if departs else None,
        }
        print(f"TP {mesh.shape['model']} vs 1 device, greedy {dtype}: {result[dtype]}", flush=True)
    return result


def theirs(name, B, Pn, G, cache, repeats):
    import torch
    import transformers

    family = "Llama" if name in llama.PRESETS else "OPT"
    hf_config = getattr(transformers, f"{family}Config")(**PRESETS[name], attn_implementation="sdpa")
    model = getattr(transformers, f"{family}ForCausalLM")(hf_config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(3, hf_config.vocab_size, (B, Pn), device="cuda")
    kwargs = dict(max_new_tokens=G, min_new_tokens=G, do_sample=True, top_k=0, attention_mask=torch.ones_like(ids))
    if cache == "static":
        kwargs["cache_implementation"] = "static"
        # transformers compiles the forward itself for a static cache (compiling it here as well made
        # CUDA graphs overwrite outputs that generate still reads)

    def run(n):
        with torch.no_grad():
            return model.generate(ids, **{**kwargs, "max_new_tokens": n, "min_new_tokens": n})

    sync = lambda _: torch.cuda.synchronize()
    result = {
        "total": common.timeit(lambda: run(G), repeats, block=sync),
        "prefill": common.timeit(lambda: run(1), repeats, block=sync),
    }
    model = None  # free the weights and cache before the next configuration
    torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-1.3b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the devices used: all)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--unroll", type=int, default=0, help="Backend.scan_unroll (0: auto, no loop on a GPU)")
    ap.add_argument(
        "--decode",
        nargs="+",
        default=["pallas", "xla"],
        choices=["pallas", "xla"],
        help="our decode attention: the Pallas kernel and/or the plain-XLA path",
    )
    ap.add_argument(
        "--layout",
        nargs="+",
        default=["decode"],
        choices=["decode", "model"],
        help="the weights as generation takes them: the decode layout (generate.decode_params, what "
        "Step 3 runs) and/or the model's own tree (each step slices the stacked layers)",
    )
    ap.add_argument(
        "--hf",
        nargs="*",
        default=["static", "dynamic"],
        choices=["static", "dynamic"],
        help="transformers' generate in a child process, before ours: its static and/or dynamic cache "
        "(default both; the dynamic cache takes minutes at 7B); --hf alone: none",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also trace one generation per batch (Pallas decode) and record its kernels by device time; "
        "the traces stay in OUT/trace-generate-B for Perfetto",
    )
    ap.add_argument(
        "--check-tokens",
        action="store_true",
        help="with --tp > 1: greedy tokens of the TP mesh against one device (bf16 and float32)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--only-hf", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.only_hf:
        print(
            json.dumps(
                {
                    B: {
                        f"hf_{cache}": common.safely(theirs, args.model, B, args.prompt, args.new, cache, args.repeats)
                        for cache in args.hf
                    }
                    for B in args.batch
                }
            )
        )
        return
    argv = [
        __file__,
        "--only-hf",
        "--model",
        args.model,
        "--batch",
        *map(str, args.batch),
        "--prompt",
        str(args.prompt),
        "--new",
        str(args.new),
        "--repeats",
        str(args.repeats),
        "--hf",
        *args.hf,
    ]
    if args.hf:
        print(
            f"transformers generate ({', '.join(args.hf)} cache) at batch {args.batch}, in a child process ...",
            flush=True,
        )
    hf_runs = common.torch_child(argv, args.batch) if args.hf else {}
    config = preset(args.model, dtype="bfloat16", backend=Backend.detect(scan_unroll=args.unroll))
    mesh = make_mesh(args.tp)
    params = jax.jit(
        lambda k: init_params(config, k, dtype=jnp.bfloat16),
        out_shardings=shardings_for(param_shapes(config), "tp", mesh),
    )(jax.random.key(0))
    layout_s = common.timeit(lambda: decode_params(config, params, mesh if mesh.size > 1 else None), args.repeats)
    layouts = {"decode": decode_params(config, params, mesh if mesh.size > 1 else None), "model": params}
    bandwidth = common.read_bandwidth()
    result = {
        "benchmark": "generate",
        **common.environment(),
        "model": args.model,
        "prompt": args.prompt,
        "new": args.new,
        "mesh": dict(mesh.shape),
        "scan_unroll": args.unroll,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "read_bandwidth_Bps": bandwidth,
        "decode_params_s": layout_s,
        "copy_bandwidth_Bps": device_bandwidth(),
        "runs": [],
    }
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for B in args.batch:
        run = {"batch": B}
        for layout in args.layout:
            for decode in args.decode:
                name = (
                    "ours"
                    + ("" if decode == "pallas" else f"_{decode}")
                    + ("" if layout == "decode" else "_model_layout")
                )
                trace = (
                    Path(args.out or common.RESULTS / "generate")
                    / (f"trace-generate-{B}" + ("" if name == "ours" else f"-{name}"))
                    if args.profile and decode == "pallas"
                    else None
                )
                run[name] = ours(config, layouts[layout], mesh, B, args.prompt, args.new, args.repeats, decode, trace)
        if mesh.size == 1:
            # its own copy of the cache: out of memory at a large batch, the row says so and the runs go on
            reads = run["xla_reads"] = common.safely(xla_read_time, config, layouts["decode"], B, args.prompt, args.new)
            print(
                f"B={B:4d} XLA reads of a step's bytes "
                + (
                    f"{reads['ms'] or float('nan'):.3f} ms ({reads['bytes'] / 1e9:.2f} GB, "
                    f"a row sum per matrix and per layer's K, V: {reads['launches']} kernels)"
                    if "error" not in reads
                    else reads["error"]
                ),
                flush=True,
            )
        hf = hf_runs.get(str(B), {})
        run.update(hf if "error" not in hf else {f"hf_{cache}": hf for cache in args.hf})
        for impl, r in run.items():
            if not isinstance(r, dict) or "total" not in r:
                continue
            total, prefill = r["total"]["median_s"], r["prefill"]["median_s"]
            r["ms_per_step"] = 1e3 * (total - prefill) / max(args.new - 1, 1)
            r["tokens_per_s"] = B * args.new / total
            r["roofline_fraction"] = (
                step_bytes(config, B, args.prompt, args.new) / bandwidth / (r["ms_per_step"] / 1e3) / mesh.size
            )
            reads = run.get("xla_reads", {}).get("ms")
            r["xla_reads_ratio"] = r["ms_per_step"] / reads if reads else None
            print(
                f"B={B:4d} {impl:10s} total {total:7.3f} s  prefill {prefill:6.3f} s  {r['ms_per_step']:6.2f} ms/step  "
                f"{r['tokens_per_s']:8.0f} tok/s  roofline {r['roofline_fraction']:.2f}"
                + (f"  {r['xla_reads_ratio']:.2f}x XLA's reads" if reads else ""),
                flush=True,
            )
        if args.check_tokens and mesh.shape["model"] > 1:
            run["tp_tokens_match"] = tp_tokens_match(config, params, mesh, B, args.prompt, args.new)
        result["runs"].append(run)
        common.write("generate", f"generate-{args.model}", result, args.out, stamp)  # what we have so far


if __name__ == "__main__":
    main()
