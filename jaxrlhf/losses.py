"""The losses of Steps 1 and 2, DPO (and Step 3's mixture LM loss) as small pure functions on masked arrays; PPO's are
in jaxrlhf.rl.losses. Each formula is in its docstring.

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


def lm_loss(logprobs, loss_mask):
    """Next-token cross-entropy from the next-token log-probs [B, T - 1] (next_token_logprobs, or token_logprobs of
    logits): (sum over targets of -log p(target), number of targets, metrics); the targets are
    `lm_targets(loss_mask)`."""
    mask = lm_targets(loss_mask)
    nll = -logprobs * mask
    total, count = jnp.sum(nll), jnp.sum(mask)
    return total, count, {"loss": total, "tokens": count}


def end_scores(values, mask):
    """The value at each row's last real token: [B] from values [B, T] and a right-padded mask [B, T]."""
    last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)
    return jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]


def reward_loss(
    chosen_values, rejected_values, chosen_ids, rejected_ids, chosen_mask, rejected_mask, *, kind: str = "span"
):
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
    total = jnp.sum(per_pair * pairs)
    metrics = {
        "loss": total,
        "pairs": jnp.float32(chosen_ids.shape[0]),
        "accuracy": jnp.sum((c_end > r_end).astype(jnp.float32)),
        "chosen_score": jnp.sum(c_end),
        "rejected_score": jnp.sum(r_end),
    }
    return total, jnp.sum(pairs), metrics


def answer_mask(attention_mask, prompt_len):
    """[B, T] int32: 1 at the real tokens from position `prompt_len[b]` on (the answer and its EOS), 0 at the prompt
    (BOS included) and the padding; a loss_mask (see lm_targets) over the answer alone."""
    t = jnp.arange(attention_mask.shape[1])[None, :]
    return (attention_mask * (t >= prompt_len[:, None])).astype(jnp.int32)


def sequence_logprobs(logprobs, loss_mask):
    """log π(answer | prompt) = sum over targets t of log p(ids[b, t] | ids[b, :t]): [B] float32 from the next-token
    log-probs [B, T - 1] (next_token_logprobs), the targets being `lm_targets(loss_mask)` (with `answer_mask`: the
    answer's tokens only)."""
    return jnp.sum(logprobs * lm_targets(loss_mask), axis=1)


def dpo_loss(
    policy_chosen,
    policy_rejected,
    ref_chosen,
    ref_rejected,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    kind: str = "sigmoid",
    lengths=None,
):
    """DPO's loss over B pairs from answer log-probs [B] (sequence_logprobs): (sum of per-pair losses, pairs, metrics).

    With h = (π_c - ref_c) - (π_r - ref_r), the policy's log-ratio of chosen over rejected minus the reference's:
        kind="sigmoid" (DPO; conservative DPO with ε = label_smoothing): -(1 - ε) log σ(β h) - ε log σ(-β h)
        kind="ipo" (IPO): (h - 1 / (2 β))², every log-prob divided by its answer's token count first (IPO's authors
                   and TRL average the log-ratios per token): `lengths` = (chosen tokens [B], rejected tokens [B])
    Implicit rewards r = β (π - ref) of each answer; metrics (sums over pairs): chosen_reward, rejected_reward,
    margin (r_c - r_r) and accuracy (r_c > r_r, a tie counting 1/2: the reference itself scores exactly 1/2).
    """
    if kind == "ipo":
        if lengths is None:
            raise ValueError("IPO averages the log-ratios per answer token: pass lengths=(chosen, rejected tokens)")
        n_c, n_r = (jnp.maximum(n, 1).astype(jnp.float32) for n in lengths)
        policy_chosen, ref_chosen = policy_chosen / n_c, ref_chosen / n_c
        policy_rejected, ref_rejected = policy_rejected / n_r, ref_rejected / n_r
    r_c, r_r = beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if kind == "sigmoid":
        eps = label_smoothing
        per_pair = -(1 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)
    elif kind == "ipo":
        per_pair = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"DPO loss kind: expected 'sigmoid' or 'ipo', got {kind!r}")
    total, pairs = jnp.sum(per_pair), jnp.float32(per_pair.shape[0])
    metrics = {
        "loss": total,
        "pairs": pairs,
        "accuracy": jnp.sum(jnp.where(r_c > r_r, 1.0, jnp.where(r_c == r_r, 0.5, 0.0))),
        "chosen_reward": jnp.sum(r_c),
        "rejected_reward": jnp.sum(r_r),
        "margin": jnp.sum(r_c - r_r),
    }
    return total, pairs, metrics
