"""The mesh, the two layouts and reshard on 8 virtual CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import POST_LN_PROJ, PRE_LN, jit_logits, left_padded_batch
from jaxrlhf import (
    LayoutError,
    OPTConfig,
    batch_sharding,
    describe,
    init_params,
    logits,
    make_mesh,
    reshard,
    shardings_for,
)
from jaxrlhf.sharding import _identity, check_tp, path_str

ALL = ("model", "data")


def specs(tree):
    return {path_str(p): x.sharding.spec for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_make_mesh():
    assert len(jax.devices()) == 8
    for tp in (1, 2, 4, 8):
        mesh = make_mesh(tp)
        assert dict(mesh.shape) == {"data": 8 // tp, "model": tp}
    with pytest.raises(LayoutError, match="inference_tp_size 3 must be >= 1 and divide the number of devices"):
        make_mesh(3)


EXPECTED = {  # path -> (FSDP spec on 8 devices, TP spec), for the PRE_LN test config plus a value head
    "decoder/embed_tokens/embedding": (P(ALL, None), P("model", None)),  # [64, 32]
    "decoder/embed_positions/embedding": (P(None, ALL), P(None, None)),  # [42, 32]: 42 is not divisible by 8
    "decoder/final_layer_norm/scale": (P(ALL), P(None)),
    "decoder/layers/self_attn/q_proj/kernel": (P(None, None, ALL), P(None, None, "model")),  # [3, 32, 32]
    "decoder/layers/self_attn/q_proj/bias": (P(None, ALL), P(None, "model")),
    "decoder/layers/self_attn/out_proj/kernel": (P(None, ALL, None), P(None, "model", None)),  # heads rows
    "decoder/layers/self_attn/out_proj/bias": (P(None, ALL), P(None, None)),
    "decoder/layers/fc1/kernel": (P(None, None, ALL), P(None, None, "model")),  # [3, 32, 64]
    "decoder/layers/fc1/bias": (P(None, ALL), P(None, "model")),
    "decoder/layers/fc2/kernel": (P(None, ALL, None), P(None, "model", None)),  # [3, 64, 32]
    "decoder/layers/final_layer_norm/bias": (P(None, ALL), P(None, None)),
    "value_head/kernel": (P(ALL, None), P(None, None)),
}


def test_reshard_round_trip_values_and_specs():
    config = OPTConfig(**PRE_LN)
    host = jax.device_get(init_params(config, jax.random.key(0), value_head=True))
    mesh = make_mesh(tp=4)
    fsdp = reshard(host, "fsdp", mesh)  # host -> devices
    got = specs(fsdp)
    for path, (want, _) in EXPECTED.items():
        assert got[path] == want, path
    tp = reshard(fsdp, "tp", mesh)
    got = specs(tp)
    for path, (_, want) in EXPECTED.items():
        assert got[path] == want, path
    # Each device holds exactly its shard: a quarter of the vocab of the embedding under tp = 4.
    emb = tp["decoder"]["embed_tokens"]["embedding"]
    assert {s.data.shape for s in emb.addressable_shards} == {(16, 32)}
    back = reshard(tp, "fsdp", mesh, donate=True)
    assert emb.is_deleted()  # donation released the TP copy
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert specs(back) == specs(fsdp)


def test_fsdp_to_tp_is_a_plain_all_gather():
    """FSDP splits the dimension that TP splits, "model"-major, so no device needs a byte it will drop."""
    mesh = make_mesh(tp=2)
    params = reshard(init_params(OPTConfig(**PRE_LN), jax.random.key(0)), "fsdp", mesh)
    q = params["decoder"]["layers"]["self_attn"]["q_proj"]["kernel"]  # [3, 32, 32], columns over 8 devices
    tp = reshard(params, "tp", mesh)["decoder"]["layers"]["self_attn"]["q_proj"]["kernel"]
    for device in mesh.devices.flat:
        fsdp_cols = q.sharding.devices_indices_map(q.shape)[device][2]
        tp_cols = tp.sharding.devices_indices_map(tp.shape)[device][2]
        assert tp_cols.start <= fsdp_cols.start and fsdp_cols.stop <= tp_cols.stop
    hlo = jax.jit(lambda t: t, out_shardings=tp.sharding).lower(q).compile().as_text()
    assert "all-gather" in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo


def test_reshard_is_compiled_once_per_structure_and_layout():
    mesh = make_mesh(tp=2)
    params = reshard(init_params(OPTConfig(**PRE_LN), jax.random.key(0)), "fsdp", mesh)
    tp = reshard(params, "tp", mesh)
    before = _identity.cache_info()
    for _ in range(3):
        reshard(params, "tp", mesh)
    after = _identity.cache_info()
    assert after.hits == before.hits + 3 and after.misses == before.misses
    # Leaves already in place pass through as the same buffers; the others are new arrays.
    same = lambda a, b: a is b
    moved = jax.tree.map(same, params, tp)
    assert moved["decoder"]["layers"]["self_attn"]["q_proj"]["kernel"] is False
    assert reshard(tp, "tp", mesh) is tp  # nothing to move: the tree itself comes back


@pytest.mark.parametrize("variant", [PRE_LN, POST_LN_PROJ], ids=["pre_ln", "post_ln_proj"])
@pytest.mark.slow
def test_both_layouts_compute_the_same_logits(variant):
    config = OPTConfig(**variant)
    params = init_params(config, jax.random.key(1), std=0.2)
    ids, mask = left_padded_batch(config.vocab_size, [8, 5, 3, 8, 1, 2, 7, 6], T=8)
    ref = np.asarray(jit_logits(config, params, ids, mask))
    mesh = make_mesh(tp=4)
    for layout in ("fsdp", "tp"):
        sharded = reshard(params, layout, mesh)
        batch = jax.device_put((ids, mask), batch_sharding(mesh, layout))
        out = jax.jit(lambda p, b: logits(config, p, *b))(sharded, batch)
        np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5)


def test_optimizer_state_shards_like_the_parameters():
    mesh = make_mesh(tp=2)
    params = init_params(OPTConfig(**PRE_LN), jax.random.key(0))
    state = jax.eval_shape(optax.adamw(1e-3).init, params)
    shardings = shardings_for(state, "fsdp", mesh)
    mu = shardings[0].mu["decoder"]["layers"]["fc1"]["kernel"]
    assert mu.spec == P(None, None, ALL)
    assert shardings[0].count.spec == P()  # scalars are replicated


def test_uncovered_and_indivisible_leaves_are_errors():
    mesh = make_mesh(tp=8)
    with pytest.raises(LayoutError, match="decoder/mystery/kernel: no layout rule covers this parameter"):
        shardings_for({"decoder": {"mystery": {"kernel": jnp.zeros((4, 4))}}}, "fsdp", mesh)
    with pytest.raises(LayoutError, match="'mlp' dimension \\(60\\) does not divide over the 8 devices"):
        shardings_for({"decoder": {"layers": {"fc1": {"kernel": jnp.zeros((2, 8, 60))}}}}, "tp", mesh)
    odd = shardings_for({"decoder": {"embed_tokens": {"embedding": jnp.zeros((60, 8))}}}, "tp", mesh)
    assert odd["decoder"]["embed_tokens"]["embedding"].spec == P(None, None)  # a vocabulary that does not divide: whole
    with pytest.raises(LayoutError, match="has 3 dimensions, but the layout table expects 2"):
        shardings_for({"decoder": {"embed_tokens": {"embedding": jnp.zeros((8, 8, 8))}}}, "tp", mesh)
    with pytest.raises(LayoutError, match="unknown layout 'zero3'"):
        shardings_for({"value_head": {"kernel": jnp.zeros((8, 1))}}, "zero3", mesh)
    with pytest.raises(LayoutError, match=r"num_attention_heads \(12\) is not divisible by inference_tp_size \(8\)"):
        check_tp(12, mesh)


def test_describe_reports_bytes_per_device(capsys):
    mesh = make_mesh(tp=2)
    params = reshard(init_params(OPTConfig(**PRE_LN), jax.random.key(0)), "tp", mesh)
    text = describe(params)
    assert capsys.readouterr().out.strip() == text
    row = next(line for line in text.splitlines() if line.startswith("decoder/embed_tokens/embedding"))
    # [64, 32] float32 = 8 KiB, split by vocab over tp = 2 -> 4 KiB per device.
    assert row.split() == [
        "decoder/embed_tokens/embedding",
        "(64,",
        "32)",
        "float32",
        "P('model',",
        "None)",
        "4.0",
        "KiB",
    ]
    assert text.splitlines()[-1].split()[0] == "total"
    host = describe({"value_head": {"kernel": np.zeros((4, 1), np.float32)}})
    assert "host" in host and "16 B" in host
