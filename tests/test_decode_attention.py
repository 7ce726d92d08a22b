"""The Pallas decode-attention kernel (interpret mode on the CPU) and the XLA path against the reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import make_mesh
from jaxrlhf.kernels.decode_attention import (
    DecodeAttentionConfig,
    decode_attention,
    decode_attention_reference,
    decode_step,
    decode_step_reference,
    fuses_step,
)

KERNEL = DecodeAttentionConfig(implementation="pallas", block_s=16, interpret=True)


def inputs(L, B, H, Hkv, S, K, dtype, seed):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, H, K), dtype) * K**-0.5
    k = jax.random.normal(ks[1], (L, B, Hkv, S, K), dtype)
    v = jax.random.normal(ks[2], (L, B, Hkv, S, K), dtype)
    start = jax.random.randint(ks[3], (B,), 0, S // 2)  # left padding of different lengths
    end = start + 1 + jax.random.randint(ks[4], (B,), 0, S - S // 2)  # ragged current lengths, >= 1 slot
    return q, k, v, start, end


CASES = [  # (L, B, H, Hkv, S, K, dtype): multi-head and grouped-query, head dims 64 and 128, ragged
    (1, 4, 4, 4, 64, 64, jnp.float32),
    (3, 3, 8, 2, 48, 128, jnp.bfloat16),
    (2, 5, 4, 1, 80, 64, jnp.float32),
    (4, 2, 16, 4, 32, 64, jnp.bfloat16),
    (2, 3, 32, 2, 48, 64, jnp.float32),  # 16 queries per KV head: no repeats for the products
    (2, 3, 12, 2, 48, 128, jnp.bfloat16),  # Qwen2.5-1.5B's 6 queries per KV head, padded to 8 for Triton
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize(
    "implementation, use_dot",
    [("pallas", True), ("pallas", False), ("xla", True)],
    ids=["kernel", "kernel_elementwise", "xla"],
)
@pytest.mark.slow
def test_kernel_and_xla_match_the_reference(case, implementation, use_dot):
    L, B, H, Hkv, S, K, dtype = CASES[case]
    q, k, v, start, end = inputs(L, B, H, Hkv, S, K, dtype, seed=100 + case)  # fresh inputs per case
    layer = L - 1
    config = dataclasses.replace(KERNEL, implementation=implementation, use_dot=use_dot)
    got = decode_attention(q, k, v, start, end, layer, config=config)
    want = decode_attention_reference(q, k, v, start, end, layer)
    assert not np.allclose(np.asarray(want, np.float32), 0)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    if L > 1:  # another layer gives another answer
        other = decode_attention_reference(q, k, v, start, end, 0)
        assert np.abs(np.asarray(other, np.float32) - np.asarray(want, np.float32)).max() > 0.1


SPLIT_CASES = [  # (B, H, Hkv, S, K, dtype, num_splits): chunks of S=64 in 16-slot blocks
    (4, 2, 2, 64, 64, jnp.float32, 4),  # multi-head, 4 chunks of 16
    (4, 8, 2, 64, 128, jnp.bfloat16, 3),  # grouped-query; 3 splits round to chunks of 32, so 2 programs
    (4, 14, 2, 64, 64, jnp.float32, 2),  # Qwen2.5-0.5B's 7 queries per KV head (padded to 8), split
]


@pytest.mark.parametrize("case", range(len(SPLIT_CASES)))
def test_split_kernel_matches_the_reference(case):
    """Flash-decoding: rows whose range lies inside one chunk, rows with empty chunks before and after their
    range, and a row with no valid slot at all (zeros, no NaN from its empty chunks)."""
    B, H, Hkv, S, K, dtype, num_splits = SPLIT_CASES[case]
    q, k, v, _, _ = inputs(2, B, H, Hkv, S, K, dtype, seed=200 + case)
    start = jnp.array([0, 37, 20, 50])  # all; inside one chunk (32..47); 2nd..4th chunk; none (50 >= 50)
    end = jnp.array([64, 45, 61, 50])
    config = dataclasses.replace(KERNEL, num_splits=num_splits)
    got = np.asarray(decode_attention(q, k, v, start, end, 1, config=config), np.float32)
    want = np.asarray(decode_attention_reference(q, k, v, start, end, 1), np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got[:3], want[:3], atol=tol, rtol=tol)
    np.testing.assert_array_equal(got[3], 0.0)


def test_auto_splits_by_hand():
    auto = DecodeAttentionConfig()
    assert auto.splits(programs=128, slots=2048, cores=132) == 2  # B=32, Hkv=4: 256 programs for 132 SMs
    assert auto.splits(programs=64, slots=2048, cores=132) == 4
    assert auto.splits(programs=16, slots=2048, cores=132) == 4  # chunks of at least 512 slots
    assert auto.splits(programs=128, slots=512, cores=132) == 1
    assert auto.splits(programs=256, slots=2048, cores=132) == 1  # every SM has a program: as without splits
    assert auto.splits(programs=32, slots=2048, cores=None) == 1  # CPU: SM count unknown
    assert DecodeAttentionConfig(num_splits=8).splits(programs=4096, slots=256, cores=132) == 4  # 4 blocks of 64
    assert DecodeAttentionConfig(num_splits=3, block_s=16).splits(programs=4, slots=64, cores=None) == 2  # 32 + 32
    assert DecodeAttentionConfig(num_splits=8, block_s=16).splits(programs=4096, slots=48, cores=132) == 3


def test_reference_by_hand_and_slots_outside_the_range_are_ignored():
    q = jnp.array([[[1.0, 0.0]]])  # B=1, H=1, K=2
    k = jnp.array([[[[1.0, 0.0], [0.0, 1.0], [9.0, 9.0], [2.0, 0.0]]]])  # B=1, Hkv=1, S=4, K=2
    v = jnp.array([[[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0], [0.0, 3.0]]]])
    out = decode_attention_reference(q, k, v, jnp.array([0]), jnp.array([2]))
    w = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()
    np.testing.assert_allclose(np.asarray(out)[0, 0], w[0] * np.array([1, 0]) + w[1] * np.array([0, 1]), rtol=1e-6)
    k_big = jnp.concatenate([k] * 4, axis=2)  # S = 16 for the kernel's block
    v_big = jnp.concatenate([v] * 4, axis=2)
    got = decode_attention(q, k_big, v_big, jnp.array([0]), jnp.array([2]), config=KERNEL)
    np.testing.assert_allclose(np.asarray(got), np.asarray(out), rtol=1e-6)


@pytest.mark.slow
def test_per_shard_under_tensor_parallelism():
    """Split over 2 chunks per shard (one split under TP: tests/test_generate.py's kernel runs)."""
    mesh = make_mesh(tp=4)  # 8 CPU devices: data 2 x model 4
    q, k, v, start, end = inputs(2, 4, 8, 4, 32, 64, jnp.float32, seed=7)
    want = decode_attention_reference(q, k, v, start, end, 1)
    config = dataclasses.replace(KERNEL, num_splits=2)
    got = jax.jit(lambda *a: decode_attention(*a, 1, config=config, mesh=mesh))(q, k, v, start, end)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_bad_shapes_and_knobs():
    q, k, v, start, end = inputs(1, 1, 3, 2, 32, 64, jnp.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention(q, k, v, start, end, config=KERNEL)
    with pytest.raises(ValueError, match=r"block_s: expected 0 \(auto\) or a power of two"):
        DecodeAttentionConfig(block_s=48)
    auto = DecodeAttentionConfig()
    assert auto.slots_per_block(64, 2048) == auto.slots_per_block(64, 2048, groups=4) == 64
    assert auto.slots_per_block(128, 512) == 64  # multi-head: 64 slots
    assert auto.slots_per_block(128, 512, groups=4) == 32  # grouped-query: 4096 / head dim
    assert DecodeAttentionConfig(block_s=16).slots_per_block(128, 512) == 16
    assert DecodeAttentionConfig().slots_per_block(128, 48) == 16  # at most the power of two dividing S
    with pytest.raises(ValueError, match="num_splits: expected an int >= 0"):
        DecodeAttentionConfig(num_splits=-1)
    with pytest.raises(ValueError, match="implementation: expected"):
        DecodeAttentionConfig(implementation="triton")
    q, k, v, start, end = inputs(1, 1, 2, 2, 40, 64, jnp.float32, seed=0)
    with pytest.raises(ValueError, match="cache length 40 must be a multiple of 16"):
        decode_attention(q, k, v, start, end, config=KERNEL)
    with pytest.raises(ValueError, match="cache length 40 must be a multiple of 16"):  # the fused step too
        decode_step(jnp.zeros((1, 2, 3, 64)), k, v, start, 5, config=KERNEL)


@pytest.mark.parametrize("mask_loads", [True, False], ids=["masked_loads", "whole_blocks"])
def test_kernel_lowers_to_triton_for_an_h200(mask_loads):
    """Interpret mode (the other tests) checks the kernel's arithmetic, not what Triton accepts: lower it for an
    abstract H200 (no GPU needed), multi-head at head dim 64 and grouped-query at 128, one split and four."""
    from jax import export
    from jax._src.mesh import AbstractDevice, AbstractMesh

    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((4,), jnp.int32)
    for H, Hkv, K, splits in [(32, 32, 64, 1), (32, 8, 128, 4), (12, 2, 128, 1), (14, 2, 64, 1)]:
        config = DecodeAttentionConfig("auto", interpret=False, mask_loads=mask_loads, num_splits=splits)
        fn = jax.jit(lambda q, k, v, s, e: decode_attention(q, k, v, s, e, 1, config=config))
        with jax.sharding.use_abstract_mesh(h200):
            exported = export.export(
                fn, platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
            )(bf16(4, H, K), bf16(2, 4, Hkv, 2048, K), bf16(2, 4, Hkv, 2048, K), rows, rows)
        module = exported.mlir_module()
        assert module.count('name = "jaxrlhf_decode_attention"') == 1
        assert ("masked_load" in module) == mask_loads  # the Triton IR's debug names
        assert fuses_step(config, 4, Hkv, 512, K, H // Hkv) == (splits == 1)  # Qwen2.5's 6 groups padded to 8
        # the fused step, its caches aliased to its outputs: grouped-query heads with rotary and RMSNorm (Llama),
        # (and Qwen3's per-head q/k norm), multi-head with a LayerNorm, its float32 product and a bias (OPT)
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
        G2, llama = H // Hkv + 2, Hkv < H
        step = jax.jit(
            lambda qkv, k, v, s, c, n, x, m, r, cs, b, w: decode_step(
                qkv,
                k,
                v,
                s,
                300,
                1,
                rope=(c, n) if llama else None,
                rms=(x, 1e-5) if llama else None,
                layer_norm=None if llama else (m, r, 2048, 1e-5, cs),
                bias=None if llama else b,
                qk_norm=(w, 1e-6) if llama else None,  # Qwen3's
                config=config,
            )
        )
        with jax.sharding.use_abstract_mesh(h200):
            exported = export.export(
                step,
                platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
            )(
                (bf16 if llama else f32)(4, Hkv, G2, K),
                bf16(2, 4, Hkv, 512, K),
                bf16(2, 4, Hkv, 512, K),
                rows,
                f32(4, K // 2),
                f32(4, K // 2),
                bf16(4, 5120),
                f32(4),
                f32(4),  # Llama-13B's width: 5 pieces
                f32(Hkv, G2, K),
                bf16(Hkv, G2, K),
                bf16(2, K),
            )
        module = exported.mlir_module()
        assert module.count('name = "jaxrlhf_decode_attention_step"') == 1 and "output_operand_alias" in module


@pytest.mark.slow
def test_masked_loads_read_nothing_outside_the_valid_range():
    """With masked loads the slots outside a row's range are never read: NaN there leaves the output equal to
    the reference on a clean cache. Whole blocks read them (their scores are masked, but NaN values times a
    zero probability are NaN), so the cache must be clean there, as generation's zero-initialised cache is."""
    L, B, H, Hkv, S, K = 2, 3, 4, 2, 64, 64
    q, k, v, start, end = inputs(L, B, H, Hkv, S, K, jnp.float32, seed=7)
    start, end = jnp.array([3, 0, 17]), jnp.array([40, 21, 64])  # ranges that start and end inside blocks of 16
    inside = ((jnp.arange(S) >= start[:, None]) & (jnp.arange(S) < end[:, None]))[None, :, None, :, None]
    dirty = lambda x: jnp.where(inside, x, jnp.nan)
    want = decode_attention_reference(q, jnp.where(inside, k, 0), jnp.where(inside, v, 0), start, end, 1)
    got = decode_attention(q, dirty(k), dirty(v), start, end, 1, config=KERNEL)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    whole = decode_attention(q, dirty(k), dirty(v), start, end, 1, config=dataclasses.replace(KERNEL, mask_loads=False))
    assert np.isnan(np.asarray(whole)).any(axis=(1, 2)).all()  # every row has a partial block


STEP_CASES = [  # (L, B, Hkv, G, S, K, dtype, rope, the folded norm: None, "rms" or "layer", RMSNorm's width D, bias,
    # Qwen3's per-head q/k norm)
    (2, 3, 2, 2, 48, 64, jnp.float32, True, "rms", 96, False, False),  # Llama: grouped-query, rotary, RMSNorm (D in 3)
    (1, 4, 4, 1, 64, 64, jnp.float32, False, None, 0, False, False),  # OPT unfolded (post-LN): multi-head, neither
    (2, 4, 4, 1, 64, 64, jnp.float32, False, "layer", 0, True, False),  # OPT pre-LN: LayerNorm (statistics given), bias
    (3, 2, 2, 4, 32, 128, jnp.bfloat16, True, "rms", 256, True, False),  # Qwen2: q/k/v biases, in bf16
    (2, 3, 2, 4, 48, 64, jnp.float32, True, "rms", 96, False, True),  # Qwen3: q/k norm before the rotation
    (2, 3, 2, 2, 48, 64, jnp.bfloat16, False, "rms", 64, True, True),  # q/k norm with a bias, no rotation, bf16
    # query groups that are no power of two, padded to one in the kernel (masked loads and stores)
    (2, 3, 2, 6, 48, 128, jnp.bfloat16, True, "rms", 96, True, False),  # Qwen2.5-1.5B: 6 queries per KV head
    (2, 3, 2, 7, 48, 64, jnp.float32, True, "rms", 96, True, False),  # Qwen2.5-0.5B and 7B: 7
    (2, 2, 2, 3, 32, 64, jnp.float32, False, "layer", 0, True, True),  # 3, with a LayerNorm's column sums, q/k norm
]


def norm_input(key, B, D, dtype=jnp.float32):
    """Rows [B, D] of different RMS (0.5 to 2) and means (-1 to 1.5): each row's scale and shift differ."""
    rows = jax.random.normal(key, (B, D)) * jnp.linspace(0.5, 2.0, B)[:, None] + jnp.linspace(-1.0, 1.5, B)[:, None]
    return rows.astype(dtype)


@pytest.mark.parametrize("case", range(len(STEP_CASES)))
@pytest.mark.slow
def test_the_fused_step_equals_normalise_rotate_write_attend(case):
    L, B, Hkv, G, S, K, dtype, rope, norm, D, bias, qk = STEP_CASES[case]
    ks = jax.random.split(jax.random.key(200 + case), 8)  # fresh inputs per case
    # A folded LayerNorm's product comes in float32 (common.SelfAttention._fused_step): its mean part cancels
    qkv = jax.random.normal(ks[0], (B, Hkv, G + 2, K), jnp.float32 if norm == "layer" else dtype)
    k, v = (jax.random.normal(key, (L, B, Hkv, S, K), dtype) for key in ks[1:3])
    start, slot, layer = jax.random.randint(ks[3], (B,), 0, S // 4), S // 2 + 3, L - 1
    angle = jax.random.uniform(ks[4], (B, K // 2), maxval=6.0)
    rope = (jnp.cos(angle), jnp.sin(angle)) if rope else None
    rms = (norm_input(ks[5], B, D, dtype), 0.5) if norm == "rms" else None
    x = norm_input(ks[5], B, 96)  # a LayerNorm's input rows: their sums and sums of squares
    layer_norm = (
        (x.sum(-1), (x * x).sum(-1), 96, 0.5, jax.random.normal(ks[6], (Hkv, G + 2, K))) if norm == "layer" else None
    )
    bias = jax.random.normal(ks[7], (Hkv, G + 2, K), dtype) if bias else None
    # scales away from 1, different for q and k (a swap shows), and a large epsilon (an epsilon left out shows)
    qk_norm = (jax.random.uniform(ks[6], (2, K), minval=0.5, maxval=1.5).astype(dtype), 0.3) if qk else None
    parts = dict(rope=rope, rms=rms, layer_norm=layer_norm, bias=bias, qk_norm=qk_norm)
    got = decode_step(qkv, k, v, start, slot, layer, **parts, config=KERNEL)
    ref = lambda **change: decode_step_reference(qkv, k, v, start, slot, layer, **(parts | change))
    want = ref()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=tol, rtol=tol)
    for name, g, w in (("k", got[1], want[1]), ("v", got[2], want[2])):  # the write, and every other slot untouched
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=1e-6, err_msg=name)
    assert not np.allclose(
        np.asarray(want[1][layer, :, :, slot], np.float32), np.asarray(k[layer, :, :, slot], np.float32)
    )
    differs = lambda other: np.abs(np.asarray(other[0], np.float32) - np.asarray(want[0], np.float32)).max() > 0.05
    if rope is not None:  # each part matters: without it the answer differs
        assert differs(ref(rope=None))
    if qk_norm is not None:
        assert differs(ref(qk_norm=None))
        assert differs(ref(qk_norm=(qk_norm[0][::-1], qk_norm[1])))  # q's and k's scales swapped
    if layer_norm is not None:
        centred = (0 * layer_norm[0], layer_norm[1] - layer_norm[0] ** 2 / 96, *layer_norm[2:])  # same variance, mean 0
        assert differs(ref(layer_norm=centred))
    if bias is not None:
        assert differs(ref(bias=None))


def pallas_operands(fn, *args):
    """The names of the operands of the one pallas_call in fn's program ("qkv", "k", ...), in the kernel's order."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                mapping = eqn.params["grid_mapping"]
                found.append([bm.origin.rsplit(".", 1)[-1] for bm in mapping.block_mappings[: mapping.num_inputs]])
            for param in eqn.params.values():
                if isinstance(param, jax.extend.core.ClosedJaxpr):
                    walk(param.jaxpr)
                elif isinstance(param, jax.extend.core.Jaxpr):
                    walk(param)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    (names,) = found
    return names


def test_the_fused_step_gets_only_the_parts_in_use():
    """A part switched off is no operand of the kernel (not a zero-filled stand-in), and the cache buffers stay
    aliased to the outputs that hold the written slots, whatever parts come."""
    B, Hkv, G, S, K = 2, 2, 2, 32, 64
    qkv, k, v = jnp.ones((B, Hkv, G + 2, K)), jnp.zeros((1, B, Hkv, S, K)), jnp.full((1, B, Hkv, S, K), 2.0)
    table, rows, heads = jnp.ones((B, K // 2)), jnp.ones((B,)), jnp.ones((Hkv, G + 2, K))
    always = ["layer", "start", "slot", "qkv"]
    for parts, names in [
        ({}, []),
        (dict(rope=(table, table), rms=(jnp.ones((B, 96)), 1e-5)), ["cos", "sin", "x"]),  # Llama
        (dict(layer_norm=(rows, rows, 96, 1e-5, heads), bias=heads), ["sums", "squares", "colsum", "bias"]),  # OPT
        (dict(rope=(table, table), qk_norm=(jnp.ones((2, K)), 1e-6)), ["cos", "sin", "norms"]),  # Qwen3
    ]:
        fn = lambda qkv, k, v: decode_step(qkv, k, v, 0, 5, **parts, config=KERNEL)
        assert pallas_operands(fn, qkv, k, v) == always + names + ["k", "v"]
        _, k_out, v_out = fn(qkv, k, v)
        kept = np.arange(S) != 5  # the other slots are the input buffers' (k 0, v 2)
        np.testing.assert_array_equal(k_out[:, :, :, kept], k[:, :, :, kept])
        np.testing.assert_array_equal(v_out[:, :, :, kept], v[:, :, :, kept])
        assert not np.allclose(v_out[:, :, :, 5], 2.0)  # this step's value written


@pytest.mark.slow
def test_the_fused_step_per_shard_and_when_it_applies():
    mesh = make_mesh(tp=2)  # 8 CPU devices: data 4 x model 2
    L, B, Hkv, G, S, K = 2, 4, 2, 2, 32, 64
    ks = jax.random.split(jax.random.key(9), 8)
    qkv = jax.random.normal(ks[0], (B, Hkv, G + 2, K))
    k, v = (jax.random.normal(key, (L, B, Hkv, S, K)) for key in ks[1:3])
    start, angle = jax.random.randint(ks[3], (B,), 0, 8), jax.random.uniform(ks[4], (B, K // 2), maxval=6.0)
    rope, rms = (jnp.cos(angle), jnp.sin(angle)), (norm_input(ks[5], B, 128), 1e-5)
    bias = jax.random.normal(ks[7], qkv.shape[1:])  # per KV head: each shard takes its heads' part
    want = decode_step_reference(qkv, k, v, start, 20, 1, rope=rope, rms=rms, bias=bias)
    got = jax.jit(lambda *a: decode_step(*a, 20, 1, rope=rope, rms=rms, bias=bias, config=KERNEL, mesh=mesh))(
        qkv, k, v, start
    )
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)
    x = norm_input(ks[6], B, 64)
    layer_norm = (x.sum(-1), (x * x).sum(-1), 64, 1e-5, jax.random.normal(ks[6], qkv.shape[1:]))  # sums per row
    want = decode_step_reference(qkv, k, v, start, 20, 1, layer_norm=layer_norm, bias=bias)
    got = jax.jit(lambda *a: decode_step(*a, 20, 1, layer_norm=layer_norm, bias=bias, config=KERNEL, mesh=mesh))(
        qkv, k, v, start
    )
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)
    # Only the kernel, only with tensor-core products, only unsplit: elsewhere the model runs the unfused path.
    assert fuses_step(KERNEL, 64, 8, 512, 128, 4)
    assert not fuses_step(dataclasses.replace(KERNEL, implementation="xla"), 64, 8, 512, 128, 4)
    assert not fuses_step(dataclasses.replace(KERNEL, use_dot=False), 64, 8, 512, 128, 4)
    assert not fuses_step(dataclasses.replace(KERNEL, num_splits=2), 64, 8, 512, 128, 4)
    # "auto": both kernels pad 6 or 7 query heads per KV head to 8 (Qwen2.5), unless the head dim is no power of two
    auto = dataclasses.replace(KERNEL, implementation="auto")
    assert (
        fuses_step(auto, 64, 2, 512, 128, 6)
        and fuses_step(auto, 64, 2, 512, 64, 7)
        and fuses_step(auto, 64, 8, 512, 128, 4)
    )
    assert not auto.use_kernel(96, 6) and not fuses_step(auto, 64, 2, 512, 96, 6)


def test_kernel_ir_compares_programs_not_unused_operands():
    """tools/kernel_ir.py, which showed that naming the fused step's operands left its Triton program as it was:
    an operand the kernel never reads does not count, a changed operation does."""
    from tools import kernel_ir

    fn, shapes = kernel_ir._step_call(*kernel_ir.STEPS["opt_mha_plain"][:-1], None)
    triton = kernel_ir.lower(fn, shapes, kernel_ir._mesh(None)[0]).split("// ---- stablehlo")[0]
    name = "tt.func public @jaxrlhf_decode_attention_step("
    unused = triton.replace(name, name + "%unused: !tt.ptr<f32> {tt.divisibility = 32 : i32}, ", 1)
    assert unused != triton and kernel_ir.canonical(unused) == kernel_ir.canonical(triton)
    changed = triton.replace("arith.mulf", "arith.addf", 1)
    assert changed != triton and kernel_ir.canonical(changed) != kernel_ir.canonical(triton)
