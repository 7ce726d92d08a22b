"""Steps 1 and 2 (and DPO): one pure jitted step, and `train` from a folder to an HF export. The training state and
the optimizer are jaxrlhf.optim's (shared with Step 3); the loop itself is jaxrlhf.loop's.

    train_step(state, batch) -> (state, metrics)
        batch leaves are [accumulation, B / accumulation, ...]; a scan over the micro-batches sums each
        loss's (total, count) and gradients (optim.Accumulator), then divides once, so 1 or k micro-batches and
        1 or 8 devices give the same update. A step whose loss or gradient norm is not finite changes no weight
        (metrics["skipped"] = 1.0).

The batch is split over all devices. The step is jitted once with explicit shardings and the state donated.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
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
from jaxrlhf.lora import LoRAConfig
from jaxrlhf.metrics import MetricsLog
from jaxrlhf.models import LOGITS_CHUNK, Backend, init_params, preset
from jaxrlhf.optim import (
    LossFn,
    OptimConfig,
    apply_gradients,
    check_microbatches,
    create_state,
    effective_params,
    make_optimizer,
    micro_gradients,
    precision_warning,
    schedule,
    state_shardings,
    step_keys,
    zero_gradients,
)
from jaxrlhf.sharding import FSDP_AXES, make_mesh
from jaxrlhf.tokenizer import load_tokenizer


@dataclasses.dataclass(frozen=True)
class RunConfig(loop.LoopConfig):
    """Steps 1 and 2's settings: the run's (loop.LoopConfig: output_dir, epochs, logging, saving, ...) and these."""

    #: a Hugging Face OPT folder, or random:NAME (random weights of a released OPT shape, e.g. random:opt-125m)
    model: str = ""
    #: sequences per optimizer step, over all devices
    batch_size: int = 16
    #: evaluate every this many steps (0: only at the end)
    eval_every: int = 0
    #: batches per evaluation (0: the whole eval set)
    eval_batches: int = 0
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
    optim: OptimConfig = OptimConfig()
    lora: LoRAConfig = LoRAConfig()
    data: DataConfig = DataConfig()

    def __post_init__(self):
        super().__post_init__()
        check_fields(
            self,
            **dict.fromkeys(("batch_size", "tp"), ">= 1"),
            **dict.fromkeys(("eval_every", "eval_batches", "logits_chunk"), ">= 0"),
            dropout="[0, 1)",
        )


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
    name: str = "",
) -> dict:
    """Step 1 or 2 (or DPO) from start to HF export: checks, model, data, state, the loop (jaxrlhf.loop.fit), then
    output_dir/model. Returns the final state, the logged records, the model config and the model folder. `name`
    (default "Step N") names the run in its last line.

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
    where = f"{jax.process_count()} process(es), this is process {jax.process_index()}"
    log(f"mesh {dict(mesh.shape)}: {mesh.size} devices, {where}")
    if warning := precision_warning(run.precision, run.optim, run.lora):
        log(warning)
    config, params, tokenizer = load_model(run, value_head=value_head, fresh_head=True)
    data, batches, total = _load_data(run, step, tokenizer, config, log)
    tx = make_optimizer(run.optim, total, run.lora)
    state = create_state(params, run.lora, tx, jax.random.key(run.seed), mesh, reference=reference is not None)
    on_eval = make_on_eval(config, tokenizer, data, state) if make_on_eval else None
    loss_fn, reference_fn = make_loss(config), partial(reference, config) if reference else None
    shardings = state_shardings(state, mesh)
    step_fn = jax.jit(
        make_train_step(loss_fn, tx, run.lora, reference_fn), out_shardings=(shardings, None), donate_argnums=0
    )
    put = partial(_put, mesh)
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

    lr_fn = schedule(run.optim, run.optim.learning_rate, total)
    evaluate = _evaluator(run, step, data, batches.pad_id, put, loss_fn, reference_fn, summarise, on_eval)
    kw = dict(total=total, evaluate=evaluate, eval_every=run.eval_every, log=log, manager=manager, shardings=shardings)
    state, records = loop.fit(
        run,
        state,
        train_step,
        partial(_window_figures, summarise, lr_fn, since),
        batches,
        **kw,
        metrics_log=MetricsLog(out, run.report_to, settings(run)),
        shown=("loss", "accuracy", "lr", "tokens_per_s"),
    )
    final = to_host(effective_params(state, run.lora))
    if jax.process_index() == 0:
        save_hf(out / "model", config, final, tokenizer, manifest={"settings": settings(run)})
    log(f"{name or f'Step {step}'} done: Hugging Face model in {out / 'model'}")
    return {"state": state, "records": records, "config": config, "model_dir": out / "model"}


def _put(mesh, spec, host: dict) -> dict:
    """This process's rows of a host batch on the mesh, split like `spec`."""
    return {k: jax.make_array_from_process_local_data(NamedSharding(mesh, spec), v) for k, v in host.items()}


def _load_data(run: RunConfig, step: int, tokenizer, config, log):
    """(data splits, the training Batches, the run's optimizer steps), checked before anything compiles."""
    data = prepare(run.data, step, tokenizer, log=log)
    check_rows(data, step, run.data, config.max_position_embeddings)
    proc = dict(process_index=jax.process_index(), process_count=jax.process_count())
    batches = Batches(data["train"], step, run.batch_size, run.data, tokenizer.pad_token_id, **proc)
    total = run.max_steps or run.epochs * len(batches)
    if total <= 0:
        raise ValueError("nothing to train: 0 steps (check epochs, max_steps and the size of the training set)")
    return data, batches, total


def _window_figures(summarise, lr_fn, since: dict, window: list) -> dict:
    """The figures of the steps since the last log ((i, metrics) each); skipped steps are left out of the sums.
    `since`: the window's tokens and start (reset here)."""
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


def _evaluator(run: RunConfig, step: int, data, pad_id: int, put, loss_fn, reference_fn, summarise, on_eval):
    """evaluate(state) -> figures | None: the eval split in order, in batches of run.batch_size (the last partial one
    dropped; run.eval_batches of them if set), plus on_eval's figures."""

    @jax.jit
    def eval_fn(state, batch):
        batch = with_reference(reference_fn, state, batch)
        _, count, sums = loss_fn(effective_params(state, run.lora, fused=False), batch, None)
        return {**sums, "count": count}

    def evaluate(state):
        sums, n, B = None, num_rows(data["eval"]) // run.batch_size, run.batch_size
        for i in range(min(n, run.eval_batches) if run.eval_batches else n):
            batch = make_batch(data["eval"], range(i * B, (i + 1) * B), step, run.data, pad_id)
            m = jax.device_get(eval_fn(state, put(P(FSDP_AXES), batch)))
            sums = m if sums is None else jax.tree.map(np.add, sums, m)
        if sums is None:
            return None
        return {**summarise(sums), **(on_eval(state) if on_eval is not None else {})}

    return evaluate
