"""The fused decode step at 6 and 7 query heads per KV head (Qwen2.5; 8 for comparison) on a GPU, compiled by Triton:
equal to the interpret-mode kernel (tested equal to the reference on the CPU) and to the unfused XLA path, and timed
(us per layer, the mean of 20 chained calls in one jitted loop, median of 5) against the unfused path (XLA's norm, bias,
rotation and cache writes, then the decode-attention kernel) and plain XLA at Qwen2.5-1.5B's decode shape: 256 slots,
2 KV heads of 128, a 4,352-slot cache (256 + 4,096), rows at ~2k and ~4k tokens.

    PYTHONPATH=. python bench/probes/decode-step-groups-probe-20261205.py [slots] [out.json]
"""
import dataclasses, json, sys, time
import jax, jax.numpy as jnp, numpy as np
from jaxrlhf.kernels.decode_attention import DecodeAttentionConfig, decode_attention, decode_step, fuses_step

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
CPU = jax.default_backend() == "cpu"  # a smoke run: interpret mode, small shapes
GPU = DecodeAttentionConfig("auto", interpret=CPU)
f32 = jnp.float32

def inputs(L, B, Hkv, G, S, K, lo, hi, seed=0):
    ks = jax.random.split(jax.random.key(seed), 8)
    qkv = jax.random.normal(ks[0], (B, Hkv, G + 2, K), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (L, B, Hkv, S, K), jnp.bfloat16) for kk in ks[1:3])
    start = jax.random.randint(ks[3], (B,), 0, 32)
    slot = jax.random.randint(ks[4], (B,), lo, hi)
    ang = jax.random.uniform(ks[5], (B, K // 2), maxval=6.0)
    x = jax.random.normal(ks[6], (B, 1536), jnp.bfloat16)
    bias = jax.random.normal(ks[7], (Hkv, G + 2, K), jnp.bfloat16)
    return qkv, k, v, start, slot, (jnp.cos(ang), jnp.sin(ang)), x, bias

def fused(cfg, qkv, k, v, start, slot, layer, rope, x, bias):
    return decode_step(qkv, k, v, start, slot, layer, rope=rope, rms=(x, 1e-6), bias=bias, config=cfg)

def unfused(cfg, qkv, k, v, start, slot, layer, rope, x, bias, xla=False):
    B, Hkv, G2, K = qkv.shape
    G = G2 - 2
    r = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(f32)), -1) + 1e-6)
    y = qkv.astype(f32) * r[:, None, None, None] + bias.astype(f32)
    c, s = rope[0][:, None, None, :], rope[1][:, None, None, :]
    turn = lambda t: jnp.concatenate([t[..., :K//2] * c - t[..., K//2:] * s, t[..., K//2:] * c + t[..., :K//2] * s], -1)
    q, kn = turn(y[:, :, :G]), turn(y[:, :, G:G+1])[:, :, 0]
    rows = jnp.arange(B)
    k = k.at[layer, rows, :, slot].set(kn.astype(k.dtype))
    v = v.at[layer, rows, :, slot].set(y[:, :, G + 1].astype(v.dtype))
    qq = q.reshape(B, Hkv * G, K).astype(k.dtype)
    cfg = dataclasses.replace(cfg, implementation="xla") if xla else cfg
    return decode_attention(qq, k, v, start, slot + 1, layer, config=cfg), k, v

ok = True
for G, K in ((6, 128), (7, 64), (4, 128)):
    a = inputs(2, 8, 2, G, 512, K, 100, 500)
    got = jax.jit(lambda *a: fused(GPU, *a[:6], *a[6:]))(*a[:5], 1, *a[5:])
    want = jax.jit(lambda *a: fused(dataclasses.replace(GPU, implementation="pallas", interpret=True), *a))(*a[:5], 1, *a[5:])
    ref = jax.jit(lambda *a: unfused(GPU, *a, xla=True))(*a[:5], 1, *a[5:])
    for name, g, w, rr in zip(("out", "k", "v"), got, want, ref):
        e1 = float(jnp.max(jnp.abs(g.astype(f32) - w.astype(f32))))
        e2 = float(jnp.max(jnp.abs(g.astype(f32) - rr.astype(f32))))
        print(f"G={G} K={K} {name}: |fused - interpret| {e1:.3g}  |fused - unfused xla| {e2:.3g}", flush=True)
        ok &= e1 < 2e-2 and e2 < 5e-2
print("CORRECT" if ok else "MISMATCH", flush=True)

def timed(fn, args, n=20):
    def loop(qkv, k, v, *rest):
        def body(i, c):
            k, v, acc = c
            out, k, v = fn(qkv, k, v, rest[0], rest[1], i % 4, *rest[2:])
            return k, v, acc + out[0, 0, 0].astype(f32)
        return jax.lax.fori_loop(0, n, body, (k, v, f32(0)))
    f = jax.jit(loop, donate_argnums=(1, 2))
    qkv, k, v, *rest = args
    k, v, _ = f(qkv, k, v, *rest); jax.block_until_ready(k)
    ts = []
    for _ in range(5):
        t = time.perf_counter(); k, v, _ = f(qkv, k, v, *rest); jax.block_until_ready(k); ts.append(time.perf_counter() - t)
    return np.median(ts) / n * 1e6, (qkv, k, v, *rest)

B = int(sys.argv[1]) if len(sys.argv) > 1 else 256
rows = []
for G in (6, 7, 8):
    S = 256 if CPU else 4352
    for lo, hi in ((100, 200),) if CPU else ((1500, 2300), (3500, 4300)):
        args = inputs(4, B, 2, G, S, 128, lo, hi)
        print(f"B={B} G={G} slots~{lo}-{hi}: fuses_step={fuses_step(GPU, B, 2, S, 128, G)}", flush=True)
        for name, fn in (("fused", lambda *a: fused(GPU, *a)), ("unfused kernel", lambda *a: unfused(GPU, *a)),
                         ("unfused xla", lambda *a: unfused(GPU, *a, xla=True))):
            t, args = timed(fn, args)
            print(f"   {name:15s} {t:8.1f} us/layer", flush=True)
            rows.append(dict(slots=B, groups=G, valid=[lo, hi], path=name, us_per_layer=round(t, 2)))
if len(sys.argv) > 2:
    info = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, correct=ok, rows=rows)
    with open(sys.argv[2], "w") as f:
        json.dump(info, f, indent=1)
