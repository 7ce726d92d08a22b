"""Steps 1 and 2: the training state, the optimizer, one pure jitted step, and `train` from a folder to an HF export
(the loop itself, shared with Step 3, is jaxrlhf.loop).

    state = {"trainable": {"params": ..., "lora": ...},   what the optimizer updates (fp32 master weights)
             "frozen":    {"params": ...,                 the base weights under only_optimize_lora
                           "reference": ...},             a frozen copy of the starting weights (DPO's reference)
             "opt": optax state, "step": int32, "rng": uint32[2] key data}

    train_step(state, batch) -> (state, metrics)
        batch leaves are [accumulation, B / accumulation, ...]; a scan over the micro-batches sums each
        loss's (total, count) and gradients, then divides once, so 1 or k micro-batches and 1 or 8 devices
        give the same update. LoRA adapters are fused into the weights inside the step (never in place). A step
        whose loss or gradient norm is not finite changes no weight (metrics["skipped"] = 1.0).

Every leaf of the state lives in the FSDP layout (jaxrlhf.sharding); the batch is split over all
devices. The step is jitted once with explicit shardings and the state donated.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf import loop
from jaxrlhf.checkpoint import VALUE_HEAD_FILE, load_hf, save_hf
from jaxrlhf.config import ConfigError, check_fields
from jaxrlhf.data import Batches, DataConfig, prepare
from jaxrlhf.data.batches import make_batch, num_rows
from jaxrlhf.data.pipeline import check_rows
from jaxrlhf.distributed import to_host
from jaxrlhf.loop import settings, start_run
from jaxrlhf.lora import LoRAConfig, adapted_mask, attach, fuse, init_lora
from jaxrlhf.metrics import MetricsLog, check_trackers
from jaxrlhf.models import LOGITS_CHUNK, Backend, init_params, preset
from jaxrlhf.sharding import FSDP_AXES, batch_sharding, make_mesh, path_str, reshard, shardings_for
from jaxrlhf.tokenizer import load_tokenizer


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


@dataclasses.dataclass(frozen=True)
class RunConfig:
    #: a Hugging Face OPT folder, or random:NAME (random weights of a released OPT shape, e.g. random:opt-125m)
    model: str = ""
    #: tokenizer folder (default: the model folder)
    tokenizer: str | None = None
    #: where the HF model (model/), Orbax state (state/), metrics.jsonl and TensorBoard events (tb/) go
    output_dir: str = "runs/step"
    #: sequences per optimizer step, over all devices
    batch_size: int = 16
    #: passes over the training set
    epochs: int = 1
    #: stop after this many optimizer steps (0: run the epochs)
    max_steps: int = 0
    #: evaluate every this many steps (0: only at the end)
    eval_every: int = 0
    #: batches per evaluation (0: the whole eval set)
    eval_batches: int = 0
    #: save the training state every this many steps (0: only at the end)
    save_every: int = 0
    #: also save it when this many minutes have passed since the last save (0: never by the clock); SIGINT/SIGTERM
    #: save it too, after the step under way
    save_minutes: float = 30.0
    #: training states kept on disk (the newest)
    keep_checkpoints: int = 2
    #: continue the run saved in output_dir (its newest state), or skip it if it is finished; false: start from
    #: scratch, refused where output_dir already holds a run
    resume: bool = True
    #: bf16: bf16 compute with fp32 master weights and optimizer; fp32; pure_bf16: bf16 everywhere
    precision: Literal["bf16", "fp32", "pure_bf16"] = "bf16"
    #: recompute each layer in the backward pass (DeepSpeed-Chat's --gradient_checkpointing)
    remat: bool = False
    #: the LM loss and log-probs run the LM head's log-softmax on this many tokens at a time (over the whole
    #: micro-batch), never holding [B, T, V] float32 logits; 0: in one piece (models.head_logprobs)
    logits_chunk: int = LOGITS_CHUNK
    #: dropout probability (null: the checkpoint's own; 0 disables it, DeepSpeed-Chat's --disable_dropout)
    dropout: float | None = None
    #: tensor-parallel size of the mesh's "model" axis (training is FSDP over all devices either way)
    tp: int = 1
    #: seed of the weights of random models, LoRA init and dropout
    seed: int = 1234
    #: print and write metrics every this many steps
    log_every: int = 10
    #: where metrics go besides metrics.jsonl: tensorboard, wandb, mlflow (see jaxrlhf/metrics.py)
    report_to: tuple[str, ...] = ("tensorboard",)
    #: stop the run after this many steps in a row skipped for a non-finite loss or gradient norm
    max_skipped_steps: int = 10
    optim: OptimConfig = OptimConfig()
    lora: LoRAConfig = LoRAConfig()
    data: DataConfig = DataConfig()

    def __post_init__(self):
        check_fields(
            self,
            **dict.fromkeys(
                ("batch_size", "epochs", "keep_checkpoints", "tp", "log_every", "max_skipped_steps"), ">= 1"
            ),
            **dict.fromkeys(("max_steps", "eval_every", "eval_batches", "save_every", "logits_chunk"), ">= 0"),
            dropout="[0, 1)",
            save_minutes=">= 0",
        )
        check_trackers(self.report_to)


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


def make_optimizer(cfg: OptimConfig, total_steps: int, lora_cfg: LoRAConfig = LoRAConfig()):
    """AdamW over the trainable tree {"params": ..., "lora": ...} with optax's partitioning: frozen leaves
    get a zero update and no optimizer state (`optax.masked` alone would leave them moving), the rest
    is clipped by global norm, and the adapters have their own learning rate."""

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


def micro_gradients(loss_fn: LossFn, lora_cfg: LoRAConfig, state, mb, key):
    """(gradients, total, count, sums) of one micro-batch: what a step adds up over its micro-batches."""

    def compute(trainable):
        total, count, sums = loss_fn(
            effective_params({**state, "trainable": trainable}, lora_cfg, fused=False), mb, key
        )
        return total, (count, sums)

    (total, (count, sums)), grads = jax.value_and_grad(compute, has_aux=True)(state["trainable"])
    return grads, total, count, sums


def zero_gradients(loss_fn: LossFn, lora_cfg: LoRAConfig, state, mb, key):
    """micro_gradients' zeros (the accumulator a step starts from), for micro-batches shaped like `mb`."""
    shapes = jax.eval_shape(partial(micro_gradients, loss_fn, lora_cfg), state, mb, key)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def apply_gradients(tx, lora_cfg: LoRAConfig, state, acc):
    """The step from summed micro-batch gradients `acc` = (grads, total, count, sums): the gradients divided once by
    the summed count, then the optimizer -> (state, metrics: sums plus "count", "grad_norm" and "skipped").

    Non-finite guard: a step whose loss or gradient norm is not finite (a too-high learning rate, a bad batch) is
    skipped inside the compiled step: the trainable weights and the optimizer state (its count, so the learning-rate
    schedule, included) stay as they were, and "skipped" is 1.0 (else 0.0). The step counter and the dropout key
    still advance, so the batch counts as consumed and a resumed run lines up with the data. The caller decides
    when too many skips in a row end the run (jaxrlhf.loop); deciding here costs no host sync.
    """
    grads, total, count, sums = acc
    grads = jax.tree.map(lambda g: g / jnp.maximum(count, 1).astype(g.dtype), grads)
    trained = [g for g, lab in zip(jax.tree.leaves(grads), jax.tree.leaves(labels(grads, lora_cfg))) if lab != "frozen"]
    grad_norm = _global_norm(trained)
    finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
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
    return new, {**sums, "count": count, "grad_norm": grad_norm, "skipped": skipped}


def step_keys(state):
    """The dropout key of this step's micro-batches (fold_in its index): the split apply_gradients does not keep."""
    return jax.random.split(jax.random.wrap_key_data(state["rng"]))[1]


def with_reference(reference_fn, state, batch):
    """`reference_fn(reference, batch)`: the batch plus what the frozen starting weights (init_state(reference=True):
    the copy, or under only_optimize_lora the frozen base, which is the starting model with the adapters off) compute
    for it (DPO's reference log-probs), outside the gradient; the batch itself without a reference_fn."""
    if reference_fn is None:
        return batch
    return reference_fn(state["frozen"].get("reference", state["frozen"].get("params")), batch)


def make_train_step(loss_fn: LossFn, tx, lora_cfg: LoRAConfig, reference_fn=None):
    """The pure `train_step(state, batch) -> (state, metrics)` over batch leaves [micro-batches, rows, ...]: a scan
    adds up the micro-batches' gradients and loss sums (micro_gradients), apply_gradients divides once and steps.
    A `reference_fn` runs on each micro-batch first (with_reference)."""

    def train_step(state, batch):
        micro = jax.tree.leaves(batch)[0].shape[0]
        keys = jax.vmap(lambda i: jax.random.fold_in(step_keys(state), i))(jnp.arange(micro))

        def body(acc, xs):
            mb, k = xs
            mb = with_reference(reference_fn, state, mb)
            return jax.tree.map(jnp.add, acc, micro_gradients(loss_fn, lora_cfg, state, mb, k)), None

        first = with_reference(reference_fn, state, jax.tree.map(lambda x: x[0], batch))  # only its shapes are used
        init = zero_gradients(loss_fn, lora_cfg, state, first, keys[0])
        acc, _ = jax.lax.scan(body, init, (batch, keys))
        return apply_gradients(tx, lora_cfg, state, acc)

    return train_step


# ------------------------------------------------------------------------------------------- Steps 1 and 2


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


def load_model(run: RunConfig, *, value_head: bool, fresh_head: bool = False):
    """(OPTConfig set up for this run, host params in the master dtype, tokenizer) from run.model.

    `value_head`: the model needs one (a reward model or critic). A folder without it gets a fresh one only under
    `fresh_head` (Step 2 starting from an SFT model); elsewhere (Step 3's critic, scoring) a random head would
    silently train against or report a random reward, so that is an error naming the folder.
    """
    if not run.model:
        raise ValueError("model: required, a Hugging Face OPT folder (or random:opt-125m for random weights)")
    if run.model.startswith("random:") and run.tokenizer is None:
        raise ValueError("tokenizer: required with a random model (e.g. a folder with OPT's vocab.json + merges.txt)")
    dtype = jnp.bfloat16 if run.precision == "pure_bf16" else jnp.float32
    compute = "float32" if run.precision == "fp32" else "bfloat16"
    key = jax.random.key(run.seed)
    if run.model.startswith("random:"):
        config = preset(run.model.removeprefix("random:"))  # any family's (opt-125m, llama-2-7b, ...)
        params = jax.device_get(init_params(config, key, value_head=value_head, dtype=dtype))
    else:
        config, params = load_hf(run.model, dtype=dtype)
    if value_head and "value_head" not in params:
        if not fresh_head:
            raise ConfigError(
                f"{run.model}: no {VALUE_HEAD_FILE}, so no trained value head; a reward model or critic "
                "must be a Step 2 output (python -m jaxrlhf.reward writes output_dir/model with it)"
            )
        head = 0.02 * jax.random.normal(jax.random.fold_in(key, 7), (config.word_embed_proj_dim, 1))
        params = {**params, "value_head": {"kernel": np.asarray(head, dtype)}}
    if not value_head:
        params = {k: v for k, v in params.items() if k != "value_head"}
    overrides = {"dtype": compute, "remat": run.remat, "backend": Backend.detect()}
    if run.dropout is not None:
        overrides.update(dropout=run.dropout, attention_dropout=run.dropout)
    config = dataclasses.replace(config, **overrides)
    tokenizer = load_tokenizer(run.tokenizer or run.model)
    return config, params, tokenizer


def train(
    run: RunConfig,
    step: int,
    make_loss,
    summarise,
    *,
    value_head: bool = False,
    log=print,
    mesh=None,
    make_on_eval=None,
    reference=None,
) -> dict:
    """Step 1 or 2 (or DPO) from start to HF export: checks, model, data, state, the loop (jaxrlhf.loop.fit), then
    output_dir/model. Returns the final state, the logged records, the model config and the model folder.

    `make_loss(config)` gives the loss function; `summarise(sums)` turns metric sums into the figures to log (e.g. loss
    per token, accuracy per pair); `make_on_eval(config, tokenizer, data, state)` may give an extra evaluation (e.g.
    sample answers); `reference(config, params, batch)`, the config bound, is make_train_step's reference_fn, and the
    state then keeps the starting weights frozen. `mesh` defaults to all devices with a "model" axis of run.tp. The
    eval split is evaluated in order in batches of run.batch_size (the last partial one dropped; run.eval_batches of
    them if set). Steps the non-finite guard skips are logged at the next log step (no extra host sync) and left out of
    the logged loss.
    """
    mesh = mesh or make_mesh(run.tp)
    accum = run.optim.gradient_accumulation_steps
    check_microbatches(run.batch_size, accum, mesh.size)
    out = Path(run.output_dir)
    manager = loop.checkpoint_manager(out, run.keep_checkpoints)
    if start_run(run, [out / "model"], manager.latest_step(), log=log):
        manager.close()
        return {"state": None, "records": [], "config": None, "model_dir": out / "model", "skipped": True}
    log(
        f"mesh {dict(mesh.shape)}: {mesh.size} devices, {jax.process_count()} process(es), this is process "
        f"{jax.process_index()}"
    )
    if warning := precision_warning(run.precision, run.optim, run.lora):
        log(warning)
    config, params, tokenizer = load_model(run, value_head=value_head, fresh_head=True)
    data = prepare(run.data, step, tokenizer, log=log)
    check_rows(data, step, run.data, config.max_position_embeddings)  # before anything compiles
    proc = dict(process_index=jax.process_index(), process_count=jax.process_count())
    batches = Batches(data["train"], step, run.batch_size, run.data, tokenizer.pad_token_id, **proc)
    total = run.max_steps or run.epochs * len(batches)
    if total <= 0:
        raise ValueError("nothing to train: 0 steps (check epochs, max_steps and the size of the training set)")
    tx = make_optimizer(run.optim, total, run.lora)
    state = create_state(params, run.lora, tx, jax.random.key(run.seed), mesh, reference=reference is not None)
    on_eval = make_on_eval(config, tokenizer, data, state) if make_on_eval else None
    loss_fn, reference_fn = make_loss(config), partial(reference, config) if reference else None
    shardings = state_shardings(state, mesh)
    step_fn = jax.jit(
        make_train_step(loss_fn, tx, run.lora, reference_fn), out_shardings=(shardings, None), donate_argnums=0
    )

    @jax.jit
    def eval_fn(state, batch):
        batch = with_reference(reference_fn, state, batch)
        _, count, sums = loss_fn(effective_params(state, run.lora, fused=False), batch, None)
        return {**sums, "count": count}

    put = lambda spec, host: {
        k: jax.make_array_from_process_local_data(NamedSharding(mesh, spec), v) for k, v in host.items()
    }
    lr_fn = schedule(run.optim, run.optim.learning_rate, total)
    since = {"tokens": 0, "clock": time.perf_counter()}  # of the log window
    host_batches = iter(batches)

    def train_step(state, i):
        host = next(host_batches)
        where = f"step {i} (epoch {batches.epoch}, batch {batches.position - 1})"
        since["tokens"] += int(sum(v.sum() for k, v in host.items() if k.endswith("mask") and "loss" not in k))
        # leaves [B, ...] -> [accumulation, B / accumulation, ...], the rows split over all devices
        micro = {k: v.reshape(accum, v.shape[0] // accum, *v.shape[1:]) for k, v in host.items()}
        state, metrics = step_fn(state, put(P(None, FSDP_AXES), micro))
        return state, (i, metrics), [("model", metrics["skipped"], where)]

    def log_figures(window):
        i, window = window[-1][0], jax.device_get([m for _, m in window])
        kept = [m for m in window if not m["skipped"]]
        sums = jax.tree.map(lambda *xs: np.sum(xs), *(kept or window))  # all skipped: the figures show the NaN
        figures = {
            **summarise(sums),
            "grad_norm": float(sums["grad_norm"]) / len(kept or window),
            "skipped": len(window) - len(kept),
            "lr": float(lr_fn(i - 1)),
            "tokens_per_s": since["tokens"] * jax.process_count() / (time.perf_counter() - since["clock"]),
        }
        since.update(tokens=0, clock=time.perf_counter())
        return figures

    def evaluate(state):
        sums, n, B = None, num_rows(data["eval"]) // run.batch_size, run.batch_size
        for i in range(min(n, run.eval_batches) if run.eval_batches else n):
            batch = make_batch(data["eval"], range(i * B, (i + 1) * B), step, run.data, batches.pad_id)
            m = jax.device_get(eval_fn(state, put(P(FSDP_AXES), batch)))
            sums = m if sums is None else jax.tree.map(np.add, sums, m)
        if sums is None:
            return None
        return {**summarise(sums), **(on_eval(state) if on_eval is not None else {})}

    state, records = loop.fit(
        run,
        state,
        train_step,
        log_figures,
        batches,
        total=total,
        evaluate=evaluate,
        log=log,
        manager=manager,
        shardings=shardings,
        metrics_log=MetricsLog(out, run.report_to, settings(run)),
        shown=("loss", "accuracy", "lr", "tokens_per_s"),
    )
    final = to_host(effective_params(state, run.lora))
    if jax.process_index() == 0:
        save_hf(out / "model", config, final, tokenizer, manifest={"settings": settings(run)})
    log(f"Step {step} done: Hugging Face model in {out / 'model'}")
    return {"state": state, "records": records, "config": config, "model_dir": out / "model"}
