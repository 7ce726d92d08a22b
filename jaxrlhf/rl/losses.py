"""Step 3's math as small pure functions on masked arrays; each formula is in its docstring: PPO's (rewards, GAE,
the clipped losses, the adaptive KL controller) and the critic-free algorithms' advantages (GRPO, RLOO, REINFORCE++),
the KL loss estimators and the loss aggregations.

Answer positions t = 0 .. G - 1; mask[b, t] = 1 for generated tokens up to and including the first EOS,
so row b has n_b = sum(mask[b]) real tokens at t = 0 .. n_b - 1. Every mean is a masked mean over the
whole batch. The arrays are [B, G] float32 unless said otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf.losses import masked_mean


def sequence_kl(logprobs, ref_logprobs, mask):
    """The KL to the reference per answer, estimated on the sampled tokens:
    mean_b sum_t (logprobs - ref_logprobs) * mask."""
    return jnp.sum((logprobs - ref_logprobs) * mask.astype(jnp.float32)) / mask.shape[0]


def adaptive_kl_coef(kl_coef, kl, target: float, horizon: int, samples: int):
    """Ziegler et al.'s (2019) proportional controller, once per batch of `samples` answers whose KL per answer
    is `kl`: kl_coef * (1 + clip(kl / target - 1, -0.2, 0.2) * samples / horizon)."""
    return kl_coef * (1 + jnp.clip(kl / target - 1, -0.2, 0.2) * samples / horizon)


def compute_rewards(logprobs, ref_logprobs, score, mask, kl_coef: float = 0.1, clip_score: float = 5.0):
    """Per-token rewards [B, G]: r_t = -kl_coef * (logprobs_t - ref_logprobs_t) * mask_t, plus
    clip(score, -clip_score, clip_score) at each row's last real token t = n_b - 1 (score [B])."""
    mask = mask.astype(jnp.float32)
    rewards = -kl_coef * (logprobs - ref_logprobs) * mask
    last = jnp.arange(mask.shape[1])[None, :] == (jnp.sum(mask, axis=1, keepdims=True) - 1)
    return rewards + jnp.where(last, jnp.clip(score, -clip_score, clip_score)[:, None], 0.0)


def gae(values, rewards, mask, gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation -> (advantages, returns), both [B, G]:

        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   returns = A + V

    with V and A zero past the last real token (so the last real token's delta is r_t - V_t)."""
    mask = mask.astype(jnp.float32)
    values, rewards = values * mask, rewards * mask
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values

    def back(carry, delta_and_mask):  # from t = G - 1 down to 0
        delta, m = delta_and_mask
        a = (delta + gamma * lam * carry) * m
        return a, a

    _, adv = jax.lax.scan(back, jnp.zeros_like(deltas[:, 0]), (deltas.T, mask.T), reverse=True)
    adv = adv.T
    return adv, (adv + values) * mask


def whiten(x, mask, shift_mean: bool = True):
    """(x - masked_mean) / sqrt(masked_var + 1e-8), zero where mask is 0 (the mean kept if not shift_mean)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * jax.lax.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * mask.astype(x.dtype)


def policy_loss(logprobs, old_logprobs, advantages, clip_low: float = 0.2, clip_high: float | None = None):
    """PPO's clipped surrogate per token [B, G], with clip-higher (DAPO: clip_high > clip_low; None: clip_low):
    with ratio = exp(logprobs - old_logprobs), max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio = jnp.exp(logprobs - old_logprobs)
    return jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))


def kl_penalty(logprobs, ref_logprobs, kind: str):
    """The per-token KL estimator [B, G] of a KL loss term (Schulman's k1 and k3), with d = ref_logprobs - logprobs:
    k1 = -d = log p - log p_ref;  k3 = exp(d) - d - 1 (>= 0, unbiased, lower variance; veRL's low_var_kl)."""
    d = ref_logprobs - logprobs
    if kind == "k1":
        return -d
    if kind == "k3":
        return jnp.exp(d) - d - 1.0
    raise ValueError(f"kl_loss: expected k1 or k3, got {kind!r}")


def aggregate(per_token, mask, mode: str = "token_mean"):
    """A per-token loss [B, G] as (total, count), the loss being total / count; a step sums both over its micro-batches
    and divides once, so the loss is the whole batch's, however it is cut. With n_b = sum_t mask[b, t]:

        token_mean            sum_bt l * m / sum_b n_b                       every token weighs the same (DAPO; PPO's)
        seq_mean_token_mean   sum_b (sum_t l * m / n_b) / #{b: n_b > 0}      every answer weighs the same (GRPO's paper)
        seq_mean_token_sum    sum_b sum_t l * m / #{b: n_b > 0}              an answer's tokens summed (Dr. GRPO-like)
    """
    mask = mask.astype(jnp.float32)
    n = jnp.sum(mask, axis=1)
    if mode == "token_mean":
        return jnp.sum(per_token * mask), jnp.sum(n)
    per_row = jnp.sum(per_token * mask, axis=1)
    if mode == "seq_mean_token_mean":
        per_row = per_row / jnp.maximum(n, 1)
    elif mode != "seq_mean_token_sum":
        raise ValueError(f"loss_agg: unknown mode {mode!r}")
    return jnp.sum(per_row), jnp.sum(n > 0).astype(jnp.float32)


def actor_loss(logprobs, old_logprobs, advantages, mask, clip=0.2, clip_high=None, mode="token_mean"):
    """The policy loss: policy_loss aggregated by `mode` (aggregate); PPO's masked mean by default."""
    total, count = aggregate(policy_loss(logprobs, old_logprobs, advantages, clip, clip_high), mask, mode)
    return total / jnp.maximum(count, 1)


def grpo_advantages(rewards, n: int, scale: bool = True, eps: float = 1e-6):
    """GRPO's (Shao et al. 2024) advantage per answer [B] from sequence rewards [B] in groups of n consecutive rows
    (the n answers to one prompt, rows g n .. g n + n - 1): with mean_g and std_g (unbiased, ddof 1) over the group,
    A_b = r_b - mean_g, divided by std_g + eps when `scale` (TRL's scale_rewards, veRL's norm_adv_by_std_in_grpo)."""
    r = rewards.reshape(-1, n)  # [B / n, n]: a group per row
    adv = r - jnp.mean(r, axis=1, keepdims=True)
    if scale:
        adv = adv / (jnp.std(r, axis=1, keepdims=True, ddof=1) + eps)
    return adv.reshape(-1)


def rloo_advantages(rewards, n: int):
    """RLOO's (Ahmadian et al. 2024) advantage per answer [B]: the reward minus the mean of the other n - 1 answers'
    rewards in its group (groups as in grpo_advantages): A_b = r_b - (sum_g - r_b) / (n - 1)."""
    r = rewards.reshape(-1, n)
    return (r - (jnp.sum(r, axis=1, keepdims=True) - r) / (n - 1)).reshape(-1)


def reinforce_pp_advantages(rewards, mask, gamma: float = 1.0):
    """REINFORCE++'s (Hu 2025) advantages [B, G] from per-token rewards [B, G] (compute_rewards: the KL penalty on
    every token, the score on the last): the discounted return G_t = sum_{s >= t} gamma^(s - t) r_s, normalised over
    the batch's answer tokens, (G - mean) / sqrt(var + 1e-8) (whiten). That is GAE with V = 0 and lam = 1."""
    returns, _ = gae(jnp.zeros_like(rewards), rewards, mask, gamma, 1.0)
    return whiten(returns, mask)


def critic_loss(values, old_values, returns, mask, clip: float = 0.2):
    """Clipped value loss: with v_clip = old_values + clip(values - old_values, -clip, clip),
    0.5 * masked_mean(max((values - returns)^2, (v_clip - returns)^2), mask)."""
    v_clip = old_values + jnp.clip(values - old_values, -clip, clip)
    return 0.5 * masked_mean(jnp.maximum((values - returns) ** 2, (v_clip - returns) ** 2), mask)
