"""OPT in Flax against transformers' PyTorch OPTForCausalLM on the same random weights."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import POST_LN_PROJ, PRE_LN, hf_logits, jit_logits, left_padded_batch, make_hf_opt
from jaxrlhf import load_hf, logits, values
from jaxrlhf.models import Backend, Mode, OPTConfig, init_params, positions_from_mask


@pytest.fixture(scope="module", params=[PRE_LN, POST_LN_PROJ], ids=["pre_ln", "post_ln_proj"])
def hf_folder(request, tmp_path_factory):
    return make_hf_opt(tmp_path_factory.mktemp(request.param_index.__str__()), **request.param)


def test_logits_match_transformers_fp32_left_padded(hf_folder):
    config, params = load_hf(hf_folder)
    ids, mask = left_padded_batch(config.vocab_size, [12, 9, 4, 1], T=12)
    ours = np.asarray(jit_logits(config, params, ids, mask))
    ref = hf_logits(hf_folder, ids, mask)
    real = mask.astype(bool)  # padded positions have no meaning in either implementation
    diff = np.abs(ours - ref)[real].max()
    print(f"max |ours - HF| over real tokens: {diff:.2e} (logit scale {np.abs(ref[real]).max():.2f})")
    assert np.abs(ref[real]).max() > 1.0  # the comparison is not between near-zero numbers
    assert diff <= 1e-4
    # the head on the last 5 positions only (the engine's answer log-probs) gives those positions' logits
    np.testing.assert_allclose(np.asarray(jit_logits(config, params, ids, mask, last=5)), ours[:, -5:], atol=1e-5)


def test_left_padding_gives_the_same_logits_as_no_padding(hf_folder):
    config, params = load_hf(hf_folder)
    ids, mask = left_padded_batch(config.vocab_size, [5], T=9, seed=3)
    padded = np.asarray(jit_logits(config, params, ids, mask))[0, 4:]
    alone = np.asarray(jit_logits(config, params, ids[:, 4:], mask[:, 4:]))[0]
    np.testing.assert_allclose(padded, alone, atol=1e-5)


def test_any_padding_pattern_gives_the_logits_of_the_real_tokens_alone(hf_folder):
    """Right padding and holes in the middle too: the decoder moves real tokens first internally."""
    config, params = load_hf(hf_folder)
    ids, _ = left_padded_batch(config.vocab_size, [6], T=6, seed=5)
    alone = np.asarray(jit_logits(config, params, ids, np.ones_like(ids)))[0]
    holes = np.array([[1, 1, 0, 1, 0, 1, 1, 1, 0]], np.int32)  # real, real, pad, real, pad, real, real, real, pad
    padded = np.full((1, 9), 1, np.int32)
    padded[holes == 1] = ids[0]
    out = np.asarray(jit_logits(config, params, padded, holes))[0]
    np.testing.assert_allclose(out[holes[0] == 1], alone, atol=1e-5)
    assert np.isfinite(out).all()


def test_packed_sequences_give_the_logits_of_each_alone(hf_folder):
    """Two sequences packed in one left-padded row (segment_ids; positions restarting at 0 in each): each attends
    within its segment only, so each gets the logits and values it gets alone."""
    config, params = load_hf(hf_folder)
    ids, _ = left_padded_batch(config.vocab_size, [7], T=7, seed=11)
    a, b = ids[:, :3], ids[:, 3:]
    row = np.concatenate([np.full((1, 2), config.pad_token_id, np.int32), a, b], 1)
    mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    packing = dict(
        segment_ids=np.array([[0, 0, 1, 1, 1, 2, 2, 2, 2]]), positions=np.array([[-1, -1, 0, 1, 2, 0, 1, 2, 3]])
    )
    packed = np.asarray(jax.jit(partial(logits, config))(params, row, mask, **packing))[0]
    head = {**params, "value_head": {"kernel": jax.random.normal(jax.random.key(1), (config.word_embed_proj_dim, 1))}}
    packed_values = np.asarray(jax.jit(partial(values, config))(head, row, mask, **packing))[0]
    for seq, at in ((a, slice(2, 5)), (b, slice(5, 9))):
        alone = np.asarray(jit_logits(config, params, seq, np.ones_like(seq)))[0]
        np.testing.assert_allclose(packed[at], alone, atol=1e-5)
        np.testing.assert_allclose(
            packed_values[at], np.asarray(values(config, head, seq, np.ones_like(seq)))[0], atol=1e-5
        )


def test_the_backend_is_detected_once_and_its_default_is_plain_xla():
    assert Backend.detect() == Backend() == OPTConfig().backend  # the CPU: XLA attention, a rolled loop, no kernels
    assert Backend.detect(decode_attention="pallas", scan_unroll=3) == Backend("xla", "pallas", True, 3)  # interpreted
    with pytest.raises(ValueError, match="Backend.attention"):
        Backend(attention="auto")  # "auto" is detect()'s to resolve, never the model's
    with pytest.raises(ValueError, match="Mode.kind"):
        Mode("generate")


def test_positions_follow_the_mask():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(positions_from_mask(mask), [[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4]])


def test_value_head_is_a_linear_map_of_the_last_hidden_state(hf_folder):
    import torch
    from transformers import OPTModel

    config, params = load_hf(hf_folder)
    head = np.random.default_rng(0).normal(size=(config.word_embed_proj_dim, 1)).astype(np.float32)
    ids, mask = left_padded_batch(config.vocab_size, [7, 3], T=7)
    ours = np.asarray(values(config, {**params, "value_head": {"kernel": head}}, ids, mask))
    with torch.no_grad():
        h = OPTModel.from_pretrained(hf_folder)(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state
    ref = h.numpy() @ head[:, 0]
    np.testing.assert_allclose(ours[mask == 1], ref[mask == 1], atol=1e-4)


@partial(jax.jit, static_argnums=1)
@jax.value_and_grad
def _value_and_grad(p, cfg, ids, mask):
    return jnp.sum(jax.nn.log_softmax(logits(cfg, p, ids, mask))[..., 5] * mask)


@pytest.mark.parametrize(
    "change",
    [{"remat": True}, {"backend": Backend(scan_unroll=2)}, {"remat": True, "backend": Backend(scan_unroll=0)}],
    ids=["remat", "unroll", "remat_unrolled"],
)
@pytest.mark.slow
def test_remat_and_unrolling_change_neither_values_nor_gradients(hf_folder, change):
    config, params = load_hf(hf_folder)
    ids, mask = left_padded_batch(config.vocab_size, [6, 4], T=6)

    plain = _value_and_grad(params, dataclasses.replace(config, backend=Backend(scan_unroll=1)), ids, mask)
    other = _value_and_grad(params, dataclasses.replace(config, **change), ids, mask)
    np.testing.assert_allclose(plain[0], other[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(other[1])):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_bfloat16_compute_tracks_float32(hf_folder):
    config, params = load_hf(hf_folder)
    ids, mask = left_padded_batch(config.vocab_size, [8, 3], T=8)
    real = mask.astype(bool)
    f32 = np.asarray(jit_logits(config, params, ids, mask))[real]
    bf16_params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
    bf16 = np.asarray(jit_logits(dataclasses.replace(config, dtype="bfloat16"), bf16_params, ids, mask))
    assert bf16.dtype == np.float32
    assert np.isfinite(bf16).all()  # padded rows too: a masked bias that overflowed bf16 would give NaNs
    err = np.abs(bf16[real] - f32).max() / np.abs(f32).max()
    assert err < 0.05, err
    assert np.mean(np.argmax(bf16[real], -1) == np.argmax(f32, -1)) > 0.9


def test_dropout_only_with_a_key_and_reproducible():
    config = OPTConfig(**PRE_LN, dropout=0.3, attention_dropout=0.2)
    params = init_params(config, jax.random.key(0), std=0.3)
    ids, mask = left_padded_batch(config.vocab_size, [6, 6], T=6)
    base = jit_logits(config, params, ids, mask)
    np.testing.assert_array_equal(base, jit_logits(config, params, ids, mask))
    k1, k2 = jax.random.split(jax.random.key(1))
    d1 = jit_logits(config, params, ids, mask, dropout_rng=k1)
    assert np.abs(np.asarray(d1 - base)).max() > 1e-3
    np.testing.assert_array_equal(d1, jit_logits(config, params, ids, mask, dropout_rng=k1))
    assert np.abs(np.asarray(d1 - jit_logits(config, params, ids, mask, dropout_rng=k2))).max() > 1e-3


def test_init_params_statistics():
    config = OPTConfig(**POST_LN_PROJ)
    params = init_params(config, jax.random.key(0), value_head=True)
    assert params["value_head"]["kernel"].shape == (16, 1)
    layers = params["decoder"]["layers"]
    np.testing.assert_array_equal(layers["self_attn_layer_norm"]["scale"], 1.0)
    np.testing.assert_array_equal(layers["fc1"]["bias"], 0.0)
    assert abs(float(jnp.std(layers["fc1"]["kernel"])) - 0.02) < 0.003
    # Layers get independent draws, not one draw repeated L times.
    assert not np.allclose(layers["fc1"]["kernel"][0], layers["fc1"]["kernel"][1])


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="dtype"):
        OPTConfig(dtype="float64")
    with pytest.raises(ValueError, match="not divisible"):
        OPTConfig(hidden_size=30, num_attention_heads=4)


def test_float32_logits_has_the_plain_gradients_and_a_bf16_backward():
    from jaxrlhf.models.common import float32_logits

    kh, kw, kg = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(kh, (2, 5, 16), jnp.float32)
    w = jax.random.normal(kw, (40, 16), jnp.float32)
    g = jax.random.normal(kg, (2, 5, 40), jnp.float32)

    def vjp(f, *args):
        out, back = jax.vjp(f, *args)
        return out, back(g)

    ours = vjp(lambda h, w: float32_logits("bte,ve->btv", h, w), h, w)
    plain = vjp(lambda h, w: jnp.einsum("bte,ve->btv", h, w), h, w)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-5)

    # In bf16 the backward's products take bf16 operands (a float32 operand makes XLA run float32 GEMMs), and
    # the gradients track the float32 ones.
    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    loss = lambda h, w: jnp.sum(jax.nn.log_softmax(float32_logits("bte,ve->btv", h, w)) * g)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hb, wb)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]  # the forward's is nested
    assert len(dots) == 2
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    fast = jax.grad(loss, argnums=(0, 1))(hb, wb)
    exact = jax.grad(loss, argnums=(0, 1))(h, w)
    for a, b in zip(fast, exact):
        assert a.dtype == jnp.bfloat16
        err = np.abs(np.asarray(a, np.float32) - b).max() / np.abs(b).max()
        assert err < 0.02, err


KERNELS = Backend(decode_attention="pallas", interpret=True)
FFN_BLOCKS = dict(vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, ffn_dim=512)


def test_decode_kernels_are_chosen_once_and_name_what_is_off():
    """models.decode_kernels, by hand: at 16 rows with widths of whole 64 x 128 blocks both FFN products run in
    decode_matmul and the attention in the fused step; at 8 rows neither product (each named as off); the training
    layout runs no layer kernel (named); LoRA attached to the decode layout is an error; "xla" runs none, names none.
    A Mode refuses layer kernels outside a decode step in the decode layout."""
    from jaxrlhf.models import DecodeKernels, decode_kernels

    config = OPTConfig(**FFN_BLOCKS, word_embed_proj_dim=128, backend=KERNELS)
    k = decode_kernels(config, batch=16, slots=64)
    assert (k.attention.implementation, k.fused_step, k.matmul, k.swiglu, k.off) == (
        "pallas",
        True,
        ("fc1", "fc2"),
        False,
        (),
    )
    k = decode_kernels(config, batch=8, slots=64)
    assert k.fused_step and k.matmul == () and [w.split(" ")[0] for w in k.off] == ["fc1", "fc2"]
    k = decode_kernels(config, batch=16, slots=64, layout=False, lora=True)
    assert not k.layers and k.attention.implementation == "pallas" and "training layout" in k.off[0], k
    with pytest.raises(ValueError, match="LoRA"):
        decode_kernels(config, batch=16, slots=64, lora=True)
    xla = decode_kernels(dataclasses.replace(config, backend=Backend()), batch=16, slots=64)
    assert xla == DecodeKernels(dataclasses.replace(KERNELS.kernels, implementation="xla", interpret=False))
    with pytest.raises(ValueError, match="Mode.kernels"):
        Mode("prefill", True, kernels=DecodeKernels(fused_step=True))
    with pytest.raises(ValueError, match="Mode.kernels"):
        Mode("decode", False, kernels=DecodeKernels(matmul=("fc1",)))
