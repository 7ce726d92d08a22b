"""The hybrid engine of Step 3: four models on one mesh, and DeepSpeed-Chat's two verbs.

    actor      trainable   a train state in the FSDP layout (jaxrlhf.optim: trainable/frozen/opt/step/rng)
    critic     trainable   the same, initialised from the Step 2 reward model (value head included)
    reference  frozen      the Step 1 weights: the actor's own base leaves wherever they never move (the
                           kernels that carry LoRA adapters; everything under only_optimize_lora), plus a copy
                           of the other leaves. Without LoRA that copy is the whole model.
    reward     frozen      the Step 2 weights, sharing the critic's never-moving base leaves the same way; none
                           where reward.model_weight is 0 (the reward is Python functions' alone, jaxrlhf.rewards)
    ema        optional    fused actor weights, float32; ema = decay * ema + (1 - decay) * actor after each actor step

    generate_experience(prompts [B, P] left-padded):
        one layer at a time: fuse LoRA, cast to the compute dtype, reshard to the "tp" layout, give each layer its
        own arrays (generate.decode_params) ──generate (early exit; decode_slots refilled from the batch)──►
        answers [B, G] ──drop the generation copy (the KV cache lives only inside the compiled generate call)──►
        score in the FSDP layout, no gradients (rl/experience.py): old log-probs, reference log-probs, critic values,
        reward score, in packed micro-batches (rl/packing.py: several sequences to a row, each its own segment, a
        token budget each), while the reward functions score the decoded answers on the host (a thread) ──► their
        weighted sum added to the reward model's ──► the adaptive KL coefficient's step (once per generation
        batch; the batch keeps the one it was scored under)
    train_rlhf(experience[, unsupervised batch]):
        rewards (KL penalty + clipped score) ──► GAE (on the padded [B, G] block) ──► actor PPO step (rl/steps.py)
        (+ unsup_coef * LM loss): gradients summed over the packed micro-batches, divided once ──► EMA
        ──► critic step the same way;  states donated

Critic-free algorithms (algorithm grpo, rloo, reinforce_pp): no critic. The reward model then holds all its own
leaves, nothing is shared; scoring computes no values; each prompt is answered num_samples_per_prompt times (its
rows side by side: a group, whose answers differ by generation's per-row keys); the advantages come from the
group's or the batch's rewards (rl/experience.py) and train_rlhf runs the actor's step only.

Phases (each timed in `timings`, marked in a profile, run through `observer` if set): generate_experience is
_generation_copy ("reshard", a context that frees the copy on exit) -> _answer ("generate") -> _frozen_on_device
("offload", a context) -> _score ("score") -> _function_scores ("rewards") -> _kl_step; train_rlhf is "advantages"
then each model's _step ("actor_step", "critic_step"). held_out (Step 3's evaluation) runs generate_experience's
phases but _kl_step, with a sampling key of its own, then advantages for the figures: the state is not changed.
The engine owns Step 3's state (`state`): jaxrlhf.ppo checkpoints engine.state, and a restored one enters through
load_state.

Offload (ModelSide.offload, offload_reference_model, offload_reward_model): those trees live in pinned host
memory and are copied to the device for the program that uses them (an optimizer state for its model's step,
the reference and reward leaves for scoring), then freed there. jaxrlhf.plan counts them in those phases only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.distributed import to_host
from jaxrlhf.generate import DECODE_SLOTS, decode_params, generate, stop_tuple
from jaxrlhf.lora import LoRAConfig, adapted_mask
from jaxrlhf.optim import create_state, effective_params, place, state_shardings
from jaxrlhf.rl import packing, steps
from jaxrlhf.rl.config import EngineConfig
from jaxrlhf.rl.experience import (
    Static,
    advantages,
    base_params,
    group_spread,
    next_kl_coef,
    padded_experience,
    row_layout,
    score,
    take_rows,
    truncated_rows,
    with_shared,
)
from jaxrlhf.sharding import check_tp, reshard, shardings_for

#: what the losses read of an experience (train_rlhf's advantages and steps)
TRAINED = (
    "seq",
    "seq_mask",
    "mask",
    "logprobs",
    "ref_logprobs",
    "values",
    "scores",
    "function_scores",
    "scored",
    "truncated",
)
#: the sampling key of held-out answers (`held_out`), beside the iterations' (fold_in of the iteration): the same at
#: every evaluation, so that evaluations compare
HELD_OUT_KEY = 2**32 - 1

# --------------------------------------------------------------------------- weights shared with a frozen model


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


def free(tree, keep=None):
    """Delete the arrays of `tree` now, all but those that are also `keep`'s (a program hands back an untouched input
    as is): what is done with is gone before the next phase, not whenever Python collects it."""
    kept = {id(x) for x in jax.tree.leaves(keep)}
    for x in jax.tree.leaves(tree):
        if id(x) not in kept:
            x.delete()


def to_memory(tree, kind: str, donate: bool = False):
    """`tree` in memory `kind` ("pinned_host" or "device") with the same layout; `donate` frees the source (by
    hand once the copy exists: jax 0.11 cannot donate across memory kinds)."""
    out = jax.block_until_ready(jax.device_put(tree, jax.tree.map(lambda x: x.sharding.with_memory_kind(kind), tree)))
    if donate:
        free(tree, keep=out)
    return out


def repeat_rows(batch: dict, n: int) -> dict:
    """Every row of a prompt batch (arrays [B, ...] on the host or the device, lists [B]) repeated n times side by
    side: rows i n .. i n + n - 1 are prompt i's group."""
    if n == 1:
        return batch

    def rep(x):
        if isinstance(x, (list, tuple)):
            return [v for v in x for _ in range(n)]
        return (np if isinstance(x, np.ndarray) else jnp).repeat(x, n, axis=0)

    return {k: rep(v) for k, v in batch.items()}


def tree_bytes(tree) -> int:
    """Global bytes of the arrays in `tree` (None leaves count nothing)."""
    return sum(x.nbytes for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------------------------- the engine


class HybridEngine:
    """Actor, critic, reference and reward model on `mesh` (see the module docstring).

    `actor` and `critic` are (model config, host params) pairs: the Step 1 model and the Step 2 reward model
    (with its value head). `total_steps` is the number of optimizer steps each of actor and critic will take
    (for the learning-rate schedules). `self.state` is everything that training changes, one pytree (what
    Orbax saves); the frozen models' own leaves are rebuilt from the same folders on resume.
    """

    def __init__(
        self,
        cfg: EngineConfig,
        mesh,
        actor: tuple[Any, Any],
        critic: tuple[Any, Any],
        *,
        total_steps: int,
        eos_id: int | tuple[int, ...] | None = None,
        pad_id: int | None = None,
    ):
        self.cfg, self.mesh = cfg, mesh
        (self.actor_config, actor_params), (self.critic_config, critic_params) = actor, critic
        # Everything the compiled programs depend on besides array shapes: engines alike share their compilations.
        # Where arrays wait between uses changes no program: an offloaded engine shares the others' compilations.
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(EngineConfig)}
        fields.update(
            old_logprobs=cfg.old_logprobs_source,  # resolved by the whole config (a PPOConfig's loop settings too)
            offload_reference_model=False,
            offload_reward_model=False,
            **{n: dataclasses.replace(getattr(cfg, n), offload=False) for n in ("actor", "critic")},
        )
        engine_cfg = EngineConfig(**fields)
        self.static = Static(engine_cfg, self.actor_config, self.critic_config, total_steps, mesh)
        check_tp(self.actor_config.num_attention_heads, mesh)
        self.eos_id = stop_tuple(self.actor_config.eos_token_id if eos_id is None else eos_id)  # the stop ids
        self.pad_id = self.actor_config.pad_token_id if pad_id is None else pad_id
        # (a weak reference to a seq_mask, its micro-batches): the experience micro_batches planned last, not kept alive
        self._planned = (lambda: None, [])
        key = jax.random.key(cfg.seed)

        def create(name, params, i):  # offloaded Adam moments are born on the host
            side = getattr(cfg, name)
            memory = "pinned_host" if side.offload else "device"
            return create_state(params, side.lora, self.static.tx(name), jax.random.fold_in(key, i), mesh, memory)

        actor_state = create("actor", actor_params, 1)
        frozen_dtype = self.actor_config.compute_dtype  # what the forward casts to anyway
        self.ref_own = reshard(
            own_leaves(actor_params, never_moves(actor_state, cfg.actor.lora), frozen_dtype), "fsdp", mesh
        )
        self._replicated = lambda x: jax.device_put(x, NamedSharding(mesh, P()))
        self.state = {
            "actor": actor_state,
            "kl_coef": self._replicated(np.float32(cfg.kl_coef)),
            "iteration": self._replicated(np.int32(0)),
        }
        if cfg.critic_free:  # the reward model alone: all its leaves its own
            shared = jax.tree.map(lambda _: False, critic_params)
        else:
            self.state["critic"] = create("critic", critic_params, 2)
            shared = never_moves(self.state["critic"], cfg.critic.lora)
        # No reward model where reward.model_weight is 0 (the reward is Python functions' alone): none held or run.
        self.reward_own = (
            reshard(own_leaves(critic_params, shared, self.critic_config.compute_dtype), "fsdp", mesh)
            if cfg.reward.model_scale
            else None
        )
        if cfg.enable_ema:
            self.state["ema"] = steps.fused_actor(cfg.actor.lora, mesh, actor_state)
        self.timings: dict[str, float] = {}  # seconds per phase (ppo logs them per iteration)
        self.reshard_bytes = 0  # the last generation copy's
        self.steps_since_generation = 0  # actor steps since the last generate_experience (old_logprobs step)
        self.observer = None  # observer(phase, run) -> run(), around each phase (jaxrlhf.plan.measure)
        if cfg.offload_reference_model:
            self.ref_own = to_memory(self.ref_own, "pinned_host", donate=True)
        if cfg.offload_reward_model:
            self.reward_own = to_memory(self.reward_own, "pinned_host", donate=True)
        self.offload()

    # ------------------------------------------------------------------------------------------------ layout

    def shardings(self, state=None):
        """The shardings of `self.state` (or a tree shaped like it): FSDP for every model, scalars replicated."""
        state = self.state if state is None else state
        replicated = NamedSharding(self.mesh, P())
        out = {name: state_shardings(state[name], self.mesh) for name in self.trained if name in state}
        out.update(kl_coef=replicated, iteration=replicated)
        if "ema" in state:
            out["ema"] = shardings_for(state["ema"], "fsdp", self.mesh)
        return out

    def offload(self):
        """Move the optimizer states that the config offloads to host memory (after construction or a restore)."""
        for name in self.trained:
            self._opt_to(name, "pinned_host")

    def load_state(self, state: dict):
        """Take `state` (shaped like `self.state`, e.g. restored from a checkpoint onto `shardings()`) as the engine's
        own: the one door by which a state from outside enters. Its offloaded optimizer states go back to host
        memory."""
        if jax.tree.structure(state) != jax.tree.structure(self.state):
            raise ValueError("load_state: the state is not shaped like the engine's (another algorithm or settings?)")
        self.state = dict(state)
        self.offload()

    @property
    def trained(self) -> tuple[str, ...]:
        """The trainable models: the actor, and the critic unless the algorithm is critic-free."""
        return ("actor",) if self.cfg.critic_free else ("actor", "critic")

    def _opt_to(self, name: str, kind: str):
        state = self.state[name]
        elsewhere = any(x.sharding.memory_kind != kind for x in jax.tree.leaves(state["opt"]))
        if getattr(self.cfg, name).offload and elsewhere:
            self.state[name] = {**state, "opt": self._timed("offload", to_memory, state["opt"], kind, True)}

    # ------------------------------------------------------------------------------------------------ verbs

    def _timed(self, phase: str, fn, *args):
        """fn(*args) as phase `phase`: timed, marked in a profile (tools/common.py splits its kernels by phase) and
        run through the observer, if any (jaxrlhf.plan.measure's: `observer(phase, run)` returns run())."""
        run = lambda: jax.block_until_ready(fn(*args))  # noqa: E731
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation(f"jaxrlhf.{phase}"):
            out = run() if self.observer is None else self.observer(phase, run)
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - start
        return out

    def generate_experience(self, prompt_batch: dict, start_rewards=None, draw: int = 0) -> dict:
        """Answers to left-padded prompts {"prompt_ids", "prompt_mask"} [B, P] (host or device arrays; optionally
        "answer_limits" [B], each answer's own maximum length) and their scores. Returns the experience, on the mesh
        with rows split over every device: seq, seq_mask [B, P + G] (prompt then answer); mask (answer tokens up to
        and including EOS), logprobs (old), ref_logprobs, values, generation_logprobs (generation's own) [B, G]; scores
        [B] (reward.model_weight x the reward model's score; 0 without one), function_scores [B] (the reward functions'
        weighted sum), scored [B] (1, or 0 where a function left the answer out of the loss), with functions
        function_parts [B, F] (each one's own score, NaN where it gave none: the metrics'); kl_coef (the KL
        penalty's coefficient for this batch; an adaptive one then moves on this batch's KL).
        `start_rewards(prompt_batch, tokens, mask)`, given, is called with the answers [B, G] as soon as they exist and
        returns a Future of the reward functions' HostScores of this process's rows (jaxrlhf.ppo.reward_starter):
        they run on the host while the device scores. Also truncated [B] (1: no EOS within the answer's limit).
        `draw` > 0: an extra draw of dynamic sampling for the same generation batch (its own sampling key; the
        iteration counter, which keys the checkpoints, does not move)."""
        exp = self._experience(prompt_batch, start_rewards, draw)
        exp["kl_coef"] = self._kl_step(exp, draw)
        self.steps_since_generation = 0
        return exp

    def held_out(self, prompt_batch: dict, start_rewards=None) -> tuple[dict, dict]:
        """Held-out prompts answered and scored as generate_experience does (num_samples_per_prompt answers each), with
        a sampling key of their own, the same at every call, and the state untouched (no iteration, no KL step):
        Step 3's evaluation. Returns the experience and its figures as the training batch's (reward, kl, answer_len,
        truncated, ...: the same advantages program, on device)."""
        exp = self._experience(prompt_batch, start_rewards, None, old=True)
        return exp, advantages(self.static.returns, {k: exp[k] for k in TRAINED if k in exp}, self.state["kl_coef"])[1]

    def _experience(self, prompt_batch: dict, start_rewards, draw: int | None, old: bool = False) -> dict:
        """generate_experience's experience, without its KL coefficient (draw None: held-out answers' key); `old`:
        scored with the old log-probs even where the actor step would give them (held_out has no step)."""
        prompt_batch = repeat_rows(prompt_batch, self.cfg.num_samples_per_prompt)
        ids, mask = prompt_batch["prompt_ids"], prompt_batch["prompt_mask"]
        if isinstance(ids, np.ndarray):  # this process's rows, split over "data" as generation wants them
            ids, mask = place({"ids": ids, "mask": mask}, self.mesh, "tp").values()
        with self._generation_copy() as params:
            tokens, answer_mask, gen_logprobs = self._timed(
                "generate", self._answer, params, ids, mask, prompt_batch.get("answer_limits"), draw
            )
            pending = start_rewards(prompt_batch, tokens, answer_mask) if start_rewards else None
        source, scoring = self.static.cfg.old_logprobs, self.static.scoring
        if old and source == "step":
            scoring = dataclasses.replace(scoring, old=True)
        with self._frozen_on_device() as frozen:
            exp = self._timed("score", self._score, scoring, self._weights(), frozen, ids, mask, tokens, answer_mask)
        if source == "generation":
            exp["logprobs"] = gen_logprobs * answer_mask
        exp.update(self._function_scores(pending, exp["scores"]))
        exp["truncated"] = truncated_rows(self.mesh, tokens, answer_mask, self.eos_id)
        exp["generation_logprobs"] = gen_logprobs
        return exp

    # ------------------------------------------------------------------------------------------------ phases

    @contextlib.contextmanager
    def _generation_copy(self):
        """The actor's weights as generation runs them (phase "reshard"): LoRA fused, the compute dtype, the "tp"
        layout, each layer its own arrays (generate.decode_params, built one layer at a time). Freed on exit
        (DeepSpeed-Chat's release of the inference copy): the KV cache lives only inside the compiled generate call,
        so nothing of generation stays. The actor's own arrays are kept: jit hands back an untouched input as is."""

        def build():
            actor = effective_params(self.state["actor"], self.cfg.actor.lora, fused=False)
            return decode_params(self.actor_config, actor, self.mesh)

        params = self._timed("reshard", build)
        self.reshard_bytes = tree_bytes(params)
        try:
            yield params
        finally:
            free(params, keep=self.state["actor"])

    def _answer(self, params, ids, mask, limits, draw: int | None):
        """Phase "generate": the answers (tokens, mask, generation's log-probs [B, G]) with this iteration's key (and
        draw's; draw None: the held-out answers' key)."""
        cfg = self.cfg
        it = HELD_OUT_KEY if draw is None else int(self.state["iteration"])
        key = jax.random.fold_in(jax.random.key(cfg.seed), it)
        key = jax.random.fold_in(key, draw) if draw else key
        gen = generate(
            self.actor_config,
            params,
            ids,
            mask,
            key,
            max_new_tokens=cfg.max_answer_len,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            limits=limits,
            slots=cfg.decode_slots or DECODE_SLOTS,
            refill=cfg.refill_size,
            mesh=self.mesh,
            group=cfg.num_samples_per_prompt,  # repeat_rows' groups: each prompt prefilled once
        )
        return gen.tokens, gen.mask, gen.logprobs

    @contextlib.contextmanager
    def _frozen_on_device(self):
        """The reference's and reward model's own leaves for scoring: offloaded ones copied to the device (phase
        "offload") and those copies freed on exit; the host copies stay."""
        cfg, trees = self.cfg, (self.ref_own, self.reward_own)
        offloaded = (cfg.offload_reference_model, cfg.offload_reward_model)
        frozen = [self._timed("offload", to_memory, own, "device") if on else own for own, on in zip(trees, offloaded)]
        try:
            yield frozen
        finally:
            for tree, on in zip(frozen, offloaded):
                if on:
                    free(tree)

    def _weights(self) -> dict:
        """The trainable models' weights without their optimizer states (which may be in host memory)."""
        return {n: {k: v for k, v in self.state[n].items() if k in ("trainable", "frozen")} for n in self.trained}

    def _function_scores(self, pending, scores) -> dict:
        """function_scores and scored [B]: the reward functions' weighted sum and which rows they scored (0: a
        function returned None or timed out, left out of the loss), unclipped; zeros and ones without functions. With
        them function_parts [B, F]: each function's own scores.
        Phase "rewards": the wait for the functions after the device's scoring, if they outlast it."""
        if pending is None:
            return {"function_scores": scores * 0, "scored": scores * 0 + 1}
        done = self._timed("rewards", pending.result)
        parts = {"function_scores": done.scores, "scored": done.scored, "function_parts": done.parts}
        return place(parts, self.mesh, "fsdp")

    def _kl_step(self, exp: dict, draw: int):
        """The KL coefficient of this batch's rewards, the same in every PPO epoch. The adaptive controller then
        steps once per generation batch, on this batch's KL (Ziegler et al. 2019; TRL's PPOTrainer), and the
        iteration counter moves (not for an extra draw of dynamic sampling)."""
        kl_coef = self.state["kl_coef"]
        if self.cfg.kl_target is not None:
            self.state["kl_coef"] = next_kl_coef(self.static.returns, kl_coef, {**exp, "kl_coef": kl_coef})
        if not draw:
            self.state["iteration"] = self.state["iteration"] + 1
        return kl_coef

    def group_spread(self, exp: dict) -> np.ndarray:
        """[B / n] bool on the host: whether each group's rewards differ (dynamic sampling keeps those)."""
        return np.asarray(to_host(group_spread(self.static.returns, exp)))

    def select_rows(self, experiences: list[dict], rows, left_out=()) -> dict:
        """One experience from rows `rows` (indices into the experiences' rows one after another; their number must
        split over the devices) of experiences alike, kl_coef the first's; the rows at positions `left_out` of `rows`
        are kept for the shape but marked unscored (scored 0: out of the loss and of their group's statistics)."""
        rows = np.asarray(rows, np.int32)
        keep = np.ones(len(rows), np.float32)
        keep[list(left_out)] = 0.0
        per_row = [k for k, v in experiences[0].items() if k != "kl_coef" and getattr(v, "ndim", 0) >= 1]
        out = take_rows(self.mesh, [{k: e[k] for k in per_row} for e in experiences], rows, keep)
        return {**out, "kl_coef": experiences[0]["kl_coef"]}

    def _score(self, scoring, weights, frozen, ids, mask, tokens, answer_mask):
        """Phase "score": the experience scored in packed micro-batches of max_tokens_per_micro_batch
        (jaxrlhf.rl.packing): old log-probs (where `scoring` computes them: Scoring.old), reference log-probs,
        values, scores."""
        cfg, (B, G) = self.cfg, answer_mask.shape
        exp = padded_experience(self.mesh, ids, mask, tokens, answer_mask)
        names = {"ref_logprobs": True, "logprobs": scoring.old, "values": not cfg.critic_free}
        out = {k: jnp.zeros((B, G), jnp.float32) for k, on in names.items() if on}
        out = row_layout({**out, "scores": jnp.zeros((B,), jnp.float32)}, self.mesh)
        for micro in self.micro_batches(exp):
            out = score(scoring, weights, *frozen, exp, out, micro)
        return {**exp, **out}

    def micro_batches(self, exp: dict) -> list[packing.Micro]:
        """The packed micro-batches of an experience (packing.plan on its rows' real tokens; the same every time, so
        scoring and the training steps of one experience share one plan: it is kept for the seq_mask planned last)."""
        if self._planned[0]() is exp["seq_mask"]:
            return self._planned[1]
        seq_mask = np.asarray(to_host(exp["seq_mask"] != 0))  # whole on every process: one plan for all
        T, multiple = seq_mask.shape[1], self.cfg.packed_width_multiple
        budget = self.cfg.max_tokens_per_micro_batch
        micro = packing.plan(seq_mask, T - exp["mask"].shape[1], budget, self.mesh.size, multiple, max_width=T)
        self._planned = (weakref.ref(exp["seq_mask"]), micro)
        return micro

    def _step(self, name: str, exp: dict, micro: list, unsup: dict | None, parts: list, from_step: bool):
        """One optimizer step of `name` over the experience's packed micro-batches (plus, for the actor, the mixture
        batch `unsup` in its packed parts): gradients summed, divided once (rl/steps.py: step)."""
        ema = self.state.get("ema") if name == "actor" else None
        return steps.step(self.static, name, self.state[name], ema, exp, micro, unsup, parts, from_step)

    def train_rlhf(self, experience: dict, unsupervised: dict | None = None) -> dict:
        """One PPO step of the actor (plus the mixture LM loss on `unsupervised`, a Step 1-style batch) and one
        of the critic (if any) on `experience`; the EMA follows the actor. Returns the batch's figures as floats.
        An experience without old log-probs (old_logprobs step) gets the actor step's own, detached, as
        experience["logprobs"]: what later PPO epochs over it, the figures and the alarms read."""
        from_step = "logprobs" not in experience
        if from_step and self.steps_since_generation:
            raise RuntimeError(
                "old_logprobs step: this batch's old log-probs were to come from the actor step's own forward, but "
                f"the actor has stepped {self.steps_since_generation} time(s) since the last generate_experience, so "
                "its weights are no longer those that answered (several batches generated before training?); set "
                "old_logprobs: scoring"
            )
        raw, kl_coef = {k: experience[k] for k in TRAINED if k in experience}, experience["kl_coef"]
        unsup = unsupervised
        if unsupervised is not None and isinstance(unsupervised["input_ids"], np.ndarray):
            unsup = place(unsupervised, self.mesh, "fsdp")
        stand_in = {"logprobs": raw["ref_logprobs"]} if from_step else {}  # until the step gives them (the KL 0)
        exp, stats = self._timed("advantages", advantages, self.static.returns, {**raw, **stand_in}, kl_coef)
        if from_step:  # PPO's advantages are taken in the actor step (steps.ActorLoss)
            exp["kl_coef"] = kl_coef
        micro, parts, figures = self.micro_batches(experience), [], {}  # scoring's plan
        if unsup is not None:  # the mixture batch's gradient_accumulation_steps parts, each packed
            masks = to_host({k: unsup[k] != 0 for k in ("attention_mask", "loss_mask")})
            n, multiple = self.cfg.actor.optim.gradient_accumulation_steps, self.cfg.packed_width_multiple
            parts = packing.mixture_plan(masks["attention_mask"], masks["loss_mask"], n, self.mesh.size, multiple)
        for name in self.trained:  # the actor (with the mixture batch), then the critic
            self._opt_to(name, "device")  # offloaded optimizer states are on the device for their own step only
            part, own = (unsup, from_step) if name == "actor" else (None, False)
            self.state[name], ema, m = self._timed(f"{name}_step", self._step, name, exp, micro, part, parts, own)
            if ema is not None:
                self.state["ema"] = ema
            self._opt_to(name, "pinned_host")
            if own:  # the batch's figures and the critic's returns from the step's old log-probs
                experience["logprobs"] = raw["logprobs"] = m.pop("old_logprobs")
                exp, stats = self._timed("advantages", advantages, self.static.returns, raw, kl_coef)
            figures.update({f"{name}_skipped": m["skipped"], f"{name}_grad_norm": m["grad_norm"]})
            figures.update(
                {k: m[k] / m["count"] for k in ("actor_loss", "unsup_loss", "kl_loss", "critic_loss") if k in m}
            )
            if name == "actor":  # the ratio's diagnostics: token means, and its extremes (losses.ratio_figures)
                self.steps_since_generation += 1
                tokens = jnp.maximum(m["ratio_tokens"], 1)
                figures.update({k: m[k] / tokens for k in ("clip_frac", "approx_kl")}, ratio_mean=m["ratio"] / tokens)
                figures.update(ratio_min=m["ratio_min"], ratio_max=m["ratio_max"])
        if self.static.returns.kl_estimator == "none":  # the reward's KL coefficient; with a KL loss term it weighs
            stats["kl_coef"] = kl_coef  # nothing (GRPO's default) and is not reported
        return {k: float(v) for k, v in jax.device_get({**stats, **figures}).items()}

    # ------------------------------------------------------------------------------------------------ views

    def actor_params(self):
        """The actor's weights as it runs (LoRA fused), FSDP layout."""
        return effective_params(self.state["actor"], self.cfg.actor.lora)

    def critic_params(self):
        """The critic's weights (LoRA fused), FSDP layout; None without a critic."""
        return effective_params(self.state["critic"], self.cfg.critic.lora) if "critic" in self.state else None

    def ema_params(self):
        """The EMA of the actor in the actor's own dtypes (it is kept in float32), FSDP layout: what is exported."""
        return jax.tree.map(lambda e, a: e.astype(a.dtype), self.state["ema"], base_params(self.state["actor"]))

    def reference_params(self):
        return with_shared(self.ref_own, self.state["actor"])

    def reward_params(self):
        """The reward model's weights, FSDP layout; None without one (reward.model_weight 0)."""
        return None if self.reward_own is None else with_shared(self.reward_own, self.state.get("critic"))
