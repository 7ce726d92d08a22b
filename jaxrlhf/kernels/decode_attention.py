"""Decode attention: one query per row against its KV cache, reading only the row's valid slots.

    q     [B, H, K]        this step's query (one token per row), already scaled
    k, v  [B, S, Hkv, K]   one layer's cache; query head h reads KV head h // (H / Hkv) (grouped-query)
    start, end  [B] int32  row b attends slots start[b] <= s < end[b] (left padding, current length)
    out   [B, H, K]

The Pallas kernel runs one program per (row, KV head): it holds that head's G = H / Hkv queries, walks
the row's valid slots in blocks of `block_s` with an online softmax in float32, and so reads only the
part of the cache that holds real tokens (plain XLA reads all S slots every step). The scores are
elementwise products summed over K rather than a matrix product, because G is often 1 and a decode step
is bound by memory, not by arithmetic. `decode_attention_reference` is the plain-jnp definition.

Status: tested on the CPU in interpret mode against the reference; not yet compiled, tuned or benchmarked
on the GPU, and not yet wired into generation (which uses `models.opt.cached_attention`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """Tuning knobs of the kernel."""

    block_s: int = 128  # cache slots per inner step; a power of two that divides S
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool | None = None  # None: interpret mode when not on a GPU (CPU tests)

    def __post_init__(self):
        if self.block_s < 16 or self.block_s & (self.block_s - 1):
            raise ValueError(f"block_s: expected a power of two >= 16, got {self.block_s}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps: expected a power of two, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages: expected >= 1, got {self.num_stages}")


def decode_attention_reference(q, k, v, start, end):
    """softmax over the valid slots of q . k, times v; float32 inside, q's dtype out."""
    B, H, K = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, H // Hkv, K).astype(jnp.float32)
    scores = jnp.einsum("bhgk,bshk->bhgs", qg, k.astype(jnp.float32))
    s = jnp.arange(S)
    valid = (s[None, :] >= start[:, None]) & (s[None, :] < end[:, None])  # [B, S]
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgs,bshk->bhgk", probs, v.astype(jnp.float32))
    return out.reshape(B, H, K).astype(q.dtype)


def _kernel(start_ref, end_ref, q_ref, k_ref, v_ref, o_ref, *, block_s: int):
    # start_ref, end_ref: [1] (this row's valid range); q_ref, o_ref: [G, K] (the queries of one KV head);
    # k_ref, v_ref: [S, K] (that KV head's cache for this row).
    start, end = start_ref[0], end_ref[0]
    q = q_ref[...].astype(jnp.float32)
    G, K = q.shape

    def body(i, carry):
        m, l, acc = carry  # running max [G], normaliser [G], weighted sum of values [G, K]
        s0 = pl.multiple_of(i * block_s, block_s)
        kb = k_ref[pl.ds(s0, block_s), :].astype(jnp.float32)  # [block_s, K]
        vb = v_ref[pl.ds(s0, block_s), :].astype(jnp.float32)
        scores = jnp.sum(q[:, None, :] * kb[None, :, :], axis=-1)  # [G, block_s]
        pos = s0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
        ok = (pos >= start) & (pos < end)
        scores = jnp.where(ok, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[:, None] + jnp.sum(p[:, :, None] * vb[None, :, :], axis=1)
        return m_new, l, acc

    # Only the blocks that hold valid slots are read. The running max starts finite so that the first
    # rescale exp(m - m_new) is 0, not NaN.
    init = (jnp.full((G,), -1e30, jnp.float32), jnp.zeros((G,), jnp.float32), jnp.zeros((G, K), jnp.float32))
    m, l, acc = jax.lax.fori_loop(start // block_s, pl.cdiv(end, block_s), body, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("config",))
def decode_attention(q, k, v, start, end, *, config: DecodeAttentionConfig = DecodeAttentionConfig()):
    """The Pallas kernel (see the module docstring for shapes); rows with start >= end give zeros."""
    B, H, K = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({Hkv})")
    block_s = min(config.block_s, S)
    if S % block_s:
        raise ValueError(f"cache length {S} is not a multiple of block_s {block_s}; allocate the cache rounded up")
    G = H // Hkv
    interpret = config.interpret if config.interpret is not None else jax.default_backend() != "gpu"
    params = None if interpret else pl.triton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    out = pl.pallas_call(
        functools.partial(_kernel, block_s=block_s),
        grid=(B, Hkv),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h: (b,)),
            pl.BlockSpec((1,), lambda b, h: (b,)),
            pl.BlockSpec((None, None, G, K), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, S, None, K), lambda b, h: (b, 0, h, 0)),
            pl.BlockSpec((None, S, None, K), lambda b, h: (b, 0, h, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, G, K), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, G, K), q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="jaxrlhf_decode_attention",
    )(start.astype(jnp.int32), end.astype(jnp.int32), q.reshape(B, Hkv, G, K), k, v)
    return out.reshape(B, H, K)
