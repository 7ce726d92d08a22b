"""Probe (2026-12-02, not part of the package): how fast can ONE kernel read a matrix of a decode product's size?
XLA's row sum (a reduction kernel that reads every byte once and writes a few KB) over distinct bf16 matrices, 24 of
each size in one jitted program (more bytes than the 50 MB L2), device µs per kernel from a profile. Against the
decode products' 11.2 µs for fc1's 33.5 MB (bench/README.md), and the 4 GiB read that tools.common.read_bandwidth
calls the roofline.
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONPATH=. python bench/probes/read-floor-probe-20261202.py OUT_DIR
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp

from tools import common


def main(out_dir):
    res = {"read_bandwidth_Bps": common.read_bandwidth(), "sizes": []}
    key = jax.random.key(0)
    for k, n in [(2048, 2048), (2048, 6144), (2048, 8192), (8192, 8192), (16384, 16384)]:
        count = 24 if k * n <= 2048 * 8192 else 4
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) for i in range(count)]
        f = jax.jit(lambda ws: [jnp.sum(w, axis=1, dtype=jnp.float32) for w in ws])
        jax.block_until_ready(f(ws))
        with tempfile.TemporaryDirectory() as d:
            prof = common.kernel_profile(lambda: f(ws), d, top=4)
        line = max(prof.values(), key=lambda v: v["busy_ms"])
        us = 1e3 * line["busy_ms"] / count
        row = {"shape": [k, n], "MB": k * n * 2 / 1e6, "us_per_read": us, "TBps": k * n * 2 / us / 1e6,
               "kernels": [(x["name"][:40], x["count"], round(1e3 * x["total_ms"] / x["count"], 2))
                           for x in line["kernels"]]}
        print(json.dumps(row), flush=True)
        res["sizes"].append(row)
        del ws
    with open(os.path.join(out_dir, "read-floor-probe.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
