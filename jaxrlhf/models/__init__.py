"""The model families and one functional API over them, chosen by the config's type.

    family      config        module                 HF config.json model_type
    OPT         OPTConfig     jaxrlhf.models.opt     "opt"
    Llama       LlamaConfig   jaxrlhf.models.llama   "llama"

A family module (models/common.py says what it holds) is found from the config's type by the functions below, so the
engine, the trainers and generation run every family through the same code. Each call's kind is explicit: `logits` and
`values` are "train" (given a dropout key) or "score" calls; `logits_with_cache` a "prefill" or "decode" call
(`Mode`). How the machine runs them is the config's `backend` (`Backend.detect()` at start-up; default plain XLA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf.models import common, llama, opt
from jaxrlhf.models.common import Backend, Mode, positions_from_mask  # noqa: F401  (the API's types)
from jaxrlhf.models.llama import LlamaConfig
from jaxrlhf.models.opt import OPTConfig

FAMILIES = {"opt": opt, "llama": llama}  # config.json model_type -> module
CONFIGS = {"opt": OPTConfig, "llama": LlamaConfig}
# Every parameter path's logical axes (sharding.py): each family's table, then what they share.
PARAM_AXES = [row for fam in FAMILIES.values() for row in fam.PARAM_AXES] + common.PARAM_AXES


def family(config):
    """The module (opt or llama) that implements `config`."""
    try:
        return FAMILIES[config.model_type]
    except (AttributeError, KeyError):
        raise TypeError(
            f"not a model config of a known family ({', '.join(FAMILIES)}): {type(config).__name__}"
        ) from None


def _forward(
    config, params, input_ids, attention_mask, value_head, dropout_rng, positions, segment_ids, last=0, at=None
):
    """A "train" call (with `dropout_rng`: dropout on) or a "score" call of `config`'s family."""
    mode = Mode("score" if dropout_rng is None else "train")
    model = family(config).Model(config, value_head=value_head, mode=mode, last=last)
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


init_cache = common.init_cache  # an empty KV cache [L, B, Hkv, S, K] for generation (see models/common.py)


def logits_with_cache(config, params, input_ids, positions, cache, mode: Mode, last: int = 0):
    """Logits [B, T, V] of T new tokens written into the cache at cache["slot"] (of the last `last` positions
    if > 0), and the updated cache: a "prefill" or "decode" call (`mode`, with the decode layout and the mesh)."""
    model = family(config).Model(config, mode=mode, last=last)
    out, cache = model.apply({"params": params}, input_ids, None, cache, positions)
    return out, {**cache, "slot": cache["slot"] + input_ids.shape[1]}


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
    """A config of a released architecture by name (opt-125m ... opt-66b, llama-2-7b, ...), random weights' shapes."""
    for model_type, fam in FAMILIES.items():
        if name in fam.PRESETS:
            return CONFIGS[model_type](**{**fam.PRESETS[name], **overrides})
    names = sorted(n for fam in FAMILIES.values() for n in fam.PRESETS)
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(names)}")
