"""The critic-free algorithms of Step 3 (algorithm grpo | rloo | reinforce_pp): their advantages, the KL loss
estimators, the loss aggregations and clip-higher against hand-computed cases and NumPy loops written here; the
engine's groups (each prompt's n answers side by side, no critic); the settings refused; the memory plan without a
critic; and one GRPO iteration (two PPO epochs, two accumulated micro-batches, a k3 KL loss, seq-mean-token-mean,
clip-higher) against an independent computation; (slow) GRPO and RLOO raise the built-in task's gold reward.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import ACTOR, CRITIC, config, engine, host, models, prompts  # noqa: F401  (fixtures)
from test_ppo_reference import OPTIM, Adam, P, answer_logprobs, jit_values

from jaxrlhf import make_mesh
from jaxrlhf import plan as memory_plan
from jaxrlhf.optim import OptimConfig
from jaxrlhf.rl import EngineConfig, HybridEngine, ModelSide
from jaxrlhf.rl.losses import (
    aggregate,
    grpo_advantages,
    kl_penalty,
    overlong_penalty,
    policy_loss,
    ratio_figures,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)

MASK = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0]], np.float32)
ONE = make_mesh(1, jax.devices()[:1])

# ------------------------------------------------------------------- references written here, loops in NumPy


def np_group_advantages(r, n, kind, scale=True):
    """GRPO (scale: / (std ddof 1 + 1e-6)) or RLOO over consecutive groups of n, one group at a time."""
    out = np.zeros(len(r))
    for start in range(0, len(r), n):
        g = r[start : start + n]
        for j in range(n):
            if kind == "rloo":
                out[start + j] = g[j] - (g.sum() - g[j]) / (n - 1)
            else:
                out[start + j] = (g[j] - g.mean()) / ((g.std(ddof=1) + 1e-6) if scale else 1.0)
    return out


def np_reinforce_pp_baseline(scores, mask, n, valid=None):
    """Group mean over the valid answers subtracted (0 for a group whose valid rewards are equal), the centred score
    on every token (gamma 1, no KL), divided by the std over the valid answers' tokens."""
    valid = np.ones(len(scores)) if valid is None else valid
    centred = np.zeros(len(scores))
    for start in range(0, len(scores), n):
        g, v = scores[start : start + n], valid[start : start + n] > 0
        if len(set(g[v])) > 1:
            centred[start : start + n] = np.where(v, g - g[v].mean(), 0)
    m = mask * valid[:, None]
    tokens = (centred[:, None] * m)[m > 0]
    return centred[:, None] * m / np.sqrt(tokens.var() + 1e-8)


def np_gspo_loss(lp, old, adv, mask, low, high):
    """GSPO's loss per token and its gradient d loss / d lp [B, G], one answer at a time: s = exp(mean_t (lp - old));
    the term -A s, or -A clip(s) where that is the larger (then no gradient)."""
    loss, grad = np.zeros_like(lp), np.zeros_like(lp)
    for b in range(len(lp)):
        n = int(mask[b].sum())
        s = np.exp(np.mean(lp[b, :n] - old[b, :n]))
        a = adv[b, 0]
        unclipped, clipped = -a * s, -a * np.clip(s, 1 - low, 1 + high)
        loss[b, :n] = max(unclipped, clipped)
        grad[b, :n] = -a * s if unclipped >= clipped else 0.0  # d(-A s_b,t)/d lp_t = -A s_b (GSPO-token)
    return loss, grad


def np_reinforce_pp(rewards, mask, gamma):
    returns = np.zeros_like(rewards)
    for b in range(len(rewards)):
        running = 0.0
        for t in reversed(range(int(mask[b].sum()))):
            running = rewards[b, t] + gamma * running
            returns[b, t] = running
    real = returns[mask > 0]
    return (returns - real.mean()) / np.sqrt(real.var() + 1e-8) * mask


# ------------------------------------------------------------------------------------- the pure functions


def test_grpo_and_rloo_advantages_by_hand():
    r = jnp.array([1.0, 2.0, 3.0, 0.0, 0.0, 9.0])  # two groups of 3: means 2 and 3, stds (ddof 1) 1 and sqrt(27)
    s = math.sqrt(27)
    np.testing.assert_allclose(grpo_advantages(r, 3, scale=False), [-1, 0, 1, -3, -3, 6], rtol=1e-6)
    np.testing.assert_allclose(
        grpo_advantages(r, 3), [-1 / (1 + 1e-6), 0, 1 / (1 + 1e-6), -3 / s, -3 / s, 6 / s], rtol=1e-5
    )
    # the mean of the two others: 1 - 2.5, 2 - 2, 3 - 1.5; 0 - 4.5, 0 - 4.5, 9 - 0
    np.testing.assert_allclose(rloo_advantages(r, 3), [-1.5, 0, 1.5, -4.5, -4.5, 9], rtol=1e-6)


@pytest.mark.parametrize("kind", ["grpo", "rloo", "grpo_unscaled"])
def test_group_advantages_equal_numpy_loops(kind):
    """Random rewards, 4 groups of 4 (groups of unequal means and spreads: a wrong axis or grouping shows)."""
    rng = np.random.default_rng(0)
    r = rng.normal(size=16) * np.repeat([0.5, 1, 2, 4], 4) + np.repeat([0, 3, -2, 5], 4)
    got = rloo_advantages(jnp.asarray(r), 4) if kind == "rloo" else grpo_advantages(jnp.asarray(r), 4, kind == "grpo")
    np.testing.assert_allclose(got, np_group_advantages(r, 4, kind[:4], kind == "grpo"), rtol=1e-5, atol=1e-6)
    # A group's advantages depend on its own rewards only: the other groups' rewards changed, its own stay.
    r2 = r.copy()
    r2[4:] += rng.normal(size=12) * 10
    got2 = (
        rloo_advantages(jnp.asarray(r2), 4) if kind == "rloo" else grpo_advantages(jnp.asarray(r2), 4, kind == "grpo")
    )
    np.testing.assert_allclose(got2[:4], got[:4], rtol=1e-5, atol=1e-6)


def test_reinforce_pp_advantages_equal_a_numpy_loop():
    rng = np.random.default_rng(1)
    mask = (np.arange(5)[None] < np.array([5, 2, 4, 1])[:, None]).astype(np.float32)
    rewards = rng.normal(size=(4, 5)).astype(np.float32) * mask + (1 - mask) * 9.0  # junk beyond the answers
    got = reinforce_pp_advantages(jnp.asarray(rewards), jnp.asarray(mask), gamma=0.9)
    np.testing.assert_allclose(got, np_reinforce_pp(rewards * mask, mask, 0.9), rtol=1e-5, atol=1e-6)
    # By hand on one row of rewards (1, 2), gamma 0.5: returns (2, 2); with (x, 0) the batch (2, 2, 0, 0) is
    # normalised over its 4 answer tokens: mean 1, std 1.
    hand = reinforce_pp_advantages(jnp.array([[1.0, 2.0], [-1.0, 1.0]]), jnp.ones((2, 2)), gamma=0.5)
    # row 1: (-1 + 0.5, 1) = (-0.5, 1); all: (2, 2, -0.5, 1), mean 1.125, var (0.765625 * 2 + 2.640625 + 0.015625) / 4
    want = np.array([2.0, 2.0, -0.5, 1.0])
    np.testing.assert_allclose(np.asarray(hand).ravel(), (want - want.mean()) / np.sqrt(want.var() + 1e-8), rtol=1e-5)


@pytest.mark.parametrize("n,r", [(8, 0.7), (12, 4.7), (4, 1.0), (6, -0.3)])
def test_equal_rewards_give_exactly_zero_advantages(n, r):
    """A group of equal rewards has no learning signal. In float32, r - mean and the std are each one rounding step
    (0.7 x 8: the mean is not 0.7), so their quotient was O(1): 0.056 at n 8, r 0.7; -0.48 at n 12, r 4.7."""
    other = jnp.arange(n, dtype=jnp.float32) / n  # a second group with spread: its advantages are not zero
    rewards = jnp.concatenate([jnp.full((n,), r, jnp.float32), other])
    mask = jnp.ones((2 * n, 3))
    for name, adv in (
        ("grpo", grpo_advantages(rewards, n)),
        ("grpo unscaled", grpo_advantages(rewards, n, scale=False)),
        ("rloo", rloo_advantages(rewards, n)),
        ("reinforce_pp_baseline", reinforce_pp_baseline_advantages(rewards, mask, n)),
    ):
        adv = np.asarray(adv).reshape(2 * n, -1)
        assert np.all(adv[:n] == 0.0), (name, adv[:n].ravel())
        assert np.abs(adv[n:]).min() > 0 or name != "grpo", name
    # With a reward function's None (valid 0) in a group, the others' statistics leave it out, and it gets 0.
    valid = jnp.ones(2 * n).at[n + 1].set(0.0)
    spiked = rewards.at[n + 1].set(1e6)  # the left-out answer's reward changes nothing
    np.testing.assert_allclose(
        grpo_advantages(spiked, n, valid=valid)[n:],
        np_group_advantages(np.delete(np.asarray(other), 1), n - 1, "grpo").tolist()[:1]
        + [0.0]
        + np_group_advantages(np.delete(np.asarray(other), 1), n - 1, "grpo").tolist()[1:],
        rtol=1e-5,
        atol=1e-6,
    )


def test_reinforce_pp_baseline_equals_a_numpy_loop():
    """Group mean subtracted, then divided by the batch's std over answer tokens: by hand on two groups of two, then
    against the loop on random groups of unequal means and lengths, with a left-out answer and an equal group."""
    # groups (1, 3) and (0, 4), one token each: centred (-1, 1, -2, 2), std sqrt(2.5)
    hand = reinforce_pp_baseline_advantages(jnp.array([1.0, 3.0, 0.0, 4.0]), jnp.ones((4, 1)), 2)
    np.testing.assert_allclose(np.asarray(hand).ravel(), np.array([-1, 1, -2, 2]) / math.sqrt(2.5), rtol=1e-5)
    rng = np.random.default_rng(3)
    scores = (rng.normal(size=12) + np.repeat([0, 3, -2], 4)).astype(np.float32)
    scores[8:] = 0.5  # the third group: equal rewards
    mask = (np.arange(5)[None] < rng.integers(1, 6, 12)[:, None]).astype(np.float32)
    valid = np.ones(12, np.float32)
    valid[2] = 0.0
    got = reinforce_pp_baseline_advantages(jnp.asarray(scores), jnp.asarray(mask), 4, jnp.asarray(valid))
    np.testing.assert_allclose(got, np_reinforce_pp_baseline(scores, mask, 4, valid), rtol=1e-5, atol=1e-6)


def test_gspo_loss_and_gradient_equal_a_numpy_loop():
    """GSPO's sequence-level ratio (the mean log-ratio over the answer's tokens) and clip, per answer: its loss and
    its gradient w.r.t. the log-probs (GSPO-token: sg[s_b] p_t / sg[p_t]) against NumPy, with answers inside, above
    and below the small clip range, of both signs of advantage."""
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]], np.float32)
    old = np.random.default_rng(4).normal(size=(5, 4)).astype(np.float32)
    # mean log-ratio per answer: 1e-4 (inside), 2e-3 (above 1 + 4e-4), -2e-3 (below 1 - 3e-4), 2e-3, -2e-3
    shift = np.array(
        [[3e-4, -2e-4, 2e-4, 9], [1e-3, 3e-3, 9, 9], [-2e-3] * 4, [2e-3, 9, 9, 9], [-1e-3, -4e-3, -1e-3, 9]]
    )
    lp = (old + shift * mask).astype(np.float32)
    adv = np.array([1.0, 1.0, -1.0, -2.0, 0.5], np.float32)[:, None] * mask
    want_loss, want_grad = np_gspo_loss(lp.astype(np.float64), old, adv, mask, 3e-4, 4e-4)

    def total(x):
        return jnp.sum(policy_loss(x, jnp.asarray(old), jnp.asarray(adv), 3e-4, 4e-4, jnp.asarray(mask), True) * mask)

    per_token = policy_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), 3e-4, 4e-4, jnp.asarray(mask), True)
    np.testing.assert_allclose(per_token * mask, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(total)(jnp.asarray(lp)) * mask, want_grad, rtol=1e-5, atol=1e-6)
    # answers 1 (A > 0, above) and 4 (A > 0, below: unclipped side) vs 2 (A < 0, below: clipped): which get gradient
    assert (want_grad[1] == 0).all() and (want_grad[2] == 0).all() and (want_grad[0, :3] != 0).all()
    # the token ratio (PPO's) differs: answer 0's tokens are not clipped one by one the same way
    assert not np.allclose(
        policy_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), 3e-4, 4e-4) * mask, want_loss
    )


def test_ratio_figures_and_overlong_penalty_by_hand():
    old = jnp.zeros((2, 3))
    lp = jnp.log(jnp.array([[1.5, 0.5, 1.1], [0.9, 7.0, 7.0]]))
    adv = jnp.array([[1.0, -1.0, 1.0], [-1.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1], [1, 0, 0]])
    f = ratio_figures(lp, old, adv, mask, 0.2, 0.2)
    # clipped (the clipped term larger): 1.5 with A > 0 (1.2), 0.5 with A < 0 (0.8); 1.1 and 0.9 inside
    logs = np.log([1.5, 0.5, 1.1, 0.9])
    want = {"clip_frac": 2, "approx_kl": 0.5 * (logs**2).sum(), "ratio": 4.0, "ratio_tokens": 4}
    for k, v in want.items():
        np.testing.assert_allclose(f[k], v, rtol=1e-5, err_msg=k)
    np.testing.assert_allclose((f["ratio_min"], f["ratio_max"]), (0.5, 1.5), rtol=1e-6)  # 7.0: masked
    # DAPO's soft over-long punishment, L = 10, L_cache = 4: 0 up to 6 tokens, then -1/4 per token, -1 beyond 10
    got = overlong_penalty(jnp.array([3, 6, 7, 9, 10, 12]), 10, 4)
    np.testing.assert_allclose(got, [0, 0, -0.25, -0.75, -1, -1], atol=1e-7)
    np.testing.assert_allclose(overlong_penalty(jnp.array([8]), 10, 4, factor=0.5), [-0.25], atol=1e-7)


def test_kl_estimators_by_hand():
    lp, ref = jnp.log(jnp.array([[0.5, 0.2]])), jnp.log(jnp.array([[0.25, 0.2]]))
    # d = log p_ref - log p = log 0.5: k1 = log 2; k3 = 0.5 - log 0.5 - 1 = log 2 - 0.5; equal tokens: 0
    np.testing.assert_allclose(kl_penalty(lp, ref, "k1"), [[math.log(2), 0]], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(kl_penalty(lp, ref, "k3"), [[math.log(2) - 0.5, 0]], rtol=1e-5, atol=1e-7)
    # k3 is the reverse direction's log-ratio: a token more likely under the reference gives a positive k3 too
    np.testing.assert_allclose(kl_penalty(ref, lp, "k3"), [[2 - math.log(2) - 1, 0]], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="kl_loss"):
        kl_penalty(lp, ref, "k2")


def test_aggregations_by_hand():
    loss = jnp.array([[1.0, 3.0, 50.0], [2.0, 2.0, 8.0], [6.0, 70.0, 70.0]])  # junk where the mask is 0
    # token_mean: (1 + 3 + 2 + 2 + 8 + 6) / 6 tokens; seq_mean_token_mean: (2 + 4 + 6) / 3; token_sum: (4 + 12 + 6) / 3
    for mode, total, count in (("token_mean", 22, 6), ("seq_mean_token_mean", 12, 3), ("seq_mean_token_sum", 22, 3)):
        np.testing.assert_allclose(aggregate(loss, MASK, mode), (total, count), rtol=1e-6, err_msg=mode)
    # an empty row (a packed micro-batch's filler) counts nothing in any mode
    empty = np.concatenate([MASK, np.zeros((1, 3), np.float32)])
    padded = jnp.concatenate([loss, jnp.full((1, 3), 5.0)])
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        np.testing.assert_allclose(aggregate(padded, empty, mode), aggregate(loss, MASK, mode), rtol=1e-6)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(loss, MASK, "seq_sum")


def test_policy_loss_clip_higher_by_hand():
    old = jnp.zeros((1, 4))
    lp = jnp.log(jnp.array([[1.5, 0.5, 1.1, 0.9]]))
    adv = jnp.array([[1.0, -1.0, 1.0, -1.0]])
    # low 0.2, high 0.28: 1.5 -> 1.28 (A > 0: min gain), 0.5 -> 0.8 (A < 0), 1.1 and 0.9 inside: unclipped
    np.testing.assert_allclose(policy_loss(lp, old, adv, 0.2, 0.28), [[-1.28, 0.8, -1.1, 0.9]], rtol=1e-6)
    np.testing.assert_allclose(policy_loss(lp, old, adv, 0.2), [[-1.2, 0.8, -1.1, 0.9]], rtol=1e-6)  # symmetric


# ------------------------------------------------------------------------------------------------ settings


def test_settings_refused():
    for algorithm in ("grpo", "gspo", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(ValueError, match="num_samples_per_prompt: .* >= 2 for grpo, gspo, rloo, reinforce_pp_base"):
            EngineConfig(algorithm=algorithm)
    with pytest.raises(ValueError, match="kl_target: the adaptive KL controller"):
        EngineConfig(kl_loss="k3", kl_target=1.0)
    with pytest.raises(ValueError, match=r"kl_target: .* \(kl_loss auto, algorithm grpo\)"):
        EngineConfig(algorithm="grpo", num_samples_per_prompt=2, kl_target=1.0)
    with pytest.raises(ValueError, match=r"algorithm: expected one of \['ppo', 'grpo', 'gspo', 'rloo', 'reinforce_pp'"):
        EngineConfig(algorithm="dpo")
    with pytest.raises(ValueError, match="dynamic_sampling: .* algorithm reinforce_pp has no groups"):
        EngineConfig(algorithm="reinforce_pp", dynamic_sampling=True)
    with pytest.raises(ValueError, match="max_draws: expected >= 1"):
        EngineConfig(algorithm="grpo", num_samples_per_prompt=2, dynamic_sampling=True, max_draws=0)
    with pytest.raises(ValueError, match=r"overlong_buffer: expected at most max_answer_len \(8\), got 9"):
        EngineConfig(max_answer_len=8, overlong_buffer=9)
    with pytest.raises(ValueError, match="overlong_penalty: expected >= 0"):
        EngineConfig(overlong_penalty=-1.0)
    EngineConfig(algorithm="reinforce_pp")  # one answer per prompt is fine: its baseline is the batch's


def test_each_algorithm_defaults_to_its_published_kl_aggregation_and_clip():
    """kl_loss auto: the KL in the loss (k3) for grpo, gspo and reinforce_pp_baseline (DeepSeekMath, veRL, OpenRLHF),
    in the reward for ppo, rloo and reinforce_pp; loss_agg auto: gspo's per-answer mean; gspo's clip 3e-4 / 4e-4. A
    user's explicit choice wins."""
    cfg = lambda algorithm, **kw: EngineConfig(algorithm=algorithm, num_samples_per_prompt=2, **kw)  # noqa: E731
    kl = {a: cfg(a).kl_estimator for a in ("ppo", "grpo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline")}
    assert kl == dict(ppo="none", grpo="k3", gspo="k3", rloo="none", reinforce_pp="none", reinforce_pp_baseline="k3")
    assert cfg("grpo", kl_loss="none").kl_estimator == "none" and cfg("ppo", kl_loss="k1").kl_estimator == "k1"
    assert cfg("gspo").aggregation == "seq_mean_token_mean" and cfg("grpo").aggregation == "token_mean"
    assert cfg("gspo", loss_agg="token_mean").aggregation == "token_mean"
    assert cfg("gspo").clip_range == (3e-4, 4e-4) and cfg("grpo", clip_ratio_high=0.28).clip_range == (0.2, 0.28)
    assert cfg("gspo", clip_ratio_high=1e-3).clip_range == (3e-4, 1e-3)


def test_grpo_default_cannot_amplify_kl_noise():
    """The issue's case: a group whose answers all scored 1, with log-probs away from the reference. Under the default
    config its advantages are exactly 0 however the KL varies (the KL is a loss term); with the KL put in the reward
    (kl_loss none) it is divided by the group's std and becomes O(1) advantages of KL noise alone."""
    from jaxrlhf.rl.experience import Returns, advantages

    rng = np.random.default_rng(5)
    mask = np.ones((4, 6), np.float32)
    exp = {"logprobs": rng.normal(size=(4, 6)).astype(np.float32), "ref_logprobs": np.zeros((4, 6), np.float32)}
    exp |= {"scores": np.ones(4, np.float32), "mask": mask}
    s = lambda **kw: Returns.of(EngineConfig(algorithm="grpo", num_samples_per_prompt=4, **kw))  # noqa: E731
    out, stats = advantages(s(), exp, jnp.float32(0.1))
    assert np.all(np.asarray(out["advantages"]) == 0.0) and stats["zero_spread"] == 1.0
    noisy, _ = advantages(s(kl_loss="none"), exp, jnp.float32(0.1))
    assert np.abs(np.asarray(noisy["advantages"])).max() > 0.5  # what the old default did


def test_ppo_check_refuses_a_split_batch_and_critic_settings(tmp_path):
    from jaxrlhf.config import ConfigError
    from jaxrlhf.lora import LoRAConfig
    from jaxrlhf.ppo import PPOConfig, check

    mesh = make_mesh(1)  # 8 devices
    side = lambda **kw: ModelSide(model="x", **kw)  # noqa: E731
    base = dict(actor=side(), critic=side(), algorithm="grpo", num_samples_per_prompt=3)
    with pytest.raises(
        ConfigError, match=r"batch_size 4 x num_samples_per_prompt 3 = 12 answers does not split over the 8"
    ):
        check(PPOConfig(**base, batch_size=4), mesh)
    check(PPOConfig(**base, batch_size=8), mesh)  # 24 answers: 3 per device
    with pytest.raises(ConfigError, match="critic.lora.dim: algorithm grpo trains no critic"):
        check(PPOConfig(**{**base, "critic": side(lora=LoRAConfig(dim=4))}, batch_size=8), mesh)


def test_plan_without_a_critic():
    from jaxrlhf.data import DataConfig
    from jaxrlhf.ppo import PPOConfig
    from jaxrlhf.rewards import RewardConfig

    side = ModelSide(model="random:opt-125m")
    cfg = PPOConfig(actor=side, critic=side, batch_size=8, data=DataConfig(max_prompt_len=128), max_answer_len=128)
    mesh = memory_plan.abstract_mesh(8, 1)
    ppo = memory_plan.ppo_plan(cfg, mesh, backend="gpu")
    grpo_cfg = PPOConfig(**{**cfg.__dict__, "algorithm": "grpo", "num_samples_per_prompt": 4})
    grpo = memory_plan.ppo_plan(grpo_cfg, mesh, backend="gpu")
    assert "critic_step" in ppo.phases and "critic_step" not in grpo.phases
    assert grpo.items["critic weights"] == grpo.items["critic optimizer"] == 0 < ppo.items["critic optimizer"]
    # the reward model holds all its leaves (as PPO's does without LoRA): the critic's weights in bf16, not fp32
    assert grpo.items["reward (own leaves)"] == ppo.items["reward (own leaves)"] == ppo.items["critic weights"] // 2
    # 4 answers per prompt: 4 times the experience
    assert grpo.items["experience"] == 4 * ppo.items["experience"]
    assert "grpo trains no critic" in grpo.table() and "the reward model holds all its leaves" in grpo.table()
    rule = RewardConfig(functions=("jaxrlhf.rewards:gsm8k",))  # functions alone: no reward model is loaded
    only_rules = memory_plan.ppo_plan(PPOConfig(**{**grpo_cfg.__dict__, "reward": rule}), mesh, backend="gpu")
    assert only_rules.items["reward (own leaves)"] == 0 and "no reward model: functions score" in only_rules.table()
    dapo = PPOConfig(**{**grpo_cfg.__dict__, "dynamic_sampling": True})  # PPO's twin, for the note, has no groups
    assert "grpo trains no critic" in memory_plan.ppo_plan(dapo, mesh, backend="gpu").table()
    same_batch = memory_plan.ppo_plan(PPOConfig(**{**cfg.__dict__, "num_samples_per_prompt": 4}), mesh, backend="gpu")
    assert grpo.phase_bytes("score") < same_batch.phase_bytes(
        "score"
    )  # no critic weights, optimizer, critic's own values


# ------------------------------------------------------------------------------------------------ the engine


@pytest.mark.parametrize(
    "algorithm,kl_loss",
    [
        ("grpo", "none"),
        ("grpo", "auto"),
        ("gspo", "auto"),
        ("rloo", "auto"),
        ("reinforce_pp", "k1"),
        ("reinforce_pp_baseline", "auto"),
        ("reinforce_pp_baseline", "none"),
    ],
)
def test_the_advantages_program_on_a_whole_batch(algorithm, kl_loss):
    """experience.advantages on 8 answers (2 groups of 4, rows side by side) with log-probs away from the reference:
    the answer's reward is the clipped score plus the reward functions' (unclipped) plus the over-long penalty,
    minus kl_coef x the answer's KL unless the KL is a loss term; an unscored answer (a function's None) is out of
    its group and the loss, a truncated one out of the loss (overlong_filter)."""
    from jaxrlhf.rl.experience import Returns, advantages

    rng = np.random.default_rng(2)
    lengths = np.array([4, 2, 3, 1, 4, 4, 2, 3])
    mask = (np.arange(4)[None] < lengths[:, None]).astype(np.float32)
    lp, ref = (rng.normal(size=(8, 4)).astype(np.float32) * mask for _ in range(2))
    scores = np.array([0.5, 2.0, -0.3, 0.1, 3.0, -4.0, 0.2, 1.0], np.float32)  # clip_score 1: 2 -> 1, 3 -> 1, -4 -> -1
    functions = np.array([0.0, 1.5, 0.0, -2.0, 0.0, 0.0, 3.0, 0.0], np.float32)  # not clipped
    scored, truncated = np.ones(8, np.float32), (lengths == 4).astype(np.float32)
    scored[5] = 0.0
    n = 1 if algorithm == "reinforce_pp" else 4
    cfg = EngineConfig(
        algorithm=algorithm, num_samples_per_prompt=n, kl_loss=kl_loss, clip_score=1.0, gamma=0.9, max_answer_len=4
    )
    cfg = EngineConfig(**{**cfg.__dict__, "overlong_filter": True, "overlong_buffer": 2, "overlong_penalty": 0.5})
    exp = {"logprobs": lp, "ref_logprobs": ref, "scores": scores, "mask": mask}
    exp |= {"function_scores": functions, "scored": scored, "truncated": truncated}
    out, stats = advantages(Returns.of(cfg), exp, jnp.float32(0.2))
    beta = 0.0 if cfg.kl_estimator != "none" else 0.2
    # the over-long penalty, L 4, L_cache 2, factor 0.5: lengths 3 -> -0.25, 4 -> -0.5
    reward = np.clip(scores, -1, 1) + functions - 0.5 * np.clip((lengths - 2) / 2, 0, 1)
    token_rewards = -beta * (lp - ref) * mask
    for b, length in enumerate(lengths):
        token_rewards[b, length - 1] += reward[b]
    loss_mask = mask * (scored * (1 - truncated))[:, None]
    np.testing.assert_array_equal(out["mask"], loss_mask)
    if algorithm == "reinforce_pp":
        want = np_reinforce_pp(token_rewards * loss_mask, loss_mask, 0.9)
    elif algorithm == "reinforce_pp_baseline":
        kl_rewards = token_rewards.copy()
        kl_rewards[np.arange(8), lengths - 1] -= reward
        want = np_reinforce_pp_baseline_kl(reward, kl_rewards, mask, scored, 0.9) * loss_mask
    else:
        kind = "rloo" if algorithm == "rloo" else "grpo"
        keep = scored > 0  # the unscored answer is out of its group: 3 answers there
        per_answer = np.zeros(8)
        for start in (0, 4):
            idx = np.flatnonzero(keep[start : start + 4]) + start
            per_answer[idx] = np_group_advantages(token_rewards.sum(1)[idx], len(idx), kind)
        want = per_answer[:, None] * loss_mask
    np.testing.assert_allclose(out["advantages"], want, rtol=1e-5, atol=1e-5)
    assert "returns" not in out and "value" not in stats
    np.testing.assert_allclose(stats["truncated"], 3 / 8)
    np.testing.assert_allclose(stats["reward"], reward[scored > 0].mean(), rtol=1e-6)
    assert ("zero_spread" in stats) == (algorithm != "reinforce_pp")


def np_reinforce_pp_baseline_kl(reward, kl_rewards, mask, valid, gamma):
    """reinforce_pp_baseline with the KL in the reward: the group-centred reward (groups of 4, valid answers only) at
    the last token plus the per-token KL rewards, discounted returns, divided by their std over valid tokens."""
    centred = np.zeros(len(reward))
    for start in range(0, len(reward), 4):
        v = valid[start : start + 4] > 0
        g = reward[start : start + 4]
        centred[start : start + 4] = np.where(v, g - g[v].mean(), 0)
    rewards = kl_rewards.copy()
    lengths = mask.sum(1).astype(int)
    rewards[np.arange(len(reward)), lengths - 1] += centred
    returns = np.zeros_like(rewards)
    for b in range(len(rewards)):
        running = 0.0
        for t in reversed(range(lengths[b])):
            running = rewards[b, t] + gamma * running
            returns[b, t] = running
    m = mask * valid[:, None]
    return returns * m / np.sqrt(returns[m > 0].var() + 1e-8)


@pytest.mark.slow
def test_groups_stay_together_and_no_critic_exists(models, prompts):
    batch, eos = prompts
    e = engine(models, make_mesh(2), eos, algorithm="grpo", num_samples_per_prompt=2, temperature=1.0)
    assert "critic" not in e.state and e.critic_params() is None and e.trained == ("actor",)
    exp = host(e.generate_experience(batch))
    B, P_ = batch["prompt_ids"].shape
    assert exp["seq"].shape[0] == 2 * B and "values" not in exp
    prompt = exp["seq"][:, :P_]
    np.testing.assert_array_equal(prompt[0::2], batch["prompt_ids"])  # rows 2i and 2i + 1: prompt i
    np.testing.assert_array_equal(prompt[1::2], batch["prompt_ids"])
    answers = exp["seq"][:, P_:] * exp["mask"]
    assert sum((answers[0::2] != answers[1::2]).any(1)) >= B // 2  # the group's answers differ (per-row keys)
    # the reward model scores every answer: its score is the reward model's own
    want = np.asarray(jit_values(CRITIC, models[1], exp["seq"], exp["seq_mask"]))
    last = P_ + exp["mask"].sum(1).astype(int) - 1
    np.testing.assert_allclose(exp["scores"], want[np.arange(2 * B), last], atol=2e-5)


#: dynamic sampling's case: the groups (of 8 a draw) whose rewards differ, draw by draw
KEPT = ([0, 2, 6], [1, 5], [], [3, 4, 5, 6, 7, 0])


class Patterned(HybridEngine):
    """The engine with reward functions' scores set by KEPT: group g of draw d gets rewards (0, 1) where KEPT[d] holds
    g, else (1, 1); the reward model's score set to 0."""

    def generate_experience(self, prompt_batch, start_rewards=None, draw=0):
        exp = super().generate_experience(prompt_batch, start_rewards, draw)
        spread = np.isin(np.arange(8), KEPT[draw])
        functions = np.stack([np.where(spread, 0.0, 1.0), np.ones(8)], 1).reshape(-1).astype(np.float32)
        exp["scores"] = exp["scores"] * 0
        exp["function_scores"] = jax.device_put(functions, exp["scores"].sharding)
        return exp


@pytest.mark.parametrize("max_draws", [5, 2], ids=["filled at draw 4", "cap of 2 draws"])
def test_dynamic_sampling_drops_groups_without_spread(models, prompts, max_draws):
    """DAPO's dynamic sampling (jaxrlhf.ppo.sampled_batch) on 8 prompts x 2 answers over 8 devices: draws until 8
    groups with spread are kept or max_draws is reached, then the batch is the kept groups' rows in order, and at the
    cap dropped groups fill it, unscored (out of the loss); each draw samples anew; the dropped share is reported;
    the batch trains (its filler groups with zero advantages and no loss)."""
    from dataclasses import fields

    from jaxrlhf.ppo import PPOConfig, sampled_batch

    batch, eos = prompts
    kw = dict(algorithm="grpo", num_samples_per_prompt=2, dynamic_sampling=True, max_draws=max_draws)
    e = Patterned(config(**kw), make_mesh(1), (ACTOR, models[0]), (CRITIC, models[1]), total_steps=10, eos_id=eos)
    cfg = PPOConfig(**{f.name: getattr(e.cfg, f.name) for f in fields(EngineConfig)}, batch_size=8)
    draws = []
    record = e.generate_experience
    e.generate_experience = lambda *a, **k: draws.append(host(record(*a, **k))) or draws[-1]  # noqa: E731
    exp, figures = sampled_batch(cfg, e, iter([batch] * 4), None)
    got = host(exp)
    n_draws = min(max_draws, 4)  # 11 groups kept by draw 4
    assert len(draws) == n_draws and int(e.state["iteration"]) == 1  # extra draws leave the counter alone
    assert (draws[1]["seq"] != draws[0]["seq"]).any()  # a fresh sampling key each draw
    kept = [(d, g) for d in range(n_draws) for g in sorted(KEPT[d])]
    dropped = [(d, g) for d in range(n_draws) for g in range(8) if g not in KEPT[d]]
    chosen = (kept + dropped)[:8]
    for i, (d, g) in enumerate(chosen):
        for k in ("seq", "mask", "ref_logprobs", "function_scores", "truncated"):
            np.testing.assert_array_equal(got[k][2 * i : 2 * i + 2], draws[d][k][2 * g : 2 * g + 2], err_msg=k)
    np.testing.assert_array_equal(got["scored"], np.repeat(np.arange(8) < len(kept), 2).astype(np.float32))
    assert (len(kept) >= 8) == (max_draws == 5)  # both cases: filled, and cut short by the cap
    assert figures == {"dropped_groups": len(dropped) / (8 * n_draws), "draws": float(n_draws)}
    stats = e.train_rlhf(exp)
    assert stats["zero_spread"] == 1 - min(len(kept), 8) / 8 and np.isfinite(stats["actor_loss"])
    assert "kl_coef" not in stats  # GRPO's KL is the loss term's: the reward's coefficient weighs nothing here


# ----------------------------------------------------------- one GRPO iteration against an independent reference

GRPO = dict(
    algorithm="grpo",
    num_samples_per_prompt=2,
    kl_loss="k3",
    kl_loss_coef=0.5,
    loss_agg="seq_mean_token_mean",
    clip_ratio=0.2,
    clip_ratio_high=0.3,
    clip_score=1.0,
    kl_coef=0.3,
    ema_decay=0.9,
)
# The new algorithms at their defaults (kl_loss, loss_agg auto; gspo's clip range 3e-4 / 4e-4)
DEFAULTS = dict(num_samples_per_prompt=2, kl_loss_coef=0.5, clip_score=1.0, kl_coef=0.3, ema_decay=0.9)
SETTINGS = {
    "grpo": GRPO,
    "gspo": dict(algorithm="gspo", **DEFAULTS),
    "reinforce_pp_baseline": dict(algorithm="reinforce_pp_baseline", **DEFAULTS),
}
EPOCHS, MICRO = 2, 2


def np_ratio(lp, old, mask, algorithm):
    """The importance ratio [B, G]: per token, or GSPO's exp(mean_t (lp - old)) of the answer on each of its tokens."""
    if algorithm != "gspo":
        return np.exp(lp - old)
    return np.exp(((lp - old) * mask).sum(1, keepdims=True) / mask.sum(1, keepdims=True)) * np.ones_like(lp)


def objective(params, seq, seq_mask, mask, old, ref, adv, algorithm):
    """The clipped surrogate + 0.5 x k3: grpo (clip-higher) and gspo each answer's token mean, then the answers' mean
    (gspo on the sequence: exp(mean_t log-ratio), clipped to [1 - 3e-4, 1 + 4e-4], one term per answer, no
    stop-gradient); reinforce_pp_baseline PPO's per-token clip (0.2), the mean over all answer tokens."""
    lp = answer_logprobs(params, seq, seq_mask)
    k3 = jnp.exp(ref - lp) - (ref - lp) - 1
    per_answer = lambda x: jnp.sum(x * mask, 1) / jnp.sum(mask, 1)  # noqa: E731
    if algorithm == "gspo":
        s = jnp.exp(per_answer(lp - old))
        a = adv[:, 0]
        surrogate = jnp.maximum(-a * s, -a * jnp.clip(s, 1 - 3e-4, 1 + 4e-4))
        return jnp.mean(surrogate + 0.5 * per_answer(k3))
    ratio = jnp.exp(lp - old)
    low, high = (0.2, 0.3) if algorithm == "grpo" else (0.2, 0.2)
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - low, 1 + high)) + 0.5 * k3
    if algorithm == "grpo":
        return jnp.mean(per_answer(per_token))
    return jnp.sum(per_token * mask) / jnp.sum(mask)


grad_of = jax.jit(jax.value_and_grad(objective), static_argnums=7)


@pytest.mark.parametrize(
    "algorithm,budget",
    [("grpo", 11), ("grpo", 64), ("gspo", 11), ("reinforce_pp_baseline", 64)],
    ids=["grpo a row each", "grpo rows by length", "gspo a row each", "reinforce_pp_baseline rows by length"],
)
@pytest.mark.slow
def test_one_iteration_equals_an_independent_computation(models, prompts, algorithm, budget):
    """Two PPO epochs over one generation batch, in accumulated micro-batches (a row each, which splits every group;
    or rows by length, two micro-batches), against one step on the whole batch in plain JAX + NumPy; the advantages
    of a group never see the other groups, however the steps cut the batch. The ratio's diagnostics (clip fraction,
    approximate KL, ratio mean, min and max) against NumPy's in both epochs."""
    batch, eos = prompts
    side = ModelSide(optim=OptimConfig(**OPTIM, gradient_accumulation_steps=MICRO))
    e = engine(models, ONE, eos, actor=side, max_tokens_per_micro_batch=budget, **SETTINGS[algorithm])
    f64 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float64), tree)  # noqa: E731
    f32 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)  # noqa: E731
    actor, ref_model, ema, adam = f64(models[0]), f32(models[0]), f64(models[0]), Adam(jax.tree.leaves(models[0]))
    exp = e.generate_experience(batch)
    got = host(exp)
    seq, seq_mask, mask = got["seq"], got["seq_mask"], got["mask"].astype(np.float64)
    old = np.asarray(answer_logprobs(f32(actor), seq, seq_mask), np.float64) * mask
    ref = np.asarray(answer_logprobs(ref_model, seq, seq_mask), np.float64) * mask
    reward = np.asarray(jit_values(CRITIC, models[1], seq, seq_mask), np.float64)
    scores = reward[np.arange(len(mask)), P + mask.sum(1).astype(int) - 1]
    np.testing.assert_allclose(got["scores"], scores, atol=2e-5)
    # a KL loss term (k3): no KL in the reward, so the sequence reward is the clipped score alone
    if algorithm == "reinforce_pp_baseline":
        adv = np_reinforce_pp_baseline(np.clip(scores, -1, 1), mask, 2)
    else:
        adv = np_group_advantages(np.clip(scores, -1, 1), 2, "grpo")[:, None] * mask
    for epoch in range(EPOCHS):
        lp_before = np.asarray(answer_logprobs(f32(actor), seq, seq_mask), np.float64)
        stats = e.train_rlhf(exp)
        loss, grads = grad_of(
            f32(actor), seq, seq_mask, *(jnp.asarray(x, jnp.float32) for x in (mask, old, ref, adv)), algorithm
        )
        leaves, norm = adam.step(jax.tree.leaves(actor), [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)])
        actor = jax.tree.unflatten(jax.tree.structure(actor), leaves)
        ema = jax.tree.map(lambda m, a: 0.9 * m + 0.1 * a, ema, actor)
        np.testing.assert_allclose(stats["actor_loss"], float(loss), rtol=2e-4, atol=2e-5, err_msg=f"epoch {epoch}")
        np.testing.assert_allclose(stats["actor_grad_norm"], norm, rtol=2e-4, err_msg=f"epoch {epoch}")
        np.testing.assert_allclose(stats["advantage"], adv[mask > 0].mean(), atol=1e-5)
        assert "critic_loss" not in stats
        ratio = np_ratio(lp_before, old, mask, algorithm)[mask > 0]
        low, high = e.cfg.clip_range
        a = adv[mask > 0]
        want = {
            "clip_frac": np.mean(-a * np.clip(ratio, 1 - low, 1 + high) > -a * ratio),
            "approx_kl": np.mean(0.5 * np.log(ratio) ** 2),
            "ratio_mean": ratio.mean(),
            "ratio_min": ratio.min(),
            "ratio_max": ratio.max(),
        }
        for k, v in want.items():
            np.testing.assert_allclose(stats[k], v, rtol=1e-4, atol=1e-6, err_msg=f"{k}, epoch {epoch}")
    for name, have, want in (("actor", e.actor_params(), actor), ("ema", e.state["ema"], ema)):
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(host(have))[0], jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"{name} {jax.tree_util.keystr(path)}")
    # the case is one where the terms matter: advantages of both signs, a ratio past the clip in epoch 2, a KL
    lp_now = np.asarray(answer_logprobs(f32(actor), seq, seq_mask)) * mask
    assert adv.min() < -0.5 and adv.max() > 0.5 and np.abs(lp_now - ref).max() > 0.05
    assert stats["clip_frac"] > 0 and stats["ratio_max"] > 1 + high


# ------------------------------------------------------------------------------------ the built-in pipeline


@pytest.fixture(scope="module")
def steps_1_and_2(tmp_path_factory):
    """`python -m jaxrlhf.train --step 1 2` on the built-in task, once for the algorithms below."""
    from jaxrlhf.train import parse
    from jaxrlhf.train import run as run_train

    root = tmp_path_factory.mktemp("pipeline")
    run_train(
        parse(["--step", "1", "2", "--output-dir", str(root / "run"), f"data.cache_dir={root / 'cache'}"]),
        log=lambda _: None,
        mesh=ONE,
    )
    return root


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_the_builtin_pipeline_aligns_without_a_critic(steps_1_and_2, algorithm, tmp_path):
    """`python -m jaxrlhf.train algorithm=grpo` (rloo) from Step 1 and 2's outputs: 4 answers to each of 8 prompts,
    the reward model's scores, no critic; the final actor's gold reward on held-out prompts is clearly above the
    Step 1 model's, at a bounded KL."""
    import shutil

    from jaxrlhf.train import parse
    from jaxrlhf.train import run as run_train

    shutil.copytree(steps_1_and_2 / "run", tmp_path / "run")
    args = [
        "--step",
        "3",
        "--output-dir",
        str(tmp_path / "run"),
        f"data.cache_dir={steps_1_and_2 / 'cache'}",
        f"algorithm={algorithm}",
    ]
    result = run_train(parse(args), mesh=ONE)
    c = result["comparison"]
    print(algorithm, {k: v for k, v in c.items() if k != "examples"}, f"{result['seconds']:.0f} s")
    assert c["actor_gold_reward_sampled"] > c["step1_gold_reward_sampled"] + 0.05
    assert c["actor_gold_reward_greedy"] > c["step1_gold_reward_greedy"]
    assert 0 < c["kl_actor_to_step1"] < 10
    assert set(result["step3"]) == {"actor", "actor_ema"}  # no critic trained, none exported


@pytest.mark.slow
def test_a_critic_free_run_resumes_exactly(tmp_path, monkeypatch):
    """python -m jaxrlhf.ppo algorithm=rloo: a crash in iteration 3 and a restart give the uninterrupted run's figures
    and weights (the saved state has no critic); the outputs are the actor and its EMA only."""
    from test_ppo import figures, ppo_config

    from jaxrlhf.ppo import run
    from jaxrlhf.rl import HybridEngine
    from jaxrlhf.train import builtin_model

    folders = (
        builtin_model(tmp_path / "actor", seed=0),
        builtin_model(tmp_path / "critic", seed=1, value_head=True),
        tmp_path / "unsup.txt",
    )
    folders[2].write_text(" ".join("Sort these letters: a b c" for _ in range(40)))
    kw = dict(algorithm="rloo", num_samples_per_prompt=2, batch_size=4, kl_loss="k3", loss_agg="seq_mean_token_sum")
    whole = run(ppo_config(folders, tmp_path / "a", **kw), log=lambda _: None, mesh=ONE)
    assert set(whole["folders"]) == {"actor", "actor_ema"} and "critic" not in whole["engine"].state
    real, calls = HybridEngine.generate_experience, []

    def crash_in_iteration_3(self, batch, *args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated crash")
        return real(self, batch, *args)

    monkeypatch.setattr(HybridEngine, "generate_experience", crash_in_iteration_3)
    cfg = ppo_config(folders, tmp_path / "b", save_every=2, **kw)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, log=lambda _: None, mesh=ONE)
    monkeypatch.setattr(HybridEngine, "generate_experience", real)
    resumed = run(cfg, log=lambda _: None, mesh=ONE)
    assert [r["step"] for r in resumed["records"]] == [3, 4]
    for g, w in zip(figures(resumed["records"]), figures(whole["records"][2:])):
        assert g.keys() == w.keys() and "critic_loss" not in g
        np.testing.assert_allclose([g[k] for k in sorted(g)], [w[k] for k in sorted(w)], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(whole["engine"].state), jax.tree.leaves(resumed["engine"].state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
