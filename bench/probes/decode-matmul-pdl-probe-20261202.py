"""Probe (2026-12-02, not part of the package): does programmatic dependent launch (PDL) overlap chained Mosaic GPU
decode products? 24 layers of
fc1 (2048 -> 8192) then fc2 (8192 -> 2048), 64 rows, each product one Mosaic GPU kernel (session 15's probe);
with pdl each kernel calls griddepcontrol.launch_dependents then griddepcontrol.wait first (so the next kernel may
be launched while this one runs; its reads of x wait for this one's end). Wall time per layer over 8 passes.
    PYTHONPATH=. python bench/probes/decode-matmul-pdl-probe-20261202.py lower   # CPU: lowers, uses_pdl set
    XLA_FLAGS="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" OUT=DIR TAG=-pdlflags \
        PYTHONPATH=. python bench/probes/decode-matmul-pdl-probe-20261202.py      # GPU"""
import functools, importlib.util, json, os, sys, tempfile
sys.path.insert(0, ".")
import jax, jax.numpy as jnp
from jax import lax
from tools import common

_spec = importlib.util.spec_from_file_location(
    "mgpu_probe", os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode-matmul-mgpu-probe-20261202.py"))
_mgpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mgpu)


def mm(x, w, *, pdl, **tiles):
    """relu(x @ w) as one Mosaic GPU kernel (session 15's probe, decode-matmul-mgpu-probe-20261202.py)."""
    return _mgpu.mgpu_matmul(x, w, relu=True, pdl=pdl, **tiles)[0]


def main():
    L, M, loops = 24, 64, 8
    key = jax.random.key(0)
    w1 = [jax.random.normal(jax.random.fold_in(key, i), (2048, 8192), jnp.bfloat16) * 0.02 for i in range(L)]
    w2 = [jax.random.normal(jax.random.fold_in(key, 100 + i), (8192, 2048), jnp.bfloat16) * 0.02 for i in range(L)]
    x = jax.random.normal(key, (M, 2048), jnp.bfloat16)
    res = {"flags": os.environ.get("XLA_FLAGS"), "runs": []}
    ref = None
    for pdl in (False, True):
        def run(x, w1, w2):
            def one(_, x):
                for a, b in zip(w1, w2):
                    x = mm(mm(x, a, pdl=pdl), b, pdl=pdl) * 0.5
                return x
            return lax.fori_loop(0, loops, one, x)
        f = jax.jit(run)
        out = f(x, w1, w2).astype(jnp.float32)
        ref = out if ref is None else ref
        t = common.timeit(lambda: f(x, w1, w2), repeats=5, warmup=1)
        with tempfile.TemporaryDirectory() as d:
            prof = common.kernel_profile(lambda: f(x, w1, w2), d, top=6)
        r = {"pdl": pdl, "us_per_layer": 1e6 * t["median_s"] / (loops * L),
             "same_as_no_pdl": float(jnp.max(jnp.abs(out - ref))), "profile": prof}
        print(json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
        for line, v in prof.items():
            print("  ", line[:40], v["busy_ms"], [(k["name"][:30], k["count"], round(1e3 * k["total_ms"] / k["count"], 2)) for k in v["kernels"][:4]])
        res["runs"].append(r)
    tag = os.environ.get("TAG", "")
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), f"pdl-probe{tag}.json"), "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1:] == ["lower"]:
        from jax import export
        for pdl in (False, True):
            e = export.export(jax.jit(functools.partial(mm, pdl=pdl)), platforms=["cuda"])(
                jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048, 8192), jnp.bfloat16))
            t = e.mlir_module()
            print(pdl, "lowered", len(t), "uses_pdl" in t, t.count("griddepcontrol"))
    else:
        main()
