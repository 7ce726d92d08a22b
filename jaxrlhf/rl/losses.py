"""PPO's math (Step 3) as small pure functions on masked arrays; each formula is in its docstring.

Answer positions t = 0 .. G - 1; mask[b, t] = 1 for generated tokens up to and including the first EOS,
so row b has n_b = sum(mask[b]) real tokens at t = 0 .. n_b - 1. Every mean is a masked mean over the
whole batch. The arrays are [B, G] float32 unless said otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf.losses import masked_mean


def sequence_kl(logprobs, ref_logprobs, mask):
    """The KL to the reference per answer, estimated on the sampled tokens: mean_b sum_t (logprobs - ref_logprobs) * mask."""
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


def actor_loss(logprobs, old_logprobs, advantages, mask, clip: float = 0.2):
    """PPO's clipped surrogate: with ratio = exp(logprobs - old_logprobs),
    masked_mean(max(-A * ratio, -A * clip(ratio, 1 - clip, 1 + clip)), mask)."""
    ratio = jnp.exp(logprobs - old_logprobs)
    per_token = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1.0 - clip, 1.0 + clip))
    return masked_mean(per_token, mask)


def critic_loss(values, old_values, returns, mask, clip: float = 0.2):
    """Clipped value loss: with v_clip = old_values + clip(values - old_values, -clip, clip),
    0.5 * masked_mean(max((values - returns)^2, (v_clip - returns)^2), mask)."""
    v_clip = old_values + jnp.clip(values - old_values, -clip, clip)
    return 0.5 * masked_mean(jnp.maximum((values - returns) ** 2, (v_clip - returns) ** 2), mask)
