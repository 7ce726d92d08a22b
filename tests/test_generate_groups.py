"""A prompt's n answers (GRPO's groups) prefill it once: the same answers as prefilling every copy."""

import jax
import numpy as np
import pytest

from helpers import all_eqns, left_padded_batch
from jaxrlhf import QwenConfig, init_params, make_mesh, reshard
from jaxrlhf.generate import decode_params, generate

N_ANSWERS, G = 4, 7


@pytest.fixture(scope="module")
def model():
    """A tiny Qwen2 (4 query heads over 2 KV heads, q/k/v biases), random weights with O(1) logits."""
    config = QwenConfig(
        model_type="qwen2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return config, init_params(config, jax.random.key(0), std=0.3)


def _grouped_batch(config):
    """Five ragged prompts, each repeated N_ANSWERS times side by side (rl.engine.repeat_rows), and uneven limits."""
    ids, mask = left_padded_batch(config.vocab_size, [6, 2, 5, 1, 4], T=6, seed=3)
    ids, mask = (np.repeat(x, N_ANSWERS, axis=0) for x in (ids, mask))
    limits = np.random.default_rng(0).integers(1, G + 1, len(ids)).astype(np.int32)
    return ids, mask, limits


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_prefilling_each_prompt_once_gives_every_copys_answers(model, temperature):
    """Slots 8 and refills of one group (4 rows) over 20 rows: the last refill is partial, slots refill in any order.
    With the prompt prefilled once and its cache copied into its answers' slots, tokens, mask and log-probs equal
    those of prefilling every copy (group 1) with the same key. The copy going to another slot (a group's cache
    given to the next group's rows) changes the answers."""
    config, params = model
    ids, mask, limits = _grouped_batch(config)
    key = jax.random.key(5)
    run = lambda group, **kw: generate(
        config, params, ids, mask, key, max_new_tokens=G, temperature=temperature, eos_id=7, limits=limits,
        slots=8, refill=4, check_every=2, group=group, **kw,
    )  # fmt: skip
    want, got = run(1), run(N_ANSWERS)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-6)
    assert int(got.steps) == int(want.steps)
    tokens = np.asarray(got.tokens).reshape(5, N_ANSWERS, G)
    if temperature:  # each answer draws with its own key: a group's answers differ
        assert all(len({tuple(a) for a in group}) > 1 for group in tokens)
    else:  # greedy: a group's answers agree up to the shorter limit
        m = np.asarray(got.mask).reshape(5, N_ANSWERS, G)
        for group, gm in zip(tokens, m):
            both = gm[0] & gm[1]
            np.testing.assert_array_equal(group[0][both == 1], group[1][both == 1])


def test_each_prompt_is_prefilled_once(model):
    """The prefills run one row per prompt: a refill of 8 slots (2 prompts, 4 answers each) prefills 2 rows, where
    prefilling every copy runs 8 (the prefill's hidden states [rows, P, D] in the program)."""
    config, params = model
    ids, mask, _ = _grouped_batch(config)

    def prefill_rows(group):
        run = lambda: (
            generate(
                config, params, ids, mask, jax.random.key(0), max_new_tokens=G, slots=8, refill=8, group=group
            ).tokens
        )
        shapes = {
            v.aval.shape for eqn in all_eqns(jax.make_jaxpr(run)()) for v in eqn.outvars if hasattr(v.aval, "shape")
        }
        return {s[0] for s in shapes if s[1:] == (ids.shape[1], config.hidden_size)}

    assert prefill_rows(N_ANSWERS) == {2} and prefill_rows(1) == {8}


def test_groups_under_tensor_parallelism(model):
    """The same on a (data 4, model 2) mesh in the decode layout: a refill's one prompt is no multiple of "data"."""
    config, params = model
    ids, mask, limits = _grouped_batch(config)
    key = jax.random.key(6)
    want = generate(config, params, ids, mask, key, max_new_tokens=G, limits=limits)
    mesh = make_mesh(tp=2)
    fast = decode_params(config, reshard(params, "fsdp", mesh), mesh)
    got = generate(
        config, fast, ids, mask, key, max_new_tokens=G, limits=limits, slots=8, refill=4, group=N_ANSWERS, mesh=mesh
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)


def test_a_group_must_divide_the_batch(model):
    config, params = model
    ids, mask, _ = _grouped_batch(config)
    with pytest.raises(ValueError, match="group: expected a divisor of the batch"):
        generate(config, params, ids, mask, jax.random.key(0), max_new_tokens=2, group=3)
