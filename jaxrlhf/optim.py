"""The training state and its optimizer: what Steps 1 and 2 (jaxrlhf.trainer) and Step 3 (jaxrlhf.rl) share.

    state = {"trainable": {"params": ..., "lora": ...},   what the optimizer updates (fp32 master weights)
             "frozen":    {"params": ...,                 the base weights under only_optimize_lora
                           "reference": ...},             a frozen copy of the starting weights (DPO's reference)
             "opt": optax state, "step": int32, "rng": uint32[2] key data}

    micro_gradients(loss_fn, ...) -> Accumulator      one micro-batch's gradients and loss sums
    acc + acc ... (jax.tree.map(jnp.add))             a step adds up its micro-batches (a scan, or one program each)
    apply_gradients(tx, lora, state, acc)             divides once by the summed count, clips, steps (a non-finite
                                                      step changes no weight)

Every leaf of the state lives in the FSDP layout (jaxrlhf.sharding). LoRA adapters are fused into the weights inside a
step (never in place); the optimizer only ever sees the trainable subtree.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.config import check_fields
from jaxrlhf.lora import LoRAConfig, adapted_mask, attach, fuse, init_lora
from jaxrlhf.sharding import batch_sharding, path_str, reshard, shardings_for


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    #: peak learning rate
    learning_rate: float = 9.65e-6
    #: AdamW weight decay (never applied to biases and LayerNorm weights)
    weight_decay: float = 0.0
    #: Adam betas (DeepSpeed-Chat's)
    betas: tuple[float, ...] = (0.9, 0.95)
    #: Adam epsilon
    eps: float = 1e-8
    #: learning-rate schedule after the warm-up
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    #: linear warm-up steps from 0 to the peak
    warmup_steps: int = 0
    #: clip the global gradient norm to this (0: no clipping)
    clip_grad_norm: float = 1.0
    #: micro-batches per optimizer step (the batch is split, gradients summed)
    gradient_accumulation_steps: int = 1

    def __post_init__(self):
        if len(self.betas) != 2:
            raise ValueError(f"betas: expected two numbers in [0, 1), got {self.betas}")
        check_fields(
            self,
            **dict.fromkeys(("learning_rate", "eps"), "> 0"),
            **dict.fromkeys(("weight_decay", "warmup_steps", "clip_grad_norm"), ">= 0"),
            betas="[0, 1)",
            gradient_accumulation_steps=">= 1",
        )


# -------------------------------------------------------------------------------------------- optimizer


def schedule(cfg: OptimConfig, peak: float, total_steps: int):
    decay_steps = max(total_steps - cfg.warmup_steps, 1)
    after = {
        "cosine": optax.cosine_decay_schedule(peak, decay_steps),
        "constant": optax.constant_schedule(peak),
        "linear": optax.linear_schedule(peak, 0.0, decay_steps),
    }[cfg.schedule]
    if cfg.warmup_steps == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, cfg.warmup_steps), after], [cfg.warmup_steps])


def decay_mask(tree):
    """True where weight decay applies: not on biases and LayerNorm weights (DeepSpeed-Chat's no_decay)."""
    return jax.tree_util.tree_map_with_path(lambda p, _: path_str(p).rsplit("/", 1)[-1] not in ("bias", "scale"), tree)


def labels(trainable, lora_cfg: LoRAConfig):
    """Optimizer label of every trainable leaf: "lora" (adapters), "frozen" (kernels that carry adapters:
    DeepSpeed-Chat trains them only through the adapters) or "base"."""
    frozen = lambda tree: jax.tree.map(lambda m: "frozen" if m else "base", adapted_mask(tree, lora_cfg))
    return {k: jax.tree.map(lambda _: "lora", t) if k == "lora" else frozen(t) for k, t in trainable.items()}


@functools.cache
def make_optimizer(cfg: OptimConfig, total_steps: int, lora_cfg: LoRAConfig = LoRAConfig()):
    """AdamW over the trainable tree {"params": ..., "lora": ...} with optax's partitioning: frozen leaves
    get a zero update and no optimizer state (`optax.masked` alone would leave them moving), the rest
    is clipped by global norm, and the adapters have their own learning rate. Built once per settings (cached): the
    same object for a state's creation and every program that steps it, so it can key a jitted step."""

    def adamw(peak):
        b1, b2 = cfg.betas
        return optax.adamw(
            schedule(cfg, peak, total_steps), b1, b2, cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
        )

    label_fn = lambda tree: labels(tree, lora_cfg)
    zero_frozen = optax.multi_transform(
        {"frozen": optax.set_to_zero(), "base": optax.identity(), "lora": optax.identity()}, label_fn
    )
    update = optax.multi_transform(
        {
            "base": adamw(cfg.learning_rate),
            "lora": adamw(lora_cfg.learning_rate or cfg.learning_rate),
            "frozen": optax.set_to_zero(),
        },
        label_fn,
    )
    clip = [optax.clip_by_global_norm(cfg.clip_grad_norm)] if cfg.clip_grad_norm > 0 else []
    return optax.chain(zero_frozen, *clip, update)


# ------------------------------------------------------------------------------------------------ state


def init_state(params, lora_cfg: LoRAConfig, tx, key, reference: bool = False) -> dict:
    """The training state from (host or device) parameters; see the module docstring for its layout. `reference`:
    keep the starting weights frozen (with_reference), as a copy unless only_optimize_lora freezes them anyway."""
    lora = init_lora(params, lora_cfg, jax.random.fold_in(key, 1), dtype=jnp.float32) if lora_cfg.dim else None
    if lora_cfg.only_optimize_lora:
        trainable, frozen = {"lora": lora}, {"params": params}
    else:
        trainable, frozen = {"params": params, **({"lora": lora} if lora is not None else {})}, {}
        frozen = {"reference": params} if reference else frozen
    return {
        "trainable": trainable,
        "frozen": frozen,
        "opt": tx.init(trainable),
        "step": jnp.zeros((), jnp.int32),
        "rng": jax.random.key_data(key),
    }


def create_state(
    params, lora_cfg: LoRAConfig, tx, key, mesh, opt_memory: str = "device", reference: bool = False
) -> dict:
    """The training state built directly in the FSDP layout: no device ever holds the whole model. The
    optimizer state is made in `opt_memory` ("pinned_host": offloaded, never on the device)."""
    params = reshard(params, "fsdp", mesh)
    init = lambda p, k: init_state(p, lora_cfg, tx, k, reference)
    shardings = state_shardings(jax.eval_shape(init, params, key), mesh)
    shardings["opt"] = jax.tree.map(lambda s: s.with_memory_kind(opt_memory), shardings["opt"])
    return jax.jit(init, out_shardings=shardings)(params, key)


def state_shardings(state, mesh):
    fsdp = {k: shardings_for(state[k], "fsdp", mesh) for k in ("trainable", "frozen", "opt")}
    return fsdp | dict.fromkeys(("step", "rng"), NamedSharding(mesh, P()))


def effective_params(state, lora_cfg: LoRAConfig, fused: bool = True):
    """The weights the model runs with: the base (trainable or frozen) with LoRA fused in, as a whole second
    tree (`fused`: generation, EMA, export) or one layer at a time as the model runs (lora.attach: the
    training steps and scoring, where a whole fused copy would double the adapted weights' memory)."""
    merged = {**state["frozen"], **state["trainable"]}
    return (fuse if fused else attach)(merged["params"], merged.get("lora"), lora_cfg)


_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm

LossFn = Callable[[Any, dict, Any], tuple[jax.Array, jax.Array, dict]]  # (params, batch, rng) -> (total, count, sums)


class Accumulator(NamedTuple):
    """What a step adds up over its micro-batches (jax.tree.map(jnp.add, ...)) and apply_gradients divides once."""

    grads: Any  # like state["trainable"]: the loss totals' gradients, summed
    total: jax.Array  # (): the loss totals, summed
    count: jax.Array  # (): what the total is divided by (tokens, answers or pairs), summed
    metrics: dict  # {name: ()}: the loss function's metric sums (steps.ActorLoss may add one [B, G] array)


def micro_gradients(loss_fn: LossFn, lora_cfg: LoRAConfig, state, mb, key) -> Accumulator:
    """One micro-batch's gradients and loss sums: what a step adds up over its micro-batches."""

    def compute(trainable):
        total, count, metrics = loss_fn(
            effective_params({**state, "trainable": trainable}, lora_cfg, fused=False), mb, key
        )
        return total, (count, metrics)

    (total, (count, metrics)), grads = jax.value_and_grad(compute, has_aux=True)(state["trainable"])
    return Accumulator(grads, total, count, metrics)


def zero_gradients(loss_fn: LossFn, lora_cfg: LoRAConfig, state, mb, key) -> Accumulator:
    """micro_gradients' zeros (the accumulator a step starts from), for micro-batches shaped like `mb`."""
    shapes = jax.eval_shape(functools.partial(micro_gradients, loss_fn, lora_cfg), state, mb, key)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def apply_gradients(tx, lora_cfg: LoRAConfig, state, acc: Accumulator):
    """The step from the summed micro-batches `acc`: the gradients divided once by the summed count, then the
    optimizer -> (state, metrics: acc.metrics plus "count", "grad_norm" and "skipped").

    Non-finite guard: a step whose loss or gradient norm is not finite (a too-high learning rate, a bad batch) is
    skipped inside the compiled step: the trainable weights and the optimizer state (its count, so the learning-rate
    schedule, included) stay as they were, and "skipped" is 1.0 (else 0.0). The step counter and the dropout key
    still advance, so the batch counts as consumed and a resumed run lines up with the data. The caller decides
    when too many skips in a row end the run (jaxrlhf.loop); deciding here costs no host sync.
    """
    count = acc.count
    grads = jax.tree.map(lambda g: g / jnp.maximum(count, 1).astype(g.dtype), acc.grads)
    trained = [g for g, lab in zip(jax.tree.leaves(grads), jax.tree.leaves(labels(grads, lora_cfg))) if lab != "frozen"]
    grad_norm = _global_norm(trained)
    finite = jnp.isfinite(acc.total) & jnp.isfinite(grad_norm)
    updates, opt = tx.update(grads, state["opt"], state["trainable"])
    # The state keeps its dtypes (optax can promote bf16 moments to float32 through a float32 scalar):
    # otherwise pure bf16 would silently hold float32 moments and the step would compile twice.
    opt = jax.tree.map(lambda new, old: new.astype(old.dtype), opt, state["opt"])
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # an elementwise select, fused
    key = jax.random.split(jax.random.wrap_key_data(state["rng"]))[0]
    new = {
        **state,
        "trainable": keep(optax.apply_updates(state["trainable"], updates), state["trainable"]),
        "opt": keep(opt, state["opt"]),
        "step": state["step"] + 1,
        "rng": jax.random.key_data(key),
    }
    skipped = jnp.where(finite, 0.0, 1.0).astype(jnp.float32)
    return new, {**acc.metrics, "count": count, "grad_norm": grad_norm, "skipped": skipped}


def step_keys(state):
    """The dropout key of this step's micro-batches (fold_in its index): the split apply_gradients does not keep."""
    return jax.random.split(jax.random.wrap_key_data(state["rng"]))[1]


# ------------------------------------------------------------------------------------------- batches


def place(batch: dict[str, np.ndarray], mesh, layout: str) -> dict:
    """Put a host batch on the mesh, its leading axis split like `layout` wants (this process's rows)."""
    sharding = batch_sharding(mesh, layout)
    ways = np.prod([mesh.shape[a] for a in np.atleast_1d(sharding.spec[0])])
    out = {}
    for key, value in batch.items():
        global_rows = value.shape[0] * jax.process_count()
        if global_rows % ways:
            raise ValueError(f"batch of {global_rows} rows does not split over the {ways} devices of layout {layout!r}")
        out[key] = jax.make_array_from_process_local_data(sharding, value)
    return out


def check_microbatches(batch_size: int, accumulation: int, n_devices: int, field: str = "gradient_accumulation_steps"):
    """Refuse a batch that does not split into `accumulation` micro-batches that each split over the devices."""
    if batch_size % accumulation:
        raise ValueError(f"batch_size {batch_size} is not divisible by {field} {accumulation}")
    if (batch_size // accumulation) % n_devices:
        raise ValueError(
            f"micro-batch of {batch_size // accumulation} sequences (batch_size / {field}) does not "
            f"split over {n_devices} devices; use a multiple of {n_devices}"
        )


def precision_warning(precision: str, optim: OptimConfig, lora: LoRAConfig, who: str = "") -> str | None:
    """The warning for a run whose trained weights are bf16 at a learning rate that bf16 mostly rounds away.

    bf16 keeps 8 significant bits: next to a weight of 0.02 the spacing is 1.2e-4, so an Adam step of ~lr
    below half of it is lost. One AdamW step on N(0, 0.02) weights keeps ~19 % of the update at lr 1e-5
    (DeepSpeed-Chat's actor rate) and ~65 % at 5e-5, against all of it with fp32 master weights
    (tests/test_trainer.py). LoRA adapters are float32 under every precision, so `only_optimize_lora` is safe.
    """
    if precision != "pure_bf16" or lora.only_optimize_lora or optim.learning_rate >= 1e-4:
        return None
    return (
        f"warning: {who}precision=pure_bf16 at learning_rate {optim.learning_rate:g}: the weights are bf16, which "
        "rounds away most Adam steps this small (at 1e-5 about 19 % of the update survives), so the model barely "
        "learns; use precision=bf16 (fp32 master weights, the default) or LoRA with only_optimize_lora"
    )
