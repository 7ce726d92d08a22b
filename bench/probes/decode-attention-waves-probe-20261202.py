"""Probe (2026-12-02, not part of the package): is the decode-attention kernel's distance from a bare read at a
decode step (OPT-1.3B: 32 heads of 64, 384 of 512 slots valid) the last, partly filled wave of programs? One
program per (row, head), 6 resident per SM (shared memory), so 132 SMs hold 792: batch 64 is 2048 programs, 2.59
waves. If a call's time follows the number of whole waves, it is flat over batches 50-74 (3 waves) and jumps after;
if it follows the bytes, it grows linearly. Per batch: µs per call (64 chained calls in one jitted loop), the
bytes of the valid K and V slots, TB/s.
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONPATH=. python bench/probes/decode-attention-waves-probe-20261202.py OUT_DIR
"""
import json
import os
import sys

sys.path.insert(0, ".")

import jax.numpy as jnp

from jaxrlhf.kernels.decode_attention import DecodeAttentionConfig
from tools.bench_decode_attention import make_inputs, time_call

H, S, K, VALID = 32, 512, 64, 384


def main(out_dir):
    rows = []
    for B in (40, 48, 50, 56, 62, 64, 68, 74, 76, 82, 88, 96, 99, 104, 112, 124):
        q, k, v, _, _ = make_inputs(B, H, H, S, K, ragged=False)
        start, end = jnp.zeros((B,), jnp.int32), jnp.full((B,), VALID, jnp.int32)
        us = 1e6 * time_call(DecodeAttentionConfig(), q, k, v, start, end)
        nbytes = 2 * B * H * VALID * K * 2
        row = {"batch": B, "programs": B * H, "waves_at_792": B * H / 792, "us": us, "MB": nbytes / 1e6,
               "TBps": nbytes / us / 1e6}
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(os.path.join(out_dir, "decode-attention-waves.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
