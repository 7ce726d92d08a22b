"""The shared train step keeps the state's dtypes, so pure bf16 stays bf16 and nothing compiles twice."""

import jax
import jax.numpy as jnp
import pytest

from jaxrlhf.lora import LoRAConfig
from jaxrlhf.models import OPTConfig, init_params
from jaxrlhf.optim import OptimConfig, create_state, init_state, make_optimizer, precision_warning, state_shardings
from jaxrlhf.sft import sft_loss
from jaxrlhf.sharding import make_mesh
from jaxrlhf.trainer import make_train_step

TINY = OPTConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    ffn_dim=64,
    word_embed_proj_dim=32,
    max_position_embeddings=64,
    dtype="bfloat16",
    dropout=0.0,
)


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float32], ids=["pure_bf16", "fp32_master"])
@pytest.mark.slow
def test_state_dtypes_are_invariant_and_the_step_compiles_once(param_dtype):
    tx = make_optimizer(OptimConfig(learning_rate=1e-3, weight_decay=0.1, clip_grad_norm=1.0), 10, LoRAConfig())
    mesh = make_mesh(1, jax.devices()[:1])
    state = create_state(
        init_params(TINY, jax.random.key(0), dtype=param_dtype), LoRAConfig(), tx, jax.random.key(1), mesh
    )
    ids = jax.random.randint(jax.random.key(2), (1, 2, 8), 3, 64)
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "loss_mask": jnp.ones_like(ids)}
    step = jax.jit(
        make_train_step(sft_loss(TINY), tx, LoRAConfig()), out_shardings=(state_shardings(state, mesh), None)
    )
    dtypes = lambda s: [x.dtype for x in jax.tree.leaves(s)]
    before = dtypes(state)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        assert dtypes(state) == before
        losses.append(float(metrics["loss"] / metrics["count"]))
    assert step._cache_size() == 1
    assert losses[-1] < losses[0]
    moments = [x for x in jax.tree.leaves(state["opt"]) if x.ndim >= 2]
    assert moments and all(x.dtype == param_dtype for x in moments)


@pytest.mark.slow
def test_pure_bf16_rounds_away_small_updates_and_the_run_warns():
    """One step at DeepSpeed-Chat's actor rate: fp32 master weights move by the whole Adam step, bf16 weights keep
    a fraction of it (what precision_warning says before such a run starts)."""
    optim = OptimConfig(learning_rate=1e-5, weight_decay=0.0, warmup_steps=0, schedule="constant")
    tx = make_optimizer(optim, 10, LoRAConfig())
    mesh = make_mesh(1, jax.devices()[:1])
    ids = jax.random.randint(jax.random.key(2), (1, 4, 16), 3, 64)
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "loss_mask": jnp.ones_like(ids)}
    moved = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        state = create_state(
            init_params(TINY, jax.random.key(0), dtype=dtype), LoRAConfig(), tx, jax.random.key(1), mesh
        )
        before = jax.tree.map(lambda x: x.astype(jnp.float32), state["trainable"]["params"])
        state, _ = jax.jit(make_train_step(sft_loss(TINY), tx, LoRAConfig()))(state, batch)
        kernels = [
            (a, b)
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state["trainable"]["params"]))
            if a.ndim == 3
        ]
        moved[dtype] = sum(float(jnp.abs(b.astype(jnp.float32) - a).sum()) for a, b in kernels) / sum(
            a.size for a, _ in kernels
        )
    assert 0.9e-5 < moved[jnp.float32] < 1.01e-5  # Adam's first step: lr times ~sign(g) for every weight
    assert moved[jnp.bfloat16] < 0.4 * moved[jnp.float32], moved
    assert "pure_bf16 at learning_rate 1e-05" in precision_warning("pure_bf16", optim, LoRAConfig())
    assert precision_warning("bf16", optim, LoRAConfig()) is None
    assert precision_warning("pure_bf16", optim, LoRAConfig(dim=8, only_optimize_lora=True)) is None
    assert precision_warning("pure_bf16", OptimConfig(learning_rate=1e-3), LoRAConfig()) is None


def test_a_non_finite_step_is_skipped_inside_the_compiled_step():
    """A batch that makes the loss NaN (or only the gradient inf) leaves the weights and the optimizer state (its
    count, so the schedule, included) as they were and says so in "skipped"; the step counter moves on, and the
    next finite batch trains from the untouched state exactly as if the bad one had never come."""
    import numpy as np

    tx = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=2, clip_grad_norm=0.0), 10, LoRAConfig())

    def loss_fn(params, batch, key):  # sum over the batch of x * sqrt(|w|): at w = 0 the gradient is inf, the loss 0
        total = jnp.sum(batch["x"] * jnp.sum(jnp.sqrt(jnp.abs(params["w"]))))
        return total, jnp.float32(batch["x"].size), {"loss": total}

    state = init_state({"w": jnp.ones(3)}, LoRAConfig(), tx, jax.random.key(0))
    step = jax.jit(make_train_step(loss_fn, tx, LoRAConfig()))
    good, nan = {"x": jnp.ones((2, 4))}, {"x": jnp.ones((2, 4)).at[1, 2].set(jnp.nan)}
    want, m = step(state, good)
    assert float(m["skipped"]) == 0.0 and int(want["step"]) == 1
    for bad in (nan, "inf gradient"):
        if bad == "inf gradient":
            bad, state = good, {**state, "trainable": {"params": {"w": jnp.array([1.0, 0.0, 1.0])}}}
        after, m = step(state, bad)
        assert m["skipped"].dtype == jnp.float32 and float(m["skipped"]) == 1.0
        assert int(after["step"]) == int(state["step"]) + 1
        for a, b in zip(
            jax.tree.leaves((state["trainable"], state["opt"])), jax.tree.leaves((after["trainable"], after["opt"]))
        ):
            np.testing.assert_array_equal(a, b)
    state = init_state({"w": jnp.ones(3)}, LoRAConfig(), tx, jax.random.key(0))
    skipped, _ = step(state, nan)
    got, _ = step(skipped, good)  # the warm-up's first step again: the skipped step did not count
    np.testing.assert_allclose(got["trainable"]["params"]["w"], want["trainable"]["params"]["w"], rtol=1e-6)


def test_step3_programs_are_keyed_by_what_they_read_and_share_one_optimizer():
    """Settings a step never reads (sampling, the KL penalty's coefficient, the actor's settings for the critic) leave
    its jit key, so its compilation, as it was; one it reads changes it. The optimizer is built once per settings."""
    import dataclasses

    from jaxrlhf.rl.config import EngineConfig
    from jaxrlhf.rl.experience import Static
    from jaxrlhf.rl.steps import programs

    mesh = make_mesh(1, jax.devices()[:1])
    static = lambda **kw: Static(EngineConfig(**kw), TINY, TINY, 10, mesh)  # noqa: E731
    base = static()
    unread = static(temperature=0.7, kl_coef=0.3, actor=dataclasses.replace(EngineConfig().actor, remat=True))
    assert programs(base, "critic") == programs(unread, "critic")
    assert programs(base, "critic")[2].tx is programs(unread, "critic")[2].tx  # the same optimizer object
    assert programs(base, "actor")[2] == programs(unread, "actor")[2]  # the update reads no sampling setting
    assert programs(base, "actor")[0] != programs(unread, "actor")[0]  # the loss reads the temperature
    assert programs(base, "actor")[0] != programs(static(clip_ratio=0.3), "actor")[0]
    assert programs(base, "critic")[0] != programs(static(clip_value=0.3), "critic")[0]
    assert programs(base, "actor")[2] != programs(static(enable_ema=True), "actor")[2]
