"""Step 3's math as small pure functions on masked arrays; each formula is in its docstring: PPO's (rewards, GAE,
the clipped losses, the adaptive KL controller), the critic-free algorithms' advantages (GRPO, RLOO, REINFORCE++ and
REINFORCE++-baseline) and GSPO's sequence-level ratio, the KL loss estimators, the loss aggregations, DAPO's over-long
penalty and the ratio's diagnostics.

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


def compute_rewards(logprobs, ref_logprobs, score, mask, kl_coef: float = 0.1, clip_score: float | None = 5.0):
    """Per-token rewards [B, G]: r_t = -kl_coef * (logprobs_t - ref_logprobs_t) * mask_t, plus
    clip(score, -clip_score, clip_score) at each row's last real token t = n_b - 1 (score [B]; None: unclipped)."""
    mask = mask.astype(jnp.float32)
    rewards = -kl_coef * (logprobs - ref_logprobs) * mask
    last = jnp.arange(mask.shape[1])[None, :] == (jnp.sum(mask, axis=1, keepdims=True) - 1)
    score = score if clip_score is None else jnp.clip(score, -clip_score, clip_score)
    return rewards + jnp.where(last, score[:, None], 0.0)


def overlong_penalty(lengths, max_len: int, buffer: int, factor: float = 1.0):
    """DAPO's soft over-long punishment [B] of answers of `lengths` tokens [B], added to their rewards: with
    L = max_len and L_cache = buffer, 0 for n <= L - L_cache, ((L - L_cache) - n) / L_cache up to L, -1 beyond; times
    `factor`: factor * clip(((L - L_cache) - n) / L_cache, -1, 0)."""
    return factor * jnp.clip(((max_len - buffer) - lengths.astype(jnp.float32)) / buffer, -1.0, 0.0)


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


def log_ratio(logprobs, old_logprobs, mask=None, sequence: bool = False):
    """The importance ratio's log per token [B, G]: PPO's log p_t - log p_old_t, or (sequence) GSPO's (Zheng et al.
    2025) in its GSPO-token form, sg[log s_b] + log p_t - sg[log p_t] with log s_b = sum_t (log p_t - log p_old_t) m_t
    / n_b: its value the answer's length-normalised sequence ratio s_b on every token, its gradient that of log p_t
    (sg: stop_gradient), so the clip acts per answer and each token's gradient is s_b A_b grad log p_t."""
    if not sequence:
        return logprobs - old_logprobs
    m = mask.astype(jnp.float32)
    log_s = jnp.sum((logprobs - old_logprobs) * m, axis=1, keepdims=True) / jnp.maximum(jnp.sum(m, 1, keepdims=True), 1)
    return jax.lax.stop_gradient(log_s) + logprobs - jax.lax.stop_gradient(logprobs)


def policy_loss(
    logprobs, old_logprobs, advantages, clip_low: float = 0.2, clip_high: float | None = None, mask=None, sequence=False
):
    """PPO's clipped surrogate per token [B, G], with clip-higher (DAPO: clip_high > clip_low; None: clip_low):
    with ratio = exp(log_ratio) (per token, or GSPO's per answer with `sequence`: log_ratio),
    max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio = jnp.exp(log_ratio(logprobs, old_logprobs, mask, sequence))
    return jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))


def ratio_figures(logprobs, old_logprobs, advantages, mask, clip_low: float, clip_high: float, sequence=False):
    """The diagnostics users watch, as sums over the answer tokens (a step adds its micro-batches'; ratio_min and
    ratio_max combine by min and max): clip_frac, the tokens whose clipped term is the larger (veRL's pg_clipfrac:
    no gradient there); approx_kl, 0.5 (log ratio)^2 (TRL's approxkl; the old policy to the current); ratio (its
    sum, for the mean); ratio_tokens, the tokens counted. The ratio is policy_loss's (GSPO's per answer)."""
    m = mask.astype(jnp.float32)
    lr = jax.lax.stop_gradient(log_ratio(logprobs, old_logprobs, mask, sequence))
    ratio = jnp.exp(lr)
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) > -advantages * ratio
    return {
        "clip_frac": jnp.sum(clipped * m),
        "approx_kl": jnp.sum(0.5 * lr**2 * m),
        "ratio": jnp.sum(ratio * m),
        "ratio_tokens": jnp.sum(m),
        "ratio_min": jnp.min(jnp.where(m > 0, ratio, jnp.inf)),
        "ratio_max": jnp.max(jnp.where(m > 0, ratio, -jnp.inf)),
    }


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


def actor_loss(logprobs, old_logprobs, advantages, mask, clip=0.2, clip_high=None, mode="token_mean", sequence=False):
    """The policy loss: policy_loss aggregated by `mode` (aggregate); PPO's masked mean by default."""
    per_token = policy_loss(logprobs, old_logprobs, advantages, clip, clip_high, mask, sequence)
    total, count = aggregate(per_token, mask, mode)
    return total / jnp.maximum(count, 1)


def groups(rewards, n: int, valid=None):
    """Groups of n consecutive rows (the n answers to one prompt, rows g n .. g n + n - 1) over their valid answers
    (valid [B], 0: left out, e.g. a reward function returned None): r, v [B / n, n], and per group [B / n, 1] the
    count, the mean and `spread`: whether its valid rewards differ. A group without spread (equal rewards, or fewer
    than two valid answers) has no learning signal: its advantages are exactly 0 (computing r - mean and the std in
    float32 would leave one rounding step each, whose quotient is O(1))."""
    r = rewards.reshape(-1, n)  # [B / n, n]: a group per row
    v = jnp.ones_like(r) if valid is None else valid.reshape(-1, n).astype(r.dtype)
    count = jnp.sum(v, axis=1, keepdims=True)
    mean = jnp.sum(r * v, axis=1, keepdims=True) / jnp.maximum(count, 1)
    spread = jnp.max(jnp.where(v > 0, r, -jnp.inf), 1, keepdims=True) > jnp.min(
        jnp.where(v > 0, r, jnp.inf), 1, keepdims=True
    )
    return r, v, count, mean, spread


def grpo_advantages(rewards, n: int, scale: bool = True, eps: float = 1e-6, valid=None):
    """GRPO's (Shao et al. 2024) advantage per answer [B] from sequence rewards [B] in groups (`groups`): with mean_g
    and std_g (unbiased, ddof 1) over the group's valid answers, A_b = r_b - mean_g, divided by std_g + eps when
    `scale` (TRL's scale_rewards, veRL's norm_adv_by_std_in_grpo); 0 where the group has no spread or b is not valid."""
    r, v, count, mean, spread = groups(rewards, n, valid)
    adv = r - mean
    if scale:
        adv = adv / (jnp.sqrt(jnp.sum(adv**2 * v, axis=1, keepdims=True) / jnp.maximum(count - 1, 1)) + eps)
    return jnp.where(spread & (v > 0), adv, 0.0).reshape(-1)


def rloo_advantages(rewards, n: int, valid=None):
    """RLOO's (Ahmadian et al. 2024) advantage per answer [B]: the reward minus the mean of the other valid answers'
    rewards in its group (`groups`): A_b = r_b - (sum_g - r_b) / (count_g - 1); 0 where the group has no spread."""
    r, v, count, _, spread = groups(rewards, n, valid)
    adv = r - (jnp.sum(r * v, axis=1, keepdims=True) - r) / jnp.maximum(count - 1, 1)
    return jnp.where(spread & (v > 0), adv, 0.0).reshape(-1)


def reinforce_pp_baseline_advantages(scores, mask, n: int, valid=None, kl=None, gamma: float = 1.0):
    """REINFORCE++-baseline's (Hu 2025; OpenRLHF's reinforce_baseline) advantages [B, G] from each answer's score
    [B] in groups (`groups`): the group-centred score r_b - mean_g over the valid answers (0 for a group without
    spread: grpo_advantages unscaled) at the last real token, minus kl [B, G] per token if the KL is in the reward
    (kl_coef (log p - log p_ref)); its return G_t = sum_{s >= t} gamma^(s - t) r_s, divided by its std over the valid
    answers' tokens of the whole batch, G / sqrt(var + 1e-8). Not shifted by the batch's mean (~0 once the group
    means are out), so a group of equal rewards keeps advantages of exactly 0."""
    centred = grpo_advantages(scores, n, scale=False, valid=valid)
    zeros = jnp.zeros(mask.shape, jnp.float32)
    rewards = compute_rewards(zeros, zeros, centred, mask, 0.0, None) - (0.0 if kl is None else kl * mask)
    m = mask.astype(jnp.float32) * (1.0 if valid is None else valid.astype(jnp.float32)[:, None])
    returns, _ = gae(zeros, rewards, m, gamma, 1.0)
    mean = masked_mean(returns, m)
    return returns * jax.lax.rsqrt(masked_mean((returns - mean) ** 2, m) + 1e-8)


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
