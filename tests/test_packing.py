"""Step 3 without padding (jaxrlhf.packing): the micro-batch plan keeps to its token budget and holds every row once;
packed rows are the padded rows' real tokens; and the engine gives the same experience, losses, gradients and
updates however the batch is cut (one row per device in micro-batches of two widths, or all rows in one), for OPT
(pre- and post-LN) and Llama (grouped-query), under FSDP on 8 devices and LoRA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import POST_LN_PROJ, PRE_LN, left_padded_batch
from jaxrlhf import OPTConfig, init_params, make_mesh
from jaxrlhf.lora import LoRAConfig
from jaxrlhf.models.llama import LlamaConfig
from jaxrlhf.optim import OptimConfig
from jaxrlhf.rl import EngineConfig, HybridEngine, ModelSide
from jaxrlhf.rl.packing import pack, plan, unpack


@pytest.mark.parametrize("budget, devices, multiple", [(64, 1, 8), (40, 8, 4), (512, 2, 64), (33, 4, 1)])
def test_the_plan_holds_every_row_once_within_the_token_budget(budget, devices, multiple):
    lengths = np.random.default_rng(budget).integers(1, 33, 101)
    micro = plan(lengths, budget, devices, multiple, max_width=32)
    rows = np.concatenate([r for _, r in micro])
    assert sorted(rows[rows < 101]) == list(range(101))  # each row once, the rest empty (index B)
    for W, r in micro:
        assert len(r) % devices == 0 and len(r) // devices * W <= budget  # tokens per device within the budget
        assert (lengths[r[r < 101]] <= W).all() and (W % multiple == 0 or W in (32, budget))
    assert [W for W, _ in micro] == sorted((W for W, _ in micro), reverse=True)  # longest first
    with pytest.raises(ValueError, match="a sequence of 40 tokens is longer than max_tokens_per_micro_batch 39"):
        plan([3, 40], 39, 1)
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch: expected >= 1 \(tokens per device"):
        EngineConfig(max_tokens_per_micro_batch=0)


def test_packed_rows_are_the_real_tokens_and_unpack_puts_them_back():
    rng = np.random.default_rng(0)
    B, P, G = 5, 6, 4
    seq = rng.integers(3, 50, (B, P + G)).astype(np.int32)
    seq_mask = np.ones((B, P + G), np.int32)
    seq_mask[0, :2] = seq_mask[1, 3] = seq_mask[2, :5] = 0  # left padding, and a hole in row 1
    seq_mask[3, P + 2 :] = seq_mask[4, P + 1 :] = 0  # answers that ended early
    mask = seq_mask[:, P:]
    exp = {
        "seq": seq,
        "seq_mask": seq_mask,
        "mask": mask,
        "values": rng.normal(size=(B, G)).astype(np.float32) * mask,
        "scores": rng.normal(size=B).astype(np.float32),
    }
    rows = np.array([3, 1, 0, 5], np.int32)  # 5: an empty row
    out = jax.tree.map(np.asarray, pack(jax.tree.map(jnp.asarray, exp), jnp.asarray(rows), 10))
    for i, r in enumerate(rows[:3]):
        real = seq[r][seq_mask[r] == 1]
        np.testing.assert_array_equal(out["seq"][i, : len(real)], real)
        assert out["seq_mask"][i].tolist() == [1] * len(real) + [0] * (10 - len(real))
        n = seq_mask[r, :P].sum()
        np.testing.assert_array_equal(out["answer"][i], seq[r, P:])
        np.testing.assert_array_equal(out["seq"][i, out["head_at"][i] + 1][mask[r] == 1], seq[r, P:][mask[r] == 1])
        assert out["head_at"][i, 0] == n - 1
        np.testing.assert_array_equal(out["values"][i], exp["values"][r])
    assert out["seq_mask"][3].sum() == 0 and out["mask"][3].sum() == 0  # the empty row
    part = {"values": out["values"] * 2, "scores": out["scores"] * 2}
    back = jax.tree.map(np.asarray, unpack({"values": jnp.zeros((B, G)), "scores": jnp.zeros(B)}, part, rows))
    np.testing.assert_array_equal(back["values"][[3, 1, 0]], 2 * exp["values"][[3, 1, 0]])
    assert (back["values"][[2, 4]] == 0).all() and back["scores"][4] == 0


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


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.slow
def test_every_cut_gives_the_same_experience_losses_and_updates(family):
    """Two engines, one in micro-batches of one row per device and two widths (continuous batching in 8 decode slots)
    and one with all rows in one micro-batch (a slot per prompt): the same experience, then two PPO epochs with the
    mixture loss: the same losses, gradient norms and weights after each step (LoRA actor, FSDP)."""
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
    for budget in (1024, 12):  # 12 tokens per device: one row per device in micro-batches of widths 11 and 8
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
        widths = [W for W, _ in engine._micro_batches(exp)]
        assert set(widths) == {11, 8} if budget == 12 else widths == [11]  # the whole row, then rows of <= 8
        host = jax.device_get({k: exp[k] for k in ("seq", "mask", "logprobs", "ref_logprobs", "values", "scores")})
        stats = [engine.train_rlhf(exp, unsup) for _ in range(2)]
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
