"""The model families and one functional API over them, chosen by the config's type.

    family      config        module                 HF config.json model_type
    OPT         OPTConfig     jaxrlhf.models.opt     "opt"
    Llama       LlamaConfig   jaxrlhf.models.llama   "llama"

`logits(config, params, ...)` and the other functions below call the family of `config`, so the engine,
the trainers and generation run every family through the same code.
"""

from __future__ import annotations

from jaxrlhf.models import llama, opt
from jaxrlhf.models.common import positions_from_mask  # noqa: F401  (shared by every family)
from jaxrlhf.models.llama import LlamaConfig
from jaxrlhf.models.opt import OPTConfig

FAMILIES = {"opt": opt, "llama": llama}  # config.json model_type -> module
CONFIGS = {"opt": OPTConfig, "llama": LlamaConfig}


def family(config):
    """The module (opt or llama) that implements `config`."""
    try:
        return FAMILIES[config.model_type]
    except (AttributeError, KeyError):
        raise TypeError(f"not a model config of a known family ({', '.join(FAMILIES)}): {type(config).__name__}") from None


def logits(config, params, input_ids, attention_mask, *, dropout_rng=None, last: int = 0, at=None):
    """Next-token logits [B, T, V] in float32; with `last` > 0 only those of the last `last` positions
    [B, last, V] (the LM head, the largest product of a small model, runs on those only). Dropout runs only
    when `dropout_rng` is given."""
    return family(config).logits(config, params, input_ids, attention_mask, dropout_rng=dropout_rng, last=last, at=at)


def values(config, params, input_ids, attention_mask, *, dropout_rng=None):
    """Value-head outputs [B, T] in float32 (reward model and critic); `params` must hold `value_head`."""
    return family(config).values(config, params, input_ids, attention_mask, dropout_rng=dropout_rng)


def init_cache(config, valid, dtype=None, multiple: int = 64) -> dict:
    """An empty KV cache [L, B, Hkv, S, K] for generation (see models/common.py)."""
    return family(config).init_cache(config, valid, dtype, multiple)


def logits_with_cache(config, params, input_ids, positions, cache, last: int = 0):
    """Logits [B, T, V] of T new tokens written into the cache at cache["slot"] (of the last `last` positions
    if > 0), and the updated cache."""
    return family(config).logits_with_cache(config, params, input_ids, positions, cache, last)


def decode_layer(config, layer: dict) -> dict:
    """One layer's parameters in the decode layout (each family's products that share an input stacked)."""
    return family(config).decode_layer(config, layer)


def init_params(config, key, **kwargs):
    """Random parameters of `config`'s family (value_head=, dtype=, std=)."""
    return family(config).init_params(config, key, **kwargs)


def param_shapes(config, *, value_head: bool = False):
    """The parameter tree of `config` as ShapeDtypeStructs, allocating nothing."""
    return family(config).param_shapes(config, value_head=value_head)


def preset(name: str, **overrides):
    """A config of a released architecture by name (opt-125m ... opt-66b, llama-2-7b, ...), random weights' shapes."""
    for fam in FAMILIES.values():
        if name in fam.PRESETS:
            return CONFIGS[fam.__name__.rpartition(".")[2]](**{**fam.PRESETS[name], **overrides})
    names = sorted(n for fam in FAMILIES.values() for n in fam.PRESETS)
    raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(names)}")
