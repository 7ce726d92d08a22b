"""Probe (2026-12-02, not part of the package): a Mosaic GPU decode product [M, K] x [K, N] (TMA loads in an
emit_pipeline of `steps` buffers, wgmma into a float32 accumulator, one warpgroup per program owning tile_n output
columns of one of `split` shares of K) against kernels.decode_matmul's Triton kernel, on 24 distinct weights per
shape, device time per call from a profile. HOT=1: all 24 calls on one weight (read from L2) instead.
    PYTHONPATH=. python bench/probes/decode-matmul-mgpu-probe-20261202.py bench   (on the GPU; ROWS=64 default)
    PYTHONPATH=. python bench/probes/decode-matmul-mgpu-probe-20261202.py lower   (CPU: lowers three variants)
(The cuBLAS rows of the cold run are not valid: XLA merged the 24 products that shared x into one.)"""
import functools, json, os, sys
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def mgpu_matmul(x, w, *, tile_n=64, tile_k=128, steps=6, split=1, relu=False, pdl=False):
    """x [M, K] @ w [K, N] -> [split, M, N] (float32 partials when split > 1). relu: ReLU before the store. pdl: signal
    dependents and wait for the kernel before at the start (programmatic dependent launch; the PDL probe)."""
    m, k = x.shape
    n = w.shape[1]
    kb = k // split // tile_k

    def body(x_gmem, w_gmem, o_gmem):
        ni, si = lax.axis_index("n"), lax.axis_index("s")
        if pdl:
            plgpu.griddepcontrol_launch_dependents()
            plgpu.griddepcontrol_wait()

        def acc_scope(acc_ref):
            plgpu.emit_pipeline(
                lambda _, xs, ws: plgpu.wgmma(acc_ref, xs, ws),
                grid=(kb,),
                in_specs=[plgpu.BlockSpec((m, tile_k), lambda i: (0, si * kb + i), delay_release=1),
                          plgpu.BlockSpec((tile_k, tile_n), lambda i: (si * kb + i, ni), delay_release=1)],
                max_concurrent_steps=steps,
            )(x_gmem, w_gmem)
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((m, tile_n)))

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((m, tile_n), dtype=o_gmem.dtype))
        def _(o_smem):
            o_smem[...] = (jnp.maximum(acc, 0.0) if relu else acc).astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, :, pl.ds(ni * tile_n, tile_n)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_dtype = x.dtype if split == 1 else jnp.float32
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((split, m, n), out_dtype), grid=(n // tile_n, split),
                          grid_names=("n", "s"),
                          compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(x, w)


if __name__ == "__main__" and sys.argv[1:] == ["lower"]:
    from jax import export
    x = jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2048, 8192), jnp.bfloat16)
    for kw in [dict(), dict(tile_n=128, tile_k=64, steps=8), dict(split=2)]:
        e = export.export(jax.jit(functools.partial(mgpu_matmul, **kw)), platforms=["cuda"])(x, w)
        print(kw, "lowered", len(e.mlir_module()))


if __name__ == "__main__" and sys.argv[1:2] == ["bench"]:
    sys.path.insert(0, ".")
    import tempfile
    from jaxrlhf.kernels import decode_matmul as dm
    from tools import common
    L, M = 24, int(os.environ.get("ROWS", 64))
    key = jax.random.key(0)
    x = jax.random.normal(key, (M, 8192), jnp.bfloat16)
    results = []
    shapes = {"fc1": (2048, 8192), "qkv": (2048, 6144), "out_proj": (2048, 2048), "fc2": (8192, 2048)}
    configs = {
        "fc1": [dict(tile_n=64, tile_k=128, steps=6), dict(tile_n=64, tile_k=64, steps=10),
                dict(tile_n=32, tile_k=128, steps=4), dict(tile_n=128, tile_k=64, steps=8), dict(tile_n=64, tile_k=128, steps=4, split=2)],
        "qkv": [dict(tile_n=64, tile_k=128, steps=6), dict(tile_n=32, tile_k=128, steps=4), dict(tile_n=64, tile_k=128, steps=4, split=2)],
        "out_proj": [dict(tile_n=64, tile_k=128, steps=4, split=4), dict(tile_n=32, tile_k=128, steps=4, split=2)],
        "fc2": [dict(tile_n=64, tile_k=128, steps=6, split=4), dict(tile_n=64, tile_k=64, steps=10, split=4), dict(tile_n=128, tile_k=64, steps=6, split=4)],
    }
    warm = jax.jit(lambda a: jnp.sum(a * a))
    big = jnp.ones((1 << 28,), jnp.bfloat16)
    for _ in range(200):
        warm(big)
    for name, (K, N) in shapes.items():
        ws = [jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) * 0.02 for i in range(L)]
        xs = x[:, :K]
        mb = K * N * 2 / 1e6
        ref = jnp.dot(xs.astype(jnp.float32), ws[0].astype(jnp.float32))

        def run(label, fn):
            try:
                out = jax.jit(fn)(xs, ws[0])
                out = out.sum(0) if out.ndim == 3 else out
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
                f = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
                with tempfile.TemporaryDirectory() as d:
                    prof = common.kernel_profile(lambda: f(xs, ws), d, top=6)
                line = max(prof.values(), key=lambda v: v["busy_ms"])
                us = 1e3 * line["busy_ms"] / L
                kern = [(k["name"][:40], k["count"], round(1e3 * k["total_ms"] / k["count"], 2)) for k in line["kernels"]]
                row = dict(shape=name, impl=label, us=us, TBps=mb / us, err=err, kernels=kern)
            except Exception as e:  # noqa: BLE001
                row = dict(shape=name, impl=label, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(row), flush=True)
            results.append(row)

        split = dm.split_for(K, N)
        if os.environ.get("HOT"):
            tri = lambda x, w: dm._pallas(x, w, None, None, eps=None, relu=False, split=split, interpret=False)
            run(f"triton split {split} cold", tri)
            ws = [ws[0]] * L
            run(f"triton split {split} hot (one weight, L2)", tri)
            run("mgpu hot", functools.partial(mgpu_matmul, **configs[name][0]))
            continue
        run("cublas", lambda x, w: jnp.dot(x, w))
        run(f"triton split {split}", lambda x, w: dm._pallas(x, w, None, None, eps=None, relu=False, split=split, interpret=False))
        for cfg in configs[name]:
            run(f"mgpu {cfg}", functools.partial(mgpu_matmul, **cfg))
    json.dump(results, open(os.path.join(os.environ.get("OUT", "."), f"mgpu-probe-m{M}.json"), "w"), indent=1)
