"""Decode attention: one query per row against its KV cache, reading only the row's valid slots.

    q          [B, H, K]            this step's query (one token per row), already scaled
    k, v       [L, B, Hkv, S, K]    the whole generation cache (all layers); query head h reads KV head
                                    h // (H / Hkv) (grouped-query). A single layer's [B, Hkv, S, K] works too.
    layer      int32 scalar         which layer of the cache to read (ignored for a single layer)
    start, end [B] int32 (or scalars)  row b attends slots start[b] <= s < end[b] (left padding, current length)
    out        [B, H, K]

The Pallas (Triton) kernel runs one program per (row, KV head, split). Each (row, head) holds its slots
contiguously (S x K), so a program streams the valid slots of its chunk of S in blocks of `block_s` with an
online softmax in float32, reading only the part of the cache that holds real tokens, once (plain XLA reads
all S slots of every row every step). With one split (the default when B x Hkv already fills the GPU) a
program covers all S and writes the normalised output. With N > 1 splits (flash-decoding: for small B x Hkv,
where B x Hkv programs leave SMs idle) each program covers S / N slots and writes its partial sums (the
unnormalised output, the running max and the normaliser), and a few jnp ops merge the N partials. It reads the
layer straight out of the whole cache, so generation never copies a layer's cache out of the carried [L, ...]
buffer. The G = H / Hkv queries of a KV head go through tensor-core matrix products, which need 16 rows: the kernel
repeats its G queries 16 / G times in registers (padding them in memory cost a kernel per layer writing 16 / G times
the queries) and keeps one copy of the result. The products beat elementwise products summed over K (the
`use_dot=False` form) even when G = 1.

Under tensor parallelism (`decode_attention(..., mesh=mesh)` with a "model" axis) the kernel runs per shard
with `shard_map`: each device holds its heads' queries and cache, and its rows if "data" splits the batch.
`decode_attention_reference` is the plain-jnp definition; `xla_decode_attention` is what XLA does well
without the kernel (the switch `DecodeAttentionConfig(implementation="xla")`).

`decode_step` is the same attention one step earlier in the layer: it takes the stacked q/k/v product itself
(the decode layout's), finishes the norm folded into it (RMSNorm's 1 / rms, or LayerNorm's centring and scale),
adds the bias, applies the rotary embedding, writes the new key and value into the cache in place and attends,
in one kernel. Unfused, those are three or four small XLA kernels per layer around this one. Its operands go by
name (`StepOperands`: one field each with its shape and block; a part switched off is None, no operand at all), and
`decode_step_reference` is its plain-jnp definition. Both kernels live in this one file because the fused step shares
the attention's online softmax (`_attend`), config and launch, and a kernel file imports no other
(tests/test_layers.py).

Query groups that are no power of two (Qwen2.5: 6 or 7 query heads per KV head) run as the next power of two, as
Triton's blocks need: `decode_attention` pads the queries with zeros in memory (its outputs sliced off); the fused
step, whose queries come inside the stacked product, loads the padded rows masked (as 0) and stores only the real ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.sharding import PartitionSpec as P

from jaxrlhf.kernels import per_shard, row_mean_square, rows_axis, rows_per_shard


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """Which implementation runs, and the kernel's tuning knobs."""

    implementation: str = "xla"  # "auto" (the kernel where the shapes suit it), "pallas" (always) or "xla" (never)
    # Defaults: the best of the sweep in tools/bench_decode_attention.py --tune (docs/benchmarks.md).
    # cache slots per inner step, a power of two (smaller when S has fewer factors of 2); 0: auto, 64 slots, or
    # 4096 / head dim with grouped-query heads (32 of 128): the sweeps' best at each kind and head dim
    block_s: int = 0
    use_dot: bool = True  # scores by tensor-core products (queries repeated to 16 rows), else elementwise
    num_warps: int = 2
    num_stages: int = 3
    # Chunks of the cache per (row, KV head), each its own program (flash-decoding); 0: auto (`splits`).
    num_splits: int = 0
    # Load only the valid slots of a block (masked loads fetch nothing for the others); else whole blocks. A row's
    # first and last blocks are partly outside its range: at block_s = 64 and ~384 valid slots, whole blocks read
    # ~8 % more than the valid slots.
    mask_loads: bool = True
    interpret: bool = False  # Pallas interpret mode (CPU tests; models.Backend.interpret)

    def __post_init__(self):
        if self.implementation not in ("auto", "pallas", "xla"):
            raise ValueError(f"implementation: expected 'auto', 'pallas' or 'xla', got {self.implementation!r}")
        if self.block_s and (self.block_s < 16 or self.block_s & (self.block_s - 1)):
            raise ValueError(f"block_s: expected 0 (auto) or a power of two >= 16, got {self.block_s}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps: expected a power of two, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages: expected >= 1, got {self.num_stages}")
        if not isinstance(self.num_splits, int) or self.num_splits < 0:
            raise ValueError(f"num_splits: expected an int >= 0 (0: auto), got {self.num_splits!r}")

    def use_kernel(self, head_dim: int, groups: int) -> bool:
        """Whether the kernel runs for this head dim and `groups` query heads per KV head (any number: Triton's
        power-of-two blocks take Qwen2.5's 6 or 7 query heads per KV head as 8, the kernels pad them)."""
        if self.implementation == "auto":
            return _pow2(head_dim) and head_dim >= 16
        return self.implementation == "pallas"

    def slots_per_block(self, head_dim: int, slots: int, groups: int = 1) -> int:
        """block_s, at most the largest power of two dividing S `slots`. Auto: 64 slots, or 4096 / head_dim (within
        16..128) where `groups` query heads share a KV head: the best of tools/bench_decode_attention.py --tune."""
        block = self.block_s or (64 if groups == 1 else max(16, min(128, 4096 // head_dim)))
        return min(block, slots & -slots)

    def splits(self, programs: int, slots: int, cores: int | None, head_dim: int = 64, groups: int = 1) -> int:
        """How many chunks of whole blocks each (row, KV head) is split into, given B x Hkv `programs`, S `slots`
        and the GPU's SM count `cores` (None: unknown, e.g. on the CPU): num_splits if set (fewer where chunks
        of whole blocks need fewer). Auto (0): double the splits while B x Hkv x splits is at most the SM
        count (an SM with no program idles) and chunks keep >= 512 slots; else 1 (tools/bench_decode_attention.py
        --splits: splitting pays at a few hundred programs over long caches, and costs at short caches or many
        programs)."""
        block_s = self.slots_per_block(head_dim, slots, groups)
        splits = self.num_splits
        if not splits:
            splits = 1
            while cores and programs * splits <= cores and slots // (2 * splits) >= 512:
                splits *= 2
        return pl.cdiv(slots, _chunk(slots, splits, block_s))


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def _padded(groups: int) -> int:
    """The power of two at or above `groups` (Triton's block shapes)."""
    return 1 << (groups - 1).bit_length()


def _chunk(slots: int, splits: int, block_s: int) -> int:
    """Slots per chunk: S / splits rounded up to whole blocks, so that a block never straddles two chunks."""
    return pl.cdiv(pl.cdiv(slots, splits), block_s) * block_s


def _as_cache(k, v, layer):
    if k.ndim == 4:  # one layer: give it the leading layer axis (a free reshape)
        return k[None], v[None], jnp.zeros((), jnp.int32)
    return k, v, jnp.asarray(layer, jnp.int32)


def _valid(start, end, S):
    s = jnp.arange(S)
    return (s[None, :] >= start[:, None]) & (s[None, :] < end[:, None])  # [B, S]


def decode_attention_reference(q, k, v, start, end, layer=0):
    """softmax over the valid slots of q . k, times v; float32 throughout, q's dtype out."""
    k, v, layer = _as_cache(k, v, layer)
    k, v = k[layer], v[layer]
    B, H, K = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, H // Hkv, K).astype(jnp.float32)
    scores = jnp.einsum("bhgk,bhsk->bhgs", qg, k.astype(jnp.float32))
    scores = jnp.where(_valid(start, end, S)[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgs,bhsk->bhgk", probs, v.astype(jnp.float32))
    return out.reshape(B, H, K).astype(q.dtype)


def xla_decode_attention(q, k, v, start, end, layer=0):
    """The same in the form XLA runs fastest: bf16 operands, float32 scores, over all S slots."""
    k, v, layer = _as_cache(k, v, layer)
    k = jax.lax.dynamic_index_in_dim(k, layer, 0, keepdims=False)
    v = jax.lax.dynamic_index_in_dim(v, layer, 0, keepdims=False)
    B, H, K = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, H // Hkv, K).astype(k.dtype)
    scores = jnp.einsum("bhgk,bhsk->bhgs", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(_valid(start, end, S)[:, None, None, :], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgs,bhsk->bhgk", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, H, K).astype(q.dtype)


def _repeat_rows(x, copies: int):
    """x [G, ...] as [copies * G, ...]: row r * G + g holds x[g] (tensor-core products need 16 rows)."""
    return (
        x if copies == 1 else jnp.broadcast_to(x[None], (copies, *x.shape)).reshape(copies * x.shape[0], *x.shape[1:])
    )


def _attend(q, k_ref, v_ref, layer, b, h, start, end, init, *, block_s: int, use_dot: bool, mask_loads: bool):
    """Online softmax of the queries q [rows, K] over the slots start <= s < end of cache (layer, b, h), from the
    running state `init` (max [rows], normaliser [rows], weighted sum of values [rows, K], float32)."""
    K = q.shape[-1]

    def body(i, carry):
        m, den, acc = carry
        s0 = pl.multiple_of(i * block_s, block_s)
        pos = s0 + jax.lax.broadcasted_iota(jnp.int32, (block_s, 1), 0)
        valid = (pos >= start) & (pos < end)  # [block_s, 1]
        if mask_loads:
            load = lambda ref: pltriton.load(
                ref.at[layer, b, h, pl.ds(s0, block_s), :], mask=jnp.broadcast_to(valid, (block_s, K)), other=0
            )
        else:
            load = lambda ref: ref[layer, b, h, pl.ds(s0, block_s), :]
        kb, vb = load(k_ref), load(v_ref)  # [block_s, K]
        if use_dot:
            scores = jnp.dot(q, kb.T, preferred_element_type=jnp.float32)  # [rows, block_s]
        else:
            scores = jnp.sum(q[:, None, :] * kb.astype(jnp.float32)[None, :, :], axis=-1)
        scores = jnp.where(valid.T, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        den = den * alpha + jnp.sum(p, axis=-1)
        if use_dot:
            pv = jnp.dot(p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        else:
            pv = jnp.sum(p[:, :, None] * vb.astype(jnp.float32)[None, :, :], axis=1)
        return m_new, den, acc * alpha[:, None] + pv

    # Only the blocks that hold valid slots are read.
    return jax.lax.fori_loop(start // block_s, pl.cdiv(end, block_s), body, init)


def _one_copy(x, copies: int):
    """The first of `copies` identical groups of rows (x [copies * G, ...] -> [G, ...]): their max, exactly."""
    return x if copies == 1 else jnp.max(x.reshape(copies, -1, *x.shape[1:]), axis=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionOperands:
    """decode_attention's kernel inputs by name: the arrays, their BlockSpecs and, in `_kernel`, their refs (the block
    each program (b, h, j) sees, after the arrow). The field order is the kernel's argument order."""

    layer: Any  # [1] int32 -> [1]: which layer of the cache
    start: Any  # [B] int32 -> [1]: this row's first valid slot
    end: Any  # [B] int32 -> [1]: one past its last
    q: Any  # [B, Hkv, G, K] -> [G, K]: the queries of one KV head
    k: Any  # [L, B, Hkv, S, K] -> whole: the cache, read in place (no copy of a layer)
    v: Any  # [L, B, Hkv, S, K] -> whole


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionOutputs:
    """decode_attention's kernel outputs by name: `out` with one split; with N > 1 splits the partial sums acc, m and
    den (float32) instead, `out` None."""

    out: Any = None  # [B, Hkv, 1, G, K] -> [G, K]: the normalised output
    acc: Any = None  # [B, Hkv, N, G, K] -> [G, K]: this chunk's weighted sum of values (unnormalised)
    m: Any = None  # [B, Hkv, N, G] -> [G]: its running max
    den: Any = None  # [B, Hkv, N, G] -> [G]: its normaliser


def _named(like, **specs):
    """`like`'s class holding specs[name] for each present field of `like` (None for an absent one): a spec is given
    by its operand's name, never by position, and a field without a spec is an error."""
    fields = [f.name for f in dataclasses.fields(like)]
    if sorted(specs) != sorted(fields):
        raise ValueError(f"specs for {sorted(specs)}, expected {sorted(fields)}")
    return type(like)(**{name: None if getattr(like, name) is None else specs[name] for name in fields})


def _leaf_index(tree, name: str) -> int:
    """Where field `name` sits among tree's flattened leaves (pallas_call's aliases count them, absent ones not)."""
    return [path[-1].name for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]].index(name)


def _kernel(
    ins: AttentionOperands, outs: AttentionOutputs, *, block_s: int, chunk: int, use_dot: bool, mask_loads: bool
):
    """One program per (row b, KV head h, chunk j): the online softmax of the head's G queries over the row's valid
    slots among [j * chunk, (j + 1) * chunk); writes the normalised output (one split) or the partial sums."""
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = jnp.maximum(ins.start[0], j * chunk)  # start >= end: a chunk with no valid slot reads nothing
    end = jnp.minimum(ins.end[0], (j + 1) * chunk)
    G, K = ins.q.shape
    copies = max(16 // G, 1) if use_dot else 1  # tensor-core products need 16 rows: rows r * G + g hold query g
    rows = copies * G
    q = _repeat_rows(ins.q[...] if use_dot else ins.q[...].astype(jnp.float32), copies)
    # The running max starts at -1e30, our finite -inf: the first rescale exp(m - m_new) is 0, not NaN, and a
    # chunk with no valid slot leaves m = -1e30, den = acc = 0.
    init = (jnp.full((rows,), -1e30, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, K), jnp.float32))
    m, den, acc = _attend(
        q, ins.k, ins.v, ins.layer[0], b, h, start, end, init, block_s=block_s, use_dot=use_dot, mask_loads=mask_loads
    )
    m, den, acc = (_one_copy(x, copies) for x in (m, den, acc))
    if outs.out is not None:
        outs.out[...] = (acc / jnp.maximum(den, 1e-30)[:, None]).astype(outs.out.dtype)
    else:
        outs.acc[...], outs.m[...], outs.den[...] = acc, m, den


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOperands:
    """The fused step's inputs by name; a part switched off is None: no operand, no ref, no spec (as JAX's Pallas
    ops/gpu/decode_attention.py passes an absent start). One class holds the arrays (shapes below), their BlockSpecs
    (`_step_blocks`), their PartitionSpecs under a mesh (`_step_partitions`) and, in `_step_kernel`, their refs (the
    block each program sees, after the arrow). The field order is the kernel's argument order."""

    layer: Any  # [1] int32 -> [1]: which layer of the cache
    start: Any  # [B] int32 -> [1]: this row's first valid slot
    slot: Any  # [B] int32 -> [1]: this row's slot for the new token (the last it attends)
    qkv: Any  # [B, Hkv, G + 2, K] -> whole: per KV head its G queries, key and value (the product, without bias)
    cos: Any = None  # [B, K / 2] float32 -> [K / 2]: the rotary embedding of this row's position (rope)
    sin: Any = None  # [B, K / 2] float32 -> [K / 2]
    x: Any = None  # [B, D] -> whole: a folded RMSNorm's input rows (rms)
    sums: Any = None  # [B] float32 -> [1]: a folded LayerNorm's input row: its sum over `width` values (layer_norm)
    squares: Any = None  # [B] float32 -> [1]: and its sum of squares
    colsum: Any = None  # [Hkv, G + 2, K] float32 -> whole: the LayerNorm-folded kernel's column sums
    bias: Any = None  # [Hkv, G + 2, K] -> whole: added after the norm
    norms: Any = None  # [2, K] -> whole: Qwen3's per-head q_norm and k_norm scales (qk_norm)
    k: Any  # [L, B, Hkv, S, K] -> whole: the cache, read here and written through StepOutputs.k (one buffer)
    v: Any  # [L, B, Hkv, S, K] -> whole


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOutputs:
    """The fused step's outputs by name (arrays, then specs, then refs, as StepOperands)."""

    out: Any  # [B, Hkv, G, K] -> [G, K]; or whole, written by masked stores, where G is no power of two
    k: Any  # [L, B, Hkv, S, K] -> whole: StepOperands.k's buffer, this step's key written at each row's slot
    v: Any  # [L, B, Hkv, S, K] -> whole


def _real(at, groups: int):
    """Which of the rows `at` [..., rows, columns] of a [..., groups + 2, K] block are real queries' (or the key's
    and value's): the padded query rows past `groups` are not."""
    return at[-2].start + jax.lax.broadcasted_iota(jnp.int32, (at[-2].size, at[-1].size), 0) < groups


def _rows_of(ref, at, groups: int, G: int):
    """Rows and columns `at` of a [..., groups + 2, K] ref, the padded query rows (masked) 0."""
    return pltriton.load(ref.at[at], mask=_real(at, groups), other=0) if groups < G and at[-2].size > 1 else ref[at]


@dataclasses.dataclass(frozen=True)
class _Head:
    """What one program of the fused step (row b, KV head h) reads: its rows of the stacked product with the folded
    norm finished and the bias added (`rows`), and Qwen3's per-head norm of them (`head_norm`)."""

    ins: StepOperands  # the refs
    b: Any  # int32: this program's row
    h: Any  # int32: this program's KV head
    groups: int  # queries per KV head
    G: int  # as Triton's blocks take them: the power of two at or above
    mean: Any  # float32: a folded LayerNorm's mean of row b's input, or None
    r: Any  # float32: row b's 1 / std (LayerNorm) or 1 / rms (RMSNorm), or 1.0 without a folded norm
    qk_eps: float | None  # Qwen3's q/k norm's epsilon, None: none

    @classmethod
    def of(cls, ins: StepOperands, b, h, groups: int, eps: float | None, width: int | None, qk_eps: float | None):
        """Program (b, h)'s head, its row's folded-norm statistics read: a LayerNorm (`width` D values) from the
        row's sums (the variance as flax computes it: mean(x^2) - mean(x)^2, clipped at 0), an RMSNorm from x's row
        itself (`eps` without `width`), none where eps is None."""
        mean = None
        if width is not None:
            mean = ins.sums[0] / width
            r = jax.lax.rsqrt(jnp.maximum(ins.squares[0] / width - mean * mean, 0.0) + eps)
        else:
            r = 1.0 if eps is None else jax.lax.rsqrt(row_mean_square(ins.x, b) + eps)
        return cls(ins, b, h, groups, _padded(groups), mean, r, qk_eps)

    def rows(self, row: int, n: int, col: int, cols: int):
        """Rows row .. row + n - 1, columns col .. col + cols - 1 of this head's q/k/v [n, cols], float32: the folded
        norm finished, the bias added."""
        at, ins = (pl.ds(row, n), pl.ds(col, cols)), self.ins
        y = _rows_of(ins.qkv, (self.b, self.h) + at, self.groups, self.G).astype(jnp.float32)
        if self.mean is not None:
            y = y - self.mean * _rows_of(ins.colsum, (self.h,) + at, self.groups, self.G)
        y = y * self.r
        if ins.bias is None:
            return y
        return y + _rows_of(ins.bias, (self.h,) + at, self.groups, self.G).astype(jnp.float32)

    def head_norm(self, pieces, which: int):
        """RMSNorm of each row over K, pieces [n, K / len(pieces)] side by side; which: 0 queries, 1 the key."""
        if self.qk_eps is None:
            return pieces
        K = self.ins.qkv.shape[-1]
        r = jax.lax.rsqrt(sum(jnp.sum(x * x, axis=-1) for x in pieces) / K + self.qk_eps)[:, None]
        width = K // len(pieces)
        scale = lambda i: self.ins.norms[which, pl.ds(i * width, width)].astype(jnp.float32)[None, :]
        return [x * r * scale(i) for i, x in enumerate(pieces)]


def _rotated_query_and_key(head: _Head, key_out, layer, slot, copies: int, dtype):
    """Rotate-half (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) of the queries and the key, pairs (i, i + K / 2),
    after Qwen3's q/k norm; writes the key into the cache `key_out` [L, B, Hkv, S, K] at `slot`. Returns the queries
    [copies * G, K] in `dtype` and their scores [G] against the key as the cache holds it."""
    groups, G, K = head.groups, head.G, head.ins.qkv.shape[-1]
    half = K // 2
    cos, sin = head.ins.cos[...][None, :], head.ins.sin[...][None, :]
    turn = lambda x1, x2: (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    part = head.rows
    q1, q2 = turn(*head.head_norm([part(0, G, 0, half), part(0, G, half, half)], 0))  # [G, K / 2]
    k1, k2 = turn(*head.head_norm([part(groups, 1, 0, half), part(groups, 1, half, half)], 1))  # [1, K / 2]
    key_out[layer, head.b, head.h, pl.ds(slot, 1), pl.ds(0, half)] = k1.astype(key_out.dtype)
    key_out[layer, head.b, head.h, pl.ds(slot, 1), pl.ds(half, half)] = k2.astype(key_out.dtype)
    k1, k2 = (x.astype(key_out.dtype).astype(jnp.float32) for x in (k1, k2))  # as the cache holds it
    q1, q2 = (x.astype(dtype) for x in (q1, q2))
    s_new = jnp.sum(q1.astype(jnp.float32) * k1 + q2.astype(jnp.float32) * k2, axis=-1)  # [G]
    # The halves back side by side for the tensor-core products: q1 E1 + q2 E2 with E1 = [I 0], E2 = [0 I]
    # (exact: one nonzero term per output).
    i = jax.lax.broadcasted_iota(jnp.int32, (half, K), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (half, K), 1)
    place = lambda x, at: jnp.dot(
        _repeat_rows(x, copies),
        (j == i + at).astype(x.dtype),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return (place(q1, 0) + place(q2, half)).astype(dtype), s_new


def _query_and_key(head: _Head, key_out, layer, slot, copies: int, dtype):
    """As _rotated_query_and_key without the rotary embedding: the queries [copies * G, K] in `dtype`, their scores
    [G] against the key, written into the cache `key_out` at `slot`."""
    K = head.ins.qkv.shape[-1]
    (k_new,) = head.head_norm([head.rows(head.groups, 1, 0, K)], 1)
    key_out[layer, head.b, head.h, pl.ds(slot, 1), :] = k_new.astype(key_out.dtype)
    q = head.head_norm([head.rows(0, head.G, 0, K)], 0)[0].astype(dtype)
    s_new = jnp.sum(q.astype(jnp.float32) * k_new.astype(key_out.dtype).astype(jnp.float32), axis=-1)
    return _repeat_rows(q, copies), s_new


def _step_kernel(
    ins: StepOperands,
    outs: StepOutputs,
    *,
    groups: int,
    block_s: int,
    mask_loads: bool,
    eps: float | None,
    width: int | None,
    qk_eps: float | None,
):
    """One program per (row b, KV head h): finish the folded norm, add the bias, apply Qwen3's q/k norm and the
    rotation, write the new key and value into the cache at the row's slot, and attend from the new token's own score
    over the cached slots start .. slot - 1. The refs' blocks are in StepOperands' and StepOutputs' comments.
    G = `groups` queries per KV head, as Triton's blocks take them: a power of two, the rows past `groups` (when
    padded: the key, the value, the next head's queries) loaded as 0 and their outputs not written."""
    b, h = pl.program_id(0), pl.program_id(1)
    layer, slot = ins.layer[0], ins.slot[0]  # this row's slot
    G, K = _padded(groups), ins.qkv.shape[-1]
    copies = max(16 // G, 1)  # tensor-core products need 16 rows: rows r * G + g hold query g
    head = _Head.of(ins, b, h, groups, eps, width, qk_eps)
    v_new = head.rows(groups + 1, 1, 0, K)  # [1, K]
    query_and_key = _query_and_key if ins.cos is None else _rotated_query_and_key
    q, s_new = query_and_key(head, outs.k, layer, slot, copies, outs.out.dtype)  # [rows, K], [G]
    outs.v[layer, b, h, pl.ds(slot, 1), :] = v_new.astype(outs.v.dtype)
    v_new = v_new.astype(outs.v.dtype).astype(jnp.float32)
    # This token's own slot starts the online softmax (weight 1 at its score); the loop reads the cached slots before.
    rows = copies * G
    init = (_repeat_rows(s_new, copies), jnp.ones((rows,), jnp.float32), jnp.broadcast_to(v_new, (rows, K)))
    _, den, acc = _attend(
        q, ins.k, ins.v, layer, b, h, ins.start[0], slot, init, block_s=block_s, use_dot=True, mask_loads=mask_loads
    )
    den, acc = _one_copy(den, copies), _one_copy(acc, copies)
    out = (acc / den[:, None]).astype(outs.out.dtype)
    if groups < G:
        at = (b, h, pl.ds(0, G), pl.ds(0, K))
        pltriton.store(outs.out.at[at], out, mask=_real(at, groups))
    else:
        outs.out[...] = out


def _combine(acc, m, den):
    """Merge the splits' partial sums: acc [..., N, G, K] (unnormalised outputs), m, den [..., N, G] (running max,
    normaliser) -> [..., G, K]. Split n's terms were scaled by exp(-m_n); rescale all to the largest max M.
    A split with no valid slot has m = -1e30 (finite), so its weight exp(m - M) <= 1 is no NaN and multiplies
    its den = acc = 0; a row with no valid slot at all gives 0, as with one split."""
    w = jnp.exp(m - jnp.max(m, axis=-2, keepdims=True))  # [..., N, G]
    total = jnp.sum(w * den, axis=-2)  # [..., G]
    return jnp.sum(w[..., None] * acc, axis=-3) / jnp.maximum(total, 1e-30)[..., None]


def _launch(config: DecodeAttentionConfig, head_dim: int, slots: int, groups: int):
    """(interpret, Triton compiler params or None, the GPU's SM count or None, slots per block) for a kernel call;
    refuses a cache length the kernel's blocks cannot tile."""
    block_s = config.slots_per_block(head_dim, slots, groups)
    if block_s < 16:
        raise ValueError(f"cache length {slots} must be a multiple of 16 for the kernel; allocate the cache rounded up")
    interpret = config.interpret
    params = None if interpret else pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    cores = None if interpret else getattr(jax.devices()[0], "core_count", None)
    return interpret, params, cores, block_s


# jit makes the call removable by dead-code elimination (flax's scan over layers traces the body twice).
@functools.partial(jax.jit, static_argnames="config")
def _pallas(q, k, v, layer, start, end, *, config):
    B, H, K = q.shape
    Hkv, S = k.shape[2], k.shape[3]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G, K)
    if not _pow2(G):  # Triton's blocks: the groups padded with zero queries to a power of two, their outputs dropped
        qg, G = jnp.pad(qg, ((0, 0), (0, 0), (0, _padded(G) - G), (0, 0))), _padded(G)
    interpret, params, cores, block_s = _launch(config, K, S, G)
    splits = config.splits(B * Hkv, S, cores, K, G)
    chunk = _chunk(S, splits, block_s)
    ins = AttentionOperands(layer=layer.reshape(1), start=start, end=end, q=qg, k=k, v=v)
    row = pl.BlockSpec((1,), lambda b, h, j: (b,))
    blocks = _named(
        ins,
        layer=pl.BlockSpec((1,), lambda b, h, j: (0,)),
        start=row,
        end=row,
        q=pl.BlockSpec((None, None, G, K), lambda b, h, j: (b, h, 0, 0)),
        k=pl.no_block_spec,
        v=pl.no_block_spec,
    )
    part = lambda *shape: pl.BlockSpec((None, None, None, *shape), lambda b, h, j: (b, h, j) + (0,) * len(shape))
    array = lambda *shape: jax.ShapeDtypeStruct((B, Hkv, splits, *shape), q.dtype if splits == 1 else jnp.float32)
    if splits == 1:
        out_specs, out_shape = AttentionOutputs(out=part(G, K)), AttentionOutputs(out=array(G, K))
    else:  # the partial sums
        out_specs = AttentionOutputs(acc=part(G, K), m=part(G), den=part(G))
        out_shape = AttentionOutputs(acc=array(G, K), m=array(G), den=array(G))
    outs = pl.pallas_call(
        functools.partial(_kernel, block_s=block_s, chunk=chunk, use_dot=config.use_dot, mask_loads=config.mask_loads),
        grid=(B, Hkv, splits),
        in_specs=(blocks,),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="jaxrlhf_decode_attention",
    )(ins)
    out = outs.out[:, :, 0] if splits == 1 else _combine(outs.acc, outs.m, outs.den).astype(q.dtype)
    return out[:, :, : H // Hkv].reshape(B, H, K)


def _step_blocks(ins: StepOperands) -> StepOperands:
    """The BlockSpec of each present operand, by name (grid (B, Hkv): program (b, h))."""
    row, whole = pl.BlockSpec((1,), lambda b, h: (b,)), pl.no_block_spec
    table = pl.BlockSpec((None, ins.qkv.shape[-1] // 2), lambda b, h: (b, 0))
    return _named(
        ins,
        layer=pl.BlockSpec((1,), lambda b, h: (0,)),
        start=row,
        slot=row,
        qkv=whole,
        cos=table,
        sin=table,
        x=whole,
        sums=row,
        squares=row,
        colsum=whole,
        bias=whole,
        norms=whole,
        k=whole,
        v=whole,
    )


def _step_partitions(ins: StepOperands, rows) -> StepOperands:
    """The PartitionSpec of each present operand under a mesh, by name: heads over "model", rows over `rows`."""
    cache, heads, per_row = P(None, rows, "model", None, None), P("model", None, None), P(rows)
    return _named(
        ins,
        layer=P(),
        start=per_row,
        slot=per_row,
        qkv=P(rows, "model", None, None),
        cos=P(rows, None),
        sin=P(rows, None),
        x=P(rows, None),
        sums=per_row,
        squares=per_row,
        colsum=heads,
        bias=heads,
        norms=P(),
        k=cache,
        v=cache,
    )


@functools.partial(jax.jit, static_argnames=("config", "eps", "width", "qk_eps"))
def _pallas_step(ins: StepOperands, *, config, eps: float | None, width: int | None, qk_eps: float | None):
    """decode_step's kernel call on one shard: StepOperands in (layer a scalar), (out [B, H, K], k, v) out."""
    B, Hkv, G2, K = ins.qkv.shape
    G, S = G2 - 2, ins.k.shape[3]
    interpret, params, _, block_s = _launch(config, K, S, _padded(G))
    ins = dataclasses.replace(ins, layer=ins.layer.reshape(1))
    # the output in blocks of the G queries of a head, or (G no power of two: Triton's blocks) written by masked stores
    out_spec = pl.BlockSpec((None, None, G, K), lambda b, h: (b, h, 0, 0)) if _pow2(G) else pl.no_block_spec
    shapes = StepOutputs(
        out=jax.ShapeDtypeStruct((B, Hkv, G, K), ins.k.dtype),
        k=jax.ShapeDtypeStruct(ins.k.shape, ins.k.dtype),
        v=jax.ShapeDtypeStruct(ins.v.shape, ins.v.dtype),
    )
    kernel = functools.partial(
        _step_kernel, groups=G, block_s=block_s, mask_loads=config.mask_loads, eps=eps, width=width, qk_eps=qk_eps
    )
    outs = pl.pallas_call(
        kernel,
        grid=(B, Hkv),
        in_specs=(_step_blocks(ins),),
        out_specs=StepOutputs(out=out_spec, k=pl.no_block_spec, v=pl.no_block_spec),
        out_shape=shapes,
        # the cache is updated in place: each input buffer is its output's
        input_output_aliases={_leaf_index(ins, name): _leaf_index(shapes, name) for name in ("k", "v")},
        compiler_params=params,
        interpret=interpret,
        name="jaxrlhf_decode_attention_step",
    )(ins)
    return outs.out.reshape(B, Hkv * G, K), outs.k, outs.v


def fuses_step(
    config: DecodeAttentionConfig, batch: int, kv_heads: int, slots: int, head_dim: int, groups: int, mesh=None
) -> bool:
    """Whether `decode_step` runs as one kernel for these shapes (per shard under `mesh`): the kernel is in use
    (`use_kernel`), with tensor-core products, and one program per (row, KV head) covers all slots (no splits)."""
    if not (config.use_kernel(head_dim, groups) and config.use_dot):
        return False
    if mesh is not None and mesh.size > 1:
        batch = rows_per_shard(mesh, batch)
        kv_heads //= mesh.shape["model"]
    groups = _padded(groups)  # as the kernel runs them
    return config.splits(batch * kv_heads, slots, _launch(config, head_dim, slots, groups)[2], head_dim, groups) == 1


def decode_step(
    qkv,
    k,
    v,
    start,
    slot,
    layer=0,
    *,
    rope=None,
    rms=None,
    layer_norm=None,
    bias=None,
    qk_norm=None,
    config: DecodeAttentionConfig = DecodeAttentionConfig(),
    mesh=None,
):
    """One decode step's attention straight from the stacked q/k/v product, in one kernel (see `fuses_step`).

    qkv [B, Hkv, G + 2, K]: per KV head its G queries (pre-scaled), its key and its value, this step's token (the
    decode layout's qkv_proj output, without its bias). A norm folded into the product (its scale in the kernel's
    rows) is finished here, one of:
    - rms (x [B, D], eps): RMSNorm, each row times rsqrt(mean(x^2) + eps), x being the product's input
      (llama.decode_layer). Each program reduces x's row itself: no kernel before this one.
    - layer_norm (sums [B], squares [B], D, eps, colsum [Hkv, G + 2, K]): LayerNorm of rows of D values x whose sum
      and sum of squares come computed (one reduction per row before this kernel, not one in each of the row's
      programs), each row (row - mean(x) colsum) / sqrt(var(x) + eps), colsum being the column sums of the folded
      kernel (opt.decode_layer).
    bias (optional) [Hkv, G + 2, K]: added after the norm. qk_norm (optional): (scales [2, K], eps), Qwen3's RMSNorm
    of each query head's and of the key's K values (times scales[0] for queries, scales[1] for the key), after the
    bias and before the rotation. rope (optional): (cos, sin) [B, K / 2], the rotary
    embedding of this token's position (rotate-half pairs (i, i + K / 2)), applied to q and k. The new key and value
    are written into the cache (k, v [L, B, Hkv, S, K], updated in place) at `slot` (a scalar, or [B]: each row its
    own, as continuous batching has them), and the queries attend over slots start <= s <= slot of `layer`. Returns
    (out [B, H, K] in the cache's dtype, k, v). `decode_step_reference` is the same unfused, in plain jnp; the parts
    left out are absent from the kernel's operands (StepOperands), not zeros.
    """
    B = qkv.shape[0]
    if rms is not None and layer_norm is not None:
        raise ValueError("decode_step: pass rms or layer_norm, not both")
    f32 = lambda x: x.astype(jnp.float32)
    ins = StepOperands(
        layer=jnp.asarray(layer, jnp.int32),
        start=jnp.broadcast_to(start, (B,)).astype(jnp.int32),
        slot=jnp.broadcast_to(slot, (B,)).astype(jnp.int32),
        qkv=qkv,
        cos=None if rope is None else f32(rope[0]),
        sin=None if rope is None else f32(rope[1]),
        x=None if rms is None else rms[0],
        sums=None if layer_norm is None else f32(layer_norm[0]),
        squares=None if layer_norm is None else f32(layer_norm[1]),
        colsum=None if layer_norm is None else f32(layer_norm[4]),
        bias=bias,
        norms=None if qk_norm is None else qk_norm[0],
        k=k,
        v=v,
    )
    eps = layer_norm[3] if layer_norm is not None else rms[1] if rms is not None else None
    width, qk_eps = (None if layer_norm is None else layer_norm[2]), (None if qk_norm is None else qk_norm[1])
    rows = rows_axis(mesh, B)
    cache = P(None, rows, "model", None, None)
    fn = functools.partial(_pallas_step, config=config, eps=eps, width=width, qk_eps=qk_eps)
    fn = per_shard(fn, mesh, (_step_partitions(ins, rows),), (P(rows, "model", None), cache, cache))
    return fn(ins)


def decode_step_reference(
    qkv, k, v, start, slot, layer=0, *, rope=None, rms=None, layer_norm=None, bias=None, qk_norm=None
):
    """decode_step unfused, in float32 (its arguments, `slot` a scalar): finish the folded norm (rms: rows times
    1 / sqrt(mean(x^2) + eps); layer_norm: (row - mean colsum) / sqrt(var + eps)), add the bias, normalise each q
    head and k (qk_norm: x / sqrt(mean(x^2) + eps) * scale), rotate q and k (pairs (i, i + K / 2)), write k and v at
    `slot`, attend over start .. slot with decode_attention_reference. Returns (out [B, H, K], k, v)."""
    B, _, G2, K = qkv.shape
    x = qkv.astype(jnp.float32)
    per_row = lambda t: t[:, None, None, None]
    if rms is not None:
        x = x / per_row(jnp.sqrt(jnp.mean(jnp.square(rms[0].astype(jnp.float32)), axis=-1) + rms[1]))
    if layer_norm is not None:
        sums, squares, D, eps, colsum = layer_norm
        mean = sums / D
        x = (x - per_row(mean) * colsum) / per_row(jnp.sqrt(squares / D - mean**2 + eps))
    if bias is not None:
        x = x + bias.astype(jnp.float32)
    q, k_new, v_new = x[:, :, : G2 - 2], x[:, :, G2 - 2], x[:, :, G2 - 1]
    if qk_norm is not None:
        scales, eps = qk_norm
        rms_of = lambda t: jnp.sqrt(jnp.mean(jnp.square(t), axis=-1, keepdims=True) + eps)
        q, k_new = q / rms_of(q) * scales[0].astype(jnp.float32), k_new / rms_of(k_new) * scales[1].astype(jnp.float32)
    if rope is not None:
        cos, sin = rope[0][:, None, None, :], rope[1][:, None, None, :]
        turn = lambda t: jnp.concatenate(
            [t[..., : K // 2] * cos - t[..., K // 2 :] * sin, t[..., K // 2 :] * cos + t[..., : K // 2] * sin], axis=-1
        )
        q, k_new = turn(q), turn(k_new[:, :, None])[:, :, 0]
    k = k.at[layer, :, :, slot].set(k_new.astype(k.dtype))
    v = v.at[layer, :, :, slot].set(v_new.astype(v.dtype))
    out = decode_attention_reference(q.reshape(B, -1, K).astype(k.dtype), k, v, start, jnp.full((B,), slot + 1), layer)
    return out, k, v


def decode_attention(
    q, k, v, start, end, layer=0, *, config: DecodeAttentionConfig = DecodeAttentionConfig(), mesh=None
):
    """Attention of one query per row over its valid cache slots (shapes in the module docstring).

    Rows with start >= end give zeros (kernel) or a uniform average (XLA); generation never has one.
    `mesh` (with "data" and "model" axes): run per shard, heads over "model", rows over "data".
    """
    B, H, K = q.shape
    k, v, layer = _as_cache(k, v, layer)
    start, end = (jnp.broadcast_to(x, (B,)).astype(jnp.int32) for x in (start, end))
    Hkv = k.shape[2]
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({Hkv})")
    if not config.use_kernel(K, H // Hkv):
        return xla_decode_attention(q, k, v, start, end, layer)
    rows = rows_axis(mesh, B)
    cache = P(None, rows, "model", None, None)
    specs = (P(rows, "model", None), cache, cache, P(), P(rows), P(rows))
    return per_shard(functools.partial(_pallas, config=config), mesh, specs, P(rows, "model", None))(
        q, k, v, layer, start, end
    )
