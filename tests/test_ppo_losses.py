"""The PPO functions of losses.py against cases worked out by hand (each function's docstring states its formula).

Three answers of a batch padded to G = 3: row 0 has 2 real tokens, row 1 fills the whole length, row 2
has 1. The numbers at masked positions are junk (9, 7, ...) that must not leak into any result.
"""

import math

import jax.numpy as jnp
import numpy as np

from jaxrlhf.rl.losses import actor_loss, adaptive_kl_coef, compute_rewards, critic_loss, gae, sequence_kl, whiten

MASK = jnp.array([[1, 1, 0], [1, 1, 1], [1, 0, 0]])


def test_compute_rewards_by_hand():
    ref = jnp.zeros((3, 3))
    logprobs = jnp.array([[-1.0, -2.0, 9.0], [1.0, 0.0, 3.0], [0.5, 7.0, 7.0]])  # minus ref = the log-ratio
    score = jnp.array([2.0, 10.0, -7.0])  # clipped to 2, 5, -5
    got = compute_rewards(logprobs, ref, score, MASK, kl_coef=0.1, clip_score=5.0)
    want = [
        [0.1, 0.2 + 2.0, 0.0],  # -0.1 * (-1), -0.1 * (-2) + score at t = n - 1 = 1
        [-0.1, 0.0, -0.3 + 5.0],  # the full-length row gets its score at the very last position
        [-0.05 - 5.0, 0.0, 0.0],
    ]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # The KL term uses logprobs - ref_logprobs, not the logprobs alone.
    np.testing.assert_allclose(
        compute_rewards(logprobs, logprobs, score, MASK, 0.1, 5.0)[:, :1], [[0.0], [0.0], [-5.0]]
    )


def test_gae_by_hand():
    values = jnp.array([[1.0, 2.0, 9.0], [0.0, 1.0, 1.0], [3.0, 5.0, 5.0]])
    rewards = jnp.array([[0.5, 1.0, 7.0], [0.0, 0.0, 2.0], [1.0, 4.0, 4.0]])
    adv, ret = gae(values, rewards, MASK, gamma=1.0, lam=0.5)
    # row 0: delta_1 = 1 - 2 = -1 (V_2 is past the end: 0); delta_0 = 0.5 + 2 - 1 = 1.5; A_0 = 1.5 + 0.5 * -1 = 1
    # row 1: delta = (0 + 1 - 0, 0 + 1 - 1, 2 - 1) = (1, 0, 1); A_2 = 1, A_1 = 0.5, A_0 = 1.25
    # row 2: delta_0 = 1 - 3 = -2
    np.testing.assert_allclose(adv, [[1.0, -1.0, 0.0], [1.25, 0.5, 1.0], [-2.0, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[2.0, 1.0, 0.0], [1.25, 1.5, 2.0], [1.0, 0.0, 0.0]], rtol=1e-6)
    # gamma = 0.5, lam = 1 on row 1: delta = (0 + 0.5 - 0, 0 + 0.5 - 1, 2 - 1) = (0.5, -0.5, 1); A = (0.5, 0, 1)
    adv, ret = gae(values, rewards, MASK, gamma=0.5, lam=1.0)
    np.testing.assert_allclose(adv[1], [0.5, 0.0, 1.0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ret[1], [0.5, 1.0, 2.0], rtol=1e-6)


def test_whiten_by_hand():
    x = jnp.array([[1.0, 2.0, 100.0], [3.0, -50.0, 0.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    s = math.sqrt(2 / 3 + 1e-8)  # mean 2, variance ((1-2)^2 + 0 + (3-2)^2) / 3
    np.testing.assert_allclose(whiten(x, mask), [[-1 / s, 0.0, 0.0], [1 / s, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(
        whiten(x, mask, shift_mean=False), [[2 - 1 / s, 2.0, 0.0], [2 + 1 / s, 0.0, 0.0]], rtol=1e-6
    )


def test_actor_loss_by_hand():
    # Three real tokens: ratio 1.5 with A = 1 (clipped to 1.2), ratio 0.5 with A = -1 (clipped to 0.8),
    # ratio 1 with A = 2.
    old = jnp.zeros((3, 3))
    logprobs = jnp.array([[math.log(1.5), math.log(0.5), 5.0], [3.0, 3.0, 3.0], [0.0, 4.0, 4.0]])
    adv = jnp.array([[1.0, -1.0, 8.0], [5.0, 5.0, 5.0], [2.0, 8.0, 8.0]])
    mask = jnp.array([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    # max(-1.5, -1.2) = -1.2; max(0.5, 0.8) = 0.8; max(-2, -2) = -2: mean -0.8
    np.testing.assert_allclose(actor_loss(logprobs, old, adv, mask, clip=0.2), -0.8, rtol=1e-6)
    # A full-length row: all ratios 1 -> the loss is -mean(A).
    np.testing.assert_allclose(actor_loss(old, old, adv, jnp.array([[0, 0, 0], [1, 1, 1], [0, 0, 0]])), -5.0, rtol=1e-6)


def test_critic_loss_by_hand():
    values = jnp.array([[1.0, 0.0, 9.0], [3.0, 9.0, 9.0]])
    old = jnp.array([[0.5, 0.1, 0.0], [3.0, 0.0, 0.0]])
    returns = jnp.array([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    # t0: v_clip = 0.5 + 0.2 = 0.7: max((1 - 2)^2, (0.7 - 2)^2) = 1.69; t1: v_clip = 0: 0; row 1: (3 - 1)^2 = 4
    np.testing.assert_allclose(critic_loss(values, old, returns, mask, clip=0.2), 0.5 * (1.69 + 0 + 4) / 3, rtol=1e-6)


def test_sequence_kl_and_adaptive_kl_coef_by_hand():
    logprobs = jnp.array([[-1.0, -2.0, 9.0], [0.5, 0.5, 0.5], [-1.0, 7.0, 7.0]])
    ref = jnp.array([[-1.5, -2.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    # per answer: 0.5 + 0, 0.5 * 3, 0: mean (0.5 + 1.5 + 0) / 3
    np.testing.assert_allclose(sequence_kl(logprobs, ref, MASK), 2.0 / 3, rtol=1e-6)
    # error kl / target - 1 = 0.1 (unclipped), 0.2 (clipped from 1.0), -0.2 (clipped from -1)
    np.testing.assert_allclose(adaptive_kl_coef(0.1, 1.1, 1.0, 100, 10), 0.1 * (1 + 0.1 * 10 / 100), rtol=1e-6)
    np.testing.assert_allclose(adaptive_kl_coef(0.1, 2.0, 1.0, 100, 10), 0.1 * (1 + 0.2 * 10 / 100), rtol=1e-6)
    np.testing.assert_allclose(adaptive_kl_coef(0.1, 0.0, 1.0, 100, 10), 0.1 * (1 - 0.2 * 10 / 100), rtol=1e-6)
