"""Step 3 without padding (jaxrlhf.rl.packing): the plan holds every sequence once and whole, within its token budget,
several to a row at HH-RLHF lengths (>= 90 % real tokens); packed rows are the padded rows' real tokens, each a segment
with its own positions; a packed micro-batch gives each sequence's log-probs, entropies, values and reward score as
the padded block does; and the engine gives the same experience, losses, gradients and updates packed (several
sequences to a row, cut in micro-batches) as one sequence to a row, for OPT (pre- and post-LN) and Llama
(grouped-query), under FSDP on 8 devices and LoRA."""

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import need_assets
from helpers import POST_LN_PROJ, PRE_LN, left_padded_batch
from jaxrlhf import OPTConfig, init_params, make_mesh
from jaxrlhf.lora import LoRAConfig
from jaxrlhf.models import logprobs, values
from jaxrlhf.models.llama import LlamaConfig
from jaxrlhf.optim import OptimConfig
from jaxrlhf.rl import EngineConfig, HybridEngine, ModelSide, packing
from jaxrlhf.rl.experience import answer_logprobs, packed_values


def padded_mask(prompts, answers, P: int, G: int, holes=()):
    """seq_mask [B, P + G] of left-padded prompts and right-padded answers of these lengths (holes: (row, column) of
    padding inside a prompt, as any padding pattern may have)."""
    mask = np.zeros((len(prompts), P + G), np.int32)
    for b, (p, a) in enumerate(zip(prompts, answers)):
        mask[b, P - p : P + a] = 1
    for b, c in holes:
        mask[b, c] = 0
    return mask


@pytest.mark.parametrize("budget, devices, multiple", [(64, 1, 8), (40, 8, 4), (512, 2, 64), (33, 4, 1)])
def test_the_plan_holds_every_sequence_once_and_whole_within_the_token_budget(budget, devices, multiple):
    rng = np.random.default_rng(budget)
    P, G, B = 20, 12, 101
    mask = padded_mask(rng.integers(1, P + 1, B), rng.integers(0, G + 1, B), P, G, holes=[(0, P - 1), (7, P - 2)])
    lengths = mask.sum(1)
    micro = packing.plan(mask, P, budget, devices, multiple)
    W = micro[0].width
    longest = min(-(-lengths.max() // multiple) * multiple, lengths.max(), budget)
    assert longest + longest % 2 == W  # one width, the longest's, even (cuDNN's attention with a bias)
    rows = sum(len({*r} - {B}) > 0 for m in micro for r in m.segment)  # the rows that hold a sequence
    n = budget // W * devices  # the most rows a micro-batch may have
    assert len(micro) == -(-rows // n) and len({m.segment.shape for m in micro}) == 1  # the fewest, one shape
    seen = np.concatenate([np.unique(m.segment[m.segment < B]) for m in micro])
    assert sorted(seen) == list(range(B))  # each sequence in one micro-batch
    for m in micro:
        n, A = m.head_at.shape
        assert n % devices == 0 and n // devices * W <= budget and m.width == W  # whole rows per device, the budget
        assert A & (A - 1) == 0 or A == W
        for r in range(n):
            row = m.segment[r]
            real = row < B
            assert not real[np.argmin(real) :].any() if not real.all() else True  # padding at the row's end only
            for b in np.unique(row[real]):
                at = np.flatnonzero(row == b)
                assert (np.diff(at) == 1).all() and len(at) == lengths[b]  # whole, side by side
                np.testing.assert_array_equal(m.column[r, at], np.flatnonzero(mask[b]))  # its real tokens in order
                np.testing.assert_array_equal(m.position[r, at], np.arange(len(at)))  # positions restart at 0
            slots = m.slot[r][m.slot[r] < B * G]
            answer = np.stack([slots // G, P + slots % G], 1)  # the slot's token: row b, column P + g of the block
            # the column after head_at holds the slot's token, in the same sequence
            np.testing.assert_array_equal(m.segment[r, m.head_at[r, : len(slots)] + 1], answer[:, 0])
            np.testing.assert_array_equal(m.column[r, m.head_at[r, : len(slots)] + 1], answer[:, 1])
    assert packing.real_share(micro, B) == pytest.approx(lengths.sum() / sum(m.segment.size for m in micro))
    answers = np.concatenate([m.slot[m.slot < B * G] for m in micro])
    assert sorted(answers) == list(np.flatnonzero(mask[:, P:].reshape(-1)))  # every answer token one slot
    assert max(len(np.unique(m.segment[r])) for m in micro for r in range(len(m.segment))) > 2  # rows are shared
    with pytest.raises(ValueError, match="a sequence of 40 tokens is longer than max_tokens_per_micro_batch 39"):
        packing.plan(padded_mask([3, 30], [0, 10], 30, 10), 30, 39, 1)
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch: expected >= 1 \(tokens per device"):
        EngineConfig(max_tokens_per_micro_batch=0)


def test_the_mixture_batch_is_packed_in_its_accumulation_parts_a_slot_per_lm_target():
    """packing.mixture_plan: part i holds rows i, i + parts, ... whole; every LM target (a loss_mask token after its
    row's first real token) has one slot, scored from the column before it in its own sequence."""
    rng = np.random.default_rng(3)
    N, T = 12, 10
    lengths = rng.integers(2, T + 1, N)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)  # right-padded, as Step 1's batches
    loss = mask * (rng.random((N, T)) < 0.7)
    parts = packing.mixture_plan(mask, loss, 3, 2, 4)
    assert len(parts) == 3
    for i, m in enumerate(parts):
        rows = np.unique(m.segment[m.segment < N])
        assert list(rows) == list(range(i, N, 3)) and len(m.segment) % 2 == 0
        assert max(len(set(r[r < N])) for r in m.segment) >= 2  # several sequences to a row
        slots = m.slot[m.slot < N * T]
        want = [b * T + t for b in rows for t in range(1, T) if loss[b, t] and mask[b, t]]
        assert sorted(slots) == want
        for r in range(len(m.segment)):
            k = m.slot[r] < N * T
            at = m.head_at[r][k]
            np.testing.assert_array_equal(m.segment[r, at + 1] * T + m.column[r, at + 1], m.slot[r][k])
            assert (m.segment[r, at] == m.segment[r, at + 1]).all()  # the head in the target's own sequence


def hh_mask(B: int, P: int = 256, G: int = 256, seed: int = 0):
    """seq_mask [B, P + G] of B HH-RLHF (prompt, answer) length pairs drawn as tools/bench_ppo.py --lengths draws
    them (prompts over P dropped, answers capped at G)."""
    pairs = np.asarray(json.loads((need_assets() / "data/hh-rlhf/hh_lengths.json").read_text())["pairs"])
    pairs = pairs[pairs[:, 0] <= P]
    rows = np.random.default_rng(seed).integers(0, len(pairs), B)
    return padded_mask(pairs[rows, 0], np.minimum(pairs[rows, 1], G), P, G)


@pytest.mark.parametrize("devices", [1, 8])
def test_micro_batches_are_over_90_percent_real_tokens_at_hh_lengths(devices):
    """Batch 768 of HH-RLHF lengths in 256 + 256 with the default budget: >= 90 % of the micro-batches' tokens are
    real (sorting rows by length and cutting them to their width, one sequence to a row, gave ~70 %)."""
    budget, multiple = EngineConfig.max_tokens_per_micro_batch, EngineConfig.packed_width_multiple
    for seed in range(3):
        mask = hh_mask(768, seed=seed)
        start = time.perf_counter()
        micro = packing.plan(mask, 256, budget, devices, multiple)
        assert time.perf_counter() - start < 5  # a host plan per iteration: it must stay cheap
        share = mask.sum() / sum(m.segment.size for m in micro)
        assert share >= 0.9, (seed, share)
        assert sum((m.segment < 768).sum() for m in micro) == mask.sum()


def test_packed_rows_are_the_real_tokens_and_unpack_puts_them_back():
    rng = np.random.default_rng(0)
    B, P, G = 5, 6, 4
    seq = rng.integers(3, 50, (B, P + G)).astype(np.int32)
    seq_mask = np.ones((B, P + G), np.int32)
    seq_mask[0, :2] = seq_mask[1, 3] = seq_mask[2, :5] = 0  # left padding, and a hole in row 1
    seq_mask[3, P + 2 :] = seq_mask[4, P + 1 :] = 0  # answers that ended early
    seq_mask[3, :4] = seq_mask[4, :3] = 0  # short prompts: rows 3 and 4 share a row
    mask = seq_mask[:, P:]
    exp = jax.tree.map(jnp.asarray, {"seq": seq, "seq_mask": seq_mask, "mask": mask})
    micro = packing.plan(seq_mask, P, 20, 1, 1)  # rows of W = 9 made even, 10: two to a micro-batch
    assert micro[0].segment.shape == (2, 10) and max(len(set(r[r < B])) for m in micro for r in m.segment) == 2
    for m in micro:
        out = jax.tree.map(np.asarray, packing.pack(exp, m))
        for r in range(len(m.segment)):
            for b in np.unique(m.segment[r][m.segment[r] < B]):
                at = np.flatnonzero(m.segment[r] == b)
                np.testing.assert_array_equal(out["seq"][r, at], seq[b][seq_mask[b] == 1])
                assert (out["seq_mask"][r, at] == 1).all() and (out["segment"][r, at] == b).all()
                np.testing.assert_array_equal(out["positions"][r, at], np.arange(len(at)))
            assert (out["seq_mask"][r][m.segment[r] == B] == 0).all()
        real = m.slot < B * G
        np.testing.assert_array_equal(out["answer"][real], seq[:, P:].reshape(-1)[m.slot[real]])
        np.testing.assert_array_equal(np.take_along_axis(out["seq"], m.head_at + 1, 1)[real], out["answer"][real])
    # unpack: slot results to the answer space, each sequence's last real token's value to its row
    part_of = lambda m: {  # noqa: E731
        "values": jnp.asarray(m.slot, jnp.float32) + 0.5,  # slot a's value: its answer-space index b G + g, + 0.5
        "scores": packing.segment_ends(jnp.asarray(m.column, jnp.float32), packing.pack(exp, m), B),
    }
    back = {"values": jnp.zeros((B, G)), "scores": jnp.zeros(B)}
    for m in micro:
        back = packing.unpack(back, part_of(m), packing.pack(exp, m))
    back = jax.tree.map(np.asarray, back)
    np.testing.assert_array_equal(back["values"], np.where(mask == 1, np.arange(B * G).reshape(B, G) + 0.5, 0))
    last = [np.flatnonzero(seq_mask[b])[-1] for b in range(B)]  # the last real token's column in the block
    np.testing.assert_array_equal(back["scores"], last)


@pytest.mark.parametrize(
    "prompts, answers, joined",
    [
        ([7, 3, 5, 1, 4, 6, 2, 5, 2, 1, 3, 2], [5, 1, 3, 0, 2, 4, 5, 1, 1, 2, 0, 1], 3),  # rows of up to three
        ([7, 4, 6, 5, 7, 3, 7, 6, 2, 5, 4, 7], [5, 4, 1, 3, 0, 5, 2, 4, 5, 2, 3, 5], 1),  # 7+ tokens each: one a row
    ],
)
def test_a_packed_micro_batch_scores_each_sequence_as_the_padded_block_does(prompts, answers, joined):
    """Log-probs, entropies and values of every answer token and each sequence's reward score (its last real token)
    from packed rows of several sequences equal the padded block's, row by row with no segments (OPT and Llama): a
    position not restarted, attention across segments or a head one column off would change them. Where no row
    joins two sequences (Micro.joined false) the model runs without the segment mask, padding after each one."""
    P, G, B = 7, 5, 12
    ids, _ = left_padded_batch(64, prompts, T=P, seed=1)
    seq = np.concatenate([ids, np.random.default_rng(2).integers(3, 64, (B, G)).astype(np.int32)], 1)
    seq_mask = padded_mask(prompts, answers, P, G)
    exp = jax.tree.map(jnp.asarray, {"seq": seq, "seq_mask": seq_mask, "mask": seq_mask[:, P:]})
    micro = packing.plan(seq_mask, P, 36, 1, 1)
    assert max(len(set(r[r < B])) for m in micro for r in m.segment) == joined  # sequences to a row
    no_mask = packing.pack(exp, micro[0])["segment_ids"] is None  # the model's attention then reads no segment mask
    assert {m.joined for m in micro} == {joined > 1} and no_mask == (joined == 1)
    for config in (OPTConfig(**PRE_LN, dropout=0.0), OPT[1], LLAMA):
        lm = init_params(config, jax.random.key(0), std=0.3)
        head = init_params(config, jax.random.key(1), value_head=True, std=0.3)
        # the padded block, each row alone: answer token g from the head at P + g - 1; the value there; the score at
        # the row's last real token
        at = jnp.broadcast_to(P - 1 + jnp.arange(G), (B, G))
        lp, ent = logprobs(config, lm, exp["seq"], exp["seq_mask"], exp["seq"][:, P:], at=at, entropy=True)
        v = values(config, head, exp["seq"], exp["seq_mask"])
        last = np.array([np.flatnonzero(seq_mask[b])[-1] for b in range(B)])
        want = {"lp": lp, "ent": ent, "v": v[:, P - 1 : P - 1 + G], "score": v[np.arange(B), last]}
        got = {k: jnp.zeros((B, G)) for k in ("lp", "ent", "v")} | {"score": jnp.zeros(B)}
        for m in micro:
            e = packing.pack(exp, m)
            kw = dict(at=e["head_at"], positions=e["positions"], segment_ids=e["segment_ids"], entropy=True)
            lp, ent = logprobs(config, lm, e["seq"], e["seq_mask"], e["answer"], **kw)
            np.testing.assert_allclose(answer_logprobs(config, lm, e, temperature=1.0, chunk=0), lp, rtol=1e-6)
            vals = packed_values(config, head, e)
            part = {"lp": lp, "ent": ent, "v": jnp.take_along_axis(vals, e["head_at"], 1)}
            part["score"] = packing.segment_ends(vals, e, B)
            got = packing.unpack(got, part, e)
        m = seq_mask[:, P:] == 1
        for k in ("lp", "ent", "v"):
            np.testing.assert_allclose(np.asarray(got[k])[m], np.asarray(want[k])[m], atol=2e-5, err_msg=k)
            assert (np.asarray(got[k])[~m] == 0).all()
        np.testing.assert_allclose(got["score"], want["score"], atol=2e-5)


OPT = (OPTConfig(**PRE_LN, dropout=0.0), OPTConfig(**POST_LN_PROJ, dropout=0.0))
LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def one_to_a_row(lengths, answers, order, W: int, A: int):
    """packing._rows' stand-in for the unpacked reference: one sequence to a row."""
    return [[b] for b in order]


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.slow
def test_packed_gives_the_unpacked_experience_losses_and_updates(family, monkeypatch):
    """Two engines on 8 devices: one packs several sequences to a row in micro-batches of 12 tokens per device (8 rows
    of 12; continuous batching in 8 decode slots), the other puts one sequence in a row, all in one micro-batch (a
    slot per prompt). The same experience, then two PPO epochs with the mixture loss in two accumulated parts: the same
    losses, gradient norms and weights after each step (LoRA actor, FSDP)."""
    actor_cfg, critic_cfg = OPT if family == "opt" else (LLAMA, LLAMA)
    actor = jax.device_get(init_params(actor_cfg, jax.random.key(0), std=0.3))
    critic = jax.device_get(init_params(critic_cfg, jax.random.key(1), value_head=True, std=0.3))
    ids, mask = left_padded_batch(64, [6, 3, 5, 1, 4, 6, 2, 5, 3, 6, 1, 2, 4, 5, 6, 2], T=6, seed=5)
    limits = np.array([5, 1, 3, 5, 2, 4, 5, 1, 2, 3, 5, 4, 1, 2, 3, 5], np.int32)  # answers of uneven lengths
    unsup_ids = np.random.default_rng(0).integers(3, 64, (8, 7)).astype(np.int32)
    unsup = {"input_ids": unsup_ids, "attention_mask": np.ones_like(unsup_ids), "loss_mask": np.ones_like(unsup_ids)}
    mesh = make_mesh(1)
    optim = OptimConfig(
        learning_rate=1e-2, warmup_steps=0, schedule="constant", eps=1e-4, gradient_accumulation_steps=2
    )
    runs = []
    for budget in (12, 1024):
        if budget == 1024:  # the reference: one sequence to a row
            monkeypatch.setattr(packing, "_rows", one_to_a_row)
        cfg = EngineConfig(
            actor=ModelSide(optim=optim, lora=LoRAConfig(dim=4)),
            critic=ModelSide(optim=optim),
            precision="fp32",
            max_answer_len=5,
            enable_ema=True,
            seed=3,
            unsup_coef=0.5,
            max_tokens_per_micro_batch=budget,
            packed_width_multiple=4,
            # the packed engine also generates in 8 slots refilled 4 at a time: the same answers
            decode_slots=8 if budget == 12 else 0,
            refill_size=4,
        )
        engine = HybridEngine(cfg, mesh, (actor_cfg, actor), (critic_cfg, critic), total_steps=10, eos_id=-1, pad_id=1)
        exp = engine.generate_experience({"prompt_ids": ids, "prompt_mask": mask, "answer_limits": limits})
        micro = engine.micro_batches(exp)
        shared = max(len(set(r[r < 16])) for m in micro for r in m.segment)
        assert (len(micro), shared) == ((2, 2) if budget == 12 else (1, 1))  # packed: two sequences to a row
        host = jax.device_get({k: exp[k] for k in ("seq", "mask", "ref_logprobs", "values", "scores")})
        stats = [engine.train_rlhf(exp, unsup) for _ in range(2)]
        host["logprobs"] = jax.device_get(exp["logprobs"])  # the first actor step's own (old_logprobs auto: step)
        runs.append((host, stats, jax.device_get(engine.state)))
    (e0, s0, st0), (e1, s1, st1) = runs
    np.testing.assert_array_equal(e0["mask"].sum(1), limits)
    for k in e0:
        np.testing.assert_allclose(e1[k], e0[k], atol=2e-5, err_msg=k)
    for a, b in zip(s0, s1):
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=2e-4, atol=2e-6, err_msg=k)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(st0)[0], jax.tree.leaves(st1)):
        np.testing.assert_allclose(b, a, atol=2e-4, err_msg=jax.tree_util.keystr(path))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's flash attention: on the GPU only")
def test_cudnn_attention_over_packed_rows_equals_xla_and_is_taken():
    """Packed rows (segments) on cuDNN's flash attention, their segment mask a constant bias: the output and the
    gradients of q, k, v equal XLA's masked attention (bf16 tolerance), and the compiled program calls cuDNN (no
    silent fallback to XLA's [H, T, T] scores)."""
    from jaxrlhf.models.common import causal_attention

    B, T, H, K = 4, 256, 8, 64
    rng = np.random.default_rng(0)
    ends = [np.cumsum(rng.integers(8, 96, 8)) for _ in range(B)]  # segment boundaries, padding after the last
    segment_ids = jnp.asarray(np.stack([np.searchsorted(e[e < T], np.arange(T), side="right") for e in ends]))
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, H, K)) * 0.3, jnp.bfloat16) for _ in range(3))
    w = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)

    def loss(impl, q, k, v):
        return jnp.sum(causal_attention(q, k, v, impl, segment_ids).astype(jnp.float32) * w)

    cudnn = jax.jit(jax.value_and_grad(functools.partial(loss, "cudnn"), argnums=(0, 1, 2)))
    # cuDNN's fused attention is a custom call; the bare word "cudnn" is also in this test's own name in the metadata
    assert 'custom_call_target="__cudnn$fmha' in cudnn.lower(q, k, v).compile().as_text()
    xla = jax.jit(jax.value_and_grad(functools.partial(loss, "xla"), argnums=(0, 1, 2)))
    (a, ga), (b, gb) = cudnn(q, k, v), xla(*(x.astype(jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(a, b, rtol=2e-2)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y), atol=0.1, rtol=5e-2)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="needs a backend without cuDNN")
def test_attention_cudnn_refuses_is_said_once_and_gives_xla_s_values(caplog, monkeypatch):
    """Where cuDNN's flash attention is refused (here: no cuDNN), causal_attention says so once per process, naming
    the shapes and the reason, and computes XLA's masked attention instead: the same values."""
    from jaxrlhf.models import common

    monkeypatch.setattr(common, "_TOLD", set())
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.bfloat16) for _ in range(3))
    segment_ids = jnp.asarray(np.repeat([[0] * 5 + [1] * 11], 2, 0))
    with caplog.at_level("WARNING", logger="jaxrlhf.models"):
        outs = [common.causal_attention(q, k, v, "cudnn", segment_ids) for _ in range(2)]
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1 and "cuDNN" in told[0] and "(2, 16, 4, 8)" in told[0] and "XLA" in told[0]
    want = common.causal_attention(q, k, v, "xla", segment_ids)
    for out in outs:
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
