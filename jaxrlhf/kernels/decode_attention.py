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
in one kernel. Unfused, those are three or four small XLA kernels per layer around this one.

Query groups that are no power of two (Qwen2.5: 6 or 7 query heads per KV head) run as the next power of two, as
Triton's blocks need: `decode_attention` pads the queries with zeros in memory (its outputs sliced off); the fused
step, whose queries come inside the stacked product, loads the padded rows masked (as 0) and stores only the real ones.
"""

from __future__ import annotations

import dataclasses
import functools

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


def _kernel(
    layer_ref,
    start_ref,
    end_ref,
    q_ref,
    k_ref,
    v_ref,
    *out_refs,
    block_s: int,
    chunk: int,
    use_dot: bool,
    mask_loads: bool,
):
    # layer_ref [1]; start_ref, end_ref [1] (this row's valid range); q_ref [G, K] (the queries of one KV head);
    # k_ref, v_ref: the whole cache [L, B, Hkv, S, K]. This program reads the chunk of slots
    # [j * chunk, (j + 1) * chunk). out_refs: o_ref [G, K] (one split: the output), or acc_ref [G, K],
    # m_ref [G], l_ref [G] (the partial sums of this chunk, float32).
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = jnp.maximum(start_ref[0], j * chunk)  # start >= end: a chunk with no valid slot reads nothing
    end = jnp.minimum(end_ref[0], (j + 1) * chunk)
    G, K = q_ref.shape
    copies = max(16 // G, 1) if use_dot else 1  # tensor-core products need 16 rows: rows r * G + g hold query g
    rows = copies * G
    q = _repeat_rows(q_ref[...] if use_dot else q_ref[...].astype(jnp.float32), copies)
    # The running max starts at -1e30, our finite -inf: the first rescale exp(m - m_new) is 0, not NaN, and a
    # chunk with no valid slot leaves m = -1e30, den = acc = 0.
    init = (jnp.full((rows,), -1e30, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, K), jnp.float32))
    m, den, acc = _attend(
        q, k_ref, v_ref, layer_ref[0], b, h, start, end, init, block_s=block_s, use_dot=use_dot, mask_loads=mask_loads
    )
    m, den, acc = (_one_copy(x, copies) for x in (m, den, acc))
    if len(out_refs) == 1:
        out_refs[0][...] = (acc / jnp.maximum(den, 1e-30)[:, None]).astype(out_refs[0].dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...], m_ref[...], l_ref[...] = acc, m, den


def _step_kernel(
    layer_ref,
    start_ref,
    slot_ref,
    qkv_ref,
    cos_ref,
    sin_ref,
    x_ref,
    sum_ref,
    sq_ref,
    colsum_ref,
    bias_ref,
    norm_ref,
    k_ref,
    v_ref,
    o_ref,
    ko_ref,
    vo_ref,
    *,
    groups: int,
    block_s: int,
    mask_loads: bool,
    rope: bool,
    eps: float | None,
    width: int | None,
    bias: bool,
    qk_eps: float | None,
):
    # qkv_ref: the whole [B, Hkv, G + 2, K] (per KV head its G queries, key, value); cos_ref, sin_ref [K / 2]; x_ref
    # [B, D] (a folded RMSNorm's input); sum_ref, sq_ref [1] (a folded LayerNorm's input row: its sum and sum of
    # squares over `width` values), colsum_ref [Hkv, G + 2, K] (its kernel's column sums); bias_ref [Hkv, G + 2, K];
    # norm_ref [2, K] (the per-head q and k norms' scales, Qwen3's q_norm / k_norm, read where qk_eps is set);
    # k_ref, v_ref / ko_ref, vo_ref: the cache [L, B, Hkv, S, K], read / written (one buffer); o_ref [G, K], or the
    # whole [B, Hkv, groups, K] where `groups` is no power of two.
    # G = `groups` queries per KV head, as Triton's blocks take them: a power of two, the rows past `groups` (when
    # padded: the key, the value, the next head's queries) loaded as 0 and their outputs not written.
    b, h = pl.program_id(0), pl.program_id(1)
    layer, slot = layer_ref[0], slot_ref[0]  # this row's slot
    G, K = _padded(groups), qkv_ref.shape[-1]
    copies = max(16 // G, 1)
    real = lambda at: at[-2].start + jax.lax.broadcasted_iota(jnp.int32, (at[-2].size, at[-1].size), 0) < groups

    def rows_of(ref, at):  # rows and columns `at` of a [..., groups + 2, K] ref, padded query rows (masked) 0
        return pltriton.load(ref.at[at], mask=real(at), other=0) if groups < G and at[-2].size > 1 else ref[at]

    half = K // 2
    centred = width is not None
    if centred:  # the variance as flax computes it: mean(x^2) - mean(x)^2, clipped at 0
        mean = sum_ref[0] / width
        r = jax.lax.rsqrt(jnp.maximum(sq_ref[0] / width - mean * mean, 0.0) + eps)
    else:
        r = 1.0 if eps is None else jax.lax.rsqrt(row_mean_square(x_ref, b) + eps)

    def part(row, n, col, cols):  # rows row .. row + n - 1, columns col .. col + cols - 1 of this head's q/k/v
        at = (pl.ds(row, n), pl.ds(col, cols))
        y = rows_of(qkv_ref, (b, h) + at).astype(jnp.float32)
        if centred:
            y = y - mean * rows_of(colsum_ref, (h,) + at)
        y = y * r
        return y + rows_of(bias_ref, (h,) + at).astype(jnp.float32) if bias else y

    def head_norm(pieces, which):  # RMSNorm of each row over K, pieces [n, K / len(pieces)] side by side; 0: q, 1: k
        if qk_eps is None:
            return pieces
        r = jax.lax.rsqrt(sum(jnp.sum(x * x, axis=-1) for x in pieces) / K + qk_eps)[:, None]
        width = K // len(pieces)
        scale = lambda i: norm_ref[which, pl.ds(i * width, width)].astype(jnp.float32)[None, :]
        return [x * r * scale(i) for i, x in enumerate(pieces)]

    v_new = part(groups + 1, 1, 0, K)  # [1, K]
    if rope:  # rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for each pair (i, i + K / 2)
        cos, sin = cos_ref[...][None, :], sin_ref[...][None, :]
        turn = lambda x1, x2: (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        q1, q2 = turn(*head_norm([part(0, G, 0, half), part(0, G, half, half)], 0))  # [G, K / 2]
        k1, k2 = turn(*head_norm([part(groups, 1, 0, half), part(groups, 1, half, half)], 1))  # [1, K / 2]
        ko_ref[layer, b, h, pl.ds(slot, 1), pl.ds(0, half)] = k1.astype(ko_ref.dtype)
        ko_ref[layer, b, h, pl.ds(slot, 1), pl.ds(half, half)] = k2.astype(ko_ref.dtype)
        k1, k2 = (x.astype(ko_ref.dtype).astype(jnp.float32) for x in (k1, k2))  # as the cache holds it
        q1, q2 = (x.astype(o_ref.dtype) for x in (q1, q2))
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
        q = (place(q1, 0) + place(q2, half)).astype(o_ref.dtype)  # [rows, K]
    else:
        (k_new,) = head_norm([part(groups, 1, 0, K)], 1)
        ko_ref[layer, b, h, pl.ds(slot, 1), :] = k_new.astype(ko_ref.dtype)
        q = head_norm([part(0, G, 0, K)], 0)[0].astype(o_ref.dtype)
        s_new = jnp.sum(q.astype(jnp.float32) * k_new.astype(ko_ref.dtype).astype(jnp.float32), axis=-1)
        q = _repeat_rows(q, copies)
    vo_ref[layer, b, h, pl.ds(slot, 1), :] = v_new.astype(vo_ref.dtype)
    v_new = v_new.astype(vo_ref.dtype).astype(jnp.float32)
    # This token's own slot starts the online softmax (weight 1 at its score); the loop reads the cached slots before.
    rows = copies * G
    init = (_repeat_rows(s_new, copies), jnp.ones((rows,), jnp.float32), jnp.broadcast_to(v_new, (rows, K)))
    _, den, acc = _attend(
        q, k_ref, v_ref, layer, b, h, start_ref[0], slot, init, block_s=block_s, use_dot=True, mask_loads=mask_loads
    )
    den, acc = _one_copy(den, copies), _one_copy(acc, copies)
    out = (acc / den[:, None]).astype(o_ref.dtype)
    if groups < G:
        at = (b, h, pl.ds(0, G), pl.ds(0, K))
        pltriton.store(o_ref.at[at], out, mask=real(at))
    else:
        o_ref[...] = out


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
    scalar, row = pl.BlockSpec((1,), lambda b, h, j: (0,)), pl.BlockSpec((1,), lambda b, h, j: (b,))
    queries, whole = pl.BlockSpec((None, None, G, K), lambda b, h, j: (b, h, 0, 0)), pl.no_block_spec
    part = lambda *shape: pl.BlockSpec((None, None, None, *shape), lambda b, h, j: (b, h, j) + (0,) * len(shape))
    if splits == 1:
        out_specs, out_shape = part(G, K), jax.ShapeDtypeStruct((B, Hkv, 1, G, K), q.dtype)
    else:  # the partial sums: acc, m, den
        out_specs = [part(G, K), part(G), part(G)]
        out_shape = [jax.ShapeDtypeStruct((B, Hkv, splits, *shape), jnp.float32) for shape in ((G, K), (G,), (G,))]
    out = pl.pallas_call(
        functools.partial(_kernel, block_s=block_s, chunk=chunk, use_dot=config.use_dot, mask_loads=config.mask_loads),
        grid=(B, Hkv, splits),
        in_specs=[scalar, row, row, queries, whole, whole],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="jaxrlhf_decode_attention",
    )(layer.reshape(1), start, end, qg, k, v)
    out = out[:, :, 0] if splits == 1 else _combine(*out).astype(q.dtype)
    return out[:, :, : H // Hkv].reshape(B, H, K)


@functools.partial(jax.jit, static_argnames=("config", "rope", "eps", "width", "bias", "qk_eps"))
def _pallas_step(
    qkv,
    k,
    v,
    layer,
    start,
    slot,
    cos,
    sin,
    x,
    sums,
    squares,
    colsum,
    b,
    norms,
    *,
    config,
    rope: bool,
    eps: float | None,
    width: int | None,
    bias: bool,
    qk_eps: float | None,
):
    B, Hkv, G2, K = qkv.shape
    G, S = G2 - 2, k.shape[3]
    interpret, params, _, block_s = _launch(config, K, S, _padded(G))
    # the output in blocks of the G queries of a head, or (G no power of two: Triton's blocks) written by masked stores
    out_spec = pl.BlockSpec((None, None, G, K), lambda b, h: (b, h, 0, 0)) if _pow2(G) else pl.no_block_spec
    row = pl.BlockSpec((1,), lambda b, h: (b,))
    table = pl.BlockSpec((None, K // 2), lambda b, h: (b, 0))
    scalar = pl.BlockSpec((1,), lambda b, h: (0,))
    whole = pl.no_block_spec
    out, k, v = pl.pallas_call(
        functools.partial(
            _step_kernel,
            groups=G,
            block_s=block_s,
            mask_loads=config.mask_loads,
            rope=rope,
            eps=eps,
            width=width,
            bias=bias,
            qk_eps=qk_eps,
        ),
        grid=(B, Hkv),
        in_specs=[scalar, row, row, whole, table, table, whole, row, row, whole, whole, whole, whole, whole],
        out_specs=[out_spec, whole, whole],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hkv, G, K), k.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        input_output_aliases={12: 1, 13: 2},
        compiler_params=params,
        interpret=interpret,
        name="jaxrlhf_decode_attention_step",
    )(layer.reshape(1), start, slot, qkv, cos, sin, x, sums, squares, colsum, b, norms, k, v)
    return out.reshape(B, Hkv * G, K), k, v


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
    (out [B, H, K] in the cache's dtype, k, v). The unfused equivalent: normalise, add the bias, rotate, write with
    dynamic_update_slice, then `decode_attention(q, k, v, start, slot + 1, layer)`; tests/test_decode_attention.py
    checks one against the other.
    """
    B, Hkv, G2, K = qkv.shape
    if rms is not None and layer_norm is not None:
        raise ValueError("decode_step: pass rms or layer_norm, not both")
    start, slot = (jnp.broadcast_to(x, (B,)).astype(jnp.int32) for x in (start, slot))
    unread = lambda *shape: jnp.zeros(shape, jnp.float32)  # operands of the parts switched off
    cos, sin = rope if rope is not None else (unread(B, K // 2),) * 2
    x, eps = rms if rms is not None else (unread(B, 1), None)
    sums, squares, width, ln_eps, colsum = (
        layer_norm if layer_norm is not None else (unread(B), unread(B), None, None, unread(Hkv, G2, K))
    )
    eps = ln_eps if layer_norm is not None else eps
    b = bias if bias is not None else unread(Hkv, G2, K)
    norms, qk_eps = qk_norm if qk_norm is not None else (unread(2, K), None)
    fn = functools.partial(
        _pallas_step, config=config, rope=rope is not None, eps=eps, width=width, bias=bias is not None, qk_eps=qk_eps
    )
    rows = rows_axis(mesh, B)
    cache, heads = P(None, rows, "model", None, None), P("model", None, None)
    specs = (P(rows, "model", None, None), cache, cache, P(), P(rows), P(rows), *[P(rows, None)] * 3, P(rows), P(rows))
    fn = per_shard(fn, mesh, (*specs, heads, heads, P()), (P(rows, "model", None), cache, cache))
    cos, sin, sums, squares, colsum = (x.astype(jnp.float32) for x in (cos, sin, sums, squares, colsum))
    return fn(qkv, k, v, jnp.asarray(layer, jnp.int32), start, slot, cos, sin, x, sums, squares, colsum, b, norms)


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
