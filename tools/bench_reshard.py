"""Benchmark `reshard` between the FSDP (training) and tensor-parallel (generation) layouts.

    PYTHONPATH=. python tools/bench_reshard.py --models opt-1.3b opt-6.7b --tp 2 [--out DIR]

For each model (random weights of the real OPT shape, bf16, initialised straight into the FSDP layout):
ours (a cached jitted identity with out_shardings) against plain `jax.device_put`, both directions,
and FSDP -> fully replicated for reference. Reports median seconds, the bytes each device must
receive (the TP shard it lacks), GB/s, the collectives in the compiled program, whether anything
touched the host, and the device bandwidth ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from jaxrlhf.models import OPTConfig, init_params, param_shapes  # noqa: E402
from jaxrlhf.models.opt import PRESETS  # noqa: E402
from jaxrlhf.sharding import _identity, make_mesh, reshard, shardings_for  # noqa: E402
from tools import common  # noqa: E402


def device_bandwidth() -> float:
    """Bytes read + written per second by `a + 1` on 2 GiB of bf16 (the memory roofline)."""
    a = jnp.zeros((2**30,), jnp.bfloat16)
    add = jax.jit(lambda x: x + 1)
    t = common.timeit(lambda: add(a), repeats=10)
    return 2 * a.nbytes / t["median_s"]


def bytes_per_device(tree) -> int:
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def received_bytes(src, dst) -> int:
    """Bytes device 0 must receive: the part of its destination shards that its source shards lack."""
    total = 0
    dev = jax.devices()[0]
    for a, b in zip(jax.tree.leaves(src), jax.tree.leaves(dst)):
        have = a.sharding.devices_indices_map(a.shape)[dev]
        need = b.sharding.devices_indices_map(b.shape)[dev]
        size = lambda idx: int(np.prod([len(range(*s.indices(n))) for s, n in zip(idx, a.shape)]))
        overlap = tuple(
            slice(max(h.indices(n)[0], w.indices(n)[0]), min(h.indices(n)[1], w.indices(n)[1]))
            for h, w, n in zip(have, need, a.shape)
        )
        inter = int(np.prod([max(0, s.stop - s.start) for s in overlap])) if overlap else 1
        total += (size(need) - inter) * a.dtype.itemsize
    return total


def collectives(fn, tree) -> dict:
    hlo = fn.lower(tree).compile().as_text()
    ops = (
        "all-gather",
        "all-to-all",
        "collective-permute",
        "all-reduce",
        "reduce-scatter",
        "send",
        "recv",
        "copy-start",
    )
    return {op: len(re.findall(rf"\b{op}(-start)?\(", hlo)) for op in ops}


def bench_model(name: str, tp: int, repeats: int) -> dict:
    mesh = make_mesh(tp)
    config = OPTConfig(**PRESETS[name], dtype="bfloat16")
    fsdp_sh = shardings_for(param_shapes(config), "fsdp", mesh)
    params = jax.jit(partial(init_params, config, dtype=jnp.bfloat16), out_shardings=fsdp_sh)(jax.random.key(0))
    jax.block_until_ready(params)
    tp_sh = shardings_for(params, "tp", mesh)
    rep_sh = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    tp_params = reshard(params, "tp", mesh)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    need = received_bytes(params, tp_params)
    r = {
        "model": name,
        "mesh": dict(mesh.shape),
        "param_bytes": total,
        "fsdp_bytes_per_device": bytes_per_device(params),
        "tp_bytes_per_device": bytes_per_device(tp_params),
        "bytes_received_per_device_fsdp_to_tp": need,
    }
    to_rep = jax.jit(lambda t: t, out_shardings=rep_sh)
    methods = {
        "fsdp_to_tp": lambda: reshard(params, "tp", mesh),
        "tp_to_fsdp": lambda: reshard(tp_params, "fsdp", mesh),
        "device_put_fsdp_to_tp": lambda: jax.device_put(params, tp_sh),
        "device_put_tp_to_fsdp": lambda: jax.device_put(tp_params, fsdp_sh),
        "jit_fsdp_to_replicated": lambda: to_rep(params),
        "device_put_fsdp_to_replicated": lambda: jax.device_put(params, rep_sh),
    }
    r["went_through_host"] = {}
    for key, fn in methods.items():
        try:  # the guard raises on any implicit device -> host -> device copy
            with jax.transfer_guard("disallow"):
                jax.block_until_ready(fn())
            r["went_through_host"][key] = False
        except Exception as e:  # noqa: BLE001 - JaxRuntimeError on a disallowed transfer
            r["went_through_host"][key] = "transfer" in str(e).lower() or repr(e)
        r[key] = common.timeit(fn, repeats if "replicated" not in key else max(3, repeats // 3))
    r["leaves_moved"] = sum(
        not x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(tp_sh))
    )
    r["leaves"] = len(jax.tree.leaves(params))
    # Collectives of the whole-tree identity (reshard compiles only the leaves that move).
    r["fsdp_to_tp_collectives"] = collectives(_identity(tuple(jax.tree.leaves(tp_sh))), jax.tree.leaves(params))
    r["tp_to_fsdp_collectives"] = collectives(_identity(tuple(jax.tree.leaves(fsdp_sh))), jax.tree.leaves(tp_params))
    t = r["fsdp_to_tp"]["median_s"]
    r["fsdp_to_tp_GBps_per_device"] = need / t / 1e9 if need else None
    r["speedup_vs_device_put"] = r["device_put_fsdp_to_tp"]["median_s"] / t
    r["process_peak_bytes_device0"] = common.peak_bytes()
    tp_params = None  # the closures hold it
    print(
        f"{name}: {total / 1e9:.2f} GB, mesh {dict(mesh.shape)}: fsdp->tp {t * 1e3:.2f} ms "
        f"({(need / t / 1e9) if need else 0:.0f} GB/s received per device), tp->fsdp "
        f"{r['tp_to_fsdp']['median_s'] * 1e3:.2f} ms; device_put {r['device_put_fsdp_to_tp']['median_s'] * 1e3:.1f} ms "
        f"/ {r['device_put_tp_to_fsdp']['median_s'] * 1e3:.1f} ms; to replicated: jit "
        f"{r['jit_fsdp_to_replicated']['median_s'] * 1e3:.2f} ms, "
        f"device_put {r['device_put_fsdp_to_replicated']['median_s'] * 1e3:.1f} ms",
        flush=True,
    )
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["opt-1.3b", "opt-6.7b"], choices=sorted(PRESETS))
    ap.add_argument("--tp", type=int, nargs="+", default=None, help="generation tp sizes (default: all devices)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help="results folder (default bench/results/reshard)")
    args = ap.parse_args()
    result = {"benchmark": "reshard", **common.environment(), "device_bandwidth_Bps": device_bandwidth(), "runs": []}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for tp in args.tp or [jax.device_count()]:
        for name in args.models:
            result["runs"].append(bench_model(name, tp, args.repeats))
            common.write(
                "reshard", "reshard", result, args.out, stamp
            )  # what we have so far (a time limit may stop the rest)


if __name__ == "__main__":
    main()
