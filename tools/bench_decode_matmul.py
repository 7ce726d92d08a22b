"""Benchmark a decode step's FFN: OPT's fc1 and fc2 in our Pallas kernel (kernels.decode_matmul) against XLA.

    PYTHONPATH=. python tools/bench_decode_matmul.py --model opt-1.3b --rows 16 32 64 [--profile]
    PYTHONPATH=. python tools/bench_decode_matmul.py --model opt-125m --rows 16 --layers 2 --loops 1  # CPU

What one decode step of an OPT model runs per layer after its attention, on the decode layout's weights (the
FFN's LayerNorm folded into fc1, models.common.fold_norm), with random weights of the model's shape in bf16:
- "kernel": the rows' sums, fc1 in one kernel (the norm's end, bias and ReLU per program), fc2 split over K,
  the partials' sum with the bias and the residual (what `common.decode_product` runs at 16, 32 or 64 rows);
- "xla": the same function as XLA runs it without the kernel (more rows, the prefill): the norm's mean and
  1 / std, fc1 on the normalised rows with bias and ReLU in cuBLAS's epilogue, fc2 with bias and residual.
Each layer has its own weights (`--layers`, default the model's count, so they are not in L2) and the layers
are chained through h, as in a step, `--loops` times in one compiled loop. Figures per row count: microseconds
per layer for each form, the speed-up, and the ratio to the read roofline: fc1's and fc2's weights read once
over the read bandwidth measured in this run (tools.common.read_bandwidth; not on the CPU, where the kernel
runs in interpret mode). `--profile` adds each form's kernels by device time. The two forms' outputs after
one layer are compared (max_rel_err).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrlhf.kernels import decode_matmul as dm  # noqa: E402
from jaxrlhf.models import opt  # noqa: E402
from jaxrlhf.models.common import fold_norm, norm_rows, row_sums  # noqa: E402
from tools import common  # noqa: E402

EPS = 1e-5  # OPT's layer_norm_eps


def make_layers(key, layers: int, D: int, F: int, dtype=jnp.bfloat16) -> list[dict]:
    """`layers` FFNs of width D and F in the decode layout: fc1 with a LayerNorm's scale and shift folded in
    ("kernel", "bias", "colsum"), fc2 ("kernel", "bias")."""
    out = []
    for k in jax.random.split(key, layers):
        k = jax.random.split(k, 6)
        normal = lambda i, shape, s: jax.random.normal(k[i], shape, jnp.float32) * s
        fc1 = {"kernel": normal(0, (D, F), 0.02).astype(dtype), "bias": normal(1, (F,), 0.02).astype(dtype)}
        fc1 = fold_norm(
            fc1, (1 + normal(2, (D,), 0.1)).astype(dtype), normal(3, (D,), 0.1).astype(dtype), colsum_dtype=dtype
        )
        out.append(
            {
                "fc1": fc1,
                "fc2": {"kernel": normal(4, (F, D), 0.02).astype(dtype), "bias": normal(5, (D,), 0.02).astype(dtype)},
            }
        )
    return out


def ffn(h, w: dict, kernel: bool, interpret: bool | None = None):
    """One layer's FFN on h [M, D] (its residual added): in the kernels (`kernel`) or in XLA."""
    fc1, fc2 = w["fc1"], w["fc2"]
    if kernel:
        y = dm.decode_matmul(
            h,
            fc1["kernel"],
            bias=fc1["bias"],
            layer_norm=(*row_sums(h), fc1["colsum"], EPS),
            relu=True,
            interpret=interpret,
        )
        y = dm.decode_matmul(y, fc2["kernel"], interpret=interpret) + fc2["bias"].astype(jnp.float32)
        return h + y.astype(h.dtype)
    scale, mean = norm_rows(h, EPS, centred=True)
    x = ((h - mean) * scale).astype(h.dtype)
    y = jax.nn.relu(jnp.dot(x, fc1["kernel"]) + fc1["bias"])
    return h + (jnp.dot(y, fc2["kernel"]) + fc2["bias"])


def chain(kernel: bool, loops: int, interpret: bool | None = None):
    """A jitted h -> h through every layer, `loops` times (one compiled loop)."""

    def run(h, layers):
        step = lambda _, h: functools.reduce(lambda h, w: ffn(h, w, kernel, interpret), layers, h)
        return jax.lax.fori_loop(0, loops, step, h)

    return jax.jit(run)


def layer_bytes(D: int, F: int, dtype=jnp.bfloat16) -> int:
    """The bytes one layer's FFN must read at least: fc1's and fc2's weight matrices."""
    return 2 * D * F * jnp.dtype(dtype).itemsize


def max_rel_err(h, layer: dict, interpret: bool | None = None) -> float:
    """The kernel form against XLA's after one layer: max |difference| over max |XLA's output - h|."""
    a, b = (jax.jit(lambda h, w, k=k: ffn(h, w, k, interpret))(h, layer) for k in (True, False))
    a, b, h = (x.astype(jnp.float32) for x in (a, b, h))
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b - h)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pre_ln = sorted(name for name, p in opt.PRESETS.items() if p.get("do_layer_norm_before", True))
    ap.add_argument(
        "--model",
        default="opt-1.3b",
        choices=pre_ln,
        help="the FFN's widths D and F (pre-LN models: their FFN norm folds into fc1)",
    )
    ap.add_argument("--rows", type=int, nargs="+", default=list(dm.ROWS), help=f"rows (the batch): {dm.ROWS}")
    ap.add_argument("--layers", type=int, default=None, help="distinct layers chained (default: the model's)")
    ap.add_argument("--loops", type=int, default=8, help="passes over the layers per timed call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="add each form's kernels by device time")
    ap.add_argument("--out", default=None, help="results directory (default bench/results/decode-matmul)")
    args = ap.parse_args()
    preset = opt.PRESETS[args.model]
    D, F, L = preset["hidden_size"], preset["ffn_dim"], args.layers or preset["num_hidden_layers"]
    if any(not dm.applies(m, D, F) or not dm.applies(m, F, D) for m in args.rows):
        ap.error(f"--rows: the kernel takes {dm.ROWS} rows (and D, F multiples of {dm.BLOCK_K}); got {args.rows}")
    gpu = jax.default_backend() == "gpu"
    bandwidth = common.read_bandwidth() if gpu else None
    result = {
        "benchmark": "decode_matmul",
        **common.environment(),
        "model": args.model,
        "D": D,
        "F": F,
        "layers": L,
        "loops": args.loops,
        "split": dm.split_for(F, D),
        "read_bandwidth_Bps": bandwidth,
        "knobs": {"BLOCK_N": dm.BLOCK_N, "BLOCK_K": dm.BLOCK_K, "NUM_WARPS": dm.NUM_WARPS, "NUM_STAGES": dm.NUM_STAGES},
        "runs": [],
    }
    layers = make_layers(jax.random.key(0), L, D, F)
    roofline_us = 1e6 * layer_bytes(D, F) / bandwidth if bandwidth else None
    for M in args.rows:
        h = jax.random.normal(jax.random.key(M), (M, D), jnp.float32).astype(jnp.bfloat16)
        run = {"rows": M, "max_rel_err": max_rel_err(h, layers[0]), "roofline_us": roofline_us}
        for form, kernel in (("kernel", True), ("xla", False)):
            fn = chain(kernel, args.loops)
            t = common.timeit(lambda: fn(h, layers), repeats=args.repeats, warmup=1)
            us = 1e6 * t["median_s"] / (args.loops * L)
            run[form] = {"us_per_layer": us, "timing": t, "roofline_ratio": us / roofline_us if roofline_us else None}
            if args.profile and gpu:
                with tempfile.TemporaryDirectory() as d:
                    run[form]["profile"] = common.kernel_profile(lambda: fn(h, layers), d, top=20)
        run["speedup"] = run["xla"]["us_per_layer"] / run["kernel"]["us_per_layer"]
        result["runs"].append(run)
        ratio = lambda f: f", {run[f]['roofline_ratio']:.2f}x roofline" if roofline_us else ""
        print(
            f"rows {M:3d}: kernel {run['kernel']['us_per_layer']:7.2f} us/layer{ratio('kernel')}, "
            f"xla {run['xla']['us_per_layer']:7.2f}{ratio('xla')}, speed-up {run['speedup']:.2f}x, "
            f"max rel err {run['max_rel_err']:.2e}",
            flush=True,
        )
    common.write("decode-matmul", f"decode-matmul-{args.model}", result, args.out)


if __name__ == "__main__":
    main()
