"""Step 3's training programs: the actor's PPO step (plus the mixture LM loss) with its EMA, and the critic's
clipped value step, each over packed micro-batches accumulated one at a time (HybridEngine._step drives them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrlhf.losses import lm_loss, lm_targets
from jaxrlhf.models import next_token_logprobs
from jaxrlhf.optim import (
    Accumulator,
    apply_gradients,
    effective_params,
    micro_gradients,
    state_shardings,
    step_keys,
    zero_gradients,
)
from jaxrlhf.rl import losses
from jaxrlhf.rl.experience import Static, answer_logprobs, answer_values, fsdp_layout, packed_rows, row_layout


@functools.partial(jax.jit, static_argnums=0)
def fused_actor(s: Static, actor):
    """The actor's weights as it runs (LoRA fused), float32, in the FSDP layout: the EMA's starting point. The EMA
    is float32 under every precision: in bf16, ema + 0.008 * (actor - ema) rounds most of each step away."""
    return fsdp_layout(jax.tree.map(lambda x: x.astype(jnp.float32), effective_params(actor, s.cfg.actor.lora)), s.mesh)


#: the ratio's diagnostics (losses.ratio_figures) of a micro-batch without answers; min and max start from these
NO_RATIO = {"clip_frac": 0, "approx_kl": 0, "ratio": 0, "ratio_tokens": 0, "ratio_min": jnp.inf, "ratio_max": -jnp.inf}


def _actor_loss(s: Static, lm_weight=None):
    """The actor's loss on a micro-batch: its policy-loss total over the answers (packed rows; clip-higher, GSPO's
    sequence-level ratio for gspo, plus kl_loss_coef times the KL estimator with a KL loss term, aggregated by
    loss_agg: losses.aggregate), or with an "unsup" batch unsup_coef times its LM sum weighted by `lm_weight`
    (_lm_weight); count: the answer tokens (token_mean) or answers (the seq_mean modes). Metrics: the loss terms and
    the ratio's diagnostics (losses.ratio_figures)."""
    cfg = s.cfg
    (clip_low, clip_high), kl_kind, agg = cfg.clip_range, cfg.kl_estimator, cfg.aggregation
    sequence = cfg.algorithm == "gspo"

    def loss_fn(params, mb, key):
        loss, tokens = 0.0, jnp.zeros((), jnp.float32)
        # in every micro-batch, the mixture's too: the accumulated sums have one structure
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in NO_RATIO.items()}
        if kl_kind != "none":
            metrics["kl_loss"] = jnp.zeros((), jnp.float32)
        if "seq" in mb:
            lp = answer_logprobs(s.actor, params, mb, key, **s.scoring)
            old, adv, mask = mb["logprobs"], mb["advantages"], mb["mask"]
            per_token = losses.policy_loss(lp, old, adv, clip_low, clip_high, mask, sequence)
            metrics.update(losses.ratio_figures(lp, old, adv, mask, clip_low, clip_high, sequence))
            if kl_kind != "none":
                kl = losses.kl_penalty(lp, mb["ref_logprobs"], kl_kind)
                metrics["kl_loss"] = losses.aggregate(kl, mask, agg)[0]
                per_token = per_token + cfg.kl_loss_coef * kl
            loss, tokens = losses.aggregate(per_token, mask, agg)  # a total and its count
        metrics["actor_loss"] = jnp.asarray(loss, jnp.float32)
        if lm_weight is not None:  # DeepSpeed-Chat's mixture training, here in the same step (README: where we differ)
            lm = jnp.zeros((), jnp.float32)
            if "unsup" in mb:
                u = mb["unsup"]
                kw = dict(chunk=s.cfg.actor.logits_chunk, dropout_rng=key)
                lp = next_token_logprobs(s.actor, params, u["input_ids"], u["attention_mask"], **kw)
                lm = lm_loss(lp, u["loss_mask"])[0] * lm_weight
            metrics["unsup_loss"] = lm
            loss = loss + cfg.unsup_coef * lm
        return loss, tokens, metrics

    return loss_fn


def _critic_loss(s: Static):
    def loss_fn(params, mb, key):
        v = answer_values(s.critic, params, mb, key)
        tokens = jnp.sum(mb["mask"]).astype(jnp.float32)
        loss = losses.critic_loss(v, mb["values"], mb["returns"], mb["mask"], s.cfg.clip_value) * tokens
        return loss, tokens, {"critic_loss": loss}

    return loss_fn


def _lm_weight(s: Static, exp):
    """The whole batch's policy-loss count (answer tokens, or answers: losses.aggregate) / LM targets.

    The step's gradient is the whole batch's, however it is cut into micro-batches: the PPO loss's mean over all
    the batch's answer tokens plus unsup_coef times the LM loss's mean over all the unsupervised batch's targets.
    The trainer sums the micro-batches' totals and divides once by their summed count, the answer tokens; so a
    micro-batch's LM sum enters weighted by the whole batch's answer tokens / LM targets."""
    if "unsup" not in exp:
        return None
    count = losses.aggregate(exp["mask"].astype(jnp.float32), exp["mask"], s.cfg.aggregation)[1]
    return count / jnp.maximum(jnp.sum(lm_targets(exp["unsup"]["loss_mask"])), 1)


def _loss(s: Static, name: str, exp):
    return _actor_loss(s, _lm_weight(s, exp)) if name == "actor" else _critic_loss(s)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=4)
def accumulate(s: Static, name: str, W: int, state, acc, exp, rows, index):
    """`acc` plus one packed micro-batch's gradients and loss sums (W > 0: rows `rows` of the experience; W = 0: rows
    `rows` of exp["unsup"], the actor's mixture loss); `index`: the micro-batch's number in the step (its key)."""
    if W:
        mb = packed_rows(s, exp, rows, W)
    else:
        mb = {"unsup": row_layout(jax.tree.map(lambda x: x[rows], exp["unsup"]), s.mesh)}
    key = jax.random.fold_in(step_keys(state), index)
    grads, total, count, sums = micro_gradients(_loss(s, name, exp), s.side(name).lora, state, mb, key)
    # sums add up, but the ratio's extremes combine by min and max
    combine = lambda k: jnp.minimum if k.endswith("_min") else jnp.maximum if k.endswith("_max") else jnp.add  # noqa: E731
    sums = {k: combine(k)(acc[3][k], v) for k, v in sums.items()}
    acc = (jax.tree.map(jnp.add, acc[0], grads), acc[1] + total, acc[2] + count, sums)
    return (fsdp_layout(acc[0], s.mesh), *acc[1:])


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def zero_accumulator(s: Static, name: str, W: int, state, exp, rows):
    """The accumulator accumulate adds micro-batches into, zeros, gradients in the FSDP layout."""
    mb = packed_rows(s, exp, rows, W)
    acc = zero_gradients(_loss(s, name, exp), s.side(name).lora, state, mb, step_keys(state))
    sums = {k: jnp.full_like(v, NO_RATIO[k]) if k in ("ratio_min", "ratio_max") else v for k, v in acc[3].items()}
    return (fsdp_layout(acc[0], s.mesh), *acc[1:3], sums)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def apply(s: Static, name: str, state, ema, acc):
    """The optimizer step from accumulated gradients (trainer.apply_gradients), and the actor's EMA."""
    state, metrics = apply_gradients(s.tx(name), s.side(name).lora, state, Accumulator(*acc))
    state = jax.lax.with_sharding_constraint(state, state_shardings(state, s.mesh))
    return state, _ema_update(s, state, ema, metrics), metrics


def _ema_update(s: Static, actor, ema, metrics):
    """ema <- decay ema + (1 - decay) actor (float32), unless the trainer's non-finite guard skipped the step."""
    if ema is None:
        return None
    cfg = s.cfg
    fused = effective_params(actor, cfg.actor.lora)
    new = jax.tree.map(lambda e, a: cfg.ema_decay * e + (1 - cfg.ema_decay) * a.astype(e.dtype), ema, fused)
    new = jax.tree.map(lambda n, e: jnp.where(metrics["skipped"] > 0, e, n), new, ema)  # a skipped step: as it was
    return fsdp_layout(new, s.mesh)
