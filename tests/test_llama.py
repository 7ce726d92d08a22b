"""Llama in Flax against transformers' PyTorch LlamaForCausalLM on the same random weights: logits,
lossless HF round trips, greedy generation (one device and tensor-parallel), the layout tables."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from helpers import hf_logits, jit_logits, jit_values, left_padded_batch
from jaxrlhf import LlamaConfig, load_hf, make_mesh, reshard, save_hf, shardings_for
from jaxrlhf.generate import decode_params, generate
from jaxrlhf.models import Backend, init_params, llama, param_shapes

# Grouped-query attention (4 query heads over 2 KV heads), untied head, a non-default rope_theta; and
# plain multi-head attention with a tied head and biases (Qwen-style). 4 heads and vocab 64 split over tp 2.
GQA_UNTIED = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    rope_theta=500.0,
)
MHA_TIED_BIAS = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    attention_bias=True,
    mlp_bias=True,
)


def make_hf_llama(folder, seed: int = 0, **kwargs):
    """Save a randomly initialised `LlamaForCausalLM` (random norms and biases, O(1) logits) to `folder`."""
    import torch
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(HFConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, **kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[GQA_UNTIED, MHA_TIED_BIAS], ids=["gqa_untied", "mha_tied_bias"])
def model(request, tmp_path_factory):
    folder = make_hf_llama(tmp_path_factory.mktemp("llama") / "hf", **request.param)
    return folder, *load_hf(folder)


def test_config_is_read_from_config_json(model):
    folder, config, _ = model
    hf = json.loads((folder / "config.json").read_text())
    assert isinstance(config, LlamaConfig)
    assert (config.num_key_value_heads, config.tie_word_embeddings, config.head_dim) == (
        hf["num_key_value_heads"],
        hf["tie_word_embeddings"],
        8,
    )
    assert config.rope_theta == hf["rope_parameters"]["rope_theta"]


def test_logits_match_transformers_fp32_left_padded(model):
    folder, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [12, 9, 4, 1], T=12)
    ours = np.asarray(jit_logits(config, params, ids, mask))
    ref = hf_logits(folder, ids, mask)
    real = mask.astype(bool)  # rotary embeddings are relative: left padding shifts nothing that matters
    diff = np.abs(ours - ref)[real].max()
    print(f"max |ours - HF| over real tokens: {diff:.2e} (logit scale {np.abs(ref[real]).max():.2f})")
    assert np.abs(ref[real]).max() > 1.0
    assert diff <= 1e-4
    # the head on the last 5 positions only (the engine's answer log-probs) gives those positions' logits
    np.testing.assert_allclose(np.asarray(jit_logits(config, params, ids, mask, last=5)), ours[:, -5:], atol=1e-5)


def test_packed_sequences_give_the_logits_of_each_alone(model):
    """Two sequences in one row (segment_ids, positions restarting in each): each attends within its own only."""
    _, config, params = model
    ids, _ = left_padded_batch(config.vocab_size, [7], T=7, seed=11)
    packing = dict(segment_ids=np.array([[1, 1, 1, 2, 2, 2, 2]]), positions=np.array([[0, 1, 2, 0, 1, 2, 3]]))
    packed = np.asarray(jit_logits(config, params, ids, np.ones_like(ids), **packing))[0]
    for at in (slice(0, 3), slice(3, 7)):
        alone = np.asarray(jit_logits(config, params, ids[:, at], np.ones_like(ids[:, at])))[0]
        np.testing.assert_allclose(packed[at], alone, atol=1e-5)


def test_round_trip_is_bit_identical_and_transformers_loads_it(model, tmp_path):
    folder, config, params = model
    out = save_hf(tmp_path / "ours", config, params)
    original, saved = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(original) == sorted(saved)
    assert ("lm_head.weight" in saved) == (not config.tie_word_embeddings)
    for name in original:
        assert original[name].dtype == saved[name].dtype and original[name].tobytes() == saved[name].tobytes(), name
    ids, mask = left_padded_batch(config.vocab_size, [7, 2], T=7)
    real = mask.astype(bool)
    np.testing.assert_array_equal(hf_logits(out, ids, mask)[real], hf_logits(folder, ids, mask)[real])
    config2, params2 = load_hf(out)
    assert config2 == config
    again = save_hf(tmp_path / "again", config2, params2)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_value_head_round_trip_keeps_the_lm_head(model, tmp_path):
    from transformers import AutoModelForCausalLM

    _, config, params = model
    head = np.linspace(-1, 1, config.hidden_size, dtype=np.float32)[:, None]
    with_head = {**params, "value_head": {"kernel": head}}
    assert jax.tree.structure(param_shapes(config, value_head=True)) == jax.tree.structure(with_head)
    out = save_hf(tmp_path / "rm", config, with_head)
    AutoModelForCausalLM.from_pretrained(out)  # the LM part loads as a plain Llama
    _, back = load_hf(out)
    np.testing.assert_array_equal(back["value_head"]["kernel"], head)
    ids, mask = left_padded_batch(config.vocab_size, [5, 3], T=5)
    v = np.asarray(jit_values(config, back, ids, mask))
    assert v.shape == (2, 5) and np.isfinite(v).all() and np.abs(v).max() > 0.1


@pytest.mark.slow
def test_greedy_generation_equals_transformers(model):
    import torch
    from transformers import AutoModelForCausalLM

    folder, config, params = model
    lengths = [7, 3, 5, 1]
    ids, mask = left_padded_batch(config.vocab_size, lengths, T=7, seed=1)
    out = generate(config, params, ids, mask, jax.random.key(0), max_new_tokens=8, temperature=0.0)
    fast = generate(
        config, decode_params(config, params), ids, mask, jax.random.key(0), max_new_tokens=8, temperature=0.0
    )  # the decode layout: q/k/v (and gate/up) stacked, each layer its own arrays
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for b, n in enumerate(lengths):  # transformers row by row, unpadded
        row = torch.tensor(ids[b : b + 1, 7 - n :], dtype=torch.long)
        want = hf.generate(
            row, attention_mask=torch.ones_like(row), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
        assert np.asarray(out.tokens)[b].tolist() == want[0, n:].tolist()
        assert np.asarray(fast.tokens)[b].tolist() == want[0, n:].tolist()
    np.testing.assert_allclose(np.asarray(fast.logprobs), np.asarray(out.logprobs), atol=1e-5)


@pytest.mark.slow
def test_tensor_parallel_generation_with_the_decode_kernel_gives_the_same_tokens(model):
    _, config, params = model
    if config.tie_word_embeddings:
        pytest.skip("one variant is enough (the grouped-query one); test_convert.py runs stories260K with tp 2 too")
    ids, mask = left_padded_batch(config.vocab_size, [6, 2, 4, 5], T=6, seed=2)
    one = generate(config, params, ids, mask, jax.random.key(0), max_new_tokens=6, temperature=0.0)
    mesh = make_mesh(tp=2)
    tp = reshard(jax.tree.map(jnp.asarray, params), "tp", mesh)
    k_spec = tp["model"]["layers"]["self_attn"]["k_proj"]["kernel"].sharding.spec
    assert tuple(k_spec) == (None, None, "model")  # KV heads split over "model"
    # The GPU's path: the Pallas decode kernel (interpreted on the CPU) per shard, 1 query-head pair per KV head.
    kernel = dataclasses.replace(config, backend=Backend(decode_attention="pallas", interpret=True))
    out = generate(kernel, tp, ids, mask, jax.random.key(0), max_new_tokens=6, temperature=0.0, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(one.logprobs), atol=1e-5)
    # The engine's path: the decode layout built from the FSDP layout, split by KV heads (q/k/v) and by F (gate/up).
    fast = decode_params(config, reshard(jax.tree.map(jnp.asarray, params), "fsdp", mesh), mesh)
    layer = fast["model"]["layers"][1]
    assert tuple(layer["self_attn"]["qkv_proj"]["kernel"].sharding.spec)[:2] == (None, "model")
    assert tuple(layer["mlp"]["gate_up_proj"]["kernel"].sharding.spec) == (None, None, "model")
    out = generate(kernel, fast, ids, mask, jax.random.key(0), max_new_tokens=6, temperature=0.0, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(one.logprobs), atol=1e-5)


def test_every_parameter_has_a_layout_in_both_tables():
    config = LlamaConfig(**{**MHA_TIED_BIAS, "tie_word_embeddings": False, "num_key_value_heads": 2})
    mesh = make_mesh(tp=2)
    shapes = param_shapes(config, value_head=True)
    fsdp = shardings_for(shapes, "fsdp", mesh)
    tp = shardings_for(shapes, "tp", mesh)
    layers = lambda tree: tree["model"]["layers"]  # noqa: E731
    assert tuple(layers(tp)["self_attn"]["o_proj"]["kernel"].spec) == (None, "model", None)
    assert tuple(layers(tp)["mlp"]["gate_proj"]["kernel"].spec) == (None, None, "model")
    assert tuple(layers(tp)["mlp"]["down_proj"]["kernel"].spec) == (None, "model", None)
    assert tuple(tp["lm_head"]["kernel"].spec) == (None, "model")
    assert tuple(tp["model"]["norm"]["scale"].spec) == (None,)
    assert tuple(layers(fsdp)["mlp"]["up_proj"]["kernel"].spec) == (None, None, ("model", "data"))


@pytest.mark.slow
def test_interleaved_rope_is_rotate_half_with_permuted_projections():
    """Meta's / llama2.c's pairing (2i, 2i+1) is HF's (i, i+K/2) after permuting q/k output rows (convert.py)."""
    from jaxrlhf.convert import interleaved_to_halves

    config = LlamaConfig(**GQA_UNTIED)
    params = init_params(config, jax.random.key(0), std=0.2)
    attn = params["model"]["layers"]["self_attn"]
    permute = lambda k, heads: jnp.stack([interleaved_to_halves(x.T, heads).T for x in k])  # noqa: E731
    halves = jax.tree.map(lambda x: x, params)
    halves["model"]["layers"]["self_attn"] = {
        **attn,
        "q_proj": {"kernel": permute(attn["q_proj"]["kernel"], config.num_attention_heads)},
        "k_proj": {"kernel": permute(attn["k_proj"]["kernel"], config.num_key_value_heads)},
    }
    ids, mask = left_padded_batch(config.vocab_size, [9, 5], T=9)
    a = jit_logits(dataclasses.replace(config, rope_interleaved=True), params, ids, mask)
    b = jit_logits(config, halves, ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], atol=1e-5)
    assert np.abs(np.asarray(a - jit_logits(config, params, ids, mask))[real]).max() > 1e-3  # the layouts do differ


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        LlamaConfig(num_attention_heads=8, num_key_value_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        LlamaConfig(dtype="float64")


@pytest.mark.slow
def test_the_decode_layout_folds_each_norm_into_its_product(model):
    """llama.decode_layer: q/k/v and gate/up stacked with the RMSNorm scale that feeds them multiplied into their
    rows (values checked), the norms' entries gone; the layer then scales the product's rows by 1 / rms(h)."""
    _, config, params = model
    H, Hkv, K = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    G = H // Hkv
    layer = jax.tree.map(lambda x: np.asarray(x[1]), params["model"]["layers"])
    fast = llama.decode_layer(config, layer)
    assert "input_layernorm" not in fast and "post_attention_layernorm" not in fast
    g1, g2 = layer["input_layernorm"]["scale"], layer["post_attention_layernorm"]["scale"]
    assert np.abs(g1 - 1).max() > 0.01  # the fixture's norms are not ones: a missing fold shows
    qkv = np.asarray(fast["self_attn"]["qkv_proj"]["kernel"])  # [D, Hkv, (G + 2) K]
    attn = layer["self_attn"]
    np.testing.assert_allclose(
        qkv[:, :, : G * K], (g1[:, None] * attn["q_proj"]["kernel"] * K**-0.5).reshape(-1, Hkv, G * K), rtol=1e-6
    )
    np.testing.assert_allclose(
        qkv[:, :, G * K : (G + 1) * K], (g1[:, None] * attn["k_proj"]["kernel"]).reshape(-1, Hkv, K), rtol=1e-6
    )
    gate_up = np.asarray(fast["mlp"]["gate_up_proj"]["kernel"])  # [D, 2, F]
    np.testing.assert_allclose(gate_up[:, 1], g2[:, None] * layer["mlp"]["up_proj"]["kernel"], rtol=1e-6)
    if config.attention_bias:  # biases are added after the rows' scale: not folded
        np.testing.assert_array_equal(
            np.asarray(fast["self_attn"]["qkv_proj"]["bias"])[:, G * K : (G + 1) * K],
            attn["k_proj"]["bias"].reshape(Hkv, K),
        )


@pytest.mark.slow
def test_which_kernels_a_decode_step_runs(model):
    """With the kernels on, a decode step of the decode layout runs the fused attention step (decode_step, biases
    and all) and the SwiGLU kernel (rms_swiglu, when the MLP has no bias); with "xla" neither. Same tokens every
    way (the values are checked in the TP test above and in test_swiglu.py); the value tests cannot see a lost
    dispatch, since the unfused path gives the same tokens."""
    _, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [4, 2], T=4, seed=3)
    tokens = {}
    for impl in ("pallas", "xla"):
        cfg = dataclasses.replace(config, backend=Backend(decode_attention=impl, interpret=impl == "pallas"))
        run = lambda p: generate(cfg, p, ids, mask, jax.random.key(0), max_new_tokens=3, temperature=0.0).tokens
        fast = decode_params(cfg, jax.tree.map(jnp.asarray, params))
        program = str(jax.make_jaxpr(run)(fast))
        assert ("jaxrlhf_decode_attention_step" in program) == (impl == "pallas")
        assert ("jaxrlhf_rms_swiglu" in program) == (impl == "pallas" and not config.mlp_bias)
        tokens[impl] = np.asarray(run(fast))
    np.testing.assert_array_equal(tokens["pallas"], tokens["xla"])


def test_the_decode_step_runs_the_kernels_chosen_once(caplog, monkeypatch):
    """generation_modes chooses a decode step's kernels once and the layers' `decode` runs exactly those: the fused
    attention step and the SwiGLU kernel in every layer; with an interleaved rotary embedding (the kernel rotates
    rotate-half pairs) or MLP biases that kernel is off, said once in the log, and the layers run the unfused path."""
    from helpers import kernel_calls
    from jaxrlhf.models import common, generation_modes, init_cache, logits_with_cache

    monkeypatch.setattr(common, "_TOLD", set())  # what this process said already (another test may have)

    base = LlamaConfig(**GQA_UNTIED, backend=Backend(decode_attention="pallas", interpret=True))
    B, S, L = 2, 64, base.num_hidden_layers
    variants = {"plain": {}, "interleaved": dict(rope_interleaved=True), "mlp_bias": dict(mlp_bias=True)}
    for name, fields in variants.items():
        config = dataclasses.replace(base, **fields)
        params = decode_params(config, init_params(config, jax.random.key(0)))
        with caplog.at_level("WARNING", logger="jaxrlhf.models"):
            caplog.clear()
            for _ in range(2):
                _, mode = generation_modes(config, params, batch=B, slots=S)
        told = [r.getMessage() for r in caplog.records]
        cache = {**init_cache(config, jnp.ones((B, S), bool)), "slot": jnp.array([3, 5], jnp.int32)}
        ids = jnp.ones((B, 1), jnp.int32)
        step = jax.make_jaxpr(lambda p, c: logits_with_cache(config, p, ids, ids + 4, c, mode))(params, cache)
        calls = {
            n: kernel_calls(step, f"jaxrlhf_{n}") for n in ("decode_attention_step", "decode_attention", "rms_swiglu")
        }
        fused, swiglu = name != "interleaved", name != "mlp_bias"
        assert calls == {
            "decode_attention_step": L * fused,
            "decode_attention": L * (not fused),
            "rms_swiglu": L * swiglu,
        }
        assert mode.kernels.fused_step == fused and mode.kernels.swiglu == swiglu
        assert len(told) == (name != "plain") and all(("interleaved" if not fused else "mlp_bias") in t for t in told)
