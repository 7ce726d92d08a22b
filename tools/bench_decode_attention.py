"""Benchmark the decode-attention kernel against the plain-XLA path (BENCHMARKS.md item 2).

    PYTHONPATH=. python tools/bench_decode_attention.py [--tune] [--splits 1 2 4 8 0] [--mask-loads 1 0]
    PYTHONPATH=. python tools/bench_decode_attention.py --batch 2 --seq 64 --head-dim 64 --heads 4 --calls 2  # CPU

Shapes: batch 32-256, 32 query heads with 32 or 8 KV heads, head dim 64 and 128, cache length 512 and 2048,
bf16. Each row's valid range is ragged: left padding up to S/8 and a current length between S/2 and S
("ragged"), or the whole cache ("full"). A call is timed as the mean over 64 chained calls inside one jitted
loop (each call's output is the next call's query), so Python dispatch stays out of the microseconds.
Roofline: the K and V bytes of the valid slots, read once, over the read bandwidth measured in this run (a
sum over 4 GiB; not measured on the CPU, where the kernel runs in interpret mode). "XLA read": XLA's row sum over
a contiguous array of the same bytes (time_read), what one XLA kernel takes to read them; small calls read well
below the 4 GiB rate. `--splits` times the kernel once per value of DecodeAttentionConfig.num_splits (0: auto,
the default; the JSON records what auto chose),
`--mask-loads 1 0` with and without masked loads (whole blocks: a row's first and last block read in full).
`--tune` first sweeps block_s, num_warps, num_stages and the product form at two shapes (`--tune-shapes`,
`--tune-ragged`) and uses the best of each kind (multi-head, grouped-query) in the table; `--tune-only` stops there.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrlhf.kernels.decode_attention import (  # noqa: E402
    DecodeAttentionConfig,
    decode_attention,
    decode_attention_reference,
)
from tools import common  # noqa: E402
from tools.bench_reshard import device_bandwidth  # noqa: E402

CALLS = 64  # --calls


def make_inputs(B, H, Hkv, S, K, ragged, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, H, K), jnp.bfloat16) * K**-0.5
    k = jax.random.normal(ks[1], (1, B, Hkv, S, K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, B, Hkv, S, K), jnp.bfloat16)
    if ragged:
        start = jax.random.randint(ks[3], (B,), 0, S // 8)
        end = jax.random.randint(ks[4], (B,), S // 2, S + 1)
    else:
        start, end = jnp.zeros((B,), jnp.int32), jnp.full((B,), S, jnp.int32)
    return q, k, v, start.astype(jnp.int32), end.astype(jnp.int32)


def time_call(config, q, k, v, start, end, calls=None) -> float:
    """Seconds per call: `calls` (default CALLS) chained calls in one program."""
    calls = calls or CALLS

    @jax.jit
    def loop(q, k, v, start, end):
        body = lambda _, q: decode_attention(q, k, v, start, end, 0, config=config)
        return jax.lax.fori_loop(0, calls, body, q)

    return common.timeit(lambda: loop(q, k, v, start, end), repeats=5, warmup=1)["median_s"] / calls


def time_read(rows: int, row_bytes: int, calls=None) -> float:
    """Seconds per call of XLA's row sum over a [rows, row_bytes / 2] bf16 array: the same bytes as a call's valid K
    and V slots (a row per (row, KV head) and K or V), read by one XLA kernel, timed as time_call times the
    kernel. Each call scales the array by a factor from the previous sum (1 in bf16), so no call leaves the loop."""
    calls = calls or CALLS
    a = jax.random.normal(jax.random.key(5), (rows, max(row_bytes // 2, 1)), jnp.bfloat16)

    @jax.jit
    def loop(a):
        body = lambda _, acc: acc + jnp.sum(a * (1 + 1e-30 * acc[0]).astype(a.dtype), axis=-1, dtype=jnp.float32)
        return jax.lax.fori_loop(0, calls, body, jnp.zeros((rows,), jnp.float32))

    return common.timeit(lambda: loop(a), repeats=5, warmup=1)["median_s"] / calls


def auto_splits(config, B, H, Hkv, S, K) -> int:
    """The number of splits the kernel runs with (what num_splits=0 resolves to at this shape)."""
    cores = getattr(jax.devices()[0], "core_count", None) if jax.default_backend() == "gpu" else None
    return config.splits(B * Hkv, S, cores, K, H // Hkv)


def tune(bandwidth, result, shapes, ragged=False):
    """Sweep the knobs at each shape (B, H, Hkv, S, K) and time the best there with 2 and 4 splits too (recorded,
    not chosen: auto decides splits). Returns the best config of each kind (multi-head, grouped-query) at the
    first shape of that kind (times at different shapes do not compare)."""
    best = {}
    for B, H, Hkv, S, K in shapes:
        x = make_inputs(B, H, Hkv, S, K, ragged)
        key = "mha" if Hkv == H else "gqa"
        first, here = key not in best, None
        record = lambda cfg, t: result["tuning"].append(
            {"B": B, "H": H, "Hkv": Hkv, "S": S, "K": K, "ragged": ragged, **dataclasses.asdict(cfg), "us": 1e6 * t}
        )
        for use_dot in (False, True) if Hkv == H else (True,):
            for block_s, warps, stages in itertools.product((16, 32, 64, 128), (2, 4, 8), (2, 3, 4)):
                cfg = DecodeAttentionConfig(
                    "pallas", block_s=block_s, num_warps=warps, num_stages=stages, use_dot=use_dot, num_splits=1
                )
                try:
                    t = time_call(cfg, *x)
                except Exception as e:  # noqa: BLE001 - a knob setting that does not compile
                    print(f"tune {cfg}: {str(e)[:160]}", flush=True)
                    continue
                record(cfg, t)
                print(
                    f"tune B={B} S={S} K={K} Hkv={Hkv} dot={int(use_dot)} bs={block_s:3d} w={warps} "
                    f"st={stages}: {1e6 * t:6.1f} us",
                    flush=True,
                )
                if here is None or t < here[0]:
                    here = (t, cfg)
                    if first:
                        best[key] = here
        for n in (2, 4) if here else ():
            cfg = dataclasses.replace(here[1], num_splits=n)
            t = time_call(cfg, *x)
            record(cfg, t)
            print(
                f"tune B={B} S={S} K={K} Hkv={Hkv} best {here[1].block_s}/{here[1].num_warps}/"
                f"{here[1].num_stages}: {1e6 * here[0]:6.1f} us, {n} splits {1e6 * t:6.1f} us",
                flush=True,
            )
    return {key: cfg for key, (t, cfg) in best.items()}


def main():
    global CALLS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 2048], help="cache lengths S")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    ap.add_argument(
        "--heads",
        type=int,
        default=None,
        help="query heads (default: 2048 / head dim); KV heads: as many (multi-head) and a quarter (grouped-query)",
    )
    ap.add_argument(
        "--kv-heads",
        type=int,
        nargs="+",
        default=None,
        help="KV heads to time (default: --heads and a quarter of them); e.g. 2 for Qwen2.5-1.5B's 12 query heads",
    )
    ap.add_argument(
        "--splits",
        type=int,
        nargs="+",
        default=[0],
        help="DecodeAttentionConfig.num_splits values to time the kernel with (0: auto)",
    )
    ap.add_argument(
        "--mask-loads",
        type=int,
        nargs="+",
        default=[1],
        choices=[0, 1],
        help="DecodeAttentionConfig.mask_loads values to time the kernel with (1: only the valid slots "
        "of a block are fetched, the default; 0: whole blocks)",
    )
    ap.add_argument("--calls", type=int, default=CALLS, help="chained calls per timing")
    ap.add_argument("--tune", action="store_true", help="sweep the knobs first and use the best in the table")
    ap.add_argument(
        "--tune-shapes",
        nargs="+",
        default=["64,32,32,2048,64", "64,32,8,2048,128"],
        metavar="B,H,Hkv,S,K",
        help="the shapes --tune sweeps at (default: OPT-1.3B's heads and a grouped-query one, S = 2048)",
    )
    ap.add_argument("--tune-ragged", action="store_true", help="sweep with ragged valid ranges (as in generation)")
    ap.add_argument("--tune-only", action="store_true", help="stop after the sweep (no table)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    CALLS = args.calls
    gpu = jax.default_backend() == "gpu"
    bandwidth = common.read_bandwidth() if gpu else None  # 4 GiB reads: not on the CPU
    default, xla = DecodeAttentionConfig(implementation="pallas"), DecodeAttentionConfig(implementation="xla")
    result = {
        "benchmark": "decode_attention",
        **common.environment(),
        "read_bandwidth_Bps": bandwidth,
        "copy_bandwidth_Bps": device_bandwidth() if gpu else None,
        "calls_per_timing": CALLS,
        "splits": args.splits,
        "mask_loads": args.mask_loads,
        "runs": [],
        "tuning": [],
    }
    if gpu:
        print(
            f"read bandwidth {bandwidth / 1e12:.2f} TB/s, copy {result['copy_bandwidth_Bps'] / 1e12:.2f} TB/s",
            flush=True,
        )
    shapes = [tuple(int(n) for n in shape.split(",")) for shape in args.tune_shapes]
    if any(len(shape) != 5 for shape in shapes):
        ap.error(f"--tune-shapes: expected B,H,Hkv,S,K for each shape, got {args.tune_shapes}")
    chosen = tune(bandwidth, result, shapes, args.tune_ragged) if args.tune else {}
    if args.tune_only:
        args.batch = []
    result["kernel_config"] = {key: dataclasses.asdict(chosen.get(key, default)) for key in ("mha", "gqa")}
    ratio = lambda t, need: t * bandwidth / need if bandwidth else None
    for K in args.head_dim:
        H = args.heads or 2048 // K  # 32 heads of 64 (OPT-1.3B), 16 of 128
        for Hkv in args.kv_heads or ((H, H // 4) if H >= 4 else (H,)):
            kernel = chosen.get("mha" if Hkv == H else "gqa", default)
            for S in args.seq:
                for B in args.batch:
                    for ragged in (True, False):
                        if B * S * Hkv * K * 2 * 2 > 8 * 2**30:
                            continue
                        x = make_inputs(B, H, Hkv, S, K, ragged)
                        ref = decode_attention_reference(*x).astype(jnp.float32)
                        valid = int(np.sum(np.asarray(x[4]) - np.asarray(x[3])))
                        need = valid * Hkv * K * 2 * 2 + 2 * q_bytes(x[0])
                        t_x = time_call(xla, *x)
                        t_read = time_read(2 * B * Hkv, valid // B * K * 2)
                        run = {
                            "B": B,
                            "H": H,
                            "Hkv": Hkv,
                            "K": K,
                            "S": S,
                            "ragged": ragged,
                            "xla_us": 1e6 * t_x,
                            "xla_read_us": 1e6 * t_read,
                            "roofline_us": 1e6 * need / bandwidth if bandwidth else None,
                            "xla_roofline_ratio": ratio(t_x, need),
                            "kernel": [],
                        }
                        line = [
                            f"B={B:3d} H={H} Hkv={Hkv:2d} K={K:3d} S={S:4d} {'ragged' if ragged else 'full  '} "
                            f"xla {1e6 * t_x:7.1f} us"
                            + (f" ({ratio(t_x, need):.2f}x roofline)" if gpu else "")
                            + f" | XLA read {1e6 * t_read:7.1f} us"
                        ]
                        for n, masked in itertools.product(args.splits, args.mask_loads):
                            cfg = dataclasses.replace(kernel, num_splits=n, mask_loads=bool(masked))
                            used = auto_splits(cfg, B, H, Hkv, S, K)
                            err = float(jnp.max(jnp.abs(decode_attention(*x, config=cfg).astype(jnp.float32) - ref)))
                            t_k = time_call(cfg, *x)
                            run["kernel"].append(
                                {
                                    "num_splits": n,
                                    "splits_used": used,
                                    "mask_loads": bool(masked),
                                    "us": 1e6 * t_k,
                                    "speedup": t_x / t_k,
                                    "read_ratio": t_k / t_read,
                                    "roofline_ratio": ratio(t_k, need),
                                    "max_abs_err": err,
                                }
                            )
                            line.append(
                                f"splits {n or 'auto'}{f'={used}' if not n else ''}"
                                f"{'' if masked else ' whole blocks'} {1e6 * t_k:7.1f} us "
                                f"({t_x / t_k:.2f}x xla, {t_k / t_read:.2f}x read"
                                + (f", {ratio(t_k, need):.2f}x roofline" if gpu else "")
                                + f", err {err:.0e})"
                            )
                        result["runs"].append(run)
                        print(" | ".join(line), flush=True)
    common.write("decode-attention", "decode-attention", result, args.out)


def q_bytes(q):
    return q.size * q.dtype.itemsize


if __name__ == "__main__":
    main()
