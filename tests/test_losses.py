"""Every loss against a case computed by hand."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.losses import end_scores, lm_loss, masked_mean, reward_loss, token_logprobs


def logsig(x):
    return -math.log1p(math.exp(-x))


def test_masked_mean():
    assert float(masked_mean(jnp.array([1.0, 2.0, 3.0]), jnp.array([1, 0, 1]))) == 2.0
    assert float(masked_mean(jnp.array([1.0]), jnp.array([0]))) == 0.0


def test_lm_loss_by_hand():
    logits = jnp.array([[[0.0, 1.0, 2.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])  # [1, 3, 3]
    ids = jnp.array([[0, 2, 0]])
    lse0 = math.log(1 + math.e + math.e**2)
    lse1 = math.log(math.e**2 + 2)
    np.testing.assert_allclose(token_logprobs(logits, ids), [[2 - lse0, 2 - lse1]], rtol=1e-6)
    total, count, _ = lm_loss(token_logprobs(logits, ids), jnp.array([[0, 1, 1]]))
    np.testing.assert_allclose([total, count], [(lse0 - 2) + (lse1 - 2), 2], rtol=1e-6)
    total, count, _ = lm_loss(token_logprobs(logits, ids), jnp.array([[0, 0, 1]]))  # e.g. the prompt masked
    np.testing.assert_allclose([total, count], [lse1 - 2, 1], rtol=1e-6)


def test_reward_span_loss_by_hand():
    chosen_ids = jnp.array([[2, 5, 6, 7, 1, 1], [2, 5, 6, 1, 1, 1]])
    rejected_ids = jnp.array([[2, 5, 8, 1, 1, 1], [2, 5, 6, 1, 1, 1]])  # pair 2: identical sequences
    chosen_mask = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    rejected_mask = jnp.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]])
    cv = jnp.array([[0.1, 0.2, 0.5, 1.5, 9.0, 9.0], [0.0, 0.0, 0.3, 0.0, 0.0, 0.0]])
    rv = jnp.array([[0.1, 0.2, 0.7, -0.5, 9.0, 9.0], [0.0, 0.0, 0.3, 0.0, 0.0, 0.0]])
    total, pairs, m = reward_loss(cv, rv, chosen_ids, rejected_ids, chosen_mask, rejected_mask)
    # Pair 1 diverges at t = 2 and ends at max(4, 3) = 4: the span is t = 2, 3.
    want = -(logsig(0.5 - 0.7) + logsig(1.5 - (-0.5))) / 2
    np.testing.assert_allclose([total, pairs], [want, 1.0], rtol=1e-6)
    np.testing.assert_allclose(end_scores(cv, chosen_mask), [1.5, 0.3])
    np.testing.assert_allclose(end_scores(rv, rejected_mask), [0.7, 0.3])
    # accuracy: pair 1 1.5 > 0.7 yes; pair 2 0.3 > 0.3 no.
    np.testing.assert_allclose([m["accuracy"], m["chosen_score"], m["rejected_score"]], [1.0, 1.8, 1.0], rtol=1e-6)
    total, pairs, _ = reward_loss(cv, rv, chosen_ids, rejected_ids, chosen_mask, rejected_mask, kind="last")
    np.testing.assert_allclose([total, pairs], [-(logsig(1.5 - 0.7) + logsig(0.0)), 2.0], rtol=1e-6)
    with pytest.raises(ValueError, match="expected 'span' or 'last'"):
        reward_loss(cv, rv, chosen_ids, rejected_ids, chosen_mask, rejected_mask, kind="mean")
