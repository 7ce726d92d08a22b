"""Probe: the tail of an OPT decode layer in ONE persistent Pallas Triton kernel: the FFN alone (`fused_ffn`), or
out_proj, its residual, the FFN's LayerNorm statistics and the FFN (`fused_tail`). Not part of the package.

The two-kernel form (kernels.decode_matmul, fc1 then fc2 split four ways, then an XLA add) pays each kernel's
start, fill and drain. Here one grid of F / 64 = 128 programs (all resident: one per SM) does
  phase 1  program j: fc1 columns [64 j, 64 j + 64) with the norm's end, bias and ReLU -> h1 (global scratch)
  wait     for the 32 programs whose fc1 columns form share s = j // 32 of fc2's K (an atomic counter per share)
  phase 2  program j: fc2 share s, output columns c = j % 32 -> float32 partial
  fix-up   the last of a column block's 4 partials (an atomic counter per block) sums them + bias + residual.
Counters are reset by the last program through them, so the sync buffer is zero again after each call and is
threaded through the layers. `prefetch`: the first weight block of the phase after a wait is loaded before it.
`fused_tail` adds a phase before: out_proj split four ways over K, whose fix-up adds the bias and the residual and
writes the rows' partial sums and sums of squares per column block; a wait for all 32 fix-ups; then the FFN as
above on that h, each program finishing the norm's statistics from the 32 partials. A decode layer would then run
four kernels (the attention norm's sums, q/k/v, the attention step, this) instead of eight.

The waits need every program resident at once: one grid of 128 programs, one per SM of the H200's 132. Pallas's
interpret mode runs programs one after another, so there `fused_tail` runs one call per phase (no waits): the CPU
checks the arithmetic, the fix-ups and the counters, not the waits.

    PROBE=bench/probes/decode-tail-persistent-probe-20261202.py
    PYTHONPATH=. python $PROBE lower            # CPU: both kernels lower for an abstract H200 (Triton)
    PYTHONPATH=. python $PROBE cpu              # CPU: fused_tail in interpret mode, one call a phase, against XLA
    PYTHONPATH=. XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python $PROBE bench [--parts] [--out DIR]
                                                # GPU: against what a decode step runs now, 24 layers x 8 loops;
                                                # --parts: the fused FFN without its wait, and each phase alone
"""
from __future__ import annotations

import functools
import json
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BN, BK = 64, 128
SPIN_CAP = 1 << 22  # a wait gives up after this many polls (a wrong result instead of a hung GPU)


def _kernel(h_ref, sums_ref, sq_ref, w1_ref, colsum_ref, b1_ref, w2_ref, b2_ref, _sync_in,
            out_ref, h1_ref, part_ref, sync_ref, *, eps, S, prefetch, parts):
    # parts (timing only): "all"; "nowait" (no wait between the phases: a wrong result); "fc1" or "fc2" (one phase)
    j = pl.program_id(0)
    M, D = h_ref.shape
    F = w1_ref.shape[1]
    G = F // BN // S                     # fc1 programs per share of fc2's K
    f32 = jnp.float32
    cols = pl.ds(pl.multiple_of(j * BN, BN), BN)

    def body1(i, acc):
        k = pl.ds(pl.multiple_of(i * BK, BK), BK)
        return acc + jnp.dot(h_ref[:, k], w1_ref[k, cols], preferred_element_type=f32)

    if parts != "fc2":
        y = jax.lax.fori_loop(0, D // BK, body1, jnp.zeros((M, BN), f32))
        mean = sums_ref[...] / D
        var = jnp.maximum(sq_ref[...] / D - mean * mean, 0.0)
        y = (y - mean[:, None] * colsum_ref[cols].astype(f32)[None, :]) * jax.lax.rsqrt(var + eps)[:, None]
        y = jnp.maximum(y + b1_ref[cols].astype(f32)[None, :], 0.0)
        h1_ref[:, cols] = y.astype(h1_ref.dtype)
        pltriton.debug_barrier()
    if parts == "all":
        pltriton.atomic_add(sync_ref, _at(j // G), jnp.int32(1))   # release: h1's block is visible after this
    if parts == "fc1":
        return

    s, c = j // (D // BN), j % (D // BN)
    ccols = pl.ds(pl.multiple_of(c * BN, BN), BN)
    steps = F // S // BK
    k0 = s * steps
    if prefetch:
        w_first = w2_ref[pl.ds(pl.multiple_of(k0 * BK, BK), BK), ccols]

    def poll(carry):
        _, n = carry
        return pltriton.atomic_add(sync_ref, _at(s), jnp.int32(0)), n + 1

    if parts == "all":
        jax.lax.while_loop(lambda carry: (carry[0] < G) & (carry[1] < SPIN_CAP), poll, (jnp.int32(0), jnp.int32(0)))
        pltriton.debug_barrier()
        gone = pltriton.atomic_add(sync_ref, _at(S + s), jnp.int32(1))

        @pl.when(gone == G - 1)  # the share's last program through the wait resets its two counters
        def _():
            pltriton.atomic_add(sync_ref, _at(s), jnp.int32(-G))
            pltriton.atomic_add(sync_ref, _at(S + s), jnp.int32(-G))

    def body2(i, acc):
        k = pl.ds(pl.multiple_of((k0 + i) * BK, BK), BK)
        return acc + jnp.dot(h1_ref[:, k], w2_ref[k, ccols], preferred_element_type=f32)

    if prefetch:
        first = jnp.dot(h1_ref[:, pl.ds(pl.multiple_of(k0 * BK, BK), BK)], w_first, preferred_element_type=f32)
        y2 = jax.lax.fori_loop(1, steps, body2, first)
    else:
        y2 = jax.lax.fori_loop(0, steps, body2, jnp.zeros((M, BN), f32))
    part_ref[s, :, ccols] = y2
    pltriton.debug_barrier()
    done = pltriton.atomic_add(sync_ref, _at(2 * S + c), jnp.int32(1))

    @pl.when(done == S - 1)  # the column block's last partial: sum, bias, residual
    def _():
        total = h_ref[:, ccols].astype(f32) + b2_ref[ccols].astype(f32)[None, :]
        for t in range(S):
            total = total + part_ref[t, :, ccols]
        out_ref[:, ccols] = total.astype(out_ref.dtype)
        pltriton.atomic_add(sync_ref, _at(2 * S + c), jnp.int32(-S))



def _at(i):
    return (jnp.asarray(i, jnp.int32),)


def _wait(sync_ref, arrive, depart, target, waiters, barrier=pltriton.debug_barrier):
    """Spin until sync[arrive] reaches target; the last of `waiters` through resets both counters."""
    def poll(carry):
        return pltriton.atomic_add(sync_ref, _at(arrive), jnp.int32(0)), carry[1] + 1

    jax.lax.while_loop(lambda c: (c[0] < target) & (c[1] < SPIN_CAP), poll, (jnp.int32(0), jnp.int32(0)))
    barrier()
    gone = pltriton.atomic_add(sync_ref, _at(depart), jnp.int32(1))

    @pl.when(gone == waiters - 1)
    def _():
        pltriton.atomic_add(sync_ref, _at(arrive), jnp.int32(-target))
        pltriton.atomic_add(sync_ref, _at(depart), jnp.int32(-waiters))


def _tail_kernel(*refs, eps, prefetch, phases, interpret):
    """out_proj (+ bias + residual) -> LayerNorm statistics -> fc1 (+ norm end, bias, ReLU) -> fc2 (+ bias + residual),
    one persistent grid of 4 * D / BN programs. sync: [C] out_proj fix-up, [C] fc2 fix-up, produced, gone,
    [S] share arrive, [S] share gone (C = D / BN column blocks). `phases`: which of 0, 1, 2 this call runs; the
    waits run only between phases of one call (interpret mode runs programs one after another: one call a phase)."""
    a_ref, res_ref, wo_ref, bo_ref, w1_ref, colsum_ref, b1_ref, w2_ref, b2_ref = refs[:9]
    out_ref, hm_ref, stats_ref, po_ref, h1_ref, p2_ref, sync_ref = refs[-7:]
    barrier = (lambda: None) if interpret else pltriton.debug_barrier
    j = pl.program_id(0)
    M, D = a_ref.shape
    F = w1_ref.shape[1]
    C = D // BN
    S = F // D
    G = F // BN // S
    PRODUCED, GONE, ARRIVE, DEPART = 2 * C, 2 * C + 1, 2 * C + 2, 2 * C + 2 + S
    c, q = j % C, j // C          # column block, share of K (out_proj: 4 shares of D; fc2: S shares of F)
    ccols = pl.ds(pl.multiple_of(c * BN, BN), BN)

    if 0 in phases:
        _phase0(a_ref, res_ref, wo_ref, bo_ref, hm_ref, stats_ref, po_ref, sync_ref, c, q, ccols, barrier, PRODUCED)
    cols = pl.ds(pl.multiple_of(j * BN, BN), BN)
    if 1 in phases:
        if prefetch:
            w1_first = w1_ref[pl.ds(0, BK), cols]
        if 0 in phases:
            _wait(sync_ref, PRODUCED, GONE, C, 4 * C, barrier)
        _phase1(hm_ref, w1_ref, colsum_ref, b1_ref, stats_ref, h1_ref, sync_ref, cols, w1_first if prefetch else None,
                eps, barrier, ARRIVE + j // G)
    if 2 in phases:
        steps2 = F // S // BK
        if prefetch:
            w2_first = w2_ref[pl.ds(pl.multiple_of(q * steps2 * BK, BK), BK), ccols]
        if 1 in phases:
            _wait(sync_ref, ARRIVE + q, DEPART + q, G, G, barrier)
        _phase2(h1_ref, w2_ref, b2_ref, hm_ref, p2_ref, out_ref, sync_ref, c, q, ccols, w2_first if prefetch else None,
                barrier, C)


def _phase0(a_ref, res_ref, wo_ref, bo_ref, hm_ref, stats_ref, po_ref, sync_ref, c, q, ccols, barrier, PRODUCED):
    """out_proj's partial over share q of D (4 shares); the column block's last partial adds the bias and the
    residual, writes h and its rows' partial statistics."""
    M, D = res_ref.shape
    f32 = jnp.float32
    steps0 = D // 4 // BK

    def body0(i, acc):
        k = pl.ds(pl.multiple_of((q * steps0 + i) * BK, BK), BK)
        return acc + jnp.dot(a_ref[:, k], wo_ref[k, ccols], preferred_element_type=f32)

    po_ref[q, :, ccols] = jax.lax.fori_loop(0, steps0, body0, jnp.zeros((M, BN), f32))
    barrier()
    done = pltriton.atomic_add(sync_ref, _at(c), jnp.int32(1))

    @pl.when(done == 3)
    def _():
        y = bo_ref[ccols].astype(f32)[None, :]
        for t in range(4):
            y = y + po_ref[t, :, ccols]
        h = (res_ref[:, ccols].astype(f32) + y.astype(res_ref.dtype).astype(f32)).astype(hm_ref.dtype)
        hm_ref[:, ccols] = h
        hf = h.astype(f32)
        stats_ref[c, 0, :] = jnp.sum(hf, axis=1)
        stats_ref[c, 1, :] = jnp.sum(hf * hf, axis=1)
        pltriton.atomic_add(sync_ref, _at(c), jnp.int32(-4))
        barrier()
        pltriton.atomic_add(sync_ref, _at(PRODUCED), jnp.int32(1))


def _phase1(hm_ref, w1_ref, colsum_ref, b1_ref, stats_ref, h1_ref, sync_ref, cols, w1_first, eps, barrier, arrive):
    """fc1's columns `cols` on h (the norm's end from the statistics, bias, ReLU) -> h1; then signal `arrive`."""
    M, D = hm_ref.shape
    C = stats_ref.shape[0]
    f32 = jnp.float32
    sums = jnp.zeros((M,), f32)
    squares = jnp.zeros((M,), f32)
    for t in range(C):
        sums = sums + stats_ref[t, 0, :]
        squares = squares + stats_ref[t, 1, :]

    def body1(i, acc):
        k = pl.ds(pl.multiple_of(i * BK, BK), BK)
        return acc + jnp.dot(hm_ref[:, k], w1_ref[k, cols], preferred_element_type=f32)

    if w1_first is not None:
        first = jnp.dot(hm_ref[:, pl.ds(0, BK)], w1_first, preferred_element_type=f32)
        y = jax.lax.fori_loop(1, D // BK, body1, first)
    else:
        y = jax.lax.fori_loop(0, D // BK, body1, jnp.zeros((M, BN), f32))
    mean = sums / D
    var = jnp.maximum(squares / D - mean * mean, 0.0)
    y = (y - mean[:, None] * colsum_ref[cols].astype(f32)[None, :]) * jax.lax.rsqrt(var + eps)[:, None]
    y = jnp.maximum(y + b1_ref[cols].astype(f32)[None, :], 0.0)
    h1_ref[:, cols] = y.astype(h1_ref.dtype)
    barrier()
    pltriton.atomic_add(sync_ref, _at(arrive), jnp.int32(1))


def _phase2(h1_ref, w2_ref, b2_ref, hm_ref, p2_ref, out_ref, sync_ref, c, q, ccols, w2_first, barrier, C):
    """fc2's partial over share q of F; the column block's last partial adds the bias and the residual."""
    M, F = h1_ref.shape
    S = p2_ref.shape[0]
    steps2 = F // S // BK
    f32 = jnp.float32

    def body2(i, acc):
        k = pl.ds(pl.multiple_of((q * steps2 + i) * BK, BK), BK)
        return acc + jnp.dot(h1_ref[:, k], w2_ref[k, ccols], preferred_element_type=f32)

    if w2_first is not None:
        first2 = jnp.dot(h1_ref[:, pl.ds(pl.multiple_of(q * steps2 * BK, BK), BK)], w2_first,
                         preferred_element_type=f32)
        y2 = jax.lax.fori_loop(1, steps2, body2, first2)
    else:
        y2 = jax.lax.fori_loop(0, steps2, body2, jnp.zeros((M, BN), f32))
    p2_ref[q, :, ccols] = y2
    barrier()
    done2 = pltriton.atomic_add(sync_ref, _at(C + c), jnp.int32(1))

    @pl.when(done2 == S - 1)
    def _():
        total = hm_ref[:, ccols].astype(f32) + b2_ref[ccols].astype(f32)[None, :]
        for t in range(S):
            total = total + p2_ref[t, :, ccols]
        out_ref[:, ccols] = total.astype(out_ref.dtype)
        pltriton.atomic_add(sync_ref, _at(C + c), jnp.int32(-S))


def tail_sync_size(D, F):
    return 2 * (D // BN) + 2 + 2 * (F // D)


@functools.partial(jax.jit, static_argnames=("eps", "prefetch", "warps", "stages", "interpret"))
def fused_tail(a, res, wo, bo, w1, colsum, b1, w2, b2, sync, *, eps=1e-5, prefetch=False, warps=4, stages=4,
               interpret=False):
    (M, D), F = a.shape, w1.shape[1]
    S, C = F // D, D // BN
    assert S == 4 and F // BN == 4 * C, (D, F)
    shapes = [jax.ShapeDtypeStruct((M, D), a.dtype), jax.ShapeDtypeStruct((M, D), a.dtype),
              jax.ShapeDtypeStruct((C, 2, M), jnp.float32), jax.ShapeDtypeStruct((4, M, D), jnp.float32),
              jax.ShapeDtypeStruct((M, F), a.dtype), jax.ShapeDtypeStruct((S, M, D), jnp.float32),
              jax.ShapeDtypeStruct(sync.shape, jnp.int32)]
    call = lambda phases, n_in, aliases: pl.pallas_call(
        functools.partial(_tail_kernel, eps=eps, prefetch=prefetch, phases=phases, interpret=interpret),
        grid=(4 * C,),
        in_specs=[pl.no_block_spec] * n_in,
        out_specs=[pl.no_block_spec] * 7,
        out_shape=shapes,
        input_output_aliases=aliases,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="jaxrlhf_tail_persistent",
    )
    weights = (a, res, wo, bo, w1, colsum, b1, w2, b2)
    if not interpret:
        out, *_, sync = call((0, 1, 2), 10, {9: 6})(*weights, sync)
        return out, sync
    buffers = [jnp.zeros(s.shape, s.dtype) for s in shapes[:-1]] + [sync]
    for phase in (0, 1, 2):
        buffers = call((phase,), 16, {9 + i: i for i in range(7)})(*weights, *buffers)
    return buffers[0], buffers[-1]


def sync_size(D, F):
    S = F // D
    return 2 * S + D // BN


@functools.partial(jax.jit, static_argnames=("eps", "prefetch", "warps", "stages", "parts"))
def fused_ffn(h, sums, sq, w1, colsum, b1, w2, b2, sync, *, eps=1e-5, prefetch=False, warps=4, stages=4, parts="all"):
    (M, D), F = h.shape, w1.shape[1]
    S = F // D
    assert F % D == 0 and F // BN == S * (D // BN), (D, F)
    out, _, _, sync = pl.pallas_call(
        functools.partial(_kernel, eps=eps, S=S, prefetch=prefetch, parts=parts),
        grid=(F // BN,),
        in_specs=[pl.no_block_spec] * 9,
        out_specs=[pl.no_block_spec] * 4,
        out_shape=[jax.ShapeDtypeStruct((M, D), h.dtype), jax.ShapeDtypeStruct((M, F), h.dtype),
                   jax.ShapeDtypeStruct((S, M, D), jnp.float32), jax.ShapeDtypeStruct(sync.shape, jnp.int32)],
        input_output_aliases={8: 3},
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        name="jaxrlhf_ffn_persistent",
    )(h, sums, sq, w1, colsum, b1, w2, b2, sync)
    return out, sync


def lower():
    from jax import export
    from jax._src.mesh import AbstractDevice, AbstractMesh
    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    args = (bf16(64, 2048), f32(64), f32(64), bf16(2048, 8192), bf16(8192), bf16(8192), bf16(8192, 2048),
            bf16(2048), jax.ShapeDtypeStruct((sync_size(2048, 8192),), jnp.int32))
    for prefetch in (False, True):
        with jax.sharding.use_abstract_mesh(h200):
            exported = export.export(jax.jit(functools.partial(fused_ffn, prefetch=prefetch)), platforms=["cuda"],
                                     disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
        module = exported.mlir_module()
        print("ffn prefetch", prefetch, "lowered:", module.count("jaxrlhf_ffn_persistent"), "kernel(s),",
              len(module), "chars")


def lower_tail():
    from jax import export
    from jax._src.mesh import AbstractDevice, AbstractMesh
    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    args = (bf16(64, 2048), bf16(64, 2048), bf16(2048, 2048), bf16(2048), bf16(2048, 8192), bf16(8192), bf16(8192),
            bf16(8192, 2048), bf16(2048), jax.ShapeDtypeStruct((tail_sync_size(2048, 8192),), jnp.int32))
    for prefetch in (False, True):
        with jax.sharding.use_abstract_mesh(h200):
            exported = export.export(jax.jit(functools.partial(fused_tail, prefetch=prefetch)), platforms=["cuda"],
                                     disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
        print("tail prefetch", prefetch, "lowered:", exported.mlir_module().count("jaxrlhf_tail_persistent"))


def cpu_check():
    sys.path.insert(0, ".")
    from tools import bench_decode_matmul as bdm
    M, D, F = 16, 512, 2048
    w = bdm.make_layers(jax.random.key(0), 1, D, F, dtype=jnp.float32)[0]
    k = jax.random.split(jax.random.key(1), 4)
    wo = {"kernel": jax.random.normal(k[0], (D, D)) * 0.05, "bias": jax.random.normal(k[1], (D,)) * 0.05}
    a, h = jax.random.normal(k[2], (M, D)), jax.random.normal(k[3], (M, D))
    ref = bdm.ffn(h + (a @ wo["kernel"] + wo["bias"]), w, False)
    for prefetch in (False, True):
        got, sync = fused_tail(a, h, wo["kernel"], wo["bias"], w["fc1"]["kernel"], w["fc1"]["colsum"],
                               w["fc1"]["bias"], w["fc2"]["kernel"], w["fc2"]["bias"],
                               jnp.zeros((tail_sync_size(D, F),), jnp.int32), prefetch=prefetch, interpret=True)
        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref - h)))
        print(f"prefetch {prefetch}: max rel err {err:.2e} (fp32); sync after {sync.tolist()} (the fix-up counters "
              f"back to 0; 'produced' and the share counters are only reset by the waits, which this mode skips)")
        assert err < 1e-5, err


def bench(out_dir, parts=False):
    sys.path.insert(0, ".")
    from tools import common
    from tools import bench_decode_matmul as bdm
    from jaxrlhf.models.common import row_sums
    M, D, F, L, loops = 64, 2048, 8192, 24, 8
    layers = bdm.make_layers(jax.random.key(0), L, D, F)
    h = jax.random.normal(jax.random.key(1), (M, D), jnp.float32).astype(jnp.bfloat16)
    bandwidth = common.read_bandwidth()
    roof = 1e6 * bdm.layer_bytes(D, F) / bandwidth
    result = {"probe": "ffn_persistent", **common.environment(), "M": M, "D": D, "F": F, "layers": L,
              "loops": loops, "read_bandwidth_Bps": bandwidth, "roofline_us": roof, "runs": []}

    def fused_layer(h, sync, w, **kw):
        sums, sq = row_sums(h)
        return fused_ffn(h, sums, sq, w["fc1"]["kernel"], w["fc1"]["colsum"], w["fc1"]["bias"],
                         w["fc2"]["kernel"], w["fc2"]["bias"], sync, **kw)

    def fused_chain(**kw):
        def run(h, layers):
            def one(_, carry):
                h, sync = carry
                for w in layers:
                    h, sync = fused_layer(h, sync, w, **kw)
                return h, sync
            h, sync = jax.lax.fori_loop(0, loops, one, (h, jnp.zeros((sync_size(D, F),), jnp.int32)))
            return h, sync
        return jax.jit(run)

    # correctness: one layer against the two-kernel form, and the sync buffer back to zero
    ref = jax.jit(lambda h, w: bdm.ffn(h, w, True))(h, layers[0]).astype(jnp.float32)
    xla = jax.jit(lambda h, w: bdm.ffn(h, w, False))(h, layers[0]).astype(jnp.float32)
    variants = [dict(prefetch=False), dict(prefetch=True), dict(prefetch=False, stages=3),
                dict(prefetch=True, stages=3), dict(prefetch=True, warps=8, stages=3)]
    if parts:  # where the fused FFN's time goes: without the wait, and each phase alone (timing only)
        variants = [dict(parts=p) for p in ("all", "nowait", "fc1", "fc2")]
    for kw in variants:
        run = {"variant": kw}
        try:
            got, sync = jax.jit(lambda h, w, s: fused_layer(h, s, w, **kw))(
                h, layers[0], jnp.zeros((sync_size(D, F),), jnp.int32))
            got = got.astype(jnp.float32)
            run["max_rel_err_vs_two_kernel"] = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(xla - h.astype(jnp.float32))))
            run["max_rel_err_vs_xla"] = float(jnp.max(jnp.abs(got - xla)) / jnp.max(jnp.abs(xla - h.astype(jnp.float32))))
            run["sync_after"] = int(jnp.max(jnp.abs(sync)))
            one = jax.jit(lambda h, w, s: fused_layer(h, s, w, **kw))
            t1 = common.timeit(lambda: one(h, layers[0], sync), repeats=3, warmup=1)
            run["one_layer_s"] = t1["median_s"]
            if t1["median_s"] > 0.01:
                raise RuntimeError(f"one layer took {t1['median_s']} s: the wait is spinning out")
            fn = fused_chain(**kw)
            t = common.timeit(lambda: fn(h, layers), repeats=5, warmup=1)
            run["us_per_layer"] = 1e6 * t["median_s"] / (loops * L)
            run["sync_after_chain"] = int(jnp.max(jnp.abs(fn(h, layers)[1])))
            with tempfile.TemporaryDirectory() as d:
                run["profile"] = common.kernel_profile(lambda: fn(h, layers), d, top=8)
        except Exception as e:  # noqa: BLE001
            run["error"] = repr(e)[:2000]
        print(json.dumps({k: v for k, v in run.items() if k != "profile"}), flush=True)
        result["runs"].append(run)
    for name, kernel in (("two_kernel", True),) + ((("xla", False),) if not parts else ()):
        fn = bdm.chain(kernel, loops)
        t = common.timeit(lambda: fn(h, layers), repeats=5, warmup=1)
        run = {"variant": name, "us_per_layer": 1e6 * t["median_s"] / (loops * L)}
        with tempfile.TemporaryDirectory() as d:
            run["profile"] = common.kernel_profile(lambda: fn(h, layers), d, top=8)
        print(json.dumps({k: v for k, v in run.items() if k != "profile"}), flush=True)
        result["runs"].append(run)
    if parts:
        common.write("decode-tail-persistent-probe-parts", result, out_dir)
        return
    # the layer's tail: out_proj (+ residual) and the FFN, against what a decode step runs now
    keys = jax.random.split(jax.random.key(2), 2 * L)
    outs = [{"kernel": (jax.random.normal(keys[2 * i], (D, D)) * 0.02).astype(jnp.bfloat16),
             "bias": (jax.random.normal(keys[2 * i + 1], (D,)) * 0.02).astype(jnp.bfloat16)} for i in range(L)]
    a = jax.random.normal(jax.random.key(3), (M, D), jnp.float32).astype(jnp.bfloat16)

    def tail_two(a, h, wo, w):
        h = h + (jnp.dot(a, wo["kernel"]) + wo["bias"])
        return bdm.ffn(h, w, True)

    def tail_fused(a, h, wo, w, sync, **kw):
        return fused_tail(a, h, wo["kernel"], wo["bias"], w["fc1"]["kernel"], w["fc1"]["colsum"], w["fc1"]["bias"],
                          w["fc2"]["kernel"], w["fc2"]["bias"], sync, **kw)

    def tail_chain(fused, **kw):
        def run(h, layers, outs):
            def one(_, carry):
                h, sync = carry
                for w, wo in zip(layers, outs):
                    if fused:
                        h, sync = tail_fused(a, h, wo, w, sync, **kw)
                    else:
                        h = tail_two(a, h, wo, w)
                return h, sync
            return jax.lax.fori_loop(0, loops, one, (h, jnp.zeros((tail_sync_size(D, F),), jnp.int32)))
        return jax.jit(run)

    ref = jax.jit(tail_two)(a, h, outs[0], layers[0]).astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(ref - h.astype(jnp.float32))))
    for kw in [dict(prefetch=False), dict(prefetch=True), dict(prefetch=True, stages=3)]:
        run = {"variant": {"tail": True, **kw}}
        try:
            got, sync = jax.jit(lambda a, h, wo, w, s: tail_fused(a, h, wo, w, s, **kw))(
                a, h, outs[0], layers[0], jnp.zeros((tail_sync_size(D, F),), jnp.int32))
            run["max_rel_err_vs_two_kernel"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref))) / scale
            run["sync_after"] = int(jnp.max(jnp.abs(sync)))
            one = jax.jit(lambda a, h, wo, w, s: tail_fused(a, h, wo, w, s, **kw))
            t1 = common.timeit(lambda: one(a, h, outs[0], layers[0], sync), repeats=3, warmup=1)
            run["one_layer_s"] = t1["median_s"]
            if t1["median_s"] > 0.01:
                raise RuntimeError(f"one layer took {t1['median_s']} s: the wait is spinning out")
            fn = tail_chain(True, **kw)
            t = common.timeit(lambda: fn(h, layers, outs), repeats=5, warmup=1)
            run["us_per_layer"] = 1e6 * t["median_s"] / (loops * L)
            run["sync_after_chain"] = int(jnp.max(jnp.abs(fn(h, layers, outs)[1])))
            with tempfile.TemporaryDirectory() as d:
                run["profile"] = common.kernel_profile(lambda: fn(h, layers, outs), d, top=8)
        except Exception as e:  # noqa: BLE001
            run["error"] = repr(e)[:2000]
        print(json.dumps({k: v for k, v in run.items() if k != "profile"}), flush=True)
        result["runs"].append(run)
    fn = tail_chain(False)
    t = common.timeit(lambda: fn(h, layers, outs), repeats=5, warmup=1)
    run = {"variant": "tail_two_kernel", "us_per_layer": 1e6 * t["median_s"] / (loops * L)}
    with tempfile.TemporaryDirectory() as d:
        run["profile"] = common.kernel_profile(lambda: fn(h, layers, outs), d, top=10)
    print(json.dumps({k: v for k, v in run.items() if k != "profile"}), flush=True)
    result["runs"].append(run)
    print("roofline us/layer (fc1 + fc2)", roof, "with out_proj", roof * 9 / 8)
    common.write("decode-tail-persistent-probe", result, out_dir)


if __name__ == "__main__":
    if sys.argv[1] == "lower":
        lower()
        lower_tail()
    elif sys.argv[1] == "cpu":
        cpu_check()
    else:
        bench(sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None, parts="--parts" in sys.argv)
