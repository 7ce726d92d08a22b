"""OPT decoder in Flax Linen: the language model, reward model and critic of every step.

Shape vocabulary (used in comments and einsum strings throughout jaxrlhf):
    B batch, T sequence, D model width (hidden_size), E embedding width (word_embed_proj_dim),
    H heads, K head dim, F FFN width, V vocab, L layers.

Parameter tree (mirrors Hugging Face's module names so the name table in checkpoint.py is short):

    decoder/embed_tokens/embedding        [V, E]   also the LM head (tied)
    decoder/embed_positions/embedding     [max_position_embeddings + 2, D]
    decoder/project_in/kernel             [E, D]   only when E != D (opt-350m)
    decoder/layers/...                    every layer leaf stacked on a leading [L] axis:
        self_attn_layer_norm/{scale,bias} [L, D]
        self_attn/{q,k,v}_proj/kernel     [L, D, D]   bias [L, D]
        self_attn/out_proj/kernel         [L, D, D]   bias [L, D]
        final_layer_norm/{scale,bias}     [L, D]
        fc1/kernel [L, D, F]  bias [L, F]; fc2/kernel [L, F, D]  bias [L, D]
    decoder/final_layer_norm/{scale,bias} [D]      only for pre-LN models (all but opt-350m)
    decoder/project_out/kernel            [D, E]   only when E != D
    value_head/kernel                     [E, 1]   reward model and critic only

The layers run under one `nn.scan` (a single compiled layer body for all L layers), optionally
rematerialised per layer, so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.kernels.decode_attention import DecodeAttentionConfig, decode_attention

# OPT's learned positions start at 2: fairseq reserved ids 0 and 1 (padding) in the table.
POSITION_OFFSET = 2
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class OPTConfig:
    """The architecture (from Hugging Face's config.json) plus how to run it (dtype, remat, dropout)."""

    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    word_embed_proj_dim: int = 768
    do_layer_norm_before: bool = True
    remove_final_layer_norm: bool = False
    enable_bias: bool = True
    dropout: float = 0.1
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    bos_token_id: int = 2
    eos_token_id: int = 2
    # How to run it (not part of the checkpoint):
    dtype: str = "float32"  # compute dtype: "float32" or "bfloat16"; parameters keep their own dtype
    remat: bool = False  # recompute each layer's activations in the backward pass
    attention: str = "auto"  # "auto", "cudnn" (flash attention, GPU) or "xla"; see fused_attention
    decode_attention: str = "auto"  # generation: "auto" (our Pallas kernel on a GPU), "pallas" or "xla"
    # Layers per iteration of the loop over layers; 0 (auto): no loop at all on a GPU (measured on the H200:
    # SFT step 86 -> 78 ms, decode step 4.5 -> 4.3 ms for OPT-1.3B), a rolled loop elsewhere (fast compiles).
    scan_unroll: int = 0

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"OPTConfig.dtype: expected one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.attention not in ("auto", "cudnn", "xla"):
            raise ValueError(f"OPTConfig.attention: expected 'auto', 'cudnn' or 'xla', got {self.attention!r}")
        if self.decode_attention not in ("auto", "pallas", "xla"):
            raise ValueError(f"OPTConfig.decode_attention: expected 'auto', 'pallas' or 'xla', got {self.decode_attention!r}")
        if self.scan_unroll < 0:
            raise ValueError(f"OPTConfig.scan_unroll: expected >= 0 (0: auto), got {self.scan_unroll}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"OPTConfig: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"OPTConfig.{name}: expected a probability in [0, 1), got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def has_projection(self) -> bool:
        return self.word_embed_proj_dim != self.hidden_size

    @property
    def has_final_layer_norm(self) -> bool:
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    @property
    def compute_dtype(self):
        return _DTYPES[self.dtype]


def causal_attention(q, k, v, implementation: str = "auto"):
    """Causal softmax(q k^T) v through `jax.nn.dot_product_attention`; q, k, v [B, T, H, K], q pre-scaled.

    "cudnn" is cuDNN's flash attention (GPU, 16-bit dtypes; the [B, H, T, T] scores never exist in
    memory); "xla" the plain XLA graph (scores in float32); "auto" takes cuDNN on a GPU with a 16-bit
    dtype and XLA otherwise, or when cuDNN refuses the shapes. No mask tensor is passed (padding was
    moved out of the way by the decoder): with one, cuDNN would also compute its gradient, a
    [B, 1, T, T] tensor that made the backward pass 1.3x slower on the H200.
    """
    if implementation == "auto":
        if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
            try:
                return jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True, implementation="cudnn")
            except (ValueError, NotImplementedError, RuntimeError):  # a shape or dtype cuDNN does not take
                pass
        implementation = "xla"
    return jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True, implementation=implementation)


def cached_attention(q, k, v, cache, decode: str = "auto"):
    """Attention over a KV cache, writing this call's keys and values into it first (generation).

    q, k, v: [B, T, H, K] for T new tokens (the prompt at prefill, 1 when decoding); cache: "k", "v"
    [L, B, H, S, K] (each row's and head's slots contiguous, as the decode kernel streams them), "layer" (this layer's index), "slot" (where the T tokens go: slots slot .. slot+T-1,
    the same for every row), "valid" [B, S] (False at left padding), "start" [B] (each row's first valid
    slot). The write is one dynamic_update_slice into the cache carried through the loops, so XLA updates
    it in place. Query t attends valid slots <= slot + t. A decode step (T = 1) runs the decode-attention
    kernel (`decode`: see kernels.decode_attention), which reads only the slots start .. slot of the layer,
    straight from the whole cache; the prefill runs plain XLA over the whole cache.
    Returns (out [B, T, H, K], cache with k and v updated).
    """
    layer, slot = cache["layer"], cache["slot"]
    write = lambda c, x: jax.lax.dynamic_update_slice(c, x.transpose(0, 2, 1, 3)[None].astype(c.dtype),
                                                      (layer, 0, 0, slot, 0))
    ck, cv = write(cache["k"], k), write(cache["v"], v)
    cache = {**cache, "k": ck, "v": cv}
    S, T = ck.shape[3], q.shape[1]
    if T == 1:
        mesh = jax.sharding.get_abstract_mesh()  # generate() sets the generation mesh around its program
        mesh = None if mesh.empty or "model" not in mesh.axis_names else mesh
        config = DecodeAttentionConfig(implementation=decode)
        out = decode_attention(q[:, 0], ck, cv, cache["start"], slot + 1, layer, config=config, mesh=mesh)
        return out[:, None], cache
    kl = jax.lax.dynamic_index_in_dim(ck, layer, 0, keepdims=False).astype(q.dtype)  # [B, H, S, K]
    vl = jax.lax.dynamic_index_in_dim(cv, layer, 0, keepdims=False).astype(v.dtype)
    visible = jnp.arange(S)[None, :] <= slot + jnp.arange(T)[:, None]  # [T, S]
    allowed = cache["valid"][:, None, None, :] & visible[None, None]  # [B, 1, T, S]
    scores = jnp.einsum("bthk,bhsk->bhts", q, kl, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(jnp.where(allowed, scores, -1e9), axis=-1)  # finite: a fully masked row stays NaN-free
    out = jnp.einsum("bhts,bhsk->bthk", probs.astype(vl.dtype), vl)
    return out, cache


class OPTAttention(nn.Module):
    """Multi-head self-attention with OPT's q scaling; the softmax runs in float32.

    Without a cache (training, scoring) rows hold their real tokens first (see OPTDecoder) and attention
    is plain causal attention; with one (generation) see `cached_attention`. Returns (out, cache).
    """

    config: OPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, h, cache=None):
        # h: [B, T, D]
        c = self.config
        B, T, D = h.shape
        H, K = c.num_attention_heads, c.head_dim
        proj = lambda name: nn.Dense(D, use_bias=c.enable_bias, dtype=c.compute_dtype, name=name)
        q = proj("q_proj")(h).reshape(B, T, H, K) * (K**-0.5)  # OPT scales q after its bias
        k = proj("k_proj")(h).reshape(B, T, H, K)
        v = proj("v_proj")(h).reshape(B, T, H, K)
        if cache is not None:
            out, cache = cached_attention(q, k, v, cache, c.decode_attention)
        elif self.deterministic or c.attention_dropout == 0.0:
            out = causal_attention(q, k, v, c.attention)
        else:  # attention dropout needs the probabilities themselves
            scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32)
            scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, jnp.finfo(jnp.float32).min)
            probs = nn.Dropout(c.attention_dropout)(jax.nn.softmax(scores, axis=-1), deterministic=False)
            out = jnp.einsum("bhqs,bshk->bqhk", probs.astype(v.dtype), v)
        return proj("out_proj")(out.reshape(B, T, D)), cache


# The released OPT architectures (vocab 50272, 2048 positions, FFN = 4 x hidden), for random-weight
# models in benchmarks and demos: `OPTConfig(**PRESETS["opt-1.3b"])`.
PRESETS = {
    name: dict(num_hidden_layers=L, hidden_size=D, num_attention_heads=H, ffn_dim=4 * D, word_embed_proj_dim=D)
    for name, (L, D, H) in {
        "opt-125m": (12, 768, 12),
        "opt-1.3b": (24, 2048, 32),
        "opt-2.7b": (32, 2560, 32),
        "opt-6.7b": (32, 4096, 32),
        "opt-13b": (40, 5120, 40),
        "opt-30b": (48, 7168, 56),
        "opt-66b": (64, 9216, 72),
    }.items()
}
PRESETS["opt-350m"] = dict(
    num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, ffn_dim=4096, word_embed_proj_dim=512,
    do_layer_norm_before=False,
)


class OPTLayer(nn.Module):
    """One decoder layer; `nn.scan` stacks it L times. Carry: the hidden state h [B, T, D]."""

    config: OPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, carry, layer, where):
        # carry: (h [B, T, D], kv) with kv None, or {"k", "v"} caches [L, B, H, S, K] when generating;
        # layer: this layer's index (scanned); where: None, or "valid", "slot", "start" (see
        # cached_attention; broadcast to all layers).
        h, kv = carry
        cache = None if kv is None else {**kv, **where, "layer": layer}
        c = self.config
        dense = lambda n, name: nn.Dense(n, use_bias=c.enable_bias, dtype=c.compute_dtype, name=name)
        norm = lambda name: nn.LayerNorm(epsilon=c.layer_norm_eps, dtype=c.compute_dtype, name=name)
        drop = lambda x: nn.Dropout(c.dropout)(x, deterministic=self.deterministic)

        # Self-attention block (post-LN models, opt-350m, normalise after the residual add instead).
        residual = h
        if c.do_layer_norm_before:
            h = norm("self_attn_layer_norm")(h)
        h, cache = OPTAttention(c, self.deterministic, name="self_attn")(h, cache)
        h = residual + drop(h)
        if not c.do_layer_norm_before:
            h = norm("self_attn_layer_norm")(h)

        # Feed-forward block: fc1 -> ReLU -> fc2.
        residual = h
        if c.do_layer_norm_before:
            h = norm("final_layer_norm")(h)
        h = dense(c.hidden_size, "fc2")(nn.relu(dense(c.ffn_dim, "fc1")(h)))
        h = residual + drop(h)
        if not c.do_layer_norm_before:
            h = norm("final_layer_norm")(h)
        return (h, None if cache is None else {"k": cache["k"], "v": cache["v"]}), None


def positions_from_mask(attention_mask):
    """OPT's position ids [B, T] from the attention mask, as Hugging Face computes them.

    Real tokens count 0, 1, 2, ... from the first real token of their row (so left padding does not shift
    them); padding gets -1. Both then add POSITION_OFFSET when indexing the table.
    """
    mask = attention_mask.astype(jnp.int32)
    return jnp.cumsum(mask, axis=1) * mask - 1


def real_tokens_first(attention_mask):
    """Per-row permutation [B, T] that moves the real tokens to the front, keeping their order.

    Inside the decoder every row is laid out this way, so that "attend to earlier real tokens" is plain
    causal attention with no mask tensor, whatever the padding (left, right or in between). Padded
    positions end up last; their outputs are computed but meaningless, and callers ignore them.
    """
    return jnp.argsort(attention_mask.astype(jnp.int32) == 0, axis=1, stable=True)


class OPTDecoder(nn.Module):
    """Embeddings, the scanned layers, and the closing LayerNorm/projection. Returns h [B, T, E]."""

    config: OPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, input_ids, attention_mask, cache=None, positions=None):
        # Without a cache: any padding; returns h. With one (generation): `positions` [B, T] are given,
        # attention_mask is unused (cache["valid"] says which slots are real); returns (h, cache).
        c = self.config
        if cache is None:
            order = real_tokens_first(attention_mask)  # [B, T]
            positions = jnp.take_along_axis(positions_from_mask(attention_mask), order, 1)
            input_ids = jnp.take_along_axis(input_ids, order, 1)
        positions = positions + POSITION_OFFSET
        embed_tokens = nn.Embed(c.vocab_size, c.word_embed_proj_dim, name="embed_tokens")
        h = embed_tokens(input_ids).astype(c.compute_dtype)  # [B, T, E]
        if c.has_projection:
            h = nn.Dense(c.hidden_size, use_bias=False, dtype=c.compute_dtype, name="project_in")(h)
        h = h + nn.Embed(c.max_position_embeddings + POSITION_OFFSET, c.hidden_size, name="embed_positions")(
            positions
        ).astype(c.compute_dtype)  # no dropout on the embeddings: Hugging Face's OPT has none

        layer = nn.remat(OPTLayer, prevent_cse=False) if c.remat else OPTLayer
        layers = nn.scan(
            layer,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(0, nn.broadcast),
            length=c.num_hidden_layers,
            unroll=min(c.scan_unroll or (c.num_hidden_layers if jax.default_backend() == "gpu" else 1),
                       c.num_hidden_layers),
        )(c, self.deterministic, name="layers")
        kv = None if cache is None else {"k": cache["k"], "v": cache["v"]}
        where = None if cache is None else {n: cache[n] for n in ("valid", "slot", "start")}
        (h, kv), _ = layers((h, kv), jnp.arange(c.num_hidden_layers), where)

        if c.has_final_layer_norm:
            h = nn.LayerNorm(epsilon=c.layer_norm_eps, dtype=c.compute_dtype, name="final_layer_norm")(h)
        if c.has_projection:
            h = nn.Dense(c.word_embed_proj_dim, use_bias=False, dtype=c.compute_dtype, name="project_out")(h)
        if cache is not None:
            return h, {**cache, **kv}
        inverse = jnp.argsort(order, axis=1)
        return jnp.take_along_axis(h, inverse[..., None], 1)  # back to the caller's layout


class OPT(nn.Module):
    """OPT with its tied LM head (returns logits [B, T, V]) or, with `value_head=True`, the reward/critic
    model (returns one value per position [B, T]: `Linear(E, 1)`, no bias, on the last hidden state)."""

    config: OPTConfig
    value_head: bool = False
    deterministic: bool = True

    @nn.compact
    def __call__(self, input_ids, attention_mask, cache=None, positions=None):
        decoder = OPTDecoder(self.config, self.deterministic, name="decoder")
        h = decoder(input_ids, attention_mask, cache, positions)  # [B, T, E] (and the cache)
        if cache is not None:
            h, cache = h
        if self.value_head:
            out = nn.Dense(1, use_bias=False, dtype=self.config.compute_dtype, name="value_head")(h)[..., 0].astype(jnp.float32)
        else:
            embedding = decoder.variables["params"]["embed_tokens"]["embedding"]  # [V, E], tied LM head
            out = jnp.einsum("bte,ve->btv", h, embedding.astype(h.dtype), preferred_element_type=jnp.float32)
        return out if cache is None else (out, cache)


def _apply(config, params, input_ids, attention_mask, value_head, dropout_rng):
    model = OPT(config, value_head=value_head, deterministic=dropout_rng is None)
    rngs = None if dropout_rng is None else {"dropout": dropout_rng}
    return model.apply({"params": params}, input_ids, attention_mask, rngs=rngs)


def logits(config: OPTConfig, params: Any, input_ids, attention_mask, *, dropout_rng=None):
    """Next-token logits [B, T, V] in float32. Dropout runs only when `dropout_rng` is given."""
    return _apply(config, params, input_ids, attention_mask, False, dropout_rng)


def values(config: OPTConfig, params: Any, input_ids, attention_mask, *, dropout_rng=None):
    """Value-head outputs [B, T] in float32 (reward model and critic); `params` must hold `value_head`."""
    return _apply(config, params, input_ids, attention_mask, True, dropout_rng)


def init_cache(config: OPTConfig, valid, dtype=None, multiple: int = 64) -> dict:
    """An empty KV cache for generation: "k", "v" [L, B, H, S, K] zeros, "valid" [B, S] (which slots hold
    real tokens: False at left padding), "start" [B] (each row's first valid slot), "slot" 0.

    S is valid.shape[1] (prompt + answer length) rounded up to `multiple` (the decode kernel reads the
    cache in blocks); the extra slots are never valid.
    """
    B, S = valid.shape
    valid = jnp.pad(valid.astype(bool), ((0, 0), (0, -S % multiple)))
    shape = (config.num_hidden_layers, B, config.num_attention_heads, valid.shape[1], config.head_dim)
    zeros = jnp.zeros(shape, dtype or config.compute_dtype)
    start = jnp.argmax(valid, axis=1).astype(jnp.int32)
    return {"k": zeros, "v": zeros, "valid": valid, "start": start, "slot": jnp.zeros((), jnp.int32)}


def logits_with_cache(config: OPTConfig, params: Any, input_ids, positions, cache):
    """Logits [B, T, V] of T new tokens at cache["slot"] .. + T - 1, and the cache holding their K/V.

    `positions` [B, T] are OPT position ids without the offset (0 for a row's first real token)."""
    out, cache = OPT(config).apply({"params": params}, input_ids, None, cache, positions)
    return out, {**cache, "slot": cache["slot"] + input_ids.shape[1]}


def init_params(config: OPTConfig, key, *, value_head: bool = False, dtype=jnp.float32, std: float = 0.02):
    """Random parameters with OPT's initialisation (normal(0, std) weights, zero biases, unit LayerNorms)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(config, value_head=value_head))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, leaf), k in zip(leaves, keys):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        if name.endswith("scale"):
            out.append(jnp.ones(leaf.shape, dtype))
        elif name.endswith("bias"):
            out.append(jnp.zeros(leaf.shape, dtype))
        else:
            out.append((std * jax.random.normal(k, leaf.shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def param_shapes(config: OPTConfig, *, value_head: bool = False):
    """The parameter tree of `config` as `jax.ShapeDtypeStruct`s (float32), without allocating anything."""
    model = OPT(config, value_head=value_head)
    ids = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), ids, jnp.ones_like(ids))["params"])
