"""LoRA adapters (DeepSpeed-Chat's `--lora_dim`, `--lora_module_name`): a separate trainable subtree.

Every Linear kernel whose dotted module path contains `LoRAConfig.module_name` gets two low-rank
factors of rank r = `dim`, kept in a tree of their own that mirrors only the adapted modules. The
default filter is the model family's decoder layers, told apart by the root of the parameter tree
(FAMILY_LAYERS): OPT's "decoder.layers." (shown here), Llama's "model.layers." (q/k/v/o_proj and
mlp/gate/up/down_proj; never the embedding, the untied lm_head or the value head):

    params (untouched)                              lora (new, trainable)
    decoder/embed_tokens/embedding  [V, E]          never adapted (nor embed_positions)
    decoder/layers/
        self_attn/q_proj/kernel     [L, D, D]       self_attn/q_proj/lora_a  [L, D, r]
                         bias       [L, D]                           lora_b  [L, r, D]
        self_attn/{k,v,out}_proj    likewise        likewise
        fc1/kernel                  [L, D, F]       fc1/lora_a [L, D, r]   fc1/lora_b [L, r, F]
        fc2/kernel                  [L, F, D]       fc2/lora_a [L, F, r]   fc2/lora_b [L, r, D]
        LayerNorms, biases          as they are     -
    decoder/project_{in,out}/kernel [E, D], [D, E]  only if the filter matches ("decoder."): lora_a [E, r] ...

`fuse(params, lora, cfg)` returns the tree the model runs with, the same paths as `params`:

    kernel' = kernel + (lora_a @ lora_b) * (scaling / dim)     in float32, cast back to kernel's dtype

lora_a is DeepSpeed-Chat's `lora_right_weight` (Kaiming-uniform, a = sqrt(5)), lora_b its
`lora_left_weight` (zeros), so at initialisation the fused model is the base model exactly.

The adapters are never folded into the base weights while training: the training step fuses them
every step and differentiates through it, and the adapters keep their own gradients and optimizer
state. Folding in place and unfolding later would round `kernel + delta` to bf16 each time, and
subtracting `delta` again would not give the base weights back (the rounding error accumulates step
by step, and the reference model, which is the frozen base, would drift). The training steps and Step 3's scoring
fuse one layer at a time (`attach`: the adapters ride in the parameter tree and models.common.Dense fuses
its kernel as the layer runs), so a fused copy exists only for the layer in flight, and the backward pass
forms one layer's full gradient dW at a time before reducing it to d lora_a = dW @ (s lora_b)^T and
d lora_b = s lora_a^T @ dW. Generation, the EMA and export fuse the whole tree (`fuse`) once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxrlhf.config import check_fields
from jaxrlhf.models.common import fused_kernel
from jaxrlhf.sharding import path_str

# The default module filter per model family, keyed by the root module of its parameter tree (HF's names:
# OPTForCausalLM's model.decoder.layers; LlamaForCausalLM's, Qwen2's and Qwen3's model.layers): every Linear of the
# layers (q_norm / k_norm are norms, not adapted).
FAMILY_LAYERS = {"decoder": "decoder.layers.", "model": "model.layers."}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    #: LoRA rank (DeepSpeed-Chat's lora_dim); 0 turns LoRA off
    dim: int = 0
    #: adapt every Linear whose dotted module path (e.g. decoder.layers.self_attn.q_proj) contains this
    #: (null: every Linear of the decoder layers, for the model's family: OPT decoder.layers., Llama model.layers.)
    module_name: str | None = None
    #: the adapter output is multiplied by scaling / dim (DeepSpeed-Chat's lora_scaling)
    scaling: float = 1.0
    #: train only the adapters; all base weights (biases, LayerNorms, embeddings too) stay frozen
    only_optimize_lora: bool = False
    #: learning rate of the adapter weights (default: the base learning rate)
    learning_rate: float | None = None

    def __post_init__(self):
        check_fields(self)  # every float finite (an infinite learning rate passes the checks below)
        if self.dim < 0:
            raise ValueError(f"LoRAConfig.dim: expected >= 0 (0 = LoRA off), got {self.dim}")
        if self.module_name == "":
            raise ValueError("LoRAConfig.module_name: expected a non-empty module path fragment, e.g. decoder.layers.")
        if not self.scaling > 0:
            raise ValueError(f"LoRAConfig.scaling: expected > 0, got {self.scaling}")
        if self.only_optimize_lora and self.dim == 0:
            raise ValueError("LoRAConfig.only_optimize_lora: needs LoRA on (dim > 0)")
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ValueError(f"LoRAConfig.learning_rate: expected > 0 or None, got {self.learning_rate}")


def _kernels(params: Any) -> dict[str, Any]:
    """Linear kernels by module path ('decoder/layers/fc1'): leaves named 'kernel', [in, out] or [L, in, out]."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        module, _, name = path_str(path).rpartition("/")
        if name == "kernel" and len(x.shape) in (2, 3):
            out[module] = x
    return out


def module_filter(params: Any, cfg: LoRAConfig) -> str:
    """`cfg.module_name`, or when it is None the decoder layers of the family whose tree `params` is."""
    if cfg.module_name is not None:
        return cfg.module_name
    roots = [r for r in FAMILY_LAYERS if isinstance(params, Mapping) and r in params]
    if len(roots) != 1:
        top = sorted(params) if isinstance(params, Mapping) else type(params).__name__
        raise ValueError(
            f"LoRA: cannot tell the model family from the parameter tree (top-level modules {top}; "
            f"known: {', '.join(FAMILY_LAYERS)}); set lora.module_name"
        )
    return FAMILY_LAYERS[roots[0]]


def _targets(params: Any, cfg: LoRAConfig) -> dict[str, Any]:
    """The kernels `cfg.module_name` selects, matched like DeepSpeed-Chat against dotted module names."""
    kernels = _kernels(params)
    name = module_filter(params, cfg)
    out = {m: k for m, k in kernels.items() if name in m.replace("/", ".")}
    if not out:
        names = sorted(m.replace("/", ".") for m in kernels)
        raise ValueError(
            f"LoRA module_name {name!r} matches no Linear kernel; available modules: "
            f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}"
        )
    return out


def adapted_mask(params: Any, cfg: LoRAConfig) -> Any:
    """True at the kernels that carry adapters (False everywhere when LoRA is off).

    DeepSpeed-Chat freezes these kernels as soon as LoRA is on: their change is learnt by the adapters
    alone; `only_optimize_lora` additionally freezes everything else.
    """
    targets = set(_targets(params, cfg)) if cfg.dim else set()
    return jax.tree_util.tree_map_with_path(
        lambda p, _: path_str(p).rpartition("/")[0] in targets and path_str(p).endswith("/kernel"), params
    )


def init_lora(params: Any, cfg: LoRAConfig, key, *, dtype=None) -> dict | None:
    """Fresh adapters for the kernels of `params` (arrays or ShapeDtypeStructs) that `cfg` selects.

    lora_a [..., in, dim] ~ U(-1/sqrt(dim), 1/sqrt(dim)), independent per layer: what torch's
    `kaiming_uniform_(a=sqrt(5))` gives DeepSpeed-Chat's [in, dim] `lora_right_weight` (fan_in = dim).
    lora_b [..., dim, out] = 0. `dtype`: the kernel's unless given (float32 adapters on bf16 weights
    are the usual choice). None when LoRA is off (dim == 0).
    """
    if cfg.dim == 0:
        return None
    shapes = tuple(
        (m, tuple(k.shape), jnp.dtype(k.dtype if dtype is None else dtype))
        for m, k in sorted(_targets(params, cfg).items())
    )
    return _init(shapes, cfg.dim, key)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init(shapes: tuple, dim: int, key) -> dict:  # one compiled program for the whole tree
    lora: dict = {}
    bound = 1.0 / math.sqrt(dim)
    for (module, (*lead, n_in, n_out), dtype), k in zip(shapes, jax.random.split(key, len(shapes))):
        a = jax.random.uniform(k, (*lead, n_in, dim), jnp.float32, -bound, bound).astype(dtype)
        node = lora
        for part in module.split("/"):
            node = node.setdefault(part, {})
        node.update(lora_a=a, lora_b=jnp.zeros((*lead, dim, n_out), dtype))
    return lora


def fuse(params: Any, lora: Any, cfg: LoRAConfig) -> Any:
    """`params` with every adapted kernel replaced by kernel + (lora_a @ lora_b) * scaling / dim.

    A new tree; all other leaves are the same objects. Pure and jittable (the training step calls it
    every step and differentiates through it). With `lora` None or dim == 0, `params` itself comes back.
    """
    if lora is None or cfg.dim == 0:
        return params
    return fuse_attached(attach(params, lora, cfg))


def _fitting_adapters(params: Any, lora: Any, cfg: LoRAConfig) -> dict[str, dict[str, Any]]:
    """{module path: {"lora_a": a, "lora_b": b}} from a LoRA tree (nothing else in it), each checked against its
    kernel in `params` (it exists; the shapes fit `cfg.dim`), with lora_b in float32 times scaling / dim: what
    `fused_kernel` takes."""
    adapters: dict[str, dict[str, Any]] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(lora)[0]:
        module, _, name = path_str(path).rpartition("/")
        if name not in ("lora_a", "lora_b"):
            raise ValueError(f"{path_str(path)}: not a LoRA leaf; a LoRA tree holds only lora_a and lora_b")
        adapters.setdefault(module, {})[name] = x
    kernels = _kernels(params)
    unknown = sorted(set(adapters) - set(kernels))
    if unknown:
        raise ValueError(f"LoRA adapters {unknown} have no Linear kernel in params (modules: {sorted(kernels)})")
    for module, pair in adapters.items():
        if len(pair) != 2:
            raise ValueError(f"{module}: a LoRA adapter needs both lora_a and lora_b, got only {sorted(pair)}")
        *lead, n_in, n_out = kernels[module].shape
        a, b = pair["lora_a"].shape, pair["lora_b"].shape
        if a != (*lead, n_in, cfg.dim) or b != (*lead, cfg.dim, n_out):
            raise ValueError(
                f"LoRA adapter {module}: lora_a {a} and lora_b {b} do not fit its kernel "
                f"{kernels[module].shape} with dim {cfg.dim}"
            )
    scale = cfg.scaling / cfg.dim
    return {m: {"lora_a": p["lora_a"], "lora_b": p["lora_b"].astype(jnp.float32) * scale} for m, p in adapters.items()}


def attach(params: Any, lora: Any, cfg: LoRAConfig) -> Any:
    """`params` with each adapted module's adapters placed beside its kernel (lora_a, and lora_b times
    scaling / dim in float32): the tree the model runs with when the fusion should happen one layer at a time.

    The models' Linear (models.common.Dense) fuses its kernel as it runs, so only the layer in flight has a
    fused copy; `fuse` instead makes a whole second tree. Same arithmetic as `fuse` (fused_kernel). Pure and
    differentiable (the train steps and Step 3 scoring use it). With `lora` None or dim == 0, `params` itself.
    """
    if lora is None or cfg.dim == 0:
        return params
    out = jax.tree.map(lambda x: x, params)  # new dicts, same leaves
    for module, pair in _fitting_adapters(params, lora, cfg).items():
        node = out
        for part in module.split("/"):
            node = node[part]
        node.update(pair)
    return out


def fuse_attached(params: Any) -> Any:
    """A tree as `attach` makes it (or any tree) with each kernel that has adapters beside it fused
    (fused_kernel) and the adapters dropped: what `fuse` gives, from the attached form. Jittable; the decode
    layout (generate.decode_params) runs it one layer at a time."""
    if not isinstance(params, dict):
        return params
    if "lora_a" in params:
        out = {k: v for k, v in params.items() if k not in ("lora_a", "lora_b")}
        return {**out, "kernel": fused_kernel(params["kernel"], params["lora_a"], params["lora_b"])}
    return {k: fuse_attached(v) for k, v in params.items()}
