"""The Pallas decode-attention kernel (interpret mode on the CPU) against its plain-jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.kernels.decode_attention import DecodeAttentionConfig, decode_attention, decode_attention_reference


def inputs(B, H, Hkv, S, K, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, H, K), dtype) * K**-0.5
    k = jax.random.normal(ks[1], (B, S, Hkv, K), dtype)
    v = jax.random.normal(ks[2], (B, S, Hkv, K), dtype)
    return q, k, v


@pytest.mark.parametrize("H, Hkv, K", [(4, 4, 64), (8, 2, 128)], ids=["mha_d64", "gqa_d128"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_reference(H, Hkv, K, dtype):
    B, S = 4, 64
    q, k, v = inputs(B, H, Hkv, S, K, dtype)
    start = jnp.array([0, 5, 17, 40])  # left padding of different lengths
    end = jnp.array([64, 33, 18, 63])  # current lengths (row 2: a single valid slot)
    got = decode_attention(q, k, v, start, end, config=DecodeAttentionConfig(block_s=16))
    want = decode_attention_reference(q, k, v, start, end)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


def test_reference_by_hand_and_slots_outside_the_range_are_ignored():
    q = jnp.array([[[1.0, 0.0]]])  # B=1, H=1, K=2
    k = jnp.array([[[[1.0, 0.0]], [[0.0, 1.0]], [[9.0, 9.0]], [[2.0, 0.0]]]])  # S=4
    v = jnp.array([[[[1.0, 0.0]], [[0.0, 1.0]], [[5.0, 5.0]], [[0.0, 3.0]]]])
    out = decode_attention_reference(q, k, v, jnp.array([0]), jnp.array([2]))
    w = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()
    np.testing.assert_allclose(np.asarray(out)[0, 0], w[0] * np.array([1, 0]) + w[1] * np.array([0, 1]), rtol=1e-6)
    k_big = jnp.concatenate([k] * 4, axis=1)  # S = 16 for the kernel's block
    v_big = jnp.concatenate([v] * 4, axis=1)
    got = decode_attention(q, k_big, v_big, jnp.array([0]), jnp.array([2]), config=DecodeAttentionConfig(block_s=16))
    np.testing.assert_allclose(np.asarray(got), np.asarray(out), rtol=1e-6)


def test_bad_shapes_and_knobs():
    q, k, v = inputs(1, 3, 2, 32, 64, jnp.float32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention(q, k, v, jnp.array([0]), jnp.array([4]))
    with pytest.raises(ValueError, match="block_s: expected a power of two"):
        DecodeAttentionConfig(block_s=48)
    q, k, v = inputs(1, 2, 2, 48, 64, jnp.float32)
    with pytest.raises(ValueError, match="cache length 48 is not a multiple of block_s 32"):
        decode_attention(q, k, v, jnp.array([0]), jnp.array([4]), config=DecodeAttentionConfig(block_s=32))
