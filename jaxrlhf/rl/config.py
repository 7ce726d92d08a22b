"""The settings of Step 3: the hybrid engine's (EngineConfig, one ModelSide each for the actor and the critic) and
the run's (PPOConfig: data, length, logging, saving, alarms), read from YAML with dotted overrides (jaxrlhf.config).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from jaxrlhf.alarms import AlarmConfig
from jaxrlhf.config import ConfigError, check_fields
from jaxrlhf.data import DataConfig
from jaxrlhf.loop import LoopConfig
from jaxrlhf.lora import LoRAConfig
from jaxrlhf.models import LOGITS_CHUNK
from jaxrlhf.optim import OptimConfig
from jaxrlhf.rewards import RewardConfig

#: the algorithms whose baseline is the group's (n answers per prompt, n >= 2)
GROUPED = ("grpo", "gspo", "rloo", "reinforce_pp_baseline")


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
    #: keep the optimizer state in host memory (pinned_host), on the device only during this model's step
    #: (DeepSpeed-Chat's --offload)
    offload: bool = False
    #: the actor's log-probs and LM loss run the LM head's log-softmax on this many tokens at a time (over the whole
    #: micro-batch), never holding [B, T, V] float32 logits; 0: in one piece (models.head_logprobs)
    logits_chunk: int = LOGITS_CHUNK

    def __post_init__(self):
        check_fields(self, dropout="[0, 1)", logits_chunk=">= 0")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What the hybrid engine needs: the trainable models and the algorithm's settings.

    algorithm=ppo trains the actor and a critic (GAE on its values); the others train the actor alone: no critic is
    created, trained or exported (critic.model is then the reward model only, and the critic's other settings,
    clip_value, lam and whiten_advantages are unused). Settings left at "auto" (kl_loss, loss_agg) and the clip
    range take each algorithm's published defaults: the properties kl_estimator, aggregation and clip_range."""

    #: ppo (actor + critic, GAE) | grpo (group-mean baseline, / group std) | gspo (GRPO's advantages, GSPO's
    #: sequence-level ratio and clip) | rloo (leave-one-out baseline) | reinforce_pp (REINFORCE++: returns normalised
    #: over the batch) | reinforce_pp_baseline (group mean subtracted, / the batch's std); all but ppo are critic-free
    #: (see jaxrlhf.rl.losses)
    algorithm: Literal["ppo", "grpo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "ppo"
    #: answers sampled per prompt, n: each prompt repeated n times side by side, one group kept together through
    #: generation, scoring and the advantages; a generation batch holds batch_size prompts x n answers (as veRL's
    #: rollout.n; the group algorithms, all critic-free ones but reinforce_pp, need n >= 2)
    num_samples_per_prompt: int = 1
    #: grpo, gspo: divide each group's advantages by its reward std + 1e-6 (false: Dr. GRPO's unscaled group mean)
    scale_rewards: bool = True
    #: DAPO's dynamic sampling (group algorithms): groups whose rewards are all equal (no learning signal) are dropped
    #: and more prompts drawn until batch_size prompts' groups are kept (jaxrlhf.ppo)
    dynamic_sampling: bool = False
    #: dynamic sampling's cap: generation batches drawn at most per trained batch; at the cap the batch is filled
    #: with dropped groups left out of the loss (so the batch keeps its shape)
    max_draws: int = 4
    #: DAPO's over-long filtering: answers cut at max_answer_len without an EOS are left out of the loss
    overlong_filter: bool = False
    #: DAPO's soft over-long punishment, its buffer L_cache in tokens (0: off): with L = max_answer_len, an answer of
    #: n tokens gets overlong_penalty x min(0, max(-1, ((L - L_cache) - n) / L_cache)) added to its reward
    overlong_buffer: int = 0
    #: the soft over-long punishment's largest penalty (DAPO: 1)
    overlong_penalty: float = 1.0

    actor: ModelSide = ModelSide(optim=OptimConfig(learning_rate=9.65e-6, warmup_steps=100))
    critic: ModelSide = ModelSide(optim=OptimConfig(learning_rate=5e-6, warmup_steps=100))
    #: bf16: bf16 compute, fp32 master weights (frozen models stored in bf16); fp32; pure_bf16
    precision: Literal["bf16", "fp32", "pure_bf16"] = "bf16"
    #: tokens generated per answer (DeepSpeed-Chat's max_answer_seq_len)
    max_answer_len: int = 256
    #: sampling temperature of the answers (0: greedy)
    temperature: float = 1.0
    #: sample from the k most likely tokens only (0: off)
    top_k: int = 0
    #: sample from the smallest set of tokens holding this probability (1: off)
    top_p: float = 1.0
    #: decode slots of generation (0: 256, or one per prompt in a smaller batch). Fewer slots than prompts is
    #: continuous batching: a slot whose answer ended takes the next waiting prompt, so decode steps go to live rows
    #: (real answers are short and uneven) and the KV cache holds only the slots' rows
    decode_slots: int = 0
    #: prompts prefilled at a time into freed slots (0: decode_slots / 8)
    refill_size: int = 0
    #: tokens per device in a micro-batch of scoring and of both training steps: several of the experience's prompt +
    #: answer sequences joined into each row (jaxrlhf.rl.packing), not padded to max_prompt_len + max_answer_len, so
    #: micro-batches are set by tokens, not rows (at least one sequence: max_prompt_len + max_answer_len)
    max_tokens_per_micro_batch: int = 16384
    #: a batch's packed rows are as wide as its longest sequence rounded up to this (fewer shapes to compile)
    packed_width_multiple: int = 64
    #: tensor-parallel size of the generation layout (DeepSpeed-Chat's inference_tp_size)
    inference_tp_size: int = 1
    #: keep the reference model's own leaves in host memory, on the device only while scoring
    #: (--offload_reference_model)
    offload_reference_model: bool = False
    #: keep the reward model's own leaves in host memory, on the device only while scoring (--offload_reward_model)
    offload_reward_model: bool = False
    #: where the old log-probs (the PPO ratio's denominator) come from: scoring (an actor forward in scoring, as
    #: DeepSpeed-Chat) | step (the actor step's own forward, detached, as TRL with one iteration: the same weights, so
    #: exact in the first actor step after the batch's generation; one actor forward less) | generation (generation's
    #: own: one forward less, ~1e-2 a token from the training forward's in bf16, docs/differences.md) | auto (step
    #: wherever it is exact, else scoring: old_logprobs_refusal)
    old_logprobs: Literal["auto", "scoring", "step", "generation"] = "auto"
    #: KL penalty coefficient beta in r_t = -beta * (log p - log p_ref)
    kl_coef: float = 0.1
    #: adaptive KL controller (Ziegler et al. 2019): the KL per answer to steer kl_coef towards (null: fixed kl_coef)
    kl_target: float | None = None
    #: its horizon in samples: kl_coef *= 1 + clip(KL / kl_target - 1, -0.2, 0.2) * batch / kl_horizon, once per
    #: generation batch (every PPO epoch over a batch uses the coefficient it was generated under)
    kl_horizon: int = 10000
    #: the reward: the reward model's score (critic.model's), Python functions' or a weighted sum (jaxrlhf.rewards)
    reward: RewardConfig = RewardConfig()
    #: the reward model's score (times reward.model_weight) is clipped to [-clip_score, clip_score]; the reward
    #: functions' scores are added unclipped (jaxrlhf.rewards)
    clip_score: float = 5.0
    #: PPO ratio clip (DeepSpeed-Chat's cliprange; gspo does not use it, see clip_ratio_low)
    clip_ratio: float = 0.2
    #: the ratio's lower clip, 1 - clip_ratio_low (null: clip_ratio; gspo: 3e-4, its paper's and veRL's)
    clip_ratio_low: float | None = None
    #: the ratio's upper clip, 1 + clip_ratio_high (null: clip_ratio, gspo 4e-4; DAPO's clip-higher: e.g. 0.28 with
    #: low 0.2)
    clip_ratio_high: float | None = None
    #: how the policy loss (and a KL loss) is averaged: token_mean (every answer token alike: PPO's, DAPO's) |
    #: seq_mean_token_mean (each answer's mean, then the answers' mean: GRPO's and GSPO's papers) |
    #: seq_mean_token_sum | auto (seq_mean_token_mean for gspo, whose ratio is per answer; else token_mean)
    loss_agg: Literal["auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "auto"
    #: where the KL to the reference goes: none (in the reward, kl_coef per token, as PPO) | k1 | k3 (a loss term of
    #: weight kl_loss_coef, k1 = log p - log p_ref or k3 = exp(-k1) + k1 - 1 per token, and no KL in the reward) |
    #: auto (k3 in the loss for grpo, gspo and reinforce_pp_baseline, as DeepSeekMath, veRL and OpenRLHF; in the
    #: reward for ppo, rloo and reinforce_pp, as their papers). A KL in the reward of a group algorithm becomes part
    #: of the advantages: divided by the group's std, its noise is amplified (docs/differences.md)
    kl_loss: Literal["auto", "none", "k1", "k3"] = "auto"
    #: the KL loss term's weight (veRL's GRPO examples' 0.001; DeepSeekMath 0.04; docs/differences.md)
    kl_loss_coef: float = 0.001
    #: value clip of the critic loss (DeepSpeed-Chat's cliprange_value)
    clip_value: float = 0.2
    #: GAE discount
    gamma: float = 1.0
    #: GAE lambda
    lam: float = 0.95
    #: whiten the advantages over each batch
    whiten_advantages: bool = False
    #: keep an exponential moving average of the actor (written as actor_ema)
    enable_ema: bool = False
    #: ema = ema_decay * ema + (1 - ema_decay) * actor after each actor step
    ema_decay: float = 0.992
    #: weight of the mixture LM loss on the unsupervised set (data.unsupervised_data_path)
    unsup_coef: float = 27.8
    #: seed of the sampling (the models' own seeds come from it too)
    seed: int = 1234

    def __post_init__(self):
        rules = {  # besides every float finite and the seed in range (check_fields)
            ">= 1": ("max_answer_len", "packed_width_multiple", "inference_tp_size", "kl_horizon", "max_draws"),
            ">= 0": ("temperature", "top_k", "decode_slots", "refill_size", "kl_coef", "kl_loss_coef", "unsup_coef")
            + ("overlong_buffer", "overlong_penalty"),
            "> 0": ("kl_target", "clip_score", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_value"),
            "(0, 1]": ("top_p", "gamma"),
            "[0, 1]": ("lam",),
            "[0, 1)": ("ema_decay",),
        }
        check_fields(self, **{name: rule for rule, names in rules.items() for name in names})
        hints = typing.get_type_hints(EngineConfig)  # the choices of Literal fields, checked here for Python callers
        for name in ("precision", "algorithm", "loss_agg", "kl_loss", "old_logprobs"):
            if getattr(self, name) not in typing.get_args(hints[name]):
                choices = list(typing.get_args(hints[name]))
                raise ConfigError(f"{name}: expected one of {choices}, got {getattr(self, name)!r}")
        if self.max_tokens_per_micro_batch < 1:
            raise ConfigError(
                "max_tokens_per_micro_batch: expected >= 1 (tokens per device in a packed micro-batch; the padded "
                f"path of 0 is gone), got {self.max_tokens_per_micro_batch}"
            )
        if self.num_samples_per_prompt < (2 if self.grouped else 1):
            raise ConfigError(
                f"num_samples_per_prompt: expected >= 1, and >= 2 for {', '.join(GROUPED)} (their baseline is the "
                f"other answers to the same prompt); got {self.num_samples_per_prompt} with algorithm {self.algorithm}"
            )
        if self.dynamic_sampling and not self.grouped:
            raise ConfigError(
                f"dynamic_sampling: drops groups of equal rewards; algorithm {self.algorithm} has no groups (use one "
                f"of {', '.join(GROUPED)})"
            )
        if self.overlong_buffer > self.max_answer_len:
            raise ConfigError(
                f"overlong_buffer: expected at most max_answer_len ({self.max_answer_len}), got {self.overlong_buffer}"
            )
        if self.kl_estimator != "none" and self.kl_target is not None:
            raise ConfigError(
                "kl_target: the adaptive KL controller steers the KL in the reward; with a KL loss term (kl_loss "
                f"{self.kl_loss}, algorithm {self.algorithm}) there is none (kl_target=null, or kl_loss=none)"
            )
        if self.old_logprobs == "step" and self.old_logprobs_refusal():
            raise ConfigError(
                "old_logprobs: step takes them from the actor step's own forward, exact only where nothing reads them "
                f"before that step; here {self.old_logprobs_refusal()} (old_logprobs: scoring, or auto)"
            )

    def old_logprobs_refusal(self) -> str | None:
        """Why the actor step's own forward cannot give the old log-probs (old_logprobs step), or None where it gives
        them exactly: nothing may read them before the first actor step after the batch's generation."""
        if self.kl_target is not None:
            return "the adaptive KL controller (kl_target) steps on the batch's KL before the actor step"
        if self.whiten_advantages:
            return "whitened advantages read every answer's old log-probs before the actor step"
        if self.kl_estimator == "none" and self.algorithm != "ppo":
            return f"{self.algorithm}'s advantages read other answers' old log-probs (the KL in the reward)"
        return None

    @property
    def old_logprobs_source(self) -> str:
        """old_logprobs resolved: "scoring", "step" or "generation"."""
        if self.old_logprobs != "auto":
            return self.old_logprobs
        return "scoring" if self.old_logprobs_refusal() else "step"

    @property
    def critic_free(self) -> bool:
        """True when no critic is trained (every algorithm but ppo)."""
        return self.algorithm != "ppo"

    @property
    def grouped(self) -> bool:
        """True where the baseline is the group's: n answers to each prompt (GROUPED)."""
        return self.algorithm in GROUPED

    @property
    def kl_estimator(self) -> str:
        """kl_loss resolved: "none" (the KL in the reward), "k1" or "k3" (a loss term)."""
        if self.kl_loss != "auto":
            return self.kl_loss
        return "k3" if self.algorithm in ("grpo", "gspo", "reinforce_pp_baseline") else "none"

    @property
    def aggregation(self) -> str:
        """loss_agg resolved (losses.aggregate's mode)."""
        if self.loss_agg != "auto":
            return self.loss_agg
        return "seq_mean_token_mean" if self.algorithm == "gspo" else "token_mean"

    @property
    def clip_range(self) -> tuple[float, float]:
        """(low, high): the ratio is clipped to [1 - low, 1 + high] (gspo's defaults: its paper's 3e-4, 4e-4)."""
        default = (3e-4, 4e-4) if self.algorithm == "gspo" else (self.clip_ratio, self.clip_ratio)
        low = default[0] if self.clip_ratio_low is None else self.clip_ratio_low
        return low, default[1] if self.clip_ratio_high is None else self.clip_ratio_high


@dataclasses.dataclass(frozen=True)
class PPOConfig(EngineConfig, LoopConfig):
    """Step 3's settings: the engine's (EngineConfig), the run's (loop.LoopConfig: a step is an iteration) and these."""

    output_dir: str = "runs/ppo"  # LoopConfig's, Step 3's default: actor/, critic/, actor_ema/ (HF folders) go there
    log_every: int = 1  # LoopConfig's, Step 3's default
    #: prompts per generation batch, over all devices (DeepSpeed-Chat: per-device batch x devices); the batch holds
    #: batch_size x num_samples_per_prompt answers, which must split over the devices
    batch_size: int = 16
    #: generation batches per iteration; each then gets one actor and one critic step per PPO epoch
    generation_batches: int = 1
    #: passes over an iteration's experience
    ppo_epochs: int = 1
    #: rows per mixture LM batch (0: batch_size)
    unsup_batch_size: int = 0
    #: answer and score the held-out prompts (the data's eval split) every this many iterations and at the end,
    #: logged as the "eval" split: reward, reward/NAME per function, answer_len, ... (veRL's test_freq; 0: never)
    eval_every: int = 0
    #: batches of batch_size held-out prompts per evaluation (0: every whole batch of the eval split)
    eval_batches: int = 0
    #: print a prompt and its answer at every log (DeepSpeed-Chat's --print_answers)
    print_answers: bool = False
    #: reward-hacking alarms: bounds on answer length, repetition, entropy and KL; learned vs gold reward trend
    alarms: AlarmConfig = AlarmConfig()
    #: device memory in GiB that the memory plan must fit (0: the device's bytes_limit; the CPU reports none, so
    #: nothing is checked there unless set); see python -m jaxrlhf.plan
    device_memory_gib: float = 0.0
    data: DataConfig = DataConfig(max_prompt_len=256)

    def __post_init__(self):
        EngineConfig.__post_init__(self)
        LoopConfig.__post_init__(self)
        rules = {
            ">= 1": ("batch_size", "generation_batches", "ppo_epochs"),
            ">= 0": ("unsup_batch_size", "device_memory_gib", "eval_every", "eval_batches"),
        }
        check_fields(self, **{n: rule for rule, names in rules.items() for n in names})

    def old_logprobs_refusal(self) -> str | None:
        if self.generation_batches > 1:
            return "with generation_batches > 1 a batch is trained after another batch's actor step"
        return super().old_logprobs_refusal()
