"""Microbenchmark: a Pallas (Triton) product for few rows (decode) against cuBLAS, device time from a profile."""
import functools, json, os, sys, itertools, time
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
sys.path.insert(0, ".")
from tools import common

def kernel(x_ref, w_ref, o_ref, *, bn, bk, steps, layout):
    j, s = pl.program_id(0), pl.program_id(1)
    M = x_ref.shape[0]
    def body(i, acc):
        k = pl.multiple_of((s * steps + i) * bk, bk)
        xk = x_ref[:, pl.ds(k, bk)]
        if layout == "nk":
            wk = w_ref[pl.ds(pl.multiple_of(j * bn, bn), bn), pl.ds(k, bk)]
            return acc + jax.lax.dot_general(xk, wk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        wk = w_ref[pl.ds(k, bk), pl.ds(pl.multiple_of(j * bn, bn), bn)]
        return acc + jnp.dot(xk, wk, preferred_element_type=jnp.float32)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((M, bn), jnp.float32))
    o_ref[s, :, pl.ds(pl.multiple_of(j * bn, bn), bn)] = acc.astype(o_ref.dtype)

def gemm(x, w, *, bn, bk, split, warps, stages, layout, interpret=False):
    M, K = x.shape
    N = w.shape[0] if layout == "nk" else w.shape[1]
    steps = K // split // bk
    name = f"gemm_{layout}_n{bn}_k{bk}_s{split}_w{warps}_st{stages}"
    out = pl.pallas_call(
        functools.partial(kernel, bn=bn, bk=bk, steps=steps, layout=layout),
        grid=(N // bn, split), in_specs=[pl.no_block_spec] * 2, out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((split, M, N), jnp.float32 if split > 1 else x.dtype),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name=name)(x, w)
    return out[0] if split == 1 else out

def check():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (16, 512), jnp.float32)
    w = jax.random.normal(kw, (512, 256), jnp.float32)
    for layout in ("kn", "nk"):
        ww = w.T if layout == "nk" else w
        y = gemm(x, ww, bn=32, bk=64, split=2, warps=4, stages=3, layout=layout, interpret=True).sum(0)
        print(layout, float(jnp.abs(y - x @ w).max()))

def main():
    L, M = 24, int(os.environ.get("ROWS", 64))
    shapes = {"opt_qkv": (2048, 6144), "opt_o": (2048, 2048), "opt_fc1": (2048, 8192), "opt_fc2": (8192, 2048)}
    results = {}
    for sname, (K, N) in shapes.items():
        keys = jax.random.split(jax.random.key(1), L + 1)
        x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
        ws_kn = [jax.random.normal(k, (K, N), jnp.bfloat16) * 0.02 for k in keys[1:]]
        ws_nk = [w.T.copy() for w in ws_kn]
        ref = jnp.dot(x, ws_kn[0], preferred_element_type=jnp.float32)
        fns = {"cublas": (jax.jit(lambda x, ws: [jnp.dot(x, w) for w in ws]), ws_kn)}
        for bn, bk, split, stages, layout in itertools.product((16, 32, 64, 128), (128, 256), (1, 2, 4), (3, 4), ("nk", "kn")):
            progs = N // bn * split
            if progs < 96 or progs > 1100 or K // split // bk < 2:
                continue
            cfg = dict(bn=bn, bk=bk, split=split, warps=4, stages=stages, layout=layout)
            f = jax.jit(lambda x, ws, cfg=cfg: [gemm(x, w, **cfg) for w in ws])
            ws = ws_nk if layout == "nk" else ws_kn
            try:
                y = f(x, ws)[0]
                y = y.astype(jnp.float32).sum(0) if split > 1 else y.astype(jnp.float32)
                err = float(jnp.abs(y - ref).max() / jnp.abs(ref).max())
                if err > 2e-2:
                    print(sname, cfg, "WRONG", err); continue
            except Exception as e:
                print(sname, cfg, "FAILED", str(e)[:80]); continue
            fns[f"gemm_{layout}_n{bn}_k{bk}_s{split}_w4_st{stages}"] = (f, ws)
        t0 = time.time()
        def run_all():
            outs = [f(x, ws) for f, ws in fns.values() for _ in range(3)]
            return outs
        jax.block_until_ready(run_all())
        prof = common.kernel_profile(run_all, f"/tmp/prof_{sname}", top=100000)
        line = next(v for k, v in prof.items() if "stream" in k.lower() or True)
        allk = {}
        for v in prof.values():
            for kk in v["kernels"]:
                allk[kk["name"]] = allk.get(kk["name"], [0, 0.0]); allk[kk["name"]][0] += kk["count"]; allk[kk["name"]][1] += kk["total_ms"]
        per = {}
        other = [0, 0.0]
        for name, (c, t) in allk.items():
            key = next((n for n in fns if n != "cublas" and name.startswith(n)), None)
            if key is None:
                other[0] += c; other[1] += t
            else:
                per[key] = 1e3 * t / c
        per["cublas_and_other"] = 1e3 * other[1] / (3 * L)
        byts = K * N * 2
        ranked = sorted(per.items(), key=lambda kv: kv[1])
        results[sname] = {"K": K, "N": N, "M": M, "us": per, "kernels_other": {n: v for n, v in allk.items() if not any(n.startswith(k) for k in fns if k != "cublas")}}
        print(f"{sname} M={M} K={K} N={N} weights {byts/1e6:.1f} MB  ({time.time()-t0:.0f}s)")
        for n, us in ranked[:8] + [("cublas_and_other", per["cublas_and_other"])]:
            print(f"   {n:40s} {us:7.2f} us  {byts/max(us, 1e-9)/1e6:6.2f} TB/s")
    json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), f"gemm-m{M}.json"), "w"), indent=1)

if __name__ == "__main__":
    check() if "check" in sys.argv else main()
