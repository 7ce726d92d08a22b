"""Probe (2026-12-02, not part of the package): programmatic dependent launch (PDL) in its real form for the decode
products. Each product is a Mosaic GPU kernel with its own TMA pipeline of `steps` stages. With `pdl`, a program
first issues the TMA loads of its first `steps` WEIGHT blocks (weights never depend on the kernel before), then
signals its dependents (`griddepcontrol.launch_dependents`), then waits for the kernel before
(`griddepcontrol.wait`), and only then loads x. So the next product's weights are in flight while this one drains.

The chain is the OPT-1.3B FFN at 64 rows, 4 distinct layers x 48 passes:
    h = relu(x @ w1)              fc1, 2048 -> 8192, 64 columns a program: 128 programs
    x = x + h @ w2                fc2, 8192 -> 2048, K split 4 ways, 64 columns: 128 programs; each partial is
                                  added into x in place by a TMA reduce-add (x is a jax.Ref), no XLA add
against the same chain through kernels.decode_matmul (Triton; fc2's partials summed by an XLA add), i.e. what a
decode step runs now. `steps=3` makes a program small enough (~100 KB of shared memory) that two fit on an SM, so a
dependent program can start its weight loads beside a running one; `steps=6` (~200 KB) only where one has exited.

    PROBE=bench/probes/decode-ffn-pdl-probe-20261202.py
    PYTHONPATH=. python $PROBE lower           # CPU: lowers for CUDA, uses_pdl set where pdl
    PYTHONPATH=. python $PROBE cpu             # CPU: the pipelines in Mosaic GPU's interpreter against float32
    DRY=1 PYTHONPATH=. python $PROBE bench     # CPU: the harness on the Triton path, one layer
    XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_command_buffer=" TAG=-nocmdbuf \
        [ONLY="now,mgpu steps 4"] PYTHONPATH=. python $PROBE bench [--out DIR]              # GPU
PDL takes effect only with XLA's command buffers off (the flag above): inside CUDA graphs the kernels are not
launched early. Results and their reading: bench/README.md, "PDL in its real form, measured"."""
from __future__ import annotations

import functools
import json
import os
import sys
import tempfile

sys.path.insert(0, ".")

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def tile(w, tile_n=64):
    """[K, N] -> [N / tile_n, K, tile_n]: each program's columns contiguous in memory."""
    k, n = w.shape
    return w.reshape(k, n // tile_n, tile_n).transpose(1, 0, 2)


def product(x, w, res=None, *, relu=False, split=1, tile_n=64, tile_k=128, steps=4, pdl=True, early=True,
            x_once=False):
    """relu(x @ w) (res None), or `res[...] += x @ w` in place into the Ref `res`: each of the `split` shares of K
    reduce-adds its partial (TMA `add`). x may be a Ref too. w is [K, N], or tiled [N / tile_n, K, tile_n] (`tile`:
    a weight block is then 16 KB in one piece instead of 128 rows of 128 bytes). x_once (timing only, a wrong
    result): the rows' blocks are loaded for the first `steps` steps only, to bound what their loads cost."""
    m, k = x.shape
    tiled = w.ndim == 3
    n = w.shape[0] * w.shape[2] if tiled else w.shape[1]
    assert not tiled or w.shape[2] == tile_n
    kb = k // split // tile_k
    assert kb * split * tile_k == k and n % tile_n == 0 and steps <= kb

    def body(*refs):
        x_gmem, w_gmem, o_gmem, x_smem, w_smem, xbar, wbar, o_smem = refs
        ni, si = lax.axis_index("n"), lax.axis_index("s")
        cols = pl.ds(ni * tile_n, tile_n)

        def w_copy(i):
            rows = pl.ds((si * kb + i) * tile_k, tile_k)
            plgpu.copy_gmem_to_smem(w_gmem.at[ni, rows, :] if tiled else w_gmem.at[rows, cols],
                                    w_smem.at[i % steps], wbar.at[i % steps])

        def x_copy(i):
            plgpu.copy_gmem_to_smem(x_gmem.at[:, pl.ds((si * kb + i) * tile_k, tile_k)],
                                    x_smem.at[i % steps], xbar.at[i % steps])

        if pdl and not early:  # PDL with nothing issued before the wait
            plgpu.griddepcontrol_launch_dependents()
            plgpu.griddepcontrol_wait()
        for i in range(steps):
            w_copy(i)
        if pdl and early:
            plgpu.griddepcontrol_launch_dependents()
            plgpu.griddepcontrol_wait()
        for i in range(steps):
            x_copy(i)

        def accumulate(acc_ref):
            for i in range(kb):  # unrolled: kb is 16 for both products
                plgpu.barrier_wait(wbar.at[i % steps])
                if not x_once or i < steps:
                    plgpu.barrier_wait(xbar.at[i % steps])
                plgpu.wgmma(acc_ref, x_smem.at[i % steps], w_smem.at[i % steps])
                plgpu.wgmma_wait(1)  # the product of step i - 1 is done: its slot may be refilled
                if i >= 1 and i - 1 + steps < kb:
                    w_copy(i - 1 + steps)
                    if not x_once:
                        x_copy(i - 1 + steps)
            return plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)

        acc = pl.run_scoped(accumulate, plgpu.ACC((m, tile_n)))
        if relu:
            acc = jnp.maximum(acc, 0.0)
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[:, cols], reduction_op=None if res is None else "add")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = [plgpu.SMEM((steps, m, tile_k), x.dtype), plgpu.SMEM((steps, tile_k, tile_n), w.dtype),
               plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps),
               plgpu.SMEM((m, tile_n), x.dtype)]
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), x.dtype) if res is None else (),
        scratch_types=scratch, grid=(n // tile_n, split), grid_names=("n", "s"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(x, w) if res is None else kernel(x, w, res)


def ffn_pdl(x, w1, w2, **kw):
    """One layer on the residual stream x (a Ref), updated in place."""
    h = product(x, w1, relu=True, **kw)
    product(h, w2, x, split=4, **kw)


def ffn_now(x, w1, w2):
    """One layer as a decode step runs it now, on the Ref x."""
    from jaxrlhf.kernels import decode_matmul as dm
    h = dm.decode_matmul(x[...], w1, relu=True)
    x[...] = (x[...].astype(jnp.float32) + dm.decode_matmul(h, w2)).astype(x.dtype)


def layers(fn, x, w1, w2, loops=1):
    """`loops` passes over the layers (w1, w2 lists) from x; returns the residual stream."""
    ref = jax.new_ref(x)

    def body(_, carry):
        for a, b in zip(w1, w2):
            fn(ref, a, b)
        return carry
    lax.fori_loop(0, loops, body, 0)
    return ref[...]


def lower():
    from jax import export
    x = jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16)
    w1 = jax.ShapeDtypeStruct((2048, 8192), jnp.bfloat16)
    w2 = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)
    for steps in (3, 6):
        for pdl in (False, True):
            f = functools.partial(layers, functools.partial(ffn_pdl, steps=steps, pdl=pdl))
            e = export.export(jax.jit(lambda x, a, b: f(x, [a], [b])), platforms=["cuda"])(x, w1, w2)
            t = e.mlir_module()
            print(f"steps {steps} pdl {pdl}: lowered, {len(t)} chars, uses_pdl {t.count('uses_pdl')}", flush=True)


def cpu():
    """Mosaic GPU's interpreter on the CPU: both products' pipelines (row-major and tiled weights, 2-4 slots) against
    float32, without PDL and without the reduce-add (the interpreter has rules for neither)."""
    kernel = plgpu.kernel
    plgpu.kernel = functools.partial(kernel, interpret=plgpu.InterpretGPUParams())
    try:
        key = jax.random.key(1)
        f32 = lambda a: a.astype(jnp.float32)
        x = jax.random.normal(key, (64, 512), jnp.bfloat16)
        w1 = (jax.random.normal(jax.random.fold_in(key, 1), (512, 1024)) * 0.05).astype(jnp.bfloat16)
        w2 = (jax.random.normal(jax.random.fold_in(key, 2), (1024, 512)) * 0.05).astype(jnp.bfloat16)
        want1 = jnp.maximum(f32(x) @ f32(w1), 0)
        h = want1.astype(jnp.bfloat16)
        want2 = f32(h) @ f32(w2)
        rel = lambda got, want: float(jnp.max(jnp.abs(f32(got) - want)) / jnp.max(jnp.abs(want)))
        for steps in (2, 3, 4):
            errs = [rel(product(x, w, relu=True, steps=steps, pdl=False), want1) for w in (w1, tile(w1))]
            errs.append(rel(product(h, w2, steps=steps, pdl=False), want2))
            print(f"steps {steps}: fc1 row-major / tiled, fc2: max relative error {errs}", flush=True)
            assert max(errs) < 1e-2, errs  # bf16 outputs: one rounding, ~3e-3
    finally:
        plgpu.kernel = kernel


def bench(out_dir):
    from tools import common
    # 4 distinct layers (268 MB of weights, far more than the 50 MB L2) x 48 passes: 192 layers, as 24 x 8;
    # fewer call sites than 24 layers keep Mosaic GPU's lowering (per call site) short
    L, M, loops = 4, 64, 48
    key = jax.random.key(0)
    # scale 0.005: the residual stream grows ~0.5 % a layer, so 192 layers stay finite in bf16
    w1 = [jax.random.normal(jax.random.fold_in(key, i), (2048, 8192), jnp.bfloat16) * 0.005 for i in range(L)]
    w2 = [jax.random.normal(jax.random.fold_in(key, 100 + i), (8192, 2048), jnp.bfloat16) * 0.005 for i in range(L)]
    x0 = jax.random.normal(key, (M, 2048), jnp.bfloat16)
    # correctness of one layer against float32 XLA
    ref = x0.astype(jnp.float32) + jnp.maximum(x0.astype(jnp.float32) @ w1[0].astype(jnp.float32), 0).astype(
        jnp.bfloat16).astype(jnp.float32) @ w2[0].astype(jnp.float32)
    res = {"xla_flags": os.environ.get("XLA_FLAGS"), "rows": M, "layers": L, "loops": loops, "runs": []}
    w1t, w2t = [tile(w) for w in w1], [tile(w) for w in w2]
    variants = [("now (Triton + XLA add)", ffn_now)]
    for steps in (4, 3, 6):
        for pdl in (False, True):
            variants.append((f"mgpu steps {steps} pdl {pdl}", functools.partial(ffn_pdl, steps=steps, pdl=pdl)))
        if steps == 4:
            variants.append(("mgpu steps 4 pdl, wait first", functools.partial(ffn_pdl, steps=4, pdl=True, early=False)))
    for steps in (4, 6):
        for pdl in (False, True):
            variants.append((f"tiled steps {steps} pdl {pdl}", functools.partial(ffn_pdl, steps=steps, pdl=pdl)))
            variants.append((f"x once (wrong) steps {steps} pdl {pdl}",
                             functools.partial(ffn_pdl, steps=steps, pdl=pdl, x_once=True)))
            variants.append((f"x once (wrong) tiled steps {steps} pdl {pdl}",
                             functools.partial(ffn_pdl, steps=steps, pdl=pdl, x_once=True)))
    if os.environ.get("ONLY"):  # a comma-separated list of variant labels' starts
        variants = [v for v in variants if any(v[0].startswith(o) for o in os.environ["ONLY"].split(","))]
    if os.environ.get("DRY"):  # CPU: the harness on the Triton path only, one layer
        variants, L, loops = variants[:1], 1, 1
        w1, w2 = w1[:1], w2[:1]
    chain_ref = None
    w1s, w2s = w1, w2
    for label, fn in variants:
        row = {"variant": label}
        w1, w2 = (w1t, w2t) if "tiled" in label else (w1s, w2s)
        try:
            one = jax.jit(lambda x, a, b: layers(fn, x, [a], [b]))(x0, w1[0], w2[0]).astype(jnp.float32)
            row["max_rel_err"] = float(jnp.max(jnp.abs(one - ref)) / jnp.max(jnp.abs(ref)))
            f = jax.jit(functools.partial(layers, fn, loops=loops))
            out = f(x0, w1, w2)
            row["chain_out_absmax"] = float(jnp.max(jnp.abs(out.astype(jnp.float32))))
            if label.startswith("now"):
                chain_ref = out.astype(jnp.float32)
            if chain_ref is not None:
                row["chain_rel_diff_vs_now"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - chain_ref))
                                                     / jnp.max(jnp.abs(chain_ref)))
            t = common.timeit(lambda: f(x0, w1, w2), repeats=5, warmup=1)
            row["wall_us_per_layer"] = 1e6 * t["median_s"] / (loops * L)
            with tempfile.TemporaryDirectory() as d:
                prof = common.kernel_profile(lambda: f(x0, w1, w2), d, top=8)
            if not prof:  # the CPU (DRY) has no device trace
                raise RuntimeError("no kernel profile")
            line = max(prof.values(), key=lambda v: v["busy_ms"])
            row["kernel_us_per_layer"] = 1e3 * line["busy_ms"] / (loops * L)
            row["kernels"] = [(k["name"][:40], k["count"], round(1e3 * k["total_ms"] / k["count"], 2))
                              for k in line["kernels"]]
        except Exception as e:  # noqa: BLE001 - a probe reports what failed and goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        print(json.dumps(row), flush=True)
        res["runs"].append(row)
    res["read_bandwidth_Bps"] = common.read_bandwidth()
    tag = os.environ.get("TAG", "")
    with open(os.path.join(out_dir, f"decode-ffn-pdl-probe{tag}.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["lower"]:
        lower()
    elif sys.argv[1:2] == ["cpu"]:
        cpu()
    else:
        bench(sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else ".")
