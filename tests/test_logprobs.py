"""Log-probs without [B, T, V] logits (models.hidden + head_logprobs, chunked) against the plain computation, and
generation's log-probs at the sampling temperature."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import PRE_LN, left_padded_batch
from jaxrlhf import LlamaConfig, OPTConfig, init_params
from jaxrlhf.generate import generate
from jaxrlhf.models import head_logprobs, hidden, logits

LLAMA = LlamaConfig(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def numpy_logprobs(z, targets, temperature=1.0):
    z = np.asarray(z, np.float64) / temperature
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    return np.take_along_axis(logp, targets[..., None], -1)[..., 0], -(np.exp(logp) * logp).sum(-1)


@pytest.mark.parametrize("config", [OPTConfig(**PRE_LN, dropout=0.0), LLAMA], ids=["opt-tied", "llama-untied"])
def test_chunked_equals_plain_values_and_gradients(config):
    params = init_params(config, jax.random.key(0), std=0.3)
    ids, mask = left_padded_batch(config.vocab_size, [9, 4, 11], T=11, seed=1)
    targets = jnp.roll(jnp.asarray(ids), -1, axis=1)
    w = jnp.asarray(mask, jnp.float32)  # the padding masked out, as the losses do
    want_lp, want_ent = numpy_logprobs(logits(config, params, ids, mask), np.asarray(targets), 0.7)

    def loss(p, chunk):
        h = hidden(config, p, ids, mask)
        lp, ent = head_logprobs(config, p, h, targets, temperature=0.7, chunk=chunk, entropy=True)
        return jnp.sum((lp + 0.3 * ent) * w), (lp, ent)

    plain, chunked = (jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)(params, c) for c in (0, 7))
    for _, (lp, ent) in (plain, chunked):  # chunk 7 over 3 rows: 2 positions per chunk, 11 not a multiple
        np.testing.assert_allclose(lp * w, want_lp * w, atol=2e-5)
        np.testing.assert_allclose(ent * w, want_ent * w, atol=2e-5)
    for a, b in zip(jax.tree.leaves(plain[0]), jax.tree.leaves(chunked[0])):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def test_generation_logprobs_are_at_the_sampling_temperature():
    config = OPTConfig(**PRE_LN, dropout=0.0)
    params = init_params(config, jax.random.key(0), std=0.3)
    ids, mask = left_padded_batch(config.vocab_size, [5, 3], T=5, seed=2)
    gen = generate(config, params, ids, mask, jax.random.key(1), max_new_tokens=4, temperature=0.7)
    seq = np.concatenate([ids, np.asarray(gen.tokens)], 1)
    z = np.asarray(logits(config, params, seq, np.concatenate([mask, np.asarray(gen.mask)], 1)))[:, 4:-1]
    want = numpy_logprobs(z, np.asarray(gen.tokens), 0.7)[0] * np.asarray(gen.mask)
    np.testing.assert_allclose(np.asarray(gen.logprobs), want, atol=2e-5)


def test_chunked_backward_holds_one_chunk_of_logits():
    """XLA's own temp bytes of the gradient program: the plain one holds [B, T, V] float32 logits (and their
    log-softmax), the chunked one a chunk's (jax.checkpoint: the backward recomputes each chunk's logits)."""
    from jaxrlhf.models.common import head_logprobs as head

    B, T, E, V = 4, 256, 16, 2048
    h = jax.random.normal(jax.random.key(0), (B, T, E))
    kernel = jax.random.normal(jax.random.key(1), (V, E))
    targets = jax.random.randint(jax.random.key(2), (B, T), 0, V)
    grad = lambda chunk: jax.grad(lambda h, k: jnp.sum(head(h, k, targets, tied=True, chunk=chunk)[0]), (0, 1))
    temp = lambda chunk: jax.jit(grad(chunk)).lower(h, kernel).compile().memory_analysis().temp_size_in_bytes
    full, chunk = B * T * V * 4, 128 * V * 4  # 128 tokens a chunk: 1 / 8 of them
    assert temp(0) >= 2 * full  # the logits, their log-softmax and its gradient: measured 3 x full
    assert temp(128) <= 5 * chunk < full, (temp(128), chunk)  # measured 4.1 x chunk


def test_step3_scores_and_trains_at_the_sampling_temperature():
    """Answers sampled at temperature 0.7: the old, reference and generation's log-probs equal NumPy's
    log_softmax(logits / 0.7) of the same tokens, and the first epoch's ratio (the training step's log-probs over the
    old ones scored apart, old_logprobs scoring) is exactly 1."""
    from test_engine import ACTOR, CRITIC, LENGTHS, G, engine, host

    from jaxrlhf import make_mesh

    actor = jax.device_get(init_params(ACTOR, jax.random.key(0), std=0.3))
    critic = jax.device_get(init_params(CRITIC, jax.random.key(1), value_head=True, std=0.3))
    ids, mask = left_padded_batch(64, LENGTHS, T=6, seed=5)
    e = engine((actor, critic), make_mesh(1, jax.devices()[:1]), 2, temperature=0.7, old_logprobs="scoring")
    exp = e.generate_experience({"prompt_ids": ids, "prompt_mask": mask})
    got = host(exp)
    seq, m = got["seq"], got["mask"]
    z = np.asarray(logits(ACTOR, actor, seq, got["seq_mask"]))[:, 5:-1]
    want = numpy_logprobs(z, seq[:, 6:], 0.7)[0] * m
    for k in ("logprobs", "ref_logprobs", "generation_logprobs"):
        np.testing.assert_allclose(got[k] * m, want, atol=2e-5, err_msg=k)
    stats = e.train_rlhf(exp)
    np.testing.assert_allclose([stats["ratio_min"], stats["ratio_max"]], [1.0, 1.0], atol=1e-6)
    assert m.shape[1] == G
