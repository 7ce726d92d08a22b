"""The model families and one functional API over them, chosen by the config's type.

    family      config        module                 HF config.json model_type
    OPT         OPTConfig     jaxrlhf.models.opt     "opt"
    Llama       LlamaConfig   jaxrlhf.models.llama   "llama"
    Qwen2/2.5   QwenConfig    jaxrlhf.models.qwen    "qwen2"
    Qwen3       QwenConfig    jaxrlhf.models.qwen    "qwen3"

A family module (models/common.py says what it holds) is found from the config's type by the functions below, so the
engine, the trainers and generation run every family through the same code. Each call's kind is explicit: `logits` and
`values` (and `logprobs`: `hidden` then the chunked `head_logprobs`, where only log p(target) is needed, never the
[B, T, V] logits) are "train" (given a dropout key) or "score" calls; `logits_with_cache` a "prefill" or "decode" call
(`Mode`, from `generation_modes`). How the machine runs them is the config's `backend` (`Backend.detect()` at
start-up; default plain XLA); which decode kernels a generation runs is chosen once, by `decode_kernels`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrlhf.kernels.decode_attention import fuses_step
from jaxrlhf.models import common, llama, opt, qwen
from jaxrlhf.models.common import (  # noqa: F401  (the API's types)
    Backend,
    DecodeKernels,
    Mode,
    cache_length,
    lora_attached,
    positions_from_mask,
)
from jaxrlhf.models.llama import LlamaConfig
from jaxrlhf.models.opt import OPTConfig
from jaxrlhf.models.qwen import QwenConfig

FAMILIES = {"opt": opt, "llama": llama, "qwen2": qwen, "qwen3": qwen}  # config.json model_type -> module
CONFIGS = {"opt": OPTConfig, "llama": LlamaConfig, "qwen2": QwenConfig, "qwen3": QwenConfig}
HF_NAMES = {"opt": opt.HF, "llama": llama.HF, **qwen.HF}  # model_type -> its HF folders' names (checkpoint.py)
# Every parameter path's logical axes (sharding.py): each family's table, then what they share.
PARAM_AXES = [row for fam in dict.fromkeys(FAMILIES.values()) for row in fam.PARAM_AXES] + common.PARAM_AXES


def family(config):
    """The module (opt, llama or qwen) that implements `config`."""
    try:
        return FAMILIES[config.model_type]
    except (AttributeError, KeyError):
        raise TypeError(
            f"not a model config of a known family ({', '.join(FAMILIES)}): {type(config).__name__}"
        ) from None


def _forward(
    config,
    params,
    input_ids,
    attention_mask,
    value_head,
    dropout_rng,
    positions,
    segment_ids,
    last=0,
    at=None,
    hidden=False,
):
    """A "train" call (with `dropout_rng`: dropout on) or a "score" call of `config`'s family."""
    mode = Mode("score" if dropout_rng is None else "train", lora=lora_attached(params))
    model = family(config).Model(config, value_head=value_head, mode=mode, last=last, hidden=hidden)
    rngs = None if dropout_rng is None else {"dropout": dropout_rng}
    return model.apply({"params": params}, input_ids, attention_mask, None, positions, at, segment_ids, rngs=rngs)


def logits(
    config, params, input_ids, attention_mask, *, dropout_rng=None, last=0, at=None, positions=None, segment_ids=None
):
    """Next-token logits [B, T, V] in float32; with `last` > 0 only those of the last `last` positions
    [B, last, V] (the LM head, the largest product of a small model, runs on those only); `at` [B, A]: of those
    positions of each row. Dropout runs only when `dropout_rng` is given (a "train" call, else "score").
    positions and segment_ids [B, T]: several sequences packed in one row (each attends within its segment)."""
    return _forward(config, params, input_ids, attention_mask, False, dropout_rng, positions, segment_ids, last, at)


def values(config, params, input_ids, attention_mask, *, dropout_rng=None, positions=None, segment_ids=None):
    """Value-head outputs [B, T] in float32 (reward model and critic); `params` must hold `value_head`."""
    return _forward(config, params, input_ids, attention_mask, True, dropout_rng, positions, segment_ids)


# Tokens per chunk of the LM head's log-softmax in `logprobs` (RunConfig.logits_chunk and ModelSide.logits_chunk's
# default): a chunk's [chunk, V] float32 logits is what the head holds (622 MB at Qwen's V = 151,936).
LOGITS_CHUNK = 1024


def hidden(config, params, input_ids, attention_mask, *, dropout_rng=None, at=None, positions=None, segment_ids=None):
    """The decoder's final hidden states [B, T, E] in the compute dtype: what the LM head reads (`at` [B, A]: at those
    positions of each row, [B, A, E]); head_logprobs turns them into log-probs. Arguments as `logits`'."""
    return _forward(config, params, input_ids, attention_mask, False, dropout_rng, positions, segment_ids, 0, at, True)


def head_logprobs(config, params, h, targets, *, temperature: float = 1.0, chunk: int = LOGITS_CHUNK, entropy=False):
    """log p(targets) [B, T] float32 under softmax(logits / temperature), the logits being `config`'s LM head (tied:
    the embedding transposed; else "lm_head") on hidden states h [B, T, E] (`hidden`), computed `chunk` tokens at a
    time (0: all at once) so that no [B, T, V] float32 logits exist, in the forward or the backward; with `entropy`
    (log-probs, the entropy [B, T] of the same distribution). See common.head_logprobs."""
    tied = config.tie_word_embeddings
    body = params[family(config).Model.body_name]
    kernel = body["embed_tokens"]["embedding"] if tied else params["lm_head"]["kernel"]
    lp, ent = common.head_logprobs(h, kernel, targets, tied=tied, temperature=temperature, chunk=chunk, entropy=entropy)
    return (lp, ent) if entropy else lp


def logprobs(
    config,
    params,
    input_ids,
    attention_mask,
    targets,
    *,
    temperature: float = 1.0,
    chunk: int = LOGITS_CHUNK,
    entropy: bool = False,
    dropout_rng=None,
    at=None,
    positions=None,
    segment_ids=None,
):
    """log p(targets[b, t]) [B, T] float32 from the head at position t (`at` [B, A]: at position at[b, a], targets
    [B, A]) under softmax(logits / temperature), without the [B, T, V] logits (`hidden` then `head_logprobs`); with
    `entropy`, (log-probs, entropy). The next token's: targets = input_ids[:, 1:] of the positions before the last
    (next_token_logprobs). Other arguments as `logits`'."""
    kw = dict(dropout_rng=dropout_rng, at=at, positions=positions, segment_ids=segment_ids)
    h = hidden(config, params, input_ids, attention_mask, **kw)
    return head_logprobs(config, params, h, targets, temperature=temperature, chunk=chunk, entropy=entropy)


def next_token_logprobs(config, params, input_ids, attention_mask, *, chunk: int = LOGITS_CHUNK, dropout_rng=None):
    """log p(ids[:, t + 1] | ids[:, : t + 1]) for t = 0 .. T - 2, [B, T - 1] float32 (losses.token_logprobs of the
    logits), without the logits: the head runs on positions 0 .. T - 2, `chunk` tokens at a time (head_logprobs)."""
    h = hidden(config, params, input_ids, attention_mask, dropout_rng=dropout_rng)[:, :-1]
    return head_logprobs(config, params, h, input_ids[:, 1:], chunk=chunk)


init_cache = common.init_cache  # an empty KV cache [L, B, Hkv, S, K] for generation (see models/common.py)


def logits_with_cache(config, params, input_ids, positions, cache, mode: Mode, last: int = 0):
    """Logits [B, T, V] of T new tokens written into the cache at cache["slot"] (of the last `last` positions
    if > 0), and the updated cache: a "prefill" or "decode" call (`mode`, with the decode layout and the mesh)."""
    model = family(config).Model(config, mode=mode, last=last)
    out, cache = model.apply({"params": params}, input_ids, None, cache, positions)
    return out, {**cache, "slot": cache["slot"] + input_ids.shape[1]}


def decode_kernels(
    config, *, mesh=None, batch: int, slots: int, layout: bool = True, lora: bool = False
) -> DecodeKernels:
    """The kernels a decode step of `config` runs, chosen once when generation is set up (generation_modes): `batch`
    rows over a cache of `slots` slots, split over generation's `mesh` (None: unsharded), the parameters in the decode
    layout (`layout`) or not, LoRA adapters attached (`lora`) or not. Every reason a kernel the backend asks for is
    off is named here (DecodeKernels.off); with the backend's decode_attention "xla" none runs and none is named.

        attention   decode attention's settings: the kernel where backend.kernels takes the head dim and groups
        fused_step  the decode layout's attention in one kernel (kernels.decode_attention.fuses_step's shapes), not
                    with an interleaved rotary embedding (the kernel rotates rotate-half pairs)
        matmul      OPT's fc1 and fc2 in kernels.decode_matmul where it takes their shapes per shard
        swiglu      Llama's activation in kernels.swiglu, not with MLP biases (the kernel adds none)

    The layers' kernels need the decode layout (generate.decode_params, which fuses LoRA): in the training layout none
    of them runs, and a decode layout with adapters attached is an error."""
    backend, K = config.backend, config.head_dim
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    use = backend.kernels.use_kernel(K, H // Hkv)
    attention = dataclasses.replace(backend.kernels, implementation="pallas" if use else "xla")
    if layout and lora:
        raise ValueError("LoRA adapters attached to the decode layout: generate.decode_params fuses them")
    if backend.decode_attention == "xla":
        return DecodeKernels(attention)
    if not layout:
        why = "no fused step or products in the training layout: generate.decode_params builds the decode layout"
        return DecodeKernels(attention, off=(why + (", LoRA fused" if lora else ""),))
    off = []
    fused = fuses_step(backend.kernels, batch, Hkv, slots, K, H // Hkv, mesh)
    if isinstance(config, llama.LlamaConfig) and config.rope_interleaved:
        fused = False
        off.append(
            "fused attention step: off for an interleaved rotary embedding (the kernel rotates half-split pairs)"
        )
    elif not fused:
        off.append(
            f"fused attention step: not for {batch} rows, {Hkv} KV heads of {H // Hkv} queries, head dim {K}, "
            f"{slots} slots (kernels.decode_attention.fuses_step)"
        )
    matmul = ()
    if isinstance(config, opt.OPTConfig):
        D, F = config.hidden_size, config.ffn_dim
        products = {"fc1": (D, F, True), "fc2": (F, D, False)}
        matmul = tuple(
            n for n, (k, m, cols) in products.items() if common.decode_product_applies(mesh, batch, k, m, cols)
        )
        rows = f"{batch} rows" + ("" if mesh is None else f" over {dict(mesh.shape)}")
        off += [
            f"{n} by XLA: decode_matmul takes 16, 32 or 64 rows per shard and whole blocks, not {rows} of {k} x {m}"
            for n, (k, m, _) in products.items()
            if n not in matmul
        ]
    swiglu = isinstance(config, llama.LlamaConfig) and not config.mlp_bias
    if isinstance(config, llama.LlamaConfig) and config.mlp_bias:
        off.append("SwiGLU kernel: off with MLP biases (mlp_bias; the kernel adds none)")
    return DecodeKernels(attention, fused, matmul, swiglu, tuple(off))


def generation_modes(config, params, *, mesh=None, batch: int, slots: int) -> tuple[Mode, Mode]:
    """The Modes of a generation's prefill and decode steps with `params` (either layout; LoRA attached or not) over
    `batch` slots and a cache of `slots` slots on `mesh`: the layout and LoRA read from the tree once here, the decode
    steps' kernels chosen once (decode_kernels), each reason a kernel is off logged once."""
    layout, lora = in_decode_layout(params), lora_attached(params)
    kernels = decode_kernels(config, mesh=mesh, batch=batch, slots=slots, layout=layout, lora=lora)
    for why in kernels.off:
        common.tell_once(f"decode kernels: {why}")
    return Mode("prefill", layout, mesh, lora), Mode("decode", layout, mesh, lora, kernels)


def decode_layer(config, layer: dict) -> dict:
    """One layer's parameters in the decode layout (each family's products that share an input stacked)."""
    return family(config).decode_layer(config, layer)


def in_decode_layout(params) -> bool:
    """Whether `params` is in the decode layout (generate.decode_params: the layers a tuple of per-layer trees)."""
    return any(isinstance(v, dict) and isinstance(v.get("layers"), (tuple, list)) for v in (params, *params.values()))


def param_shapes(config, *, value_head: bool = False):
    """The parameter tree of `config` as ShapeDtypeStructs (float32), allocating nothing."""
    model = family(config).Model(config, value_head=value_head)
    ids = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), ids, jnp.ones_like(ids))["params"])


def init_params(config, key, *, value_head: bool = False, dtype=jnp.float32, std: float = 0.02):
    """Random parameters of `config`'s family: normal(0, std) weights, zero biases, unit norm scales."""
    return common.random_params(param_shapes(config, value_head=value_head), key, dtype=dtype, std=std)


def preset(name: str, **overrides):
    """A config of a released architecture by name (opt-125m ... opt-66b, llama-2-7b, qwen2.5-1.5b, qwen3-8b, ...),
    random weights' shapes."""
    for model_type, fam in FAMILIES.items():
        if name in fam.PRESETS:
            return CONFIGS[model_type](**{**fam.PRESETS[name], **overrides})
    names = sorted({n for fam in FAMILIES.values() for n in fam.PRESETS})
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(names)}")
