"""Step 3's experience: the answers scored (old and reference log-probs, values, reward), the adaptive KL
coefficient, rewards and advantages; in packed micro-batches (jaxrlhf.rl.packing).

The programs here and in jaxrlhf.rl.steps are module-level and keyed by what each reads (Scoring, Returns, the mesh:
hashable, cut from `Static`), so two engines with the same settings and shapes (a run and its resumption, or tests)
compile once, and a setting no program reads (the seed, generation's, logging's) compiles nothing again. Each pins
its outputs to the FSDP layout. Answer token g sits at sequence position prompt length + g: its log-prob comes from
the logits one position earlier (packed rows' head_at), and its value is the critic's output there too (the state
the token was chosen in).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrlhf import hooks
from jaxrlhf.lora import LoRAConfig
from jaxrlhf.losses import masked_mean
from jaxrlhf.models import logprobs, values
from jaxrlhf.optim import effective_params, make_optimizer
from jaxrlhf.rl import losses, packing
from jaxrlhf.sharding import batch_sharding, shardings_for

# --------------------------------------------------------------------------- weights shared with a frozen model


def base_params(state):
    """The base weights of a trainer state (trainable or frozen), adapters not applied."""
    return {**state["frozen"], **state["trainable"]}["params"]


def with_shared(own, state):
    """The frozen model's full tree: its own leaves, and the trainable model's base leaves where it shares (state
    None: no trainable twin, e.g. the reward model without a critic, so `own` is the whole tree)."""
    if state is None:
        return own
    return jax.tree.map(
        lambda mine, base: base if mine is None else mine, own, base_params(state), is_leaf=lambda x: x is None
    )


# ------------------------------------------------------------------------------------------- scoring


@dataclasses.dataclass(frozen=True)
class Scoring:
    """What scoring reads (score's jit key): the models, their adapters, whether it computes the old log-probs,
    the reward model's weight (0: none), answer_logprobs' settings and the mesh."""

    actor: Any  # the actor's model config
    critic: Any
    actor_lora: LoRAConfig
    critic_lora: LoRAConfig
    old: bool  # the old log-probs computed here (old_logprobs scoring; not where generation or the step gives them)
    reward_scale: float
    temperature: float  # the answers were sampled at (greedy answers, temperature 0, are scored at 1)
    chunk: int  # the actor's logits_chunk
    mesh: Any

    @property
    def logprobs(self) -> dict:
        """answer_logprobs' settings, the same for the old, reference and training log-probs."""
        return {"temperature": self.temperature, "chunk": self.chunk}


@dataclasses.dataclass(frozen=True)
class Returns:
    """What the rewards, the advantages and the KL controller read (advantages', group_spread's and next_kl_coef's
    jit key): EngineConfig's fields and properties of the same names."""

    algorithm: str
    num_samples_per_prompt: int
    scale_rewards: bool
    clip_score: float
    max_answer_len: int
    overlong_buffer: int
    overlong_penalty: float
    overlong_filter: bool
    kl_estimator: str
    gamma: float
    lam: float
    whiten_advantages: bool
    grouped: bool
    kl_target: float | None
    kl_horizon: int

    @classmethod
    def of(cls, cfg) -> Returns:
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class Static:
    """The engine's settings and models, from which each program's jit key is cut: `scoring`, `returns`, the mesh
    (the programs that only lay out rows), and jaxrlhf.rl.steps.programs' keys of the steps. Changing a setting that
    a program does not read (generation's, the seed, the micro-batch budget) compiles nothing again."""

    cfg: Any  # EngineConfig
    actor: Any  # the actor's model config
    critic: Any
    total_steps: int
    mesh: Any

    def side(self, name: str):
        return getattr(self.cfg, name)

    def tx(self, name: str):
        return make_optimizer(self.side(name).optim, self.total_steps, self.side(name).lora)

    @functools.cached_property
    def scoring(self) -> Scoring:
        cfg = self.cfg
        return Scoring(
            self.actor,
            self.critic,
            cfg.actor.lora,
            cfg.critic.lora,
            cfg.old_logprobs_source == "scoring",
            cfg.reward.model_scale,
            cfg.temperature or 1.0,
            cfg.actor.logits_chunk,
            self.mesh,
        )

    @functools.cached_property
    def returns(self) -> Returns:
        return Returns.of(self.cfg)


def fsdp_layout(tree, mesh):
    return jax.lax.with_sharding_constraint(tree, shardings_for(tree, "fsdp", mesh))


def row_layout(tree, mesh):
    return jax.lax.with_sharding_constraint(tree, batch_sharding(mesh, "fsdp"))


def answer_logprobs(config, params, packed, key=None, *, temperature: float, chunk: int):
    """[n, A]: log p of each answer slot's token of a packed micro-batch (jaxrlhf.rl.packing) under
    softmax(logits / temperature), the distribution it was sampled from, with the logits one column earlier in its
    segment (the LM head runs on the slots' head_at columns only, `chunk` tokens at a time: models.logprobs).
    Scoring.logprobs gives the two settings."""
    kw = dict(temperature=temperature, chunk=chunk, dropout_rng=key, at=packed["head_at"])
    kw.update(positions=packed["positions"], segment_ids=packed["segment_ids"])
    return logprobs(config, params, packed["seq"], packed["seq_mask"], packed["answer"], **kw)


def packed_values(config, params, packed, key=None):
    """[n, W]: the value head's output at every column of a packed micro-batch, each segment on its own."""
    kw = dict(dropout_rng=key, positions=packed["positions"], segment_ids=packed["segment_ids"])
    return values(config, params, packed["seq"], packed["seq_mask"], **kw)


def answer_values(config, params, packed, key=None):
    """[n, A]: the value of the state each answer slot's token was chosen in (at its head_at column)."""
    return jnp.take_along_axis(packed_values(config, params, packed, key), packed["head_at"], axis=1)


@hooks.program
@functools.partial(jax.jit, static_argnums=0)
def padded_experience(mesh, prompt_ids, prompt_mask, tokens, mask):
    """The padded experience block that packing cuts rows from: seq, seq_mask [B, P + G] (prompt then answer),
    mask [B, G]."""
    seq, seq_mask = jnp.concatenate([prompt_ids, tokens], 1), jnp.concatenate([prompt_mask, mask], 1)
    return row_layout({"seq": seq, "seq_mask": seq_mask, "mask": mask}, mesh)


def _score_micro(s: Scoring, state, ref_own, reward_own, packed, B: int):
    """Old log-probs (where scoring computes them: Scoring.old), reference log-probs and values (with a critic)
    [n, A] of a packed micro-batch's answer slots, and the reward scores [B] of its sequences (0 for the others)."""
    actor, critic = state["actor"], state.get("critic")
    out = {}
    if s.old:
        own = effective_params(actor, s.actor_lora, fused=False)
        out["logprobs"] = answer_logprobs(s.actor, own, packed, **s.logprobs)
    out["ref_logprobs"] = answer_logprobs(s.actor, with_shared(ref_own, actor), packed, **s.logprobs)
    if critic is not None:
        out["values"] = answer_values(s.critic, effective_params(critic, s.critic_lora, fused=False), packed)
    if not s.reward_scale:  # no reward model; the host's reward functions give the whole score
        return {**out, "scores": jnp.zeros((B,), jnp.float32)}
    reward = packed_values(s.critic, with_shared(reward_own, critic), packed)
    # the sequence's last real token (the answer's EOS if it ended): its segment's last column
    return {**out, "scores": s.reward_scale * packing.segment_ends(reward, packed, B)}


@hooks.program
@functools.partial(jax.jit, static_argnums=0, donate_argnums=5)
def score(s: Scoring, state, ref_own, reward_own, exp, out, micro):
    """One packed micro-batch (packing.Micro) of the experience scored (_score_micro) and written into the batch's
    `out` ([B, G] and [B] leaves). `state` holds the actor's and critic's weights only (their optimizer states may be
    in host memory)."""
    packed = packed_rows(s.mesh, exp, micro)
    part = _score_micro(s, state, ref_own, reward_own, packed, exp["mask"].shape[0])
    return row_layout(packing.unpack(out, part, packed), s.mesh)


@functools.partial(jax.jit, static_argnums=0)
def next_kl_coef(s: Returns, kl_coef, exp):
    """The adaptive KL controller's step on one scored batch (losses.adaptive_kl_coef)."""
    kl = losses.sequence_kl(exp["logprobs"], exp["ref_logprobs"], exp["mask"])
    return losses.adaptive_kl_coef(kl_coef, kl, s.kl_target, s.kl_horizon, exp["mask"].shape[0])


@functools.partial(jax.jit, static_argnums=0)
def truncated_rows(mesh, tokens, mask, eos_id):
    """[B] float32: 1 where an answer holds no stop token (eos_id: a tuple of them; cut at its length limit), from
    answers and their masks [B, G]."""
    stopped = jnp.isin(tokens, jnp.asarray(eos_id, jnp.int32).reshape(-1)) & (mask > 0)
    return row_layout(1.0 - jnp.any(stopped, axis=1).astype(jnp.float32), mesh)


def answer_rewards(cfg: Returns, exp):
    """Each answer's reward [B] before any KL penalty, clip(scores, -clip_score, clip_score) + function_scores + the
    over-long penalty (overlong_buffer; losses.overlong_penalty), and valid [B]: 0 where a reward function left the
    answer unscored (out of the loss and of its group's statistics). Absent keys: no reward functions' scores, all
    answers scored."""
    B = exp["mask"].shape[0]
    reward = jnp.clip(exp["scores"], -cfg.clip_score, cfg.clip_score) + exp.get("function_scores", jnp.zeros(B))
    if cfg.overlong_buffer:
        lengths = jnp.sum(exp["mask"].astype(jnp.float32), axis=1)
        reward = reward + losses.overlong_penalty(
            lengths, cfg.max_answer_len, cfg.overlong_buffer, cfg.overlong_penalty
        )
    return reward, exp.get("scored", jnp.ones(B, jnp.float32)).astype(jnp.float32)


def gae_advantages(s: Returns, exp, kl_coef):
    """PPO's advantages and returns [B, G] (losses.gae on the critic's values) of the per-token rewards: each answer's
    reward (answer_rewards) at its last token, minus kl_coef x (log p - log p_ref) on each of its tokens. Row by row:
    what the actor step takes again from its own forward's old log-probs (old_logprobs step)."""
    reward, mask = answer_rewards(s, exp)[0], exp["mask"]
    rewards = losses.compute_rewards(exp["logprobs"], exp["ref_logprobs"], reward, mask, kl_coef, None)
    return losses.gae(exp["values"], rewards, mask, s.gamma, s.lam)


@functools.partial(jax.jit, static_argnums=0)
def group_spread(s: Returns, exp):
    """[B / n] bool: whether each group's valid rewards differ (answer_rewards; losses.groups): dynamic sampling keeps
    these."""
    reward, valid = answer_rewards(s, exp)
    return losses.groups(reward, s.num_samples_per_prompt, valid)[4][:, 0]


@hooks.program
@functools.partial(jax.jit, static_argnums=0)
def advantages(s: Returns, exp, kl_coef):
    """The experience plus per-token rewards (with the KL coefficient the batch was scored under; none with a KL loss
    term), advantages [B, G] (and returns for the critic), and the batch's figures; over the whole generation batch,
    whose rows are groups of num_samples_per_prompt answers to one prompt, side by side. The answer's reward is
    answer_rewards'; "mask" becomes the loss's: unscored answers (and truncated ones with overlong_filter) out.

        ppo                    GAE on the critic's values (whitened if whiten_advantages)
        grpo, gspo / rloo      one advantage per answer from its sequence reward sum_t r_t (the reward minus the KL
                               penalty), on each of its tokens (losses.grpo_advantages, losses.rloo_advantages)
        reinforce_pp           the per-token returns normalised over the batch (losses.reinforce_pp_advantages)
        reinforce_pp_baseline  the group-centred reward's per-token returns / their batch std
                               (losses.reinforce_pp_baseline_advantages)"""
    cfg, mask = s, exp["mask"]
    reward, valid = answer_rewards(cfg, exp)
    kl_coef = kl_coef if cfg.kl_estimator == "none" else 0.0
    m = mask.astype(jnp.float32)
    loss_mask = m * valid[:, None]
    truncated = exp.get("truncated", jnp.zeros_like(valid))
    if cfg.overlong_filter:
        loss_mask = loss_mask * (1.0 - truncated)[:, None]
    stats = {
        "reward": jnp.sum(reward * valid) / jnp.maximum(jnp.sum(valid), 1),
        "kl": losses.sequence_kl(exp["logprobs"], exp["ref_logprobs"], m),
        "answer_len": jnp.mean(m.sum(1)),
        "truncated": jnp.mean(truncated),
    }
    out = {**exp, "mask": loss_mask}
    lp, ref, n = exp["logprobs"], exp["ref_logprobs"], cfg.num_samples_per_prompt
    if cfg.grouped:
        stats["zero_spread"] = 1.0 - jnp.mean(losses.groups(reward, n, valid)[4].astype(jnp.float32))
    if cfg.algorithm == "ppo":
        adv, ret = gae_advantages(cfg, exp, kl_coef)
        if cfg.whiten_advantages:
            adv = losses.whiten(adv, loss_mask)
        stats.update(
            {"advantage": masked_mean(adv, m), "return": masked_mean(ret, m), "value": masked_mean(exp["values"], m)}
        )
        return {**out, "advantages": adv, "returns": ret}, stats
    if cfg.algorithm == "reinforce_pp":
        rewards = losses.compute_rewards(lp, ref, reward, mask, kl_coef, None)
        adv = losses.reinforce_pp_advantages(rewards, loss_mask, cfg.gamma)
    elif cfg.algorithm == "reinforce_pp_baseline":
        rewards = losses.compute_rewards(lp, ref, reward, mask, kl_coef, None)
        adv = losses.reinforce_pp_baseline_advantages(reward, mask, n, valid, kl_coef * (lp - ref), cfg.gamma)
    else:
        rewards = losses.compute_rewards(lp, ref, reward, mask, kl_coef, None)
        sequence = jnp.sum(rewards, axis=1)
        per_answer = (
            losses.rloo_advantages(sequence, n, valid)
            if cfg.algorithm == "rloo"
            else losses.grpo_advantages(sequence, n, cfg.scale_rewards, valid=valid)
        )
        adv = per_answer[:, None] * m
    # the return: the sequence reward
    stats.update({"advantage": masked_mean(adv, loss_mask), "return": jnp.mean(jnp.sum(rewards, axis=1))})
    return {**out, "advantages": adv * loss_mask}, stats


@functools.partial(jax.jit, static_argnums=0)
def take_rows(mesh, experiences, rows, keep):
    """Rows `rows` [B] of experiences alike (their rows one after another) as one, rows over all devices; `keep` [B]
    multiplies "scored" (0: the row is left out of the loss)."""
    whole = {k: jnp.concatenate([e[k] for e in experiences]) for k in experiences[0]}
    out = {k: v[rows] for k, v in whole.items()}
    out["scored"] = out.get("scored", jnp.ones(rows.shape, jnp.float32)) * keep
    return row_layout(out, mesh)


def packed_rows(mesh, exp, micro):
    """The experience's micro-batch `micro` (packing.Micro) packed (packing.pack), rows over all devices."""
    return row_layout(packing.pack(exp, micro), mesh)
