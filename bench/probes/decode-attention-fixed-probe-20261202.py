"""Probe (2026-12-02, not part of the package): where does the decode-attention kernel's fixed ~11 µs per call go?
OPT-1.3B's heads (32 of 64, multi-head), bf16. Every figure is device µs per kernel from one profiler trace
(tools.common.kernel_totals, one phase per variant), so loop glue and launches between calls stay out.

- "length": the kernel at batch 64 and 128 over valid lengths 128..2048 of a 2048-slot cache. Per length the
  intercept 2 t(64) - t(128) is the cost that does not scale with the rows. If it grows with the length, it is
  the last programs' drain (a program streams its slots; the longer, the longer the tail); if it is flat, it is
  launch and prologue.
- "stream": the same grid, loop and loads with the softmax taken out (each block summed by a tensor-core product
  with ones), and XLA's sum over the same slots: how much of the fixed cost is the grid of long programs itself.
- "knobs": stages, warps, slots per block and splits at the decode shape (384 of 512 slots valid, batch 64), and
  the fused decode-step kernel there (the step's own 55.9 µs).
- "prologue": the fused step's kernel in OPT's form (LayerNorm folded, bias) rewritten here with switches, to
  find what its start costs: the first block's K and V loaded before the queries are computed ("peel"), the
  new key and value not written ("nowrite", wrong results: timing only), no norm or bias ("bare", timing only),
  the key written before the queries are computed, as the package does ("early"), and the package's unused
  operands passed too (x, cos, sin: "extra").

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONPATH=. python bench/probes/decode-attention-fixed-probe-20261202.py OUT_DIR [ONLY]
On the CPU (interpret mode) the same script checks the stream kernel against jnp and runs each variant once at
tiny shapes; it times nothing.
"""
import dataclasses
import functools
import json
import os
import sys
import time

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrlhf.kernels.decode_attention import (DecodeAttentionConfig, _one_copy, _repeat_rows, decode_attention,
                                              decode_step)
from tools.common import kernel_totals

GPU = jax.default_backend() == "gpu"
H, K = (32, 64) if GPU else (4, 64)
CALLS = 32 if GPU else 2


def _stream_kernel(start_ref, end_ref, k_ref, v_ref, o_ref, *, block_s):
    b, h = pl.program_id(0), pl.program_id(1)
    start, end = start_ref[0], end_ref[0]
    ones = jnp.ones((16, block_s), k_ref.dtype)
    layer = start * 0  # a traced 0: the interpreter's load rule wants array indices

    def body(i, acc):
        s0 = pl.multiple_of(i * block_s, block_s)
        pos = s0 + jax.lax.broadcasted_iota(jnp.int32, (block_s, 1), 0)
        mask = jnp.broadcast_to((pos >= start) & (pos < end), (block_s, K))
        load = lambda ref: pltriton.load(ref.at[layer, b, h, pl.ds(s0, block_s), :], mask=mask, other=0)
        kb, vb = load(k_ref), load(v_ref)
        return (acc + jnp.dot(ones, kb, preferred_element_type=jnp.float32)
                + jnp.dot(ones, vb, preferred_element_type=jnp.float32))

    acc = jax.lax.fori_loop(start // block_s, pl.cdiv(end, block_s), body, jnp.zeros((16, K), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_s",))
def stream(q, k, v, start, end, block_s=64):
    """Sum over the valid slots of k + v per (row, head): the kernel's grid, loop and loads without the softmax."""
    B, Hkv = k.shape[1], k.shape[2]
    row = pl.BlockSpec((1,), lambda b, h: (b,))
    out = pl.pallas_call(
        functools.partial(_stream_kernel, block_s=block_s), grid=(B, Hkv),
        in_specs=[row, row, pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.BlockSpec((None, None, 16, K), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, 16, K), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=2, num_stages=3) if GPU else None,
        interpret=not GPU, name="probe_stream")(start, end, k, v)
    return out[:, :, 0]


def xla_sum(q, k, v, start, end, length):
    return (jnp.sum(k[0, :, :, :length], axis=2, dtype=jnp.float32)
            + jnp.sum(v[0, :, :, :length], axis=2, dtype=jnp.float32)).astype(q.dtype)


def _prologue_kernel(layer_ref, start_ref, slot_ref, qkv_ref, sum_ref, sq_ref, colsum_ref, bias_ref, *refs, block_s,
                     width, eps, peel, write, norm, early=False, extra=False):
    k_ref, v_ref, o_ref, ko_ref, vo_ref = refs[3:] if extra else refs  # extra: x, cos, sin first, never read
    b, h = pl.program_id(0), pl.program_id(1)
    layer, start, slot = layer_ref[0], start_ref[0], slot_ref[0]
    G = o_ref.shape[0]
    copies = max(16 // G, 1)

    def block(i):
        s0 = pl.multiple_of(i * block_s, block_s)
        pos = s0 + jax.lax.broadcasted_iota(jnp.int32, (block_s, 1), 0)
        valid = (pos >= start) & (pos < slot)
        load = lambda ref: pltriton.load(ref.at[layer, b, h, pl.ds(s0, block_s), :],
                                         mask=jnp.broadcast_to(valid, (block_s, K)), other=0)
        return load(k_ref), load(v_ref), valid

    lo = start // block_s
    first = block(lo) if peel else None  # issued before the queries' loads and arithmetic
    mean = sum_ref[0] / width
    r = jax.lax.rsqrt(jnp.maximum(sq_ref[0] / width - mean * mean, 0.0) + eps)

    def part(row, n):
        y = qkv_ref[b, h, pl.ds(row, n), :].astype(jnp.float32)
        if not norm:
            return y
        return (y - mean * colsum_ref[h, pl.ds(row, n), :]) * r + bias_ref[h, pl.ds(row, n), :].astype(jnp.float32)

    v_new, k_new = part(G + 1, 1), part(G, 1)
    if early:
        ko_ref[layer, b, h, pl.ds(slot, 1), :] = k_new.astype(ko_ref.dtype)
    q = part(0, G).astype(o_ref.dtype)
    if write:
        ko_ref[layer, b, h, pl.ds(slot, 1), :] = k_new.astype(ko_ref.dtype)
        vo_ref[layer, b, h, pl.ds(slot, 1), :] = v_new.astype(vo_ref.dtype)
    k_new, v_new = k_new.astype(k_ref.dtype).astype(jnp.float32), v_new.astype(v_ref.dtype).astype(jnp.float32)
    s_new = jnp.sum(q.astype(jnp.float32) * k_new, axis=-1)
    q = _repeat_rows(q, copies)
    rows = copies * G

    def step(carry, kb, vb, valid):  # decode_attention._attend's body
        m, l, acc = carry
        scores = jnp.where(valid.T, jnp.dot(q, kb.T, preferred_element_type=jnp.float32), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        pv = jnp.dot(p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[:, None] + pv

    carry = (_repeat_rows(s_new, copies), jnp.ones((rows,), jnp.float32), jnp.broadcast_to(v_new, (rows, K)))
    if peel:
        carry, lo = step(carry, *first), lo + 1
    m, l, acc = jax.lax.fori_loop(lo, pl.cdiv(slot, block_s), lambda i, c: step(c, *block(i)), carry)
    l, acc = _one_copy(l, copies), _one_copy(acc, copies)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("peel", "write", "norm", "early", "extra"))
def prologue_step(qkv, k, v, start, slot, sums, squares, colsum, bias, *, peel, write, norm, early=False, extra=False):
    """decode_step(qkv, k, v, start, slot, 0, layer_norm=(sums, squares, 2048, 1e-5, colsum), bias=bias) with the
    switches above."""
    B, Hkv, G2, _ = qkv.shape
    G = G2 - 2
    row, scalar, whole = pl.BlockSpec((1,), lambda b, h: (b,)), pl.BlockSpec((1,), lambda b, h: (0,)), pl.no_block_spec
    table = pl.BlockSpec((None, K // 2), lambda b, h: (b, 0))
    unused = [jnp.zeros((B, 1), jnp.float32), jnp.zeros((B, K // 2), jnp.float32), jnp.zeros((B, K // 2), jnp.float32)]
    out, k, v = pl.pallas_call(
        functools.partial(_prologue_kernel, block_s=64, width=2048, eps=1e-5, peel=peel, write=write, norm=norm,
                          early=early, extra=extra),
        grid=(B, Hkv), in_specs=[scalar, row, scalar, whole, row, row, whole, whole]
        + ([whole, table, table] if extra else []) + [whole, whole],
        out_specs=[pl.BlockSpec((None, None, G, K), lambda b, h: (b, h, 0, 0)), whole, whole],
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, G, K), k.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        input_output_aliases={11: 1, 12: 2} if extra else {8: 1, 9: 2},
        compiler_params=pltriton.CompilerParams(num_warps=2, num_stages=3) if GPU else None,
        interpret=not GPU, name="probe_prologue_step",
    )(jnp.zeros((1,), jnp.int32), start, jnp.reshape(slot, (1,)).astype(jnp.int32), qkv, sums, squares, colsum,
      bias, *(unused if extra else []), k, v)
    return out.reshape(B, Hkv * G, K), k, v


def inputs(B, S, valid, key=0):
    ks = jax.random.split(jax.random.key(key), 3)
    q = jax.random.normal(ks[0], (B, H, K), jnp.bfloat16) * K**-0.5
    k = jax.random.normal(ks[1], (1, B, H, S, K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, B, H, S, K), jnp.bfloat16)
    return q, k, v, jnp.zeros((B,), jnp.int32), jnp.full((B,), valid, jnp.int32)


def chained(fn):
    """CALLS chained calls of fn(q, k, v, start, end) -> [B, H, K]: each output nudges the next query."""
    @jax.jit
    def loop(q, k, v, start, end):
        body = lambda _, q: (q + 1e-3 * fn(q, k, v, start, end)).astype(q.dtype)
        return jax.lax.fori_loop(0, CALLS, body, q)
    return loop


def step_inputs(B, S, valid):
    """A fused decode step's operands in OPT's form (qkv, k, v, start, sums, squares, colsum, bias); rows start at
    0..7 (left padding)."""
    ks = jax.random.split(jax.random.key(1), 5)
    qkv = jax.random.normal(ks[0], (B, H, 3, K), jnp.bfloat16)
    sums, squares = jax.random.normal(ks[1], (B,)), 2048 + jax.random.uniform(ks[2], (B,))
    colsum = jax.random.normal(ks[3], (H, 3, K)) * 0.1
    bias = (jax.random.normal(ks[4], (H, 3, K)) * 0.1).astype(jnp.bfloat16)
    _, k, v, _, _ = inputs(B, S, valid)
    return qkv, k, v, jnp.arange(B, dtype=jnp.int32) % 8, sums, squares, colsum, bias


def chained_step(config, B, S, valid, **switches):
    """CALLS chained fused decode steps, slot `valid`, the cache updated in place: the package's decode_step, or with
    `switches` (peel, write, norm) this probe's prologue_step."""
    qkv, k, v, start, sums, squares, colsum, bias = step_inputs(B, S, valid)

    def one(qkv, k, v):
        if switches:
            return prologue_step(qkv, k, v, start, valid, sums, squares, colsum, bias, **switches)
        return decode_step(qkv, k, v, start, valid, 0, layer_norm=(sums, squares, 2048, 1e-5, colsum), bias=bias,
                           config=config)

    @jax.jit
    def loop(qkv, k, v):
        def body(_, carry):
            out, k, v = one(*carry)
            return (carry[0] + 1e-3 * out.reshape(B, H, 1, K)).astype(qkv.dtype), k, v
        return jax.lax.fori_loop(0, CALLS, body, (qkv, k, v))[0]
    return lambda: loop(qkv, k, v)


def variants(only):
    """(label, group, B, valid, S, thunk) for each timed variant."""
    pallas = DecodeAttentionConfig("pallas", num_splits=1)
    att = lambda cfg: chained(functools.partial(decode_attention, config=cfg))
    out = []
    if only in ("", "length"):
        for valid in ((128, 256, 384, 768, 1536, 2048) if GPU else (64, 128)):
            for B in ((64, 128) if GPU else (2, 3)):
                S = 2048 if GPU else 128
                x = inputs(B, S, valid)
                out.append((f"attention B={B} valid={valid}", "length", B, valid, S, att(pallas), x))
                out.append((f"stream B={B} valid={valid}", "stream", B, valid, S, chained(stream), x))
                out.append((f"xla_sum B={B} valid={valid}", "stream", B, valid, S,
                            chained(functools.partial(xla_sum, length=valid)), x))
    if only in ("", "knobs"):
        B, S, valid = (64, 512, 384) if GPU else (2, 128, 96)
        x = inputs(B, S, valid)
        knobs = [dict(), dict(num_stages=2), dict(num_stages=4), dict(num_stages=5), dict(num_warps=1),
                 dict(num_warps=4), dict(block_s=32), dict(block_s=128), dict(num_splits=2), dict(num_splits=3),
                 dict(mask_loads=False)]
        for kw in knobs:
            out.append((f"attention {kw or 'default'}", "knobs", B, valid, S,
                        att(dataclasses.replace(pallas, **kw)), x))
        out.append(("stream knob shape", "knobs", B, valid, S, chained(stream), x))
        for kw in (dict(), dict(num_stages=4), dict(num_warps=4)):
            out.append((f"decode_step {kw or 'default'}", "knobs", B, valid, S,
                        chained_step(dataclasses.replace(pallas, **kw), B, S, valid), None))
    if only == "operands":  # the package's kernel against this probe's replica: its write order, its operands
        B, S, valid = (64, 512, 384) if GPU else (2, 128, 96)
        for rep in (1, 2, 3):
            out.append((f"decode_step package #{rep}", "operands", B, valid, S, chained_step(pallas, B, S, valid), None))
            for early, extra in ((False, False), (True, False), (False, True), (True, True)):
                out.append((f"prologue early={int(early)} extra={int(extra)} #{rep}", "operands", B, valid, S,
                            chained_step(pallas, B, S, valid, peel=False, write=True, norm=True, early=early,
                                         extra=extra), None))
    if only in ("", "prologue"):
        B, S, valid = (64, 512, 384) if GPU else (2, 128, 96)
        for rep in (1, 2):  # twice, in this order: run-to-run spread
            out.append((f"decode_step package #{rep}", "prologue", B, valid, S, chained_step(pallas, B, S, valid),
                        None))
            for peel, write, norm in ((False, True, True), (True, True, True), (False, False, True),
                                      (False, True, False), (True, False, False)):
                label = f"prologue peel={int(peel)} write={int(write)} norm={int(norm)} #{rep}"
                out.append((label, "prologue", B, valid, S,
                            chained_step(pallas, B, S, valid, peel=peel, write=write, norm=norm), None))
    return out


def check_prologue_step():
    """This probe's step kernel (peel on and off) against the package's decode_step, and the cache it writes."""
    B, S, slot = 3, 128, 100
    qkv, k, v, start, sums, squares, colsum, bias = step_inputs(B, S, slot)
    want, wk, wv = decode_step(qkv, k, v, start, slot, 0, layer_norm=(sums, squares, 2048, 1e-5, colsum), bias=bias,
                               config=DecodeAttentionConfig("pallas"))
    for peel, early, extra in ((False, False, False), (True, False, False), (False, True, True)):
        got, gk, gv = prologue_step(qkv, k, v, start, slot, sums, squares, colsum, bias, peel=peel, write=True,
                                    norm=True, early=early, extra=extra)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        print(f"prologue_step peel={int(peel)} against decode_step: max error {err:.1e}", flush=True)
        assert err < 2e-2 and bool(jnp.all(gk == wk)) and bool(jnp.all(gv == wv))


def main(out_dir, only=""):
    if not GPU:  # the stream kernel against jnp
        q, k, v, start, end = inputs(3, 128, 100)
        start = jnp.array([0, 5, 70], jnp.int32)
        want = jnp.stack([(k[0, b, :, start[b]:end[b]].astype(jnp.float32).sum(1)
                           + v[0, b, :, start[b]:end[b]].astype(jnp.float32).sum(1)) for b in range(3)])
        got = stream(q, k, v, start, end).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        print(f"stream kernel against jnp: relative error {err:.1e}")
        assert err < 1e-2
        check_prologue_step()
    runs = variants(only)
    thunks = []
    for label, group, B, valid, S, fn, x in runs:
        thunk = fn if x is None else functools.partial(fn, *x)
        t0 = time.perf_counter()
        jax.block_until_ready(thunk())  # compile and warm up outside the trace
        print(f"{label}: compiled and ran in {time.perf_counter() - t0:.1f} s", flush=True)
        thunks.append(thunk)
    log_dir = os.path.join(out_dir, "trace")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for (label, *_), thunk in zip(runs, thunks):
            with jax.profiler.TraceAnnotation(f"jaxrlhf.{label}"):
                jax.block_until_ready(thunk())
    import glob
    import gzip
    trace = max(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True), key=os.path.getmtime)
    totals = kernel_totals(json.load(gzip.open(trace))["traceEvents"], top=8)
    rows = []
    for label, group, B, valid, S, _, _ in runs:
        lines = [v for line, v in totals.items() if line.endswith(f"[{label}]")]
        kernels = [kk for v in lines for kk in v["kernels"]]
        ours = [kk for kk in kernels if kk["count"] >= CALLS]
        # the variant's own kernels: jaxrlhf_* / probe_* for Pallas; for XLA's sum every kernel of the loop (the
        # query's nudge included, ~1-2 µs)
        main_k = [kk for kk in ours if kk["name"].startswith(("jaxrlhf_", "probe_"))] or ours
        us = 1e3 * sum(kk["total_ms"] for kk in main_k) / CALLS
        nbytes = 2 * B * H * valid * K * 2
        rate = nbytes / us / 1e6 if us else float("nan")  # no device lines on the CPU
        row = {"label": label, "group": group, "B": B, "valid": valid, "S": S, "us": us, "MB": nbytes / 1e6,
               "TBps": rate, "kernels": kernels}
        print(f"{label:44s} {us:8.2f} us  {rate:5.2f} TB/s  "
              + ", ".join(f"{kk['name'][:28]} x{kk['count']} {1e3 * kk['total_ms'] / CALLS:.2f}" for kk in kernels[:4]),
              flush=True)
        rows.append(row)
    with open(os.path.join(out_dir, f"decode-attention-fixed{'-' + only if only else ''}.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".", sys.argv[2] if len(sys.argv) > 2 else "")
