"""Qwen2 and Qwen3 against transformers' PyTorch Qwen2ForCausalLM / Qwen3ForCausalLM on the same random weights:
logits with ragged left padding, bit-identical HF round trips, the value head, greedy generation through the Pallas
decode kernels (interpret mode; the fused step included), tensor parallelism, LoRA, the presets and the memory plan."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from helpers import hf_logits, jit_logits, jit_values, left_padded_batch
from jaxrlhf import QwenConfig, load_hf, make_mesh, preset, reshard, save_hf, shardings_for
from jaxrlhf.checkpoint import CheckpointError
from jaxrlhf.generate import decode_params, generate
from jaxrlhf.lora import LoRAConfig, attach, init_lora
from jaxrlhf.models import Backend, param_shapes

TINY = dict(  # an odd vocabulary, as added tokens make one: tp 2 keeps the LM head whole on each device
    vocab_size=67, intermediate_size=48, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2
)
# Qwen2: q/k/v biases, few KV heads (4 or 6 query heads over 2), tied and untied; Qwen3: q/k norms, a head dim that is
# not hidden / heads (16 and 12 with hidden 32), with and without attention_bias. 2 KV heads split over tp 2.
VARIANTS = {
    "qwen2_tied": dict(model_type="qwen2", hidden_size=32, num_attention_heads=4, tie_word_embeddings=True),
    "qwen2_untied_h6": dict(model_type="qwen2", hidden_size=48, num_attention_heads=6, tie_word_embeddings=False),
    "qwen3_tied_k16": dict(model_type="qwen3", hidden_size=32, num_attention_heads=4, head_dim=16),
    "qwen3_untied_bias_k12": dict(
        model_type="qwen3",
        hidden_size=32,
        num_attention_heads=4,
        head_dim=12,
        tie_word_embeddings=False,
        attention_bias=True,
    ),
}


def make_hf_qwen(folder, model_type: str, seed: int = 0, **kwargs):
    """Save a randomly initialised Qwen2/Qwen3ForCausalLM (random norms and biases, O(1) logits) to `folder`."""
    import torch
    import transformers

    name = model_type.capitalize()
    config_cls, model_cls = getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(seed)
    kwargs = {"num_hidden_layers": 2, "num_key_value_heads": 2, "tie_word_embeddings": True, **kwargs}
    model = model_cls(config_cls(**TINY, **kwargs)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def model(request, tmp_path_factory):
    folder = make_hf_qwen(tmp_path_factory.mktemp("qwen") / "hf", **VARIANTS[request.param])
    return folder, *load_hf(folder)


def test_config_is_read_from_config_json(model):
    folder, config, params = model
    hf = json.loads((folder / "config.json").read_text())
    assert isinstance(config, QwenConfig) and config.model_type == hf["model_type"]
    assert config.head_dim == hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    assert (config.num_key_value_heads, config.tie_word_embeddings) == (2, hf["tie_word_embeddings"])
    attn = params["model"]["layers"]["self_attn"]
    assert ("bias" in attn["q_proj"]) == ("bias" in attn["v_proj"]) == config.qkv_bias
    assert ("bias" in attn["o_proj"]) == hf.get("attention_bias", False)  # Qwen2: q/k/v biases only
    assert ("q_norm" in attn) == (config.model_type == "qwen3")
    if "q_norm" in attn:
        assert attn["q_norm"]["scale"].shape == attn["k_norm"]["scale"].shape == (2, config.head_dim)


def test_logits_match_transformers_fp32_left_padded(model):
    folder, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [12, 9, 4, 1], T=12)
    ours = np.asarray(jit_logits(config, params, ids, mask))
    ref = hf_logits(folder, ids, mask)
    real = mask.astype(bool)
    diff = np.abs(ours - ref)[real].max()
    print(f"max |ours - HF| over real tokens: {diff:.2e} (logit scale {np.abs(ref[real]).max():.2f})")
    assert np.abs(ref[real]).max() > 1.0
    assert diff <= 1e-4


def test_round_trip_is_bit_identical_and_transformers_loads_it(model, tmp_path):
    folder, config, params = model
    out = save_hf(tmp_path / "ours", config, params)
    original, saved = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(original) == sorted(saved)
    assert ("lm_head.weight" in saved) == (not config.tie_word_embeddings)
    for name in original:
        assert original[name].dtype == saved[name].dtype and original[name].tobytes() == saved[name].tobytes(), name
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [f"{config.model_type.capitalize()}ForCausalLM"]
    ids, mask = left_padded_batch(config.vocab_size, [7, 2], T=7)
    real = mask.astype(bool)
    np.testing.assert_array_equal(hf_logits(out, ids, mask)[real], hf_logits(folder, ids, mask)[real])
    config2, params2 = load_hf(out)
    assert config2 == config
    again = save_hf(tmp_path / "again", config2, params2)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_the_value_head_reads_the_last_hidden_state(model):
    """A value head equal to the LM head's column j gives logit j: the reward/critic path runs the same decoder."""
    _, config, params = model
    head = params["model"]["embed_tokens"]["embedding"].T if config.tie_word_embeddings else params["lm_head"]["kernel"]
    ids, mask = left_padded_batch(config.vocab_size, [6, 3], T=6, seed=4)
    logits = np.asarray(jit_logits(config, params, ids, mask))
    for j in (5, 17):
        v = np.asarray(jit_values(config, {**params, "value_head": {"kernel": head[:, j : j + 1]}}, ids, mask))
        np.testing.assert_allclose(v[mask.astype(bool)], logits[..., j][mask.astype(bool)], atol=1e-5)


KERNELS = Backend(decode_attention="pallas", interpret=True)


def test_greedy_generation_with_the_decode_kernels_equals_transformers(model):
    """Our generate() in the decode layout (q/k/v stacked, q_norm holding the attention's scale) through the fused
    decode_step kernel (interpret mode) equals HF's greedy tokens. (Compiling generation takes ~10 s here: one
    variant per family, the tied Qwen2 and the biased Qwen3 with head dim 12; tensor parallelism runs the others.)"""
    import torch
    from transformers import AutoModelForCausalLM

    folder, config, params = model
    if config.tie_word_embeddings != (config.model_type == "qwen2"):
        pytest.skip("one variant per family")
    lengths, new = [6, 2, 4, 5], 5
    ids, mask = left_padded_batch(config.vocab_size, lengths, T=6, seed=1)
    kernel = dataclasses.replace(config, backend=KERNELS)
    fast = generate(
        kernel, decode_params(config, params), ids, mask, jax.random.key(0), max_new_tokens=new, temperature=0.0
    )
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # as ours without eos_id: every row runs `new` tokens, EOS or not
    for b, n in enumerate(lengths):  # transformers row by row, unpadded
        row = torch.tensor(ids[b : b + 1, 6 - n :], dtype=torch.long)
        want = hf.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=new, do_sample=False)
        assert np.asarray(fast.tokens)[b].tolist() == want[0, n:].tolist()


def test_tensor_parallel_generation_and_reshard_both_ways(model):
    """tp 2 on the 8-device mesh: FSDP -> TP -> FSDP leaves every value as it was; generation in the decode layout
    built from FSDP (the engine's path: the fused decode kernel per shard) gives the single-device plain tokens."""
    _, config, params = model
    if config.tie_word_embeddings == (config.model_type == "qwen2"):
        pytest.skip("the other variant of each family: Qwen2 untied with 6 heads (3 per KV head), Qwen3 tied")
    ids, mask = left_padded_batch(config.vocab_size, [6, 2, 4, 5], T=6, seed=2)
    one = generate(config, params, ids, mask, jax.random.key(0), max_new_tokens=4, temperature=0.0)
    mesh = make_mesh(tp=2)
    fsdp = reshard(jax.tree.map(jnp.asarray, params), "fsdp", mesh)
    tp = reshard(fsdp, "tp", mesh)
    attn = tp["model"]["layers"]["self_attn"]
    assert tuple(attn["k_proj"]["kernel"].sharding.spec) == (None, None, "model")  # by KV heads
    back = reshard(tp, "fsdp", mesh)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, params)
    kernel = dataclasses.replace(config, backend=KERNELS)
    tree = decode_params(config, fsdp, mesh)
    out = generate(kernel, tree, ids, mask, jax.random.key(0), max_new_tokens=4, temperature=0.0, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(one.logprobs), atol=1e-5)


def test_lora_adapts_every_linear_of_the_layers_and_not_the_norms(model):
    """The default filter (model.layers.) puts adapters on q/k/v/o and gate/up/down, none on q_norm/k_norm; the
    attached forward equals the forward of the kernels with the product added by hand."""
    _, config, params = model
    if config.tie_word_embeddings == (config.model_type == "qwen2"):
        pytest.skip("one variant per family")
    cfg = LoRAConfig(dim=2, scaling=2.0)
    lora = init_lora(params, cfg, jax.random.key(3))
    layers = lora["model"]["layers"]
    assert sorted(layers["self_attn"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert sorted(layers["mlp"]) == ["down_proj", "gate_proj", "up_proj"]
    b = jax.random.normal(jax.random.key(4), layers["self_attn"]["v_proj"]["lora_b"].shape) * 0.5
    layers["self_attn"]["v_proj"]["lora_b"] = b
    by_hand = jax.tree.map(lambda x: x, params)
    v = by_hand["model"]["layers"]["self_attn"]["v_proj"]
    v["kernel"] = v["kernel"] + np.einsum("lir,lro->lio", layers["self_attn"]["v_proj"]["lora_a"], b) * (2.0 / 2)
    ids, mask = left_padded_batch(config.vocab_size, [5, 3], T=5, seed=5)
    got = jit_logits(config, attach(params, lora, cfg), ids, mask)
    want = jit_logits(config, by_hand, ids, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert np.abs(np.asarray(want - jit_logits(config, params, ids, mask))).max() > 1e-2


# The released models' parameter counts (total, without the embedding and untied head), from their model cards:
# Qwen2.5 0.49B / 0.36B, 1.54B / 1.31B, 7.61B / 6.53B; Qwen3 0.6B / 0.44B, 1.7B / 1.4B, 8.2B / 6.95B.
RELEASED = {
    "qwen2.5-0.5b": (0.49, 0.36),
    "qwen2.5-1.5b": (1.54, 1.31),
    "qwen2.5-7b": (7.61, 6.53),
    "qwen3-0.6b": (0.6, 0.44),
    "qwen3-1.7b": (1.7, 1.4),
    "qwen3-8b": (8.2, 6.95),
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_presets_have_the_released_parameter_counts(name):
    config = preset(name)
    shapes = param_shapes(config)
    total = sum(x.size for x in jax.tree.leaves(shapes)) / 1e9
    embed = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2) / 1e9
    for got, card in zip((total, total - embed), RELEASED[name]):  # within a unit of the card's last digit
        assert abs(got - card) <= 10 ** -len(str(card).split(".")[1]), (got, card)
    assert config.model_type == ("qwen3" if name.startswith("qwen3") else "qwen2")
    assert config.rope_theta == 1e6 and config.head_dim == (128 if name != "qwen2.5-0.5b" else 64)


def test_every_parameter_has_a_layout_and_the_memory_plan_counts_a_preset():
    from jaxrlhf import plan as memory_plan
    from jaxrlhf.rl import EngineConfig

    config = preset("qwen2.5-1.5b", dtype="bfloat16")
    mesh = memory_plan.abstract_mesh(8, 2)
    shapes = param_shapes(preset("qwen3-0.6b"), value_head=True)
    tp = shardings_for(shapes, "tp", make_mesh(tp=2))
    layers = tp["model"]["layers"]["self_attn"]
    assert tuple(layers["q_norm"]["scale"].spec) == (None, None)  # K is not split: each shard normalises whole heads
    assert tuple(layers["k_proj"]["kernel"].spec) == (None, None, "model")
    cfg = EngineConfig(algorithm="grpo", num_samples_per_prompt=8, max_answer_len=1024)
    p = memory_plan.plan(cfg, config, config, mesh, batch=256, prompt_len=256)  # GRPO: no critic planned
    # Qwen2.5-1.5B's 1,543,714,304 parameters in float32 masters, every leaf split over the 8 devices
    assert p.items["actor weights"] == 1_543_714_304 * 4 // 8
    # k and v [L 28, rows 256 / 4 data shards, Hkv 2 / tp 2, S 1280, K 128] in bf16
    assert p.items["KV cache"] == 2 * 28 * 64 * 1 * 1280 * 128 * 2


def test_sliding_window_and_qwen2_options_it_lacks_are_refused(tmp_path):
    folder = make_hf_qwen(tmp_path / "hf", "qwen2", hidden_size=32, num_attention_heads=4)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "use_sliding_window": True, "sliding_window": 16}))
    with pytest.raises(CheckpointError, match="use_sliding_window is True; jaxrlhf's qwen2 supports only False"):
        load_hf(folder)
    with pytest.raises(ValueError, match="attention_bias: qwen2 has none"):
        QwenConfig(**TINY, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    with pytest.raises(ValueError, match="model_type"):
        QwenConfig(model_type="qwen4")


def test_step1_runs_on_a_qwen3_folder_and_exports_what_transformers_loads(assets, tmp_path):
    """Step 1 for 2 steps on a tiny Qwen3 with the OPT tokenizer (ids 1 pad, 2 BOS/EOS): the exported folder is a
    Qwen3ForCausalLM whose logits are ours. (Steps 2 and 3, eval and chat run on such folders too: docs/usage.md.)"""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxrlhf import init_params, logits, opt_tokenizer
    from jaxrlhf.data import DataConfig
    from jaxrlhf.optim import OptimConfig
    from jaxrlhf.sft import SFTConfig
    from jaxrlhf.sft import run as run_sft

    config = QwenConfig(
        **{**TINY, "vocab_size": 50272, "pad_token_id": 1, "bos_token_id": 2},
        model_type="qwen3",
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        head_dim=16,
    )
    params = jax.device_get(init_params(config, jax.random.key(0), std=0.1))
    folder = save_hf(tmp_path / "qwen3", config, params, opt_tokenizer(assets / "opt-tokenizer"))
    data = DataConfig(data_path=("synthetic:200",), data_split="1,1,1", max_seq_len=32, cache_dir=str(tmp_path / "c"))
    cfg = SFTConfig(
        model=str(folder),
        output_dir=str(tmp_path / "out"),
        batch_size=8,
        max_steps=2,
        precision="fp32",
        sample_prompts=0,
        optim=OptimConfig(learning_rate=1e-3, warmup_steps=0),
        data=data,
    )
    out = run_sft(cfg, log=lambda _: None)
    trained_config, trained = load_hf(out["model_dir"])
    assert trained_config == config
    q_norm = trained["model"]["layers"]["self_attn"]["q_norm"]["scale"]
    assert not np.array_equal(q_norm, params["model"]["layers"]["self_attn"]["q_norm"]["scale"])  # trained too
    ids = np.array([[2, 100, 200, 300, 400, 500]], np.int32)
    ours = np.asarray(logits(config, trained, ids, np.ones_like(ids)))
    hf = AutoModelForCausalLM.from_pretrained(out["model_dir"], dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    np.testing.assert_allclose(ours, hf(torch.tensor(ids, dtype=torch.long)).logits.detach().numpy(), atol=1e-4)
