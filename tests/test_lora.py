"""LoRA adapters: initialisation, fuse, gradients through fuse, the module filter, and their layouts."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import POST_LN_PROJ, PRE_LN, left_padded_batch
from jaxrlhf import LlamaConfig, OPTConfig, init_params, logits, make_mesh, reshard, shardings_for
from jaxrlhf.config import ConfigError, field_help, load
from jaxrlhf.lora import LoRAConfig, attach, fuse, init_lora
from jaxrlhf.models import Backend
from jaxrlhf.sharding import path_str

ALL = ("model", "data")
LAYERS = "decoder/layers/"
ATTN = [f"{LAYERS}self_attn/{n}" for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
LOGITS = jax.jit(logits, static_argnums=0)  # compiled once per config: eager Flax is slow


def leaves(tree):
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def modules(lora):
    return sorted({path.rpartition("/")[0] for path in leaves(lora)})


def randomize_b(lora, seed=0, std=0.5):
    """Nonzero lora_b (as after some training), so that fuse has something to add."""
    rng = np.random.default_rng(seed)
    b = lambda p, x: jnp.asarray(std * rng.standard_normal(x.shape), x.dtype) if path_str(p).endswith("lora_b") else x
    return jax.tree_util.tree_map_with_path(b, lora)


def hand_fused(params, lora, cfg):
    """The fused tree built leaf by leaf in NumPy: kernel + a @ b * scaling / dim."""
    out = jax.tree.map(np.asarray, params)
    for module in modules(lora):
        node = out
        for part in module.split("/"):
            node = node[part]
        a, b = (np.asarray(leaves(lora)[f"{module}/{n}"], np.float32) for n in ("lora_a", "lora_b"))
        node["kernel"] = node["kernel"] + np.matmul(a, b) * (cfg.scaling / cfg.dim)
    return out


@pytest.mark.slow
def test_init_adapts_the_layer_linears_and_leaves_the_model_unchanged():
    config = OPTConfig(**PRE_LN)
    params = init_params(config, jax.random.key(0), value_head=True, std=0.2)
    cfg = LoRAConfig(dim=4)
    lora = init_lora(params, cfg, jax.random.key(1))
    assert modules(lora) == sorted(ATTN + [f"{LAYERS}fc1", f"{LAYERS}fc2"])  # not embeddings, not value_head
    got = leaves(lora)
    assert got[f"{LAYERS}fc1/lora_a"].shape == (3, 32, 4) and got[f"{LAYERS}fc1/lora_b"].shape == (3, 4, 64)
    assert got[f"{LAYERS}fc2/lora_a"].shape == (3, 64, 4) and got[f"{LAYERS}fc2/lora_b"].shape == (3, 4, 32)
    for path, x in got.items():
        x = np.asarray(x)
        assert x.dtype == np.float32
        if path.endswith("lora_b"):
            assert not x.any(), path
        else:  # Kaiming-uniform (a = sqrt(5)) on DeepSpeed-Chat's [in, dim] weight: fan_in = dim
            assert np.abs(x).max() <= 1 / math.sqrt(cfg.dim) and np.abs(x).max() > 0.8 / math.sqrt(cfg.dim)
            assert not np.array_equal(x[0], x[1]) and not np.array_equal(x[1], x[2]), path  # per layer
    assert not np.array_equal(got[f"{LAYERS}fc1/lora_a"][:, :, 0], got[f"{LAYERS}self_attn/q_proj/lora_a"][:, :, 0])
    ids, mask = left_padded_batch(config.vocab_size, [6, 3, 8], T=8)
    np.testing.assert_array_equal(LOGITS(config, fuse(params, lora, cfg), ids, mask), LOGITS(config, params, ids, mask))
    # The adapter dtype follows the kernel unless asked (shapes alone will do); LoRA off is no tree at all.
    bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    dtypes = lambda **kw: {
        x.dtype for x in leaves(jax.eval_shape(lambda: init_lora(bf16, cfg, jax.random.key(1), **kw))).values()
    }
    assert dtypes() == {jnp.dtype(jnp.bfloat16)} and dtypes(dtype=jnp.float32) == {jnp.dtype(jnp.float32)}
    assert init_lora(params, LoRAConfig(), jax.random.key(1)) is None


@pytest.mark.parametrize(
    "variant, module_name, scaling",
    [(PRE_LN, "decoder.layers.", 1.0), (POST_LN_PROJ, "decoder.", 2.0)],  # the latter adds 2-D project_in/out
    ids=["pre_ln_layers", "post_ln_proj_all"],
)
@pytest.mark.slow
def test_fuse_adds_the_scaled_low_rank_product(variant, module_name, scaling):
    config = OPTConfig(**variant)
    params = init_params(config, jax.random.key(0), std=0.2)
    cfg = LoRAConfig(dim=4, module_name=module_name, scaling=scaling)
    lora = randomize_b(init_lora(params, cfg, jax.random.key(1)))
    fused = fuse(params, lora, cfg)
    # One layer by hand: q_proj of layer 1.
    q = params["decoder"]["layers"]["self_attn"]["q_proj"]
    a = np.asarray(lora["decoder"]["layers"]["self_attn"]["q_proj"]["lora_a"][1])
    b = np.asarray(lora["decoder"]["layers"]["self_attn"]["q_proj"]["lora_b"][1])
    want = np.asarray(q["kernel"][1]) + a @ b * (scaling / 4)
    got = np.asarray(fused["decoder"]["layers"]["self_attn"]["q_proj"]["kernel"][1])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert np.abs(got - np.asarray(q["kernel"][1])).max() > 1e-2  # the adapter really moved the kernel
    # Unadapted leaves are the very same objects.
    fused_leaves, adapted = leaves(fused), {f"{m}/kernel" for m in modules(lora)}
    for path, x in leaves(params).items():
        assert (fused_leaves[path] is x) == (path not in adapted), path
    if variant is POST_LN_PROJ:
        assert {"decoder/project_in/kernel", "decoder/project_out/kernel"} <= adapted
    # The whole model against a tree fused by hand.
    ids, mask = left_padded_batch(config.vocab_size, [8, 5, 1, 7], T=8)
    ref = LOGITS(config, hand_fused(params, lora, cfg), ids, mask)
    np.testing.assert_allclose(LOGITS(config, fused, ids, mask), ref, atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(ref) - np.asarray(LOGITS(config, params, ids, mask))).max() > 1e-2


def test_fuse_keeps_bf16_kernels_and_passes_through_when_off():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(OPTConfig(**PRE_LN), jax.random.key(0)))
    cfg = LoRAConfig(dim=4)
    lora = randomize_b(init_lora(params, cfg, jax.random.key(1), dtype=jnp.float32))
    fused = fuse(params, lora, cfg)
    k = fused["decoder"]["layers"]["fc1"]["kernel"]
    assert k.dtype == jnp.bfloat16
    base = params["decoder"]["layers"]["fc1"]["kernel"]
    a, b = (np.asarray(lora["decoder"]["layers"]["fc1"][n]) for n in ("lora_a", "lora_b"))
    want = (np.asarray(base, np.float32) + np.matmul(a, b) / 4).astype(jnp.bfloat16)  # float32 sum, one rounding
    np.testing.assert_array_equal(np.asarray(k), want)
    assert fuse(params, None, cfg) is params
    assert fuse(params, lora, LoRAConfig()) is params


def test_fuse_refuses_adapters_that_do_not_fit():
    params = init_params(OPTConfig(**PRE_LN), jax.random.key(0))
    cfg = LoRAConfig(dim=4)
    lora = init_lora(params, cfg, jax.random.key(1))
    fit = r"decoder/layers/fc1: lora_a \(3, 32, 4\) and lora_b \(3, 4, 64\) do not fit its kernel \(3, 32, 64\) with"
    with pytest.raises(ValueError, match=fit):
        fuse(params, lora, LoRAConfig(dim=8))
    wrong = {"decoder": {"layers": {"fc3": lora["decoder"]["layers"]["fc1"]}}}
    with pytest.raises(ValueError, match=r"LoRA adapters \['decoder/layers/fc3'\] have no Linear kernel"):
        fuse(params, wrong, cfg)
    half = {"decoder": {"layers": {"fc1": {"lora_a": lora["decoder"]["layers"]["fc1"]["lora_a"]}}}}
    with pytest.raises(ValueError, match=r"decoder/layers/fc1: a LoRA adapter needs both lora_a and lora_b"):
        fuse(params, half, cfg)
    with pytest.raises(ValueError, match=r"decoder/layers/fc1/bias: not a LoRA leaf"):
        fuse(params, {"decoder": {"layers": {"fc1": params["decoder"]["layers"]["fc1"]}}}, cfg)


@pytest.mark.slow
def test_gradients_reach_only_the_adapters():
    config = OPTConfig(**PRE_LN)
    params = init_params(config, jax.random.key(0), std=0.2)
    before = jax.tree.map(np.array, params)
    cfg = LoRAConfig(dim=4, scaling=2.0)
    lora = init_lora(params, cfg, jax.random.key(1))
    ids, mask = left_padded_batch(config.vocab_size, [8, 6, 4, 8], T=8)

    def loss_of_params(p):  # next-token cross-entropy over real tokens
        logp = jax.nn.log_softmax(logits(config, p, ids, mask)[:, :-1])
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
        return (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()

    grad_params = jax.jit(jax.grad(loss_of_params))
    loss_and_grad = jax.jit(jax.value_and_grad(lambda lora: loss_of_params(fuse(params, lora, cfg))))
    sgd = lambda lora, g: jax.tree.map(lambda x, g: x - 0.5 * g, lora, g)
    q = lambda tree, name: np.asarray(tree["decoder"]["layers"]["self_attn"]["q_proj"][name])
    T = lambda x: np.swapaxes(x, -1, -2)

    # At init lora_b = 0, so d/d lora_a = dW @ b^T * s vanishes; d/d lora_b = a^T @ dW * s does not.
    loss0, g = loss_and_grad(lora)
    for path, x in leaves(g).items():
        assert (np.abs(np.asarray(x)).max() > 0) == path.endswith("lora_b"), path
    dW = q(grad_params(params), "kernel")
    np.testing.assert_allclose(q(g, "lora_b"), T(q(lora, "lora_a")) @ dW * (2.0 / 4), rtol=1e-4, atol=1e-7)
    # After one SGD step on the adapters lora_b is nonzero, and lora_a gets gradients too.
    lora1 = sgd(lora, g)
    loss1, g1 = loss_and_grad(lora1)
    assert all(np.abs(np.asarray(x)).max() > 0 for x in leaves(g1).values())
    dW1 = q(grad_params(fuse(params, lora1, cfg)), "kernel")
    np.testing.assert_allclose(q(g1, "lora_a"), dW1 @ T(q(lora1, "lora_b")) * (2.0 / 4), rtol=1e-4, atol=1e-7)
    # Training the adapters lowers the loss; the base weights stay bit-identical.
    loss2, _ = loss_and_grad(sgd(lora1, g1))
    assert loss2 < loss1 < loss0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), before)


def test_module_filter_selects_like_deepspeed_chat():
    params = init_params(OPTConfig(**PRE_LN), jax.random.key(0), value_head=True)
    pick = lambda name: modules(init_lora(params, LoRAConfig(dim=2, module_name=name), jax.random.key(1)))
    assert pick("fc") == [f"{LAYERS}fc1", f"{LAYERS}fc2"]
    assert pick("decoder.layers.self_attn.q_proj") == [f"{LAYERS}self_attn/q_proj"]
    assert pick("value_head") == ["value_head"]  # a Linear like any other when asked for
    with pytest.raises(
        ValueError,
        match=r"module_name 'lm_head' matches no Linear kernel; available modules: "
        r"decoder\.layers\.fc1, decoder\.layers\.fc2, decoder\.layers\.self_attn\.k_proj",
    ):
        pick("lm_head")
    with pytest.raises(ValueError, match="matches no Linear kernel"):  # embeddings are never adapted
        pick("embed_tokens")


@pytest.mark.slow  # compiles a Llama training step (10-50 s on 2 shared cores)
def test_llama_default_filter_adapts_attention_and_mlp_and_only_optimize_lora_freezes_the_base():
    from jaxrlhf.optim import OptimConfig, create_state, effective_params, make_optimizer
    from jaxrlhf.sft import sft_loss
    from jaxrlhf.trainer import make_train_step

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    params = init_params(config, jax.random.key(0), std=0.2)
    cfg = LoRAConfig(dim=4, only_optimize_lora=True)
    lora = init_lora(params, cfg, jax.random.key(1))
    layers = "model/layers/"
    assert modules(lora) == sorted(
        [f"{layers}self_attn/{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        + [f"{layers}mlp/{n}" for n in ("gate_proj", "up_proj", "down_proj")]
    )  # not lm_head
    got = leaves(lora)
    assert got[f"{layers}self_attn/k_proj/lora_b"].shape == (2, 4, 16)  # 2 KV heads x head dim 8
    assert got[f"{layers}mlp/down_proj/lora_a"].shape == (2, 48, 4)
    assert modules(init_lora(params, LoRAConfig(dim=4, module_name="lm_head"), jax.random.key(1))) == ["lm_head"]
    with pytest.raises(
        ValueError,
        match=r"cannot tell the model family from the parameter tree \(top-level modules \['encoder'\]; "
        r"known: decoder, model\); set lora.module_name",
    ):
        init_lora({"encoder": params["model"]}, cfg, jax.random.key(1))
    # A few steps of Step 1's loss with only the adapters trained: the loss falls, the base stays bit-identical.
    before = jax.tree.map(np.array, params)
    tx = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0), 4, cfg)
    state = create_state(params, cfg, tx, jax.random.key(2), make_mesh(1, jax.devices()[:1]))
    ids = np.asarray(jax.random.randint(jax.random.key(3), (1, 4, 12), 3, 64), np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": np.ones_like(ids)}
    step = jax.jit(make_train_step(sft_loss(config), tx, cfg))
    losses = []
    for _ in range(4):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"] / metrics["count"]))
    assert losses[-1] < losses[0] - 0.05, losses
    assert set(state["trainable"]) == {"lora"}
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state["frozen"]["params"]), before)
    trained = leaves(state["trainable"]["lora"])
    assert all(np.abs(np.asarray(trained[f"{m}/lora_b"])).max() > 0 for m in modules(lora))
    fused = leaves(effective_params(state, cfg))
    for path, x in leaves(params).items():  # only the adapted kernels moved in the model that runs
        assert np.array_equal(np.asarray(fused[path]), np.asarray(x)) == (
            path.rpartition("/")[0] not in modules(lora)
        ), path
    ref = LOGITS(config, hand_fused(params, state["trainable"]["lora"], cfg), ids[0], batch["attention_mask"][0])
    np.testing.assert_allclose(
        LOGITS(config, effective_params(state, cfg), ids[0], batch["attention_mask"][0]), ref, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dim=-1), r"LoRAConfig.dim: expected >= 0 \(0 = LoRA off\), got -1"),
        (dict(dim=4, scaling=0.0), "LoRAConfig.scaling: expected > 0, got 0.0"),
        (dict(only_optimize_lora=True), r"LoRAConfig.only_optimize_lora: needs LoRA on \(dim > 0\)"),
        (dict(dim=4, learning_rate=0.0), "LoRAConfig.learning_rate: expected > 0 or None, got 0.0"),
        (dict(dim=4, module_name=""), "LoRAConfig.module_name: expected a non-empty module path fragment"),
    ],
)
def test_config_validates_itself(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


def test_config_loads_from_overrides_with_help():
    assert load(LoRAConfig, None, ["dim=8", "learning_rate=5e-4", "only_optimize_lora=true"]) == LoRAConfig(
        dim=8, learning_rate=5e-4, only_optimize_lora=True
    )
    with pytest.raises(ConfigError, match="LoRAConfig.only_optimize_lora: needs LoRA on"):
        load(LoRAConfig, None, ["only_optimize_lora=true"])
    assert set(field_help(LoRAConfig)) == {"dim", "module_name", "scaling", "only_optimize_lora", "learning_rate"}


@pytest.mark.slow
def test_layouts_follow_the_kernels_and_fuse_runs_sharded():
    config = OPTConfig(**PRE_LN)
    params = init_params(config, jax.random.key(0))
    cfg = LoRAConfig(dim=4)
    lora = randomize_b(init_lora(params, cfg, jax.random.key(1)))
    mesh = make_mesh(tp=2)
    tp = {k: s.spec for k, s in leaves(shardings_for(lora, "tp", mesh)).items()}
    assert tp[f"{LAYERS}self_attn/q_proj/lora_b"] == P(None, None, "model")  # output columns, like the kernel
    assert tp[f"{LAYERS}self_attn/q_proj/lora_a"] == P(None, None, None)
    assert tp[f"{LAYERS}self_attn/out_proj/lora_a"] == P(None, "model", None)  # input rows, like the kernel
    assert tp[f"{LAYERS}self_attn/out_proj/lora_b"] == P(None, None, None)
    assert tp[f"{LAYERS}fc1/lora_b"] == P(None, None, "model") and tp[f"{LAYERS}fc2/lora_a"] == P(None, "model", None)

    sharded_lora, sharded_params = reshard(lora, "fsdp", mesh), reshard(params, "fsdp", mesh)
    fsdp = {k: x.sharding.spec for k, x in leaves(sharded_lora).items()}
    assert fsdp[f"{LAYERS}fc1/lora_a"] == P(None, ALL, None)  # [3, 32, 4]: the rank (4) does not divide by 8
    assert fsdp[f"{LAYERS}fc1/lora_b"] == P(None, None, ALL)  # [3, 4, 64]
    fused = jax.jit(fuse, static_argnums=2)(sharded_params, sharded_lora, cfg)
    want = leaves(fuse(params, lora, cfg))
    for path, x in leaves(fused).items():
        np.testing.assert_allclose(np.asarray(x), np.asarray(want[path]), rtol=1e-6, atol=1e-7, err_msg=path)
    # The adapter optimizer state shards like the adapters (its paths end the same way).
    opt = shardings_for({"mu": lora, "count": jnp.zeros((), jnp.int32)}, "tp", mesh)
    assert opt["mu"]["decoder"]["layers"]["self_attn"]["q_proj"]["lora_b"].spec == P(None, None, "model")


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.slow
def test_attach_fuses_one_layer_at_a_time_with_fuse_arithmetic_and_no_whole_fused_copy(family):
    """lora.attach (adapters beside their kernels; models.common.Dense fuses as each layer runs) gives fuse's
    logits and adapter gradients, and its compiled step holds no second copy of the adapted kernels."""
    config = (
        OPTConfig(**PRE_LN)
        if family == "opt"
        else LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
    params = init_params(config, jax.random.key(0), std=0.2)
    cfg = LoRAConfig(dim=4, scaling=2.0)
    lora = randomize_b(init_lora(params, cfg, jax.random.key(1)))
    ids, mask = left_padded_batch(config.vocab_size, [8, 6, 4, 8], T=8)
    loss = lambda merge: jax.jit(jax.value_and_grad(lambda lo: logits(config, merge(params, lo, cfg), ids, mask).std()))
    (l_fuse, g_fuse), (l_attach, g_attach) = loss(fuse)(lora), loss(attach)(lora)
    np.testing.assert_allclose(l_attach, l_fuse, rtol=1e-6)
    for path, g in leaves(g_fuse).items():
        np.testing.assert_allclose(leaves(g_attach)[path], g, rtol=2e-5, atol=1e-7, err_msg=path)
    assert np.abs(np.asarray(leaves(g_attach)[f"{next(iter(modules(lora)))}/lora_a"])).max() > 0

    # Memory: on a model whose adapted kernels dominate, attach's step needs at least one whole fused copy of
    # those kernels less than fuse's (XLA's compiled memory analysis of the temporaries).
    big = (
        OPTConfig(**{**PRE_LN, "hidden_size": 256, "ffn_dim": 1024, "num_hidden_layers": 6})
        if family == "opt"
        else LlamaConfig(
            **{
                **vars(config),
                "hidden_size": 256,
                "intermediate_size": 1024,
                "num_hidden_layers": 6,
                "num_attention_heads": 8,
            }
        )
    )
    shapes = jax.eval_shape(lambda: init_params(big, jax.random.key(0)))
    lora_shapes = jax.eval_shape(lambda: init_lora(shapes, cfg, jax.random.key(1)))
    adapted = sum(
        x.size * 4
        for p, x in leaves(shapes).items()
        if p.rpartition("/")[0] in modules(lora_shapes) and p.endswith("kernel")
    )
    temp = {
        m.__name__: jax.jit(jax.grad(lambda lo, p: logits(big, m(p, lo, cfg), ids, mask).std()))
        .lower(lora_shapes, shapes)
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
        for m in (fuse, attach)
    }
    assert temp["fuse"] - temp["attach"] > adapted, (temp, adapted)
    # With the layers unrolled (a GPU's backend), adapters attached still run one layer per iteration: unrolled,
    # XLA fused every layer's kernels up front (OPT-30B's scoring ran out of memory); rolled, one layer's at a time.
    unrolled = dataclasses.replace(config, backend=Backend(scan_unroll=0))
    loops = {
        m.__name__: jax.jit(lambda p, lo: logits(unrolled, m(p, lo, cfg), ids, mask))
        .lower(params, lora)
        .as_text()
        .count("stablehlo.while")
        for m in (fuse, attach)
    }
    assert loops == {"fuse": 0, "attach": 1}, loops
