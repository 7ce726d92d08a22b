"""KV-cached generation against the cache-free reference and transformers' own generate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import POST_LN_PROJ, PRE_LN, all_eqns, greedy_reference, kernel_calls, left_padded_batch, make_hf_opt
from jaxrlhf import load_hf, logits, make_mesh, reshard
from jaxrlhf.generate import Sampling, decode_params, generate, sample
from jaxrlhf.models import Backend

KERNELS = Backend(decode_attention="pallas", interpret=True)  # the Pallas kernels in interpret mode


@pytest.fixture(scope="module", params=[PRE_LN, POST_LN_PROJ], ids=["pre_ln", "post_ln_proj"])
def model(request, tmp_path_factory):
    folder = make_hf_opt(tmp_path_factory.mktemp("gen") / "m", **request.param)
    return folder, *load_hf(folder)


def test_greedy_equals_the_cache_free_reference_and_transformers(model):
    import torch
    from transformers import AutoModelForCausalLM

    folder, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [7, 3, 5, 1], T=7, seed=1)
    out = generate(config, params, ids, mask, jax.random.key(0), max_new_tokens=6, temperature=0.0)
    ref = np.asarray(greedy_reference(config, params, jnp.asarray(ids), jnp.asarray(mask), 6))
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    assert np.asarray(out.mask).all()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for b, n in enumerate([7, 3, 5, 1]):  # transformers row by row, unpadded
        row = torch.tensor(ids[b : b + 1, 7 - n :], dtype=torch.long)
        want = hf.generate(
            row, attention_mask=torch.ones_like(row), max_new_tokens=6, min_new_tokens=6, do_sample=False
        )
        assert np.asarray(out.tokens)[b].tolist() == want[0, n:].tolist()


@pytest.mark.slow
def test_logprobs_are_the_models_own(model):
    _, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [6, 4], T=6, seed=2)
    out = generate(config, params, ids, mask, jax.random.key(3), max_new_tokens=5, temperature=1.0)
    full_ids = np.concatenate([ids, np.asarray(out.tokens)], 1)
    full_mask = np.concatenate([mask, np.ones((2, 5), np.int32)], 1)
    lp = jax.nn.log_softmax(logits(config, params, full_ids, full_mask))[:, 5:-1]  # predicts tokens 6..10
    want = np.take_along_axis(np.asarray(lp), np.asarray(out.tokens)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), want, atol=2e-5)


@pytest.mark.slow
def test_same_key_same_tokens_and_eos_masking(model):
    _, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [5, 2, 4], T=5, seed=3)
    a = generate(config, params, ids, mask, jax.random.key(7), max_new_tokens=12, temperature=1.0)
    b = generate(config, params, ids, mask, jax.random.key(7), max_new_tokens=12, temperature=1.0)
    c = generate(config, params, ids, mask, jax.random.key(8), max_new_tokens=12, temperature=1.0)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    # Pick a token that appears as EOS: everything after its first occurrence is pad and masked out.
    tokens = np.asarray(a.tokens)
    eos = int(tokens[0, 3])
    out = generate(config, params, ids, mask, jax.random.key(7), max_new_tokens=12, temperature=1.0, eos_id=eos)
    t, m = np.asarray(out.tokens), np.asarray(out.mask)
    for row in range(3):
        hits = np.flatnonzero(tokens[row] == eos)
        end = hits[0] + 1 if len(hits) else 12
        np.testing.assert_array_equal(t[row, :end], tokens[row, :end])  # same draws up to the EOS
        assert m[row].tolist() == [1] * end + [0] * (12 - end)
        assert (t[row, end:] == config.pad_token_id).all()
        assert (np.asarray(out.logprobs)[row, end:] == 0).all()
    # Forced lengths (benchmarks): EOS barred before each row's limit and forced at it.
    limits = np.array([3, 12, 7], np.int32)
    forced = generate(
        config,
        params,
        ids,
        mask,
        jax.random.key(7),
        max_new_tokens=12,
        temperature=1.0,
        eos_id=eos,
        force_length=True,
        limits=limits,
    )
    t, m = np.asarray(forced.tokens), np.asarray(forced.mask)
    for row, n in enumerate(limits):
        assert m[row].tolist() == [1] * n + [0] * (12 - n)
        assert (t[row, : n - 1] != eos).all() and t[row, n - 1] == eos


def test_each_answer_draws_with_its_rows_key_in_the_callers_batch(model):
    """Answer token g of prompt i draws with fold_in(fold_in(key, i), g), i its row in the caller's batch (generate
    takes the prompts in order of length): each row's first token is the sample of its own prompt's last logits."""
    _, config, params = model
    lengths = [2, 7, 1, 5, 3, 6, 4, 7]
    ids, mask = left_padded_batch(config.vocab_size, lengths, T=7, seed=9)
    key = jax.random.key(4)
    last = np.asarray(logits(config, params, ids, mask))[:, -1]
    row_key = lambda i: jax.random.fold_in(jax.random.fold_in(key, i), 0)
    want = [int(sample(jnp.asarray(last[i : i + 1]), row_key(i), Sampling())[0]) for i in range(len(lengths))]
    for slots in (0, 3):
        out = generate(config, params, ids, mask, key, max_new_tokens=3, eos_id=5, slots=slots, refill=2)
        assert np.asarray(out.tokens)[:, 0].tolist() == want


def test_a_row_ends_at_any_of_several_stop_ids(model):
    """eos_id as a set (Qwen's <|im_end|> and <|endoftext|>): a row ends at its first token in the set, whichever it
    is; force_length bars them all before a row's limit and forces the first there."""
    _, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [5, 2, 4], T=5, seed=3)
    key, G = jax.random.key(7), 12
    free = np.asarray(generate(config, params, ids, mask, key, max_new_tokens=G, temperature=1.0).tokens)
    unused = int(np.setdiff1d(np.arange(4, config.vocab_size), free)[0])  # a first stop id no row ever draws
    second = int(free[0, 3])  # the one the rows end on
    out = generate(config, params, ids, mask, key, max_new_tokens=G, temperature=1.0, eos_id=[unused, second])
    t, m = np.asarray(out.tokens), np.asarray(out.mask)
    ends = [np.flatnonzero(row == second)[0] + 1 if (row == second).any() else G for row in free]
    assert ends[0] <= 4 and min(ends) < G  # rows that end early: with the first id alone they run to G
    for row, end in enumerate(ends):
        np.testing.assert_array_equal(t[row, :end], free[row, :end])  # the same draws up to the stop
        assert m[row].tolist() == [1] * end + [0] * (G - end)
        assert (t[row, end:] == config.pad_token_id).all()
    limits = np.array([9, 12, 7], np.int32)
    forced = generate(
        config, params, ids, mask, key, max_new_tokens=G, temperature=1.0, eos_id=(unused, second),
        force_length=True, limits=limits,
    )  # fmt: skip
    t, m = np.asarray(forced.tokens), np.asarray(forced.mask)
    for row, n in enumerate(limits):
        assert m[row].tolist() == [1] * n + [0] * (G - n)
        assert not np.isin(t[row, : n - 1], [unused, second]).any() and t[row, n - 1] == unused


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 2000)
    draw = lambda s: np.array([int(sample(logits, k, s)[0]) for k in keys[:400]])
    assert set(draw(Sampling(1.0, top_k=2))) == {0, 1}
    assert set(draw(Sampling(1.0, top_p=0.7))) == {0, 1}  # 0.5 + 0.3 reaches 0.7
    assert set(draw(Sampling(1.0, top_p=0.5))) == {0}
    assert int(sample(logits, keys[0], Sampling(0.0))[0]) == 0
    counts = np.bincount(np.array(jax.vmap(lambda k: sample(logits, k, Sampling(1.0))[0])(keys)), minlength=4) / 2000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.04)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, top_p=0.0)


@pytest.mark.slow
def test_generation_in_the_tensor_parallel_layout(model):
    _, config, params = model
    mesh = make_mesh(tp=4)
    ids, mask = left_padded_batch(config.vocab_size, [6, 6, 3, 5], T=6, seed=4)
    want = generate(config, params, ids, mask, jax.random.key(1), max_new_tokens=4, temperature=0.0)
    fsdp = reshard(params, "fsdp", mesh)
    batch = jax.device_put((ids, mask), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    # the model's own tree resharded, and the decode layout the engine builds from the FSDP layout
    for tp_params in (reshard(fsdp, "tp", mesh), decode_params(config, fsdp, mesh)):
        got = generate(config, tp_params, *batch, jax.random.key(1), max_new_tokens=4, temperature=0.0, mesh=mesh)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_too_long_is_refused(model):
    _, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [4], T=4)
    with pytest.raises(ValueError, match="exceeds the model's 40 positions"):
        generate(config, params, ids, mask, jax.random.key(0), max_new_tokens=37)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.slow
def test_the_decode_kernel_gives_the_xla_tokens(model, tp):
    """Generation with the Pallas decode kernel (interpret mode here; per shard under TP) equals the XLA path."""
    import dataclasses

    _, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [6, 2, 4, 5], T=6, seed=5)
    want = generate(config, params, ids, mask, jax.random.key(2), max_new_tokens=5, temperature=1.0)
    kernel = dataclasses.replace(config, backend=KERNELS)
    mesh = make_mesh(tp=tp) if tp > 1 else None  # tp 1: no mesh, the kernel runs unwrapped
    tp_params = reshard(reshard(params, "fsdp", mesh), "tp", mesh) if mesh else params
    got = generate(kernel, tp_params, ids, mask, jax.random.key(2), max_new_tokens=5, temperature=1.0, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)
    # The decode layout: each step's cache write and attention in one kernel (decode_step), straight from q/k/v
    # (pre-LN: with the attention's LayerNorm folded in and finished there).
    fast = decode_params(kernel, reshard(params, "fsdp", mesh) if mesh else params, mesh)
    run = lambda p: generate(kernel, p, ids, mask, jax.random.key(2), max_new_tokens=5, temperature=1.0, mesh=mesh)
    if mesh is None:  # (generate sets its mesh itself, which cannot happen under a trace)
        assert "jaxrlhf_decode_attention_step" in str(
            jax.make_jaxpr(lambda p: run(p).tokens)(fast)
        )  # tokens can't tell
    got = run(fast)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.slow
def test_the_ffn_kernels_give_the_xla_tokens(tmp_path, monkeypatch, tp):
    """At 16 rows (per shard) and widths of whole blocks a decode step's fc1 (its folded LayerNorm, bias and ReLU)
    and fc2 (K split in two at tp 1) run in kernels.decode_matmul (interpret mode here; per shard under TP, on a
    mesh of two devices so that each holds all 16 rows): the tokens and log-probs of the XLA path."""
    import dataclasses

    from jaxrlhf.kernels import decode_matmul

    config, params = load_hf(
        make_hf_opt(
            tmp_path / "m",
            **{**PRE_LN, "hidden_size": 128, "word_embed_proj_dim": 128, "ffn_dim": 512, "num_hidden_layers": 2},
        )
    )
    ids, mask = left_padded_batch(config.vocab_size, [6, 2, 4, 5] * 4, T=6, seed=7)
    want = generate(config, params, ids, mask, jax.random.key(3), max_new_tokens=4, temperature=1.0)
    kernel = dataclasses.replace(config, backend=KERNELS)
    mesh = make_mesh(tp=tp, devices=jax.devices()[:tp]) if tp > 1 else None
    fast = decode_params(kernel, reshard(params, "fsdp", mesh) if mesh else params, mesh)
    run = lambda p: generate(kernel, p, ids, mask, jax.random.key(3), max_new_tokens=4, temperature=1.0, mesh=mesh)
    if mesh is None:  # both products of both layers in the kernel (generate sets its mesh itself: tp 1 only)
        assert kernel_calls(jax.make_jaxpr(lambda p: run(p).tokens)(fast), "jaxrlhf_decode_matmul") == 4
    traced = []  # the products traced through the kernel (per shard under TP)
    real = decode_matmul.decode_matmul
    monkeypatch.setattr(decode_matmul, "decode_matmul", lambda *a, **k: traced.append(k.get("mesh")) or real(*a, **k))
    got = run(fast)
    if mesh is not None:  # (at tp 1 the program traced above is reused: the jaxpr check counted its calls)
        assert len(traced) == 4 and all(m.shape == {"data": 1, "model": 2} for m in traced), traced
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)


@pytest.mark.slow
def test_any_padding_pattern_gives_the_left_padded_answer(model):
    _, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [6, 3], T=6, seed=6)
    right = np.stack([np.roll(ids[1], -3), ids[0]]), np.stack([np.roll(mask[1], -3), mask[0]])  # right padding
    holes = ids[:1].copy(), np.array([[1, 0, 1, 1, 0, 1]])  # padding in between the real tokens
    want = generate(config, params, ids[[1, 0]], mask[[1, 0]], jax.random.key(0), max_new_tokens=4, temperature=0.0)
    got = generate(config, params, *right, jax.random.key(0), max_new_tokens=4, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    real = ids[:1, [0, 2, 3, 5]]
    want = generate(config, params, real, np.ones_like(real), jax.random.key(0), max_new_tokens=4, temperature=0.0)
    got = generate(config, params, *holes, jax.random.key(0), max_new_tokens=4, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


@pytest.mark.slow
def test_the_decode_layout(model):
    """decode_params: each layer its own arrays, q/k/v stacked per head (values checked), LoRA fused from the
    attached form exactly as `fuse` fuses it, greedy tokens unchanged, and no stacked [L, ...] weight left in
    the generation program (on the GPU each layer's slice of one was a copy before every step's matmul)."""
    from jaxrlhf.lora import LoRAConfig, attach, fuse, init_lora

    _, config, params = model
    L, H, K = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    fast = decode_params(config, params)
    layers = fast["decoder"]["layers"]
    assert isinstance(layers, tuple) and len(layers) == L
    qkv = {n: np.asarray(x, np.float64) for n, x in layers[1]["self_attn"]["qkv_proj"].items()}  # kernel [D, H, 3K]
    stacked = params["decoder"]["layers"]["self_attn"]
    ln = {n: np.asarray(x[1], np.float64) for n, x in params["decoder"]["layers"]["self_attn_layer_norm"].items()}
    pre_ln = config.do_layer_norm_before  # then the LayerNorm is folded in: scale into the rows, shift into the bias
    assert ("self_attn_layer_norm" in layers[1]) != pre_ln and ("colsum" in qkv) == pre_ln
    for j, name in enumerate(("q_proj", "k_proj", "v_proj")):  # the query part carries the attention's scale
        kernel = np.asarray(stacked[name]["kernel"][1], np.float64).reshape(-1, H, K) * (K**-0.5 if j == 0 else 1.0)
        bias = np.asarray(stacked[name]["bias"][1], np.float64).reshape(H, K) * (K**-0.5 if j == 0 else 1.0)
        part = lambda x: x[..., j * K : (j + 1) * K]
        if pre_ln:
            kernel, bias = kernel * ln["scale"][:, None, None], bias + np.tensordot(ln["bias"], kernel, 1)
            np.testing.assert_allclose(part(qkv["colsum"]), kernel.sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(part(qkv["kernel"]), kernel, rtol=1e-6)
        np.testing.assert_allclose(part(qkv["bias"]), bias, rtol=1e-5, atol=1e-6)
    fc1 = {n: np.asarray(x[-1], np.float64) for n, x in params["decoder"]["layers"]["fc1"].items()}
    got = {n: np.asarray(x, np.float64) for n, x in layers[-1]["fc1"].items()}
    assert ("final_layer_norm" in layers[-1]) != pre_ln and ("colsum" in got) == pre_ln
    if pre_ln:  # the FFN's LayerNorm is folded into fc1 the same way
        ffn = {n: np.asarray(x[-1], np.float64) for n, x in params["decoder"]["layers"]["final_layer_norm"].items()}
        fc1 = {"kernel": fc1["kernel"] * ffn["scale"][:, None], "bias": fc1["bias"] + ffn["bias"] @ fc1["kernel"]}
        np.testing.assert_allclose(got["colsum"], fc1["kernel"].sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["kernel"], fc1["kernel"], rtol=1e-6)
    np.testing.assert_allclose(got["bias"], fc1["bias"], rtol=1e-5, atol=1e-6)

    lora_cfg = LoRAConfig(dim=4, module_name="decoder.layers.")
    lora = jax.tree.map(lambda x: x + 0.05, init_lora(params, lora_cfg, jax.random.key(3)))  # lora_b nonzero
    from_attached = decode_params(config, attach(params, lora, lora_cfg))
    from_fused = decode_params(config, fuse(params, lora, lora_cfg))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), from_attached, from_fused)
    assert not np.array_equal(
        np.asarray(from_fused["decoder"]["layers"][0]["fc1"]["kernel"]), np.asarray(layers[0]["fc1"]["kernel"])
    )

    ids, mask = left_padded_batch(config.vocab_size, [6, 3, 5], T=6, seed=6)
    want = generate(config, params, ids, mask, jax.random.key(4), max_new_tokens=5, temperature=0.0)
    got = generate(config, fast, ids, mask, jax.random.key(4), max_new_tokens=5, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)

    def uses_of_stacked_weights(p):  # operations (the scan over layers, slices) that read a stacked kernel
        kernel_shapes = {x.shape for x in jax.tree.leaves(params["decoder"]["layers"]) if x.ndim == 3}
        jaxpr = jax.make_jaxpr(lambda p: generate(config, p, ids, mask, jax.random.key(4), max_new_tokens=5).tokens)(p)
        return sum(any(getattr(v.aval, "shape", None) in kernel_shapes for v in eqn.invars) for eqn in all_eqns(jaxpr))

    assert uses_of_stacked_weights(params) > 0  # the check sees them in the model's own layout
    assert uses_of_stacked_weights(fast) == 0


@pytest.mark.slow
def test_early_exit_stops_once_every_row_has_ended_with_the_full_runs_tokens(model):
    _, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [5, 2, 4], T=5, seed=3)
    full = generate(config, params, ids, mask, jax.random.key(7), max_new_tokens=12, check_every=1)
    assert int(full.steps) == 11  # the first token comes from the prefill
    limits = np.array([3, 5, 2], np.int32)
    out = generate(config, params, ids, mask, jax.random.key(7), max_new_tokens=12, limits=limits, check_every=2)
    assert int(out.steps) == 4  # the longest row's 4 decode steps, looked at every 2
    t, m, lp = (np.asarray(x) for x in (out.tokens, out.mask, out.logprobs))
    for row, n in enumerate(limits):
        np.testing.assert_array_equal(t[row, :n], np.asarray(full.tokens)[row, :n])
        np.testing.assert_allclose(lp[row, :n], np.asarray(full.logprobs)[row, :n], atol=1e-6)
        assert m[row].tolist() == [1] * n + [0] * (12 - n)
        assert (t[row, n:] == config.pad_token_id).all() and (lp[row, n:] == 0).all()
    with pytest.raises(ValueError, match="limits: expected 3 integers in 1 .. 12"):
        generate(config, params, ids, mask, jax.random.key(7), max_new_tokens=12, limits=np.array([3, 13, 1]))


def _eos_in_the_answers(config, params, ids, mask, key, G, temperature):
    """The token a free run draws most in its first half: an EOS that ends rows unevenly."""
    tokens = np.asarray(generate(config, params, ids, mask, key, max_new_tokens=G, temperature=temperature).tokens)
    counts = np.bincount(tokens[:, : G // 2].ravel(), minlength=config.vocab_size)
    return int(np.argmax(counts))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.slow
def test_continuous_batching_gives_each_prompt_its_own_answer(model, temperature):
    """Fewer slots than prompts: a slot whose row ended takes the next prompt. Each prompt's answer (tokens,
    log-probs, mask) is the one it gets with a slot of its own, whatever slot and refill it lands in."""
    _, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [6, 2, 4, 5, 3, 6, 1], T=6, seed=6)
    key, G = jax.random.key(11), 9
    eos = _eos_in_the_answers(config, params, ids, mask, key, G, temperature)
    limits = np.array([9, 2, 5, 1, 7, 3, 8], np.int32)
    run = lambda **kw: generate(
        config, params, ids, mask, key, max_new_tokens=G, temperature=temperature, eos_id=eos, limits=limits, **kw
    )
    want = run()
    assert 0 < np.asarray(want.mask).sum() < limits.sum()  # some rows ended at the EOS, some at their limit
    for slots, refill, every in ((2, 1, 1), (3, 2, 2), (4, 3, 3)):
        got = run(slots=slots, refill=refill, check_every=every)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
        np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)
        # the slots really were shared: every decode step (all answer tokens but the prefill's) in `slots` lanes
        assert int(got.steps) >= (np.asarray(want.mask).sum() - len(limits)) / slots


@pytest.mark.slow
def test_continuous_batching_under_tensor_parallelism_with_the_decode_kernels(model):
    """The same with the decode layout on a TP mesh: the fused step kernel writes and reads each row at its own slot."""
    import dataclasses

    _, config, params = model
    ids, mask = left_padded_batch(config.vocab_size, [6, 2, 4, 5, 3, 6, 1, 4], T=6, seed=7)
    key, G = jax.random.key(12), 7
    limits = np.array([7, 2, 5, 1, 7, 3, 6, 4], np.int32)
    want = generate(config, params, ids, mask, key, max_new_tokens=G, limits=limits)
    kernel = dataclasses.replace(config, backend=KERNELS)
    mesh = make_mesh(tp=2)
    fast = decode_params(kernel, reshard(params, "fsdp", mesh), mesh)
    got = generate(
        kernel, fast, ids, mask, key, max_new_tokens=G, limits=limits, slots=4, refill=2, check_every=2, mesh=mesh
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)


@pytest.mark.parametrize("group", [1, 2])
def test_refills_prefill_their_prompts_at_the_narrowest_width_that_holds_them(group):
    """Prompts of 2 to 130 tokens (P = 130: prefill widths 64, 96, 128 and 130) over 2 slots, refilled 2 rows at a
    time: taken in order of length (whole groups of 2 answers to a prompt, or single rows), each refill computes the
    last 64, 96 or 130 columns only, its K/V written at slots P - width onwards. Every answer is the cache-free
    reference's, greedy, in the caller's order; sampled, the same as with a slot per row."""
    from jaxrlhf.generate import prefill_widths
    from jaxrlhf.models import init_params, opt

    assert prefill_widths(130) == (64, 96, 128, 130) and prefill_widths(64) == (64,) and prefill_widths(20) == (20,)
    config = opt.OPTConfig(**{**PRE_LN, "max_position_embeddings": 160}, dropout=0.0)
    params = init_params(config, jax.random.key(1))
    lengths = [3, 70, 5, 130, 8, 9, 100, 2, 97, 64]
    ids, mask = left_padded_batch(config.vocab_size, lengths, T=130, seed=4)
    ids, mask = (np.repeat(z, group, axis=0) for z in (ids, mask))  # a group's rows hold one prompt
    run = lambda t, **kw: generate(
        config, params, ids, mask, jax.random.key(2), max_new_tokens=4, temperature=t, group=group, **kw
    )
    want = np.asarray(greedy_reference(config, params, jnp.asarray(ids), jnp.asarray(mask), 4))
    np.testing.assert_array_equal(np.asarray(run(0.0, slots=2, refill=2).tokens), want)
    sampled, own = run(1.0, slots=2, refill=2), run(1.0)
    np.testing.assert_array_equal(np.asarray(sampled.tokens), np.asarray(own.tokens))
    np.testing.assert_allclose(np.asarray(sampled.logprobs), np.asarray(own.logprobs), atol=1e-5)


def test_rows_that_cannot_end_early_decode_without_a_condition_and_as_the_early_exit_loop():
    """No stop id a token can be (benchmarks' -1) and no limits, or limits of G (bench_ppo's fixed shape), a slot
    per row: the decode loop runs its G - 1 steps with no `while` (no condition read on the way), writes the cache
    with dynamic_update_slice (every row at one slot), not a scatter of rows, and gives the tokens, log-probs and mask
    of the early-exit loop (room for G + 1 tokens, a limit of G for every row)."""
    from jaxrlhf.models import init_params, opt

    config = opt.OPTConfig(**PRE_LN, dropout=0.0)
    params = init_params(config, jax.random.key(0))
    ids, mask = left_padded_batch(config.vocab_size, [5, 2, 4], T=5, seed=3)
    G, key = 7, jax.random.key(5)
    run = lambda p, new=G, **kw: generate(config, p, ids, mask, key, max_new_tokens=new, eos_id=-1, check_every=4, **kw)
    limits = np.full(3, G, np.int32)
    fixed, limited, looped = run(params), run(params, limits=limits), run(params, G + 1, limits=limits)
    for gen in (fixed, limited):
        for got, want in ((gen.tokens, looped.tokens), (gen.mask, looped.mask), (gen.logprobs, looped.logprobs)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[:, :G])
        assert np.asarray(gen.mask).all() and int(gen.steps) == G - 1
    assert int(looped.steps) == 8  # 2 checks of 4

    def ops(new=G, **kw):  # the program's while loops, and its scatters into the [L, B, Hkv, S, K] cache
        eqns = list(all_eqns(jax.make_jaxpr(lambda p: run(p, new, **kw).tokens)(params)))
        cache_writes = [e for e in eqns if e.primitive.name == "scatter" and e.invars[0].aval.ndim == 5]
        return sum(e.primitive.name == "while" for e in eqns), len(cache_writes)

    assert ops() == (0, 0) and ops(limits=limits) == (0, 0)
    assert ops(limits=np.array([G, G - 1, G], np.int32))[0] > 0  # one limit below G: a row can end early
    whiles, cache_writes = ops(G + 1, limits=limits)
    assert whiles > 0 and cache_writes == 4  # K and V: a decode step's row by row, a refill's slots
