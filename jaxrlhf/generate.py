"""KV-cached generation: one jitted program that prefills the prompts and decodes with `lax.scan`.

    prompts [B, P] left-padded ──prefill (one pass, K/V written at slots 0..P-1)──► first token
        ──scan over G - 1 steps: one token per row at slot P + t, K/V written in place──► tokens [B, G]

Every model family runs through it (models/__init__.py picks the family from the config's type). The
cache [L, B, Hkv, P + G, K] (Hkv < H for grouped-query models such as Llama) is allocated once and carried through the scan (written with one
dynamic_update_slice per layer and step, so XLA updates it in place; DESIGN.md measured 3.6x against
passing per-layer caches through a scan). Rows stop at their first EOS: later tokens are pad and the
answer mask is 0 there (1 up to and including the EOS). Sampling: greedy (temperature 0), temperature,
top-k and top-p, from an explicit PRNG key: the same key gives the same tokens. Prompts are left-aligned
first (any padding pattern works), so each row's valid slots are one range and a decode step's attention
(our Pallas kernel on a GPU, `kernels/decode_attention.py`) reads only that range of the cache.

`generate` runs the model's own parameters, or, faster, the decode layout that `decode_params` builds from
them once (each layer its own arrays, shared-input products stacked; models/common.py says why): the Step 3
engine generates with it, and so should any caller that generates more than once with the same weights.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrlhf.lora import fuse_attached
from jaxrlhf.models import decode_layer, init_cache, logits_with_cache, positions_from_mask
from jaxrlhf.sharding import shardings_for


def _layers_key(params: dict):
    """Where "layers" sits: None at the top of `params`, else the key of the dict holding it (OPT: decoder,
    Llama: model)."""
    if "layers" in params:
        return None
    for k, v in params.items():
        if isinstance(v, dict) and "layers" in v:
            return k
    raise ValueError(f"no 'layers' in the parameter tree (top level: {sorted(params)})")


def _in_decode_layout(tree, config, mesh, layer: bool):
    """`tree` (one layer's parameters, or all but the layers) fused, cast and laid out for generation."""
    dtype = config.compute_dtype
    tree = fuse_attached(tree)
    if layer:  # stacked (and the query scale folded in) before the cast: one rounding
        tree = decode_layer(config, tree)
    # a folded LayerNorm's column sums stay float32 (models.common.fold_norm): they cancel the product's mean part
    cast = lambda path, x: (x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                            and getattr(path[-1], "key", None) != "colsum" else x)
    tree = jax.tree_util.tree_map_with_path(cast, tree)
    if mesh is not None:
        wrapped = {"layers": (tree,)} if layer else tree  # per-layer paths read layers/0/... (sharding.logical_axes)
        specs = shardings_for(wrapped, "tp", mesh)
        tree = jax.lax.with_sharding_constraint(tree, specs["layers"][0] if layer else specs)
    return tree


@partial(jax.jit, static_argnames=("config", "mesh"))
def _decode_one_layer(config, layers, i, mesh):
    return _in_decode_layout(jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), layers),
                             config, mesh, layer=True)


@partial(jax.jit, static_argnames=("config", "mesh"))
def _decode_rest(config, rest, mesh):
    return _in_decode_layout(rest, config, mesh, layer=False)


def decode_params(config, params: Any, mesh=None) -> Any:
    """`params` (the model's tree, LoRA adapters attached or not: lora.attach) as generation runs them fastest:
    LoRA fused, in the compute dtype, each layer its own arrays (the "layers" entry becomes a tuple of L
    per-layer trees, with `decode_layer`'s stacked kernels), in the generation ("tp") layout of `mesh` if given.

    Built by one compiled program per layer, so besides the result only one layer's temporaries (its fp32
    LoRA products, its gathered FSDP shards) exist at a time. The result is a new copy of the weights in the
    compute dtype; leaves that need no change may be `params`' own arrays. Pass it to `generate`.
    """
    key = _layers_key(params)
    parent = params if key is None else params[key]
    layers = parent["layers"]
    if isinstance(layers, (tuple, list)):
        return params  # already in the decode layout
    # host (NumPy) leaves go to the device once, not once per layer's program
    layers = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), layers)
    per_layer = tuple(_decode_one_layer(config, layers, jnp.int32(i), mesh)
                      for i in range(jax.tree.leaves(layers)[0].shape[0]))
    rest = {k: v for k, v in parent.items() if k != "layers"}
    out = _decode_rest(config, rest if key is None else {**params, key: rest}, mesh)
    (out if key is None else out[key])["layers"] = per_layer  # out's dicts are new (jit builds them)
    return out


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling: expected temperature >= 0, top_k >= 0, 0 < top_p <= 1; got {self}")


def sample(logits, key, s: Sampling):
    """Next tokens [B] from logits [B, V] (float32)."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1:
        # Keep the smallest set of most likely tokens whose probability reaches top_p (always the first).
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each one
        cutoff = jnp.min(jnp.where(before < s.top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: jax.Array  # [B, G] int32, pad after each row's EOS
    mask: jax.Array  # [B, G] int32: 1 for generated tokens up to and including the first EOS
    logprobs: jax.Array  # [B, G] float32: log p(token) under the model (temperature 1, no filtering)


@partial(jax.jit, static_argnames=("config", "max_new_tokens", "sampling", "eos_id", "pad_id", "force_length", "mesh"))
def _generate(config, params, input_ids, attention_mask, key, *, max_new_tokens, sampling, eos_id, pad_id, force_length,
              mesh):
    B, Pn = input_ids.shape
    G = max_new_tokens
    order = jnp.argsort(attention_mask.astype(bool), axis=1, stable=True)  # padding first, real tokens in order
    input_ids, attention_mask = (jnp.take_along_axis(x, order, 1) for x in (input_ids, attention_mask))
    valid = jnp.concatenate([attention_mask.astype(bool), jnp.ones((B, G), bool)], axis=1)
    cache = init_cache(config, valid)
    if mesh is not None:  # heads over "model", batch over "data": the tensor-parallel layout of the cache
        cache_spec = NamedSharding(mesh, P(None, "data", "model", None, None))
        cache = {**cache, "k": jax.lax.with_sharding_constraint(cache["k"], cache_spec),
                 "v": jax.lax.with_sharding_constraint(cache["v"], cache_spec)}
    positions = jnp.maximum(positions_from_mask(attention_mask), 0)
    logits, cache = logits_with_cache(config, params, input_ids, positions, cache, last=1)  # the LM head on the last only
    next_pos = jnp.sum(attention_mask, axis=1).astype(jnp.int32)  # [B]: the first answer token's position
    stop = eos_id is not None and not force_length

    def pick(logits, key, done):
        token = sample(logits, key, sampling).astype(jnp.int32)
        logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0]
        token = jnp.where(done, pad_id, token)
        live = ~done
        done = done | (token == eos_id) if stop else done
        return token, logprob * live, live.astype(jnp.int32), done

    keys = jax.random.split(key, G)
    first = pick(logits[:, -1], keys[0], jnp.zeros((B,), bool))

    def step(carry, inputs):
        cache, token, done = carry
        key, t = inputs
        logits, cache = logits_with_cache(config, params, token[:, None], (next_pos + t - 1)[:, None], cache)
        token, logprob, live, done = pick(logits[:, 0], key, done)
        return (cache, token, done), (token, logprob, live)

    (_, _, _), (tokens, logprobs, live) = jax.lax.scan(step, (cache, first[0], first[3]), (keys[1:], jnp.arange(1, G)))
    tokens = jnp.concatenate([first[0][:, None], tokens.T], axis=1)
    logprobs = jnp.concatenate([first[1][:, None], logprobs.T], axis=1)
    mask = jnp.concatenate([first[2][:, None], live.T], axis=1)
    return tokens, mask, logprobs


def generate(config, params: Any, input_ids, attention_mask, key, *, max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_id: int | None = None,
             pad_id: int | None = None, force_length: bool = False, mesh=None) -> Generation:
    """Continue left-padded prompts [B, P] by up to `max_new_tokens` tokens (see the module docstring).

    `force_length` ignores EOS (benchmarks: every row does the same work). With `mesh`, the KV cache is
    laid out for the generation ("tp") layout; pass params resharded to it. Compiled once per shape
    and set of options.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    if input_ids.shape[1] + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"{config.max_position_embeddings} positions")
    run = partial(_generate, config, params, input_ids, attention_mask, key, max_new_tokens=max_new_tokens,
                  sampling=Sampling(temperature, top_k, top_p), eos_id=eos_id,
                  pad_id=config.pad_token_id if pad_id is None else pad_id, force_length=force_length, mesh=mesh)
    if mesh is None:
        tokens, mask, logprobs = run()
    else:
        with jax.set_mesh(mesh):  # the decode kernel runs per shard of this mesh
            tokens, mask, logprobs = run()
    return Generation(tokens, mask, logprobs)
