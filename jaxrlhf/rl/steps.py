"""Step 3's training programs: the actor's PPO step (plus the mixture LM loss) with its EMA, and the critic's
clipped value step, each over packed micro-batches accumulated one at a time.

    step(s, name, state, ema, exp, micro, unsup)        one optimizer step (HybridEngine.train_rlhf calls it)
        acc = zero_accumulator(loss, state, exp, micro, mixture)       an optim.Accumulator of zeros
        acc = accumulate(loss, state, acc, exp, micro, i)              each packed micro-batch of the answers
        acc = accumulate_mixture(mixture, state, acc, mask, unsup, micro, i)  each packed part of the mixture batch
        state, ema, metrics = apply(update, state, ema, acc)           divided once, the optimizer, the EMA

Each program is module-level and jitted with a static key of what it reads (ActorLoss, CriticLoss, MixtureLoss,
Update: frozen dataclasses), so engines alike (a run and its resumption, tests) share their compilations: one
program per packed micro-batch shape, the accumulator and the states donated. The losses read the whole batch's
answer-space arrays [B, G] (old log-probs, advantages, ...): the packed micro-batch's results are scattered there
(packing.to_answers) and its mask is the batch's restricted to its answers (packing.members), so every loss, GSPO's
sequence-level ratio and the per-answer aggregations included, is the unpacked one's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrlhf import hooks
from jaxrlhf.lora import LoRAConfig
from jaxrlhf.losses import lm_targets
from jaxrlhf.optim import (
    Accumulator,
    apply_gradients,
    effective_params,
    micro_gradients,
    state_shardings,
    step_keys,
    zero_gradients,
)
from jaxrlhf.rl import losses, packing
from jaxrlhf.rl.experience import (
    Returns,
    Static,
    answer_logprobs,
    answer_values,
    fsdp_layout,
    gae_advantages,
    packed_rows,
    row_layout,
)


@functools.partial(jax.jit, static_argnums=(0, 1))
def fused_actor(lora: LoRAConfig, mesh, actor):
    """The actor's weights as it runs (LoRA fused), float32, in the FSDP layout: the EMA's starting point. The EMA
    is float32 under every precision: in bf16, ema + 0.008 * (actor - ema) rounds most of each step away."""
    return fsdp_layout(jax.tree.map(lambda x: x.astype(jnp.float32), effective_params(actor, lora)), mesh)


#: the ratio's diagnostics (losses.ratio_figures) of no answers; the accumulated min and max start from these
NO_RATIO = {"clip_frac": 0, "approx_kl": 0, "ratio": 0, "ratio_tokens": 0, "ratio_min": jnp.inf, "ratio_max": -jnp.inf}


def answers(mb: dict, slots):
    """A packed micro-batch's slot values [n, A] in the answer space [B, G] (packing.to_answers), and the loss mask of
    its answers: the batch's mask [B, G] on the rows in it (packing.members), 0 elsewhere."""
    mask, packed = mb["mask"], mb["packed"]
    return packing.to_answers(slots, packed, mask.shape), mask * packing.members(packed, mask.shape[0])[:, None]


@dataclasses.dataclass(frozen=True)
class ActorLoss:
    """The actor's policy loss on a packed micro-batch's answers: the total over them (clip-higher; GSPO's
    sequence-level ratio under `sequence`; plus kl_loss_coef times the KL estimator with a KL loss term) aggregated
    by `aggregation` (losses.aggregate); count: the answer tokens (token_mean) or answers (the seq_mean modes).
    Metrics: the loss terms and the ratio's diagnostics (losses.ratio_figures).

    `returns` given (old_logprobs step): the old log-probs are this forward's own, detached (the weights that
    generated the batch: exact in the first step after its generation, the ratio 1), PPO's advantages are taken
    from them here (experience.gae_advantages, row by row) and they are a metric too, "old_logprobs" [B, G] (each
    row's from the one micro-batch holding it; the step's sum is the batch's)."""

    model: Any  # the actor's model config
    lora: LoRAConfig
    mesh: Any
    clip: tuple[float, float]  # (low, high): the ratio clipped to [1 - low, 1 + high]
    sequence: bool  # gspo: one ratio per answer
    kl_estimator: str  # "none" (the KL is in the reward), "k1" or "k3" (a loss term)
    kl_loss_coef: float
    aggregation: str
    scoring: tuple[tuple[str, Any], ...]  # answer_logprobs' temperature and chunk (Scoring.logprobs)
    returns: Returns | None = None  # the old log-probs from this forward (above)

    def __call__(self, params, mb, key):
        lp, mask = answers(mb, answer_logprobs(self.model, params, mb["packed"], key, **dict(self.scoring)))
        old, adv, own = mb["logprobs"], mb["advantages"], {}  # in the step: a stand-in, replaced below
        if self.returns is not None:
            old = own["old_logprobs"] = jax.lax.stop_gradient(lp)
            if self.returns.algorithm == "ppo":  # with the KL in the reward; the others' do not read old log-probs
                adv = gae_advantages(self.returns, {**mb, "logprobs": old}, mb["kl_coef"])[0]
        per_token = losses.policy_loss(lp, old, adv, *self.clip, mask, self.sequence)
        metrics = losses.ratio_figures(lp, old, adv, mask, *self.clip, self.sequence)
        if self.kl_estimator != "none":
            kl = losses.kl_penalty(lp, mb["ref_logprobs"], self.kl_estimator)
            metrics["kl_loss"] = losses.aggregate(kl, mask, self.aggregation)[0]
            per_token = per_token + self.kl_loss_coef * kl
        loss, count = losses.aggregate(per_token, mask, self.aggregation)  # a total and its count
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in {**metrics, **own}.items()}
        return loss, count, {**metrics, "actor_loss": jnp.asarray(loss, jnp.float32)}


@dataclasses.dataclass(frozen=True)
class CriticLoss:
    """The critic's clipped value loss on a packed micro-batch's answers, its total over their tokens and count."""

    model: Any  # the critic's model config
    lora: LoRAConfig
    mesh: Any
    clip_value: float

    def __call__(self, params, mb, key):
        v, mask = answers(mb, answer_values(self.model, params, mb["packed"], key))
        tokens = jnp.sum(mask).astype(jnp.float32)
        loss = losses.critic_loss(v, mb["values"], mb["returns"], mask, self.clip_value) * tokens
        return loss, tokens, {"critic_loss": loss}


@dataclasses.dataclass(frozen=True)
class MixtureLoss:
    """DeepSpeed-Chat's mixture training, here in the actor's same step (README: where we differ): unsup_coef times
    the LM loss's sum on a packed part of the unsupervised batch (its slots: the LM targets, packing.mixture_plan),
    weighted by `weight` (mixture_weight); its count is 0 (the
    step divides by the answers' count alone)."""

    model: Any  # the actor's model config
    lora: LoRAConfig
    mesh: Any
    unsup_coef: float
    chunk: int  # the actor's logits_chunk
    aggregation: str  # the policy loss's (its count is the mixture's weight's numerator)

    def __call__(self, params, mb, key, weight):
        packed = mb["packed"]
        lp = answer_logprobs(self.model, params, packed, key, temperature=1.0, chunk=self.chunk)
        targets = packed["slot"] < mb["loss_mask"].size  # the filled slots
        lm = -jnp.sum(jnp.where(targets, lp, 0.0)) * weight
        return self.unsup_coef * lm, jnp.zeros((), jnp.float32), {"unsup_loss": lm}


@dataclasses.dataclass(frozen=True)
class Update:
    """The optimizer step of one model from its accumulated micro-batches, and the actor's EMA (ema_decay None: no
    EMA to update)."""

    tx: Any  # optim.make_optimizer's (cached: the same object for the same settings)
    lora: LoRAConfig
    mesh: Any
    ema_decay: float | None


@functools.cache
def programs(
    s: Static, name: str, from_step: bool = False
) -> tuple[ActorLoss | CriticLoss, MixtureLoss | None, Update]:
    """The static keys of `name`'s ("actor" or "critic") step programs, from the engine's settings; `from_step`: the
    actor's old log-probs from its own forward (ActorLoss.returns)."""
    cfg, side = s.cfg, s.side(name)
    update = Update(s.tx(name), side.lora, s.mesh, cfg.ema_decay if name == "actor" and cfg.enable_ema else None)
    if name == "critic":
        return CriticLoss(s.critic, side.lora, s.mesh, cfg.clip_value), None, update
    sequence, scoring = cfg.algorithm == "gspo", tuple(sorted(s.scoring.logprobs.items()))
    loss = ActorLoss(
        s.actor,
        side.lora,
        s.mesh,
        cfg.clip_range,
        sequence,
        cfg.kl_estimator,
        cfg.kl_loss_coef,
        cfg.aggregation,
        scoring,
        s.returns if from_step else None,
    )
    mixture = MixtureLoss(s.actor, side.lora, s.mesh, cfg.unsup_coef, side.logits_chunk, cfg.aggregation)
    return loss, mixture, update


def step(s: Static, name: str, state, ema, exp: dict, micro: list, unsup=None, parts=(), from_step: bool = False):
    """One optimizer step of `name` over the experience's packed micro-batches `micro` (packing.Micro each: plan)
    and, for the actor, the mixture batch `unsup` in its packed parts `parts` (packing.mixture_plan: rows i, i + n,
    ... of gradient_accumulation_steps n): gradients summed, divided once -> (state, ema, metrics). `from_step`: the
    actor's old log-probs from its own forward (ActorLoss.returns; exp holds "kl_coef")."""
    loss, mixture, update = programs(s, name, from_step)
    acc = zero_accumulator(loss, state, exp, micro[0], unsup is not None)
    for i, m in enumerate(micro):
        acc = accumulate(loss, state, acc, exp, m, i)
    if unsup is not None:
        for i, m in enumerate(parts):
            acc = accumulate_mixture(mixture, state, acc, exp["mask"], unsup, m, len(micro) + i)
    return apply(update, state, ema, acc)


def _add(acc: Accumulator, more: Accumulator) -> Accumulator:
    """acc + one micro-batch's gradients and sums, the gradients kept in the FSDP layout; the ratio's extremes combine
    by min and max, and metrics the micro-batch does not report stay as they were."""
    combine = lambda k: jnp.minimum if k.endswith("_min") else jnp.maximum if k.endswith("_max") else jnp.add  # noqa: E731
    grads = jax.tree.map(jnp.add, acc.grads, more.grads)
    metrics = {**acc.metrics, **{k: combine(k)(acc.metrics[k], v) for k, v in more.metrics.items()}}
    return Accumulator(grads, acc.total + more.total, acc.count + more.count, metrics)


def _laid_out(acc: Accumulator, mesh) -> Accumulator:
    """The accumulator as every program hands it on (so each compiles once): gradients in the FSDP layout, the
    [B, G] old log-probs (ActorLoss.returns) split by rows."""
    metrics = {k: row_layout(v, mesh) if v.ndim else v for k, v in acc.metrics.items()}
    return acc._replace(grads=fsdp_layout(acc.grads, mesh), metrics=metrics)


@hooks.program  # seen by jaxrlhf.plan.measure
@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def accumulate(loss: ActorLoss | CriticLoss, state, acc: Accumulator, exp, micro, index) -> Accumulator:
    """`acc` plus the experience's packed micro-batch `micro` (packing.Micro); `index`: the micro-batch's number in
    the step (its dropout key)."""
    mb = {**exp, "packed": packed_rows(loss.mesh, exp, micro)}
    key = jax.random.fold_in(step_keys(state), index)
    return _laid_out(_add(acc, micro_gradients(loss, loss.lora, state, mb, key)), loss.mesh)


def mixture_weight(loss: MixtureLoss, mask, loss_mask):
    """The whole batch's policy-loss count (answer tokens, or answers: losses.aggregate) / its LM targets.

    The step's gradient is the whole batch's, however it is cut into micro-batches: the PPO loss's mean over all
    the batch's answer tokens plus unsup_coef times the LM loss's mean over all the unsupervised batch's targets.
    The step sums the micro-batches' totals and divides once by their summed count, the answer tokens; so a
    micro-batch's LM sum enters weighted by the whole batch's answer tokens / LM targets."""
    count = losses.aggregate(mask.astype(jnp.float32), mask, loss.aggregation)[1]
    return count / jnp.maximum(jnp.sum(lm_targets(loss_mask)), 1)


@hooks.program  # seen by jaxrlhf.plan.measure
@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def accumulate_mixture(loss: MixtureLoss, state, acc: Accumulator, mask, unsup, micro, index) -> Accumulator:
    """`acc` plus the packed part `micro` of the mixture batch `unsup` (a Step 1 batch [N, T]: packing.mixture_plan);
    `mask` [B, G]: the experience's
    loss mask, whose count weighs the LM loss (mixture_weight); `index`: the micro-batch's number in the step."""
    weight = mixture_weight(loss, mask, unsup["loss_mask"])
    lm = {"seq": unsup["input_ids"], "seq_mask": unsup["attention_mask"], "mask": unsup["loss_mask"]}
    mb = {"loss_mask": unsup["loss_mask"], "packed": packed_rows(loss.mesh, lm, micro)}
    key = jax.random.fold_in(step_keys(state), index)
    more = micro_gradients(functools.partial(loss, weight=weight), loss.lora, state, mb, key)
    return _laid_out(_add(acc, more), loss.mesh)


@hooks.program  # seen by jaxrlhf.plan.measure
@functools.partial(jax.jit, static_argnums=(0, 4))
def zero_accumulator(loss: ActorLoss | CriticLoss, state, exp, micro, mixture: bool) -> Accumulator:
    """The accumulator accumulate adds micro-batches into: zeros, gradients in the FSDP layout, the ratio's extremes
    at NO_RATIO's; with `mixture`, an "unsup_loss" for accumulate_mixture too."""
    mb = {**exp, "packed": packed_rows(loss.mesh, exp, micro)}
    acc = zero_gradients(loss, loss.lora, state, mb, step_keys(state))
    metrics = {
        k: jnp.full_like(v, NO_RATIO[k]) if k in ("ratio_min", "ratio_max") else v for k, v in acc.metrics.items()
    }
    if mixture:
        metrics["unsup_loss"] = jnp.zeros((), jnp.float32)
    return _laid_out(acc._replace(metrics=metrics), loss.mesh)


@hooks.program  # seen by jaxrlhf.plan.measure
@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def apply(update: Update, state, ema, acc: Accumulator):
    """The optimizer step from accumulated gradients (optim.apply_gradients), and the actor's EMA."""
    state, metrics = apply_gradients(update.tx, update.lora, state, acc)
    state = jax.lax.with_sharding_constraint(state, state_shardings(state, update.mesh))
    return state, _ema_update(update, state, ema, metrics), metrics


def _ema_update(update: Update, actor, ema, metrics):
    """ema <- decay ema + (1 - decay) actor (float32), unless the non-finite guard skipped the step."""
    if ema is None:
        return None
    decay = update.ema_decay
    fused = effective_params(actor, update.lora)
    new = jax.tree.map(lambda e, a: decay * e + (1 - decay) * a.astype(e.dtype), ema, fused)
    new = jax.tree.map(lambda n, e: jnp.where(metrics["skipped"] > 0, e, n), new, ema)  # a skipped step: as it was
    return fsdp_layout(new, update.mesh)
