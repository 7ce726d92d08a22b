"""The hybrid engine of Step 3: four models on one mesh, and DeepSpeed-Chat's two verbs.

    actor      trainable   a trainer state in the FSDP layout (jaxrlhf.trainer: trainable/frozen/opt/step/rng)
    critic     trainable   the same, initialised from the Step 2 reward model (value head included)
    reference  frozen      the Step 1 weights: the actor's own base leaves wherever they never move (the
                           kernels that carry LoRA adapters; everything under only_optimize_lora), plus a copy
                           of the other leaves. Without LoRA that copy is the whole model.
    reward     frozen      the Step 2 weights, sharing the critic's never-moving base leaves the same way
    ema        optional    fused actor weights; ema = decay * ema + (1 - decay) * actor after each actor step

    generate_experience(prompts [B, P] left-padded):
        fuse LoRA, cast to the compute dtype ──reshard──► "tp" layout ──generate──► answers [B, G]
        ──drop the generation copy (the KV cache lives only inside the compiled generate call)──►
        score in the FSDP layout, no gradients: old log-probs, reference log-probs, critic values, reward score
    train_rlhf(experience[, unsupervised batch]):
        rewards (KL penalty + clipped score) ──► GAE ──► actor PPO step (+ unsup_coef * LM loss) ──► EMA
        ──► critic step;  states donated

Answer token g sits at sequence position P + g: its log-prob comes from the logits at P + g - 1, and its
value is the critic's output there too (the state the token was chosen in), as in DeepSpeed-Chat.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrlhf import losses
from jaxrlhf.generate import generate
from jaxrlhf.lora import LoRAConfig, adapted_mask
from jaxrlhf.models.opt import OPTConfig, logits, values
from jaxrlhf.sharding import batch_sharding, check_tp, reshard, shardings_for
from jaxrlhf.trainer import OptimConfig, create_state, effective_params, make_optimizer, make_train_step, state_shardings


@dataclasses.dataclass(frozen=True)
class ModelSide:
    """One trainable model of Step 3 (the actor or the critic) and how it is trained."""

    #: Hugging Face folder: the Step 1 model (actor) or the Step 2 reward model (critic, also the reward)
    model: str = ""
    optim: OptimConfig = OptimConfig()
    lora: LoRAConfig = LoRAConfig()
    #: recompute each layer in the backward pass (DeepSpeed-Chat's --actor/critic_gradient_checkpointing)
    remat: bool = False
    #: dropout in the training steps (null: the checkpoint's own; 0 is DeepSpeed-Chat's --disable_*_dropout)
    dropout: float | None = 0.0


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What the hybrid engine needs: the two trainable models and the PPO algorithm's settings."""

    actor: ModelSide = ModelSide(optim=OptimConfig(learning_rate=9.65e-6, warmup_steps=100))
    critic: ModelSide = ModelSide(optim=OptimConfig(learning_rate=5e-6, warmup_steps=100))
    #: bf16: bf16 compute, fp32 master weights (frozen models stored in bf16); fp32; pure_bf16
    precision: Literal["bf16", "fp32", "pure_bf16"] = "bf16"
    #: tokens generated per answer (DeepSpeed-Chat's max_answer_seq_len)
    max_answer_len: int = 256
    #: sampling of the answers (temperature 0: greedy)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    #: tensor-parallel size of the generation layout (DeepSpeed-Chat's inference_tp_size)
    inference_tp_size: int = 1
    #: kept for DeepSpeed-Chat configs: the KV cache exists only inside the compiled generate call and is
    #: always freed when it returns, with the generation copy of the weights
    release_inference_cache: bool = True
    #: use generation's own log-probs as the old log-probs (skips one actor forward; equal in fp32, tested)
    old_logprobs_from_generation: bool = False
    #: KL penalty coefficient beta in r_t = -beta * (log p - log p_ref)
    kl_coef: float = 0.1
    #: adaptive KL controller (Ziegler et al. 2019): target KL per answer (null: fixed kl_coef) and horizon
    kl_target: float | None = None
    kl_horizon: int = 10000
    #: the reward model's score is clipped to [-clip_score, clip_score]
    clip_score: float = 5.0
    #: PPO ratio clip (DeepSpeed-Chat's cliprange) and value clip (cliprange_value)
    clip_ratio: float = 0.2
    clip_value: float = 0.2
    #: GAE discount and lambda
    gamma: float = 1.0
    lam: float = 0.95
    #: whiten the advantages over each batch
    whiten_advantages: bool = False
    #: keep an exponential moving average of the actor (written as actor_ema)
    enable_ema: bool = False
    ema_decay: float = 0.992
    #: weight of the mixture LM loss on the unsupervised set (data.unsupervised_data_path)
    unsup_coef: float = 27.8
    #: seed of the sampling (the models' own seeds come from it too)
    seed: int = 1234

    def __post_init__(self):
        checks = [
            (self.precision in ("bf16", "fp32", "pure_bf16"), f"precision: expected bf16, fp32 or pure_bf16, got {self.precision!r}"),
            (self.max_answer_len >= 1, f"max_answer_len: expected >= 1, got {self.max_answer_len}"),
            (self.temperature >= 0 and self.top_k >= 0 and 0 < self.top_p <= 1, "sampling: expected temperature >= 0, "
             f"top_k >= 0, 0 < top_p <= 1; got {self.temperature}, {self.top_k}, {self.top_p}"),
            (self.inference_tp_size >= 1, f"inference_tp_size: expected >= 1, got {self.inference_tp_size}"),
            (self.kl_coef >= 0, f"kl_coef: expected >= 0, got {self.kl_coef}"),
            (self.kl_target is None or self.kl_target > 0, f"kl_target: expected > 0 or null, got {self.kl_target}"),
            (self.kl_horizon > 0, f"kl_horizon: expected > 0, got {self.kl_horizon}"),
            (self.clip_score > 0 and self.clip_ratio > 0 and self.clip_value > 0,
             "clip_score, clip_ratio and clip_value must be > 0"),
            (0 < self.gamma <= 1 and 0 <= self.lam <= 1, f"expected 0 < gamma <= 1 and 0 <= lam <= 1, got {self.gamma}, {self.lam}"),
            (0 <= self.ema_decay < 1, f"ema_decay: expected a number in [0, 1), got {self.ema_decay}"),
            (self.unsup_coef >= 0, f"unsup_coef: expected >= 0, got {self.unsup_coef}"),
        ]
        for d in (self.actor.dropout, self.critic.dropout):
            checks.append((d is None or 0 <= d < 1, f"dropout: expected a probability in [0, 1) or null, got {d}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# --------------------------------------------------------------------------- weights shared with a frozen model


def base_params(state):
    """The base weights of a trainer state (trainable or frozen), adapters not applied."""
    return {**state["frozen"], **state["trainable"]}["params"]


def never_moves(state, lora: LoRAConfig):
    """True at the base leaves that training never changes: all under only_optimize_lora, else the
    kernels that carry adapters (they get a zero update), else none."""
    params = base_params(state)
    if "params" in state["frozen"]:
        return jax.tree.map(lambda _: True, params)
    return adapted_mask(params, lora) if lora.dim else jax.tree.map(lambda _: False, params)


def own_leaves(host_params, shared_mask, dtype):
    """The leaves a frozen model must hold itself (None where it shares the trainable model's), in `dtype`."""
    return jax.tree.map(lambda x, shared: None if shared else np.asarray(x, dtype), host_params, shared_mask)


def with_shared(own, state):
    """The frozen model's full tree: its own leaves, and the trainable model's base leaves where it shares."""
    return jax.tree.map(lambda mine, base: base if mine is None else mine, own, base_params(state),
                        is_leaf=lambda x: x is None)


def tree_bytes(tree) -> int:
    """Global bytes of the arrays in `tree` (None leaves count nothing)."""
    return sum(x.nbytes for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------------------------- the engine


class HybridEngine:
    """Actor, critic, reference and reward model on `mesh` (see the module docstring).

    `actor` and `critic` are (OPTConfig, host params) pairs: the Step 1 model and the Step 2 reward model
    (with its value head). `total_steps` is the number of optimizer steps each of actor and critic will take
    (for the learning-rate schedules). `self.state` is everything that training changes, one pytree (what
    Orbax saves); the frozen models' own leaves are rebuilt from the same folders on resume.
    """

    def __init__(self, cfg: EngineConfig, mesh, actor: tuple[OPTConfig, Any], critic: tuple[OPTConfig, Any], *,
                 total_steps: int, eos_id: int | None = None, pad_id: int | None = None):
        self.cfg, self.mesh = cfg, mesh
        (self.actor_config, actor_params), (self.critic_config, critic_params) = actor, critic
        check_tp(self.actor_config.num_attention_heads, mesh)
        self.eos_id = self.actor_config.eos_token_id if eos_id is None else eos_id
        self.pad_id = self.actor_config.pad_token_id if pad_id is None else pad_id
        key = jax.random.key(cfg.seed)
        self.actor_tx = make_optimizer(cfg.actor.optim, total_steps, cfg.actor.lora)
        self.critic_tx = make_optimizer(cfg.critic.optim, total_steps, cfg.critic.lora)
        actor_state = create_state(actor_params, cfg.actor.lora, self.actor_tx, jax.random.fold_in(key, 1), mesh)
        critic_state = create_state(critic_params, cfg.critic.lora, self.critic_tx, jax.random.fold_in(key, 2), mesh)
        frozen_dtype = self.actor_config.compute_dtype  # what the forward casts to anyway
        self.ref_own = reshard(own_leaves(actor_params, never_moves(actor_state, cfg.actor.lora), frozen_dtype), "fsdp", mesh)
        self.reward_own = reshard(own_leaves(critic_params, never_moves(critic_state, cfg.critic.lora),
                                             self.critic_config.compute_dtype), "fsdp", mesh)
        self.state = {"actor": actor_state, "critic": critic_state, "kl_coef": jnp.float32(cfg.kl_coef),
                      "iteration": jnp.zeros((), jnp.int32)}
        if cfg.enable_ema:
            fused = lambda s: effective_params(s, cfg.actor.lora)
            self.state["ema"] = jax.jit(fused, out_shardings=shardings_for(jax.eval_shape(fused, actor_state), "fsdp", mesh))(actor_state)
        self.timings: dict[str, float] = {}
        self.reshard_bytes = 0
        self._compile()

    # ---------------------------------------------------------------------------------------- compiled pieces

    def shardings(self, state=None):
        """The shardings of `self.state` (or a tree shaped like it): FSDP for every model, scalars replicated."""
        state = self.state if state is None else state
        replicated = NamedSharding(self.mesh, P())
        out = {"actor": state_shardings(state["actor"], self.mesh), "critic": state_shardings(state["critic"], self.mesh),
               "kl_coef": replicated, "iteration": replicated}
        if "ema" in state:
            out["ema"] = shardings_for(state["ema"], "fsdp", self.mesh)
        return out

    def _compile(self):
        cfg, mesh = self.cfg, self.mesh
        actor_cfg, critic_cfg = self.actor_config, self.critic_config
        rows = batch_sharding(mesh, "fsdp")
        shardings = self.shardings()

        def answer_logprobs(params, exp, key=None):  # [B, G]: log p of each answer token
            G = exp["mask"].shape[1]
            out = logits(actor_cfg, params, exp["seq"], exp["seq_mask"], dropout_rng=key)
            return losses.token_logprobs(out, exp["seq"])[:, -G:]

        def answer_values(config, params, exp, key=None):  # [B, G]: the value where each answer token was chosen
            G = exp["mask"].shape[1]
            return values(config, params, exp["seq"], exp["seq_mask"], dropout_rng=key)[:, -G - 1 : -1]

        def to_generation(actor_state):  # fused, in the compute dtype: the copy that is resharded and generates
            dtype = actor_cfg.compute_dtype
            return jax.tree.map(lambda x: x.astype(dtype), effective_params(actor_state, cfg.actor.lora))

        gen_shapes = jax.eval_shape(to_generation, self.state["actor"])
        self._to_generation = jax.jit(to_generation, out_shardings=shardings_for(gen_shapes, "fsdp", mesh))

        def score(state, ref_own, reward_own, prompt_ids, prompt_mask, tokens, mask, gen_logprobs):
            c = lambda x: jax.lax.with_sharding_constraint(x, rows)
            exp = {"seq": c(jnp.concatenate([prompt_ids, tokens], 1)), "seq_mask": c(jnp.concatenate([prompt_mask, mask], 1)),
                   "mask": c(mask)}
            actor, critic = state["actor"], state["critic"]
            if cfg.old_logprobs_from_generation:
                exp["logprobs"] = c(gen_logprobs * mask)
            else:
                exp["logprobs"] = answer_logprobs(effective_params(actor, cfg.actor.lora), exp) * mask
            exp["ref_logprobs"] = answer_logprobs(with_shared(ref_own, actor), exp) * mask
            exp["values"] = answer_values(critic_cfg, effective_params(critic, cfg.critic.lora), exp) * mask
            reward = values(critic_cfg, with_shared(reward_own, critic), exp["seq"], exp["seq_mask"])
            last = prompt_ids.shape[1] + jnp.sum(mask, axis=1) - 1  # the answer's last real token (EOS if it ended)
            exp["scores"] = jnp.take_along_axis(reward, last[:, None], axis=1)[:, 0]
            return exp

        self._score = jax.jit(score, out_shardings=rows)  # every output is [B, ...], rows over all devices

        def advantages(exp, kl_coef):
            rewards = losses.compute_rewards(exp["logprobs"], exp["ref_logprobs"], exp["scores"], exp["mask"], kl_coef,
                                             cfg.clip_score)
            adv, ret = losses.gae(exp["values"], rewards, exp["mask"], cfg.gamma, cfg.lam)
            if cfg.whiten_advantages:
                adv = losses.whiten(adv, exp["mask"])
            return {**exp, "advantages": adv, "returns": ret, "rewards": rewards}

        def actor_loss(params, exp, key):
            lp = answer_logprobs(params, exp, key)
            loss = losses.actor_loss(lp, exp["logprobs"], exp["advantages"], exp["mask"], cfg.clip_ratio)
            metrics = {"actor_loss": loss}
            if "unsup" in exp:  # DeepSpeed-Chat's mixture training, in the same step
                u = exp["unsup"]
                total, count, _ = losses.lm_loss(logits(actor_cfg, params, u["input_ids"], u["attention_mask"], dropout_rng=key),
                                                 u["input_ids"], u["loss_mask"])
                metrics["unsup_loss"] = total / jnp.maximum(count, 1)
                loss = loss + cfg.unsup_coef * metrics["unsup_loss"]
            return loss, jnp.float32(1), metrics

        def critic_loss(params, exp, key):
            v = answer_values(critic_cfg, params, exp, key)
            loss = losses.critic_loss(v, exp["values"], exp["returns"], exp["mask"], cfg.clip_value)
            return loss, jnp.float32(1), {"critic_loss": loss}

        one_micro = lambda step: lambda state, exp: step(state, jax.tree.map(lambda x: x[None], exp))  # [1, B, ...]
        actor_step = one_micro(make_train_step(actor_loss, self.actor_tx, cfg.actor.lora))
        critic_step = one_micro(make_train_step(critic_loss, self.critic_tx, cfg.critic.lora))

        def actor_update(actor, ema, exp):
            actor, metrics = actor_step(actor, exp)
            if ema is not None:
                fused = effective_params(actor, cfg.actor.lora)
                ema = jax.tree.map(lambda e, a: cfg.ema_decay * e + (1 - cfg.ema_decay) * a.astype(e.dtype), ema, fused)
            return actor, ema, metrics

        def stats(exp):
            m = exp["mask"].astype(jnp.float32)
            return {"reward": jnp.mean(exp["scores"]), "kl": jnp.sum((exp["logprobs"] - exp["ref_logprobs"]) * m) / m.shape[0],
                    "answer_len": jnp.mean(m.sum(1)), "advantage": losses.masked_mean(exp["advantages"], m),
                    "return": losses.masked_mean(exp["returns"], m), "value": losses.masked_mean(exp["values"], m)}

        self._advantages = jax.jit(lambda exp, kl_coef: (lambda e: (e, stats(e)))(advantages(exp, kl_coef)))
        self._actor_update = jax.jit(actor_update, donate_argnums=(0, 1),
                                     out_shardings=(shardings["actor"], shardings.get("ema"), None))
        self._critic_update = jax.jit(critic_step, donate_argnums=0, out_shardings=(shardings["critic"], None))

    # ------------------------------------------------------------------------------------------------ verbs

    def _timed(self, phase: str, fn, *args):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - start
        return out

    def generate_experience(self, prompt_batch: dict) -> dict:
        """Answers to left-padded prompts {"prompt_ids", "prompt_mask"} [B, P] (host or device arrays) and
        their scores; returns the experience: seq, seq_mask [B, P + G]; mask, tokens, logprobs,
        ref_logprobs, values [B, G]; scores [B]; all on the mesh, rows split over every device."""
        cfg, mesh = self.cfg, self.mesh
        ids, mask = prompt_batch["prompt_ids"], prompt_batch["prompt_mask"]
        if ids.shape[1] + cfg.max_answer_len > self.actor_config.max_position_embeddings:
            raise ValueError(f"max_prompt_len ({ids.shape[1]}) + max_answer_len ({cfg.max_answer_len}) exceeds the "
                             f"actor's {self.actor_config.max_position_embeddings} positions")
        gen_rows = batch_sharding(mesh, "tp")
        ids, mask = (jax.device_put(np.asarray(x), gen_rows) if isinstance(x, np.ndarray) else x for x in (ids, mask))
        # One copy of the actor's weights in the generation layout; the FSDP-layout temporary is given up as
        # soon as it has moved (it is always a new tree: LoRA fused and/or cast, or at least a jit output).
        actor_leaves = {id(x) for x in jax.tree.leaves(self.state["actor"])}
        fresh = lambda tree: [x for x in jax.tree.leaves(tree) if id(x) not in actor_leaves]

        def to_tp():  # jit may hand back an untouched input (fp32, no LoRA): never free the actor's own arrays
            fsdp = self._to_generation(self.state["actor"])
            return reshard(fsdp, "tp", mesh, donate=len(fresh(fsdp)) == len(jax.tree.leaves(fsdp)))

        params = self._timed("reshard", to_tp)
        self.reshard_bytes = tree_bytes(params)
        key = jax.random.fold_in(jax.random.key(cfg.seed), int(self.state["iteration"]))
        def answer():
            gen = generate(self.actor_config, params, ids, mask, key, max_new_tokens=cfg.max_answer_len,
                           temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, eos_id=self.eos_id,
                           pad_id=self.pad_id, mesh=mesh)
            return gen.tokens, gen.mask, gen.logprobs

        tokens, answer_mask, gen_logprobs = self._timed("generate", answer)
        for leaf in fresh(params):  # DeepSpeed-Chat's release of the inference copy
            leaf.delete()
        del params
        exp = self._timed("score", self._score, self.state, self.ref_own, self.reward_own, ids, mask, tokens, answer_mask,
                          gen_logprobs)
        exp["generation_logprobs"] = gen_logprobs
        self.state["iteration"] = self.state["iteration"] + 1
        return exp

    def train_rlhf(self, experience: dict, unsupervised: dict | None = None) -> dict:
        """One PPO step of the actor (plus the mixture LM loss on `unsupervised`, a Step 1-style batch) and one
        of the critic on `experience`; the EMA follows the actor. Returns the batch's figures as floats."""
        exp = {k: experience[k] for k in ("seq", "seq_mask", "mask", "logprobs", "ref_logprobs", "values", "scores")}
        if unsupervised is not None:
            exp["unsup"] = {k: jax.device_put(np.asarray(v), batch_sharding(self.mesh, "fsdp")) if isinstance(v, np.ndarray)
                            else v for k, v in unsupervised.items()}
        exp, stats = self._timed("advantages", self._advantages, exp, self.state["kl_coef"])
        actor, ema, a = self._timed("actor_step", self._actor_update, self.state["actor"], self.state.get("ema"), exp)
        self.state.update(actor=actor, **({"ema": ema} if ema is not None else {}))
        critic, c = self._timed("critic_step", self._critic_update, self.state["critic"], exp)
        self.state["critic"] = critic
        stats.update(actor_loss=a["actor_loss"], actor_grad_norm=a["grad_norm"], critic_loss=c["critic_loss"],
                     critic_grad_norm=c["grad_norm"], kl_coef=self.state["kl_coef"], **{k: a[k] for k in ("unsup_loss",) if k in a})
        stats = {k: float(v) for k, v in jax.device_get(stats).items()}
        if self.cfg.kl_target is not None:  # adaptive KL controller: move beta towards the target KL
            error = float(np.clip(stats["kl"] / self.cfg.kl_target - 1, -0.2, 0.2))
            batch = experience["mask"].shape[0]
            self.state["kl_coef"] = jnp.float32(float(self.state["kl_coef"]) * (1 + error * batch / self.cfg.kl_horizon))
        return stats

    # ------------------------------------------------------------------------------------------------ views

    def actor_params(self):
        """The actor's weights as it runs (LoRA fused), FSDP layout."""
        return effective_params(self.state["actor"], self.cfg.actor.lora)

    def critic_params(self):
        return effective_params(self.state["critic"], self.cfg.critic.lora)

    def reference_params(self):
        return with_shared(self.ref_own, self.state["actor"])

    def reward_params(self):
        return with_shared(self.reward_own, self.state["critic"])
