"""The losses of every step as small pure functions on masked arrays; each formula is in its docstring.

Losses return SUMS and the count they are over (`(total, count, metrics)`), not means: a step that
accumulates micro-batches, or splits a batch over devices, adds the sums and divides once, so the result
is the same however the batch was cut.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_mean(x, mask):
    """sum(x * mask) / sum(mask) (0 when the mask is empty)."""
    mask = mask.astype(x.dtype)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1)


def token_logprobs(logits, input_ids):
    """log p(ids[:, t + 1] | ids[:, : t + 1]) for t = 0 .. T - 2: [B, T - 1] float32, from logits [B, T, V]."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]


def lm_targets(loss_mask):
    """[B, T - 1] float32: 1 where token t + 1 is a target. `loss_mask[b, t] = 1` marks token t as a target
    (see jaxrlhf.data.batches); it is predicted from the logits at t - 1, so the first token never is."""
    return loss_mask[:, 1:].astype(jnp.float32)


def lm_loss(logits, input_ids, loss_mask):
    """Next-token cross-entropy: (sum over targets of -log p(target), number of targets, metrics); the targets
    are `lm_targets(loss_mask)`."""
    mask = lm_targets(loss_mask)
    nll = -token_logprobs(logits, input_ids) * mask
    total, count = jnp.sum(nll), jnp.sum(mask)
    return total, count, {"loss": total, "tokens": count}


def end_scores(values, mask):
    """The value at each row's last real token: [B] from values [B, T] and a right-padded mask [B, T]."""
    last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)
    return jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]


def reward_loss(chosen_values, rejected_values, chosen_ids, rejected_ids, chosen_mask, rejected_mask, *,
                kind: str = "span"):
    """Pairwise reward-model loss over B right-padded pairs: (sum of per-pair losses, pairs, metrics).

    kind="span" (DeepSpeed-Chat's): for each pair, the mean of -log sigmoid(v_chosen[t] - v_rejected[t])
    over t from the first position where the two token sequences differ up to (not including) the later
    of their two ends. Pairs with identical sequences have an empty span and add nothing.
    kind="last": the Bradley-Terry loss on end scores, -log sigmoid(end_chosen - end_rejected).
    Metrics (sums over pairs): accuracy (end_chosen > end_rejected), chosen and rejected end scores.
    """
    c_end, r_end = end_scores(chosen_values, chosen_mask), end_scores(rejected_values, rejected_mask)
    if kind == "last":
        per_pair = -jax.nn.log_sigmoid(c_end - r_end)
        pairs = jnp.ones_like(per_pair)
    elif kind == "span":
        T = chosen_ids.shape[1]
        t = jnp.arange(T)[None, :]
        differ = (chosen_ids != rejected_ids) & ((chosen_mask + rejected_mask) > 0)
        start = jnp.where(differ.any(1), jnp.argmax(differ, axis=1), T)
        end = jnp.maximum(chosen_mask.sum(1), rejected_mask.sum(1))
        span = ((t >= start[:, None]) & (t < end[:, None])).astype(jnp.float32)
        per_token = -jax.nn.log_sigmoid(chosen_values - rejected_values)
        n = span.sum(1)
        per_pair = jnp.sum(per_token * span, axis=1) / jnp.maximum(n, 1)
        pairs = (n > 0).astype(jnp.float32)
    else:
        raise ValueError(f"reward loss kind: expected 'span' or 'last', got {kind!r}")
    metrics = {
        "loss": jnp.sum(per_pair * pairs),
        "pairs": jnp.float32(chosen_ids.shape[0]),
        "accuracy": jnp.sum((c_end > r_end).astype(jnp.float32)),
        "chosen_score": jnp.sum(c_end),
        "rejected_score": jnp.sum(r_end),
    }
    return jnp.sum(per_pair * pairs), jnp.sum(pairs), metrics


# ---------------------------------------------------------------------------------------------- PPO (Step 3)
#
# Answer positions t = 0 .. G - 1; mask[b, t] = 1 for generated tokens up to and including the first EOS,
# so row b has n_b = sum(mask[b]) real tokens at t = 0 .. n_b - 1. Every mean is a masked mean over the
# whole batch. The arrays are [B, G] float32 unless said otherwise.


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
