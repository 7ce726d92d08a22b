"""DPO (jaxrlhf.dpo): its loss and reward accuracy against a NumPy reference, and training end to end on tiny models."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import OPTConfig, init_params, load_hf, opt_tokenizer, save_hf
from jaxrlhf.data import DataConfig
from jaxrlhf.dpo import DPOConfig, main, run
from jaxrlhf.losses import answer_mask, dpo_loss, sequence_logprobs
from jaxrlhf.lora import LoRAConfig
from jaxrlhf.trainer import OptimConfig

TINY = dict(vocab_size=50272, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
            max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0)


# ------------------------------------------------------------------------------------ the formulas, against NumPy


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def reference_dpo(pc, pr, rc, rr, beta, eps, kind):
    """Per-pair DPO / IPO loss and the accuracy of the implicit rewards, written out pair by pair."""
    losses, hits = [], []
    for a, b, c, d in zip(pc, pr, rc, rr):
        h = (a - c) - (b - d)
        if kind == "ipo":
            losses.append((h - 1.0 / (2.0 * beta)) ** 2)
        else:
            losses.append(-(1.0 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h))
        reward_c, reward_r = beta * (a - c), beta * (b - d)
        hits.append(1.0 if reward_c > reward_r else 0.5 if reward_c == reward_r else 0.0)
    return np.array(losses), np.array(hits)


@pytest.mark.parametrize("kind,beta,eps", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("sigmoid", 2.0, 0.4),
                                           ("ipo", 0.1, 0.0), ("ipo", 1.5, 0.0)])
def test_dpo_loss_matches_numpy(kind, beta, eps):
    rng = np.random.default_rng(0)
    pc, pr, rc, rr = (rng.normal(-20, 6, 12).astype(np.float32) for _ in range(4))
    pc[3], pr[3] = rc[3], rr[3]  # a pair where the policy is the reference: a tie, counted 1/2
    total, count, m = dpo_loss(*map(jnp.asarray, (pc, pr, rc, rr)), beta=beta, label_smoothing=eps, kind=kind)
    want, hits = reference_dpo(pc.astype(np.float64), pr, rc, rr, beta, eps, kind)
    np.testing.assert_allclose(float(total), want.sum(), rtol=1e-5)
    assert float(count) == float(m["pairs"]) == 12
    assert float(m["accuracy"]) == hits.sum() and 0 < hits.sum() < 12
    np.testing.assert_allclose(float(m["chosen_reward"]), beta * (pc - rc).sum(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(m["rejected_reward"]), beta * (pr - rr).sum(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(m["margin"]), beta * ((pc - rc) - (pr - rr)).sum(), rtol=1e-5, atol=1e-5)


def test_dpo_loss_hand_computed():
    """One pair by hand: the policy gained 2 nats on chosen and lost 1 on rejected against the reference, h = 3."""
    args = [jnp.array([-8.0]), jnp.array([-13.0]), jnp.array([-10.0]), jnp.array([-12.0])]
    total, _, m = dpo_loss(*args, beta=0.5)
    assert math.isclose(float(total), math.log1p(math.exp(-1.5)), rel_tol=1e-6)  # -log σ(1.5)
    total, _, _ = dpo_loss(*args, beta=0.5, label_smoothing=0.25)  # 0.75 (-log σ(1.5)) + 0.25 (-log σ(-1.5))
    assert math.isclose(float(total), 0.75 * math.log1p(math.exp(-1.5)) + 0.25 * math.log1p(math.exp(1.5)), rel_tol=1e-6)
    total, _, _ = dpo_loss(*args, beta=0.5, kind="ipo")
    assert math.isclose(float(total), (3.0 - 1.0) ** 2, rel_tol=1e-6)
    assert float(m["accuracy"]) == 1.0 and math.isclose(float(m["chosen_reward"]), 1.0) and math.isclose(
        float(m["rejected_reward"]), -0.5)
    assert math.isclose(float(dpo_loss(*args[:2], *args[:2], beta=0.1)[0]), math.log(2.0), rel_tol=1e-6)


def test_answer_logprobs_match_numpy():
    """Summed log-probs of the answer tokens alone: the prompt (BOS included) and the padding masked."""
    rng = np.random.default_rng(1)
    B, T, V = 3, 7, 11
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    lengths, prompt_len = np.array([7, 5, 3]), np.array([3, 2, 3])  # the last row: no answer at all
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    got = sequence_logprobs(jnp.asarray(logits), jnp.asarray(ids), answer_mask(jnp.asarray(mask), jnp.asarray(prompt_len)))
    want = np.zeros(B)
    for b in range(B):
        for t in range(prompt_len[b], lengths[b]):  # token t, predicted by the logits at t - 1
            z = logits[b, t - 1].astype(np.float64)
            want[b] += z[ids[b, t]] - np.log(np.exp(z - z.max()).sum()) - z.max()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
    assert want[2] == 0.0


def test_settings_are_checked():
    with pytest.raises(ValueError, match="beta"):
        DPOConfig(beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOConfig(label_smoothing=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match="loss kind"):
        dpo_loss(*[jnp.zeros(2)] * 4, beta=0.1, kind="hinge")


def test_help_names_the_settings(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "python -m jaxrlhf.dpo" in out and "beta" in out and "label_smoothing" in out and "loss_type" in out


# ------------------------------------------------------------------------------------------ training end to end


@pytest.fixture(scope="module")
def tiny_model(assets, tmp_path_factory):
    """A tiny random OPT with the real OPT tokenizer, as an HF folder."""
    folder = tmp_path_factory.mktemp("tiny") / "model"
    config = OPTConfig(**TINY)
    return save_hf(folder, config, jax.device_get(init_params(config, jax.random.key(0), std=0.1)),
                   opt_tokenizer(assets / "opt-tokenizer"))


def dpo_config(model, tmp_path, **kw):
    data = DataConfig(data_path=("synthetic:800",), data_split="0,1,0", eval_fraction=0.2, max_seq_len=32,
                      cache_dir=str(tmp_path / "cache"))
    base = dict(model=str(model), output_dir=str(tmp_path / "out"), batch_size=16, epochs=3, log_every=1,
                precision="fp32", beta=0.5, optim=OptimConfig(learning_rate=3e-3, warmup_steps=2), data=data)
    return DPOConfig(**{**base, **kw})


def train_losses(records):
    return [r["loss"] for r in records if r["split"] == "train"]


@pytest.mark.parametrize("lora", [LoRAConfig(), LoRAConfig(dim=8, only_optimize_lora=True, learning_rate=1e-2)],
                         ids=["full", "lora"])
def test_dpo_learns_the_builtin_preferences(tiny_model, tmp_path, lora):
    """Three epochs over 640 pairs on 8 devices: the first step's loss is log 2 (policy = reference), the loss falls,
    and on the 160 held-out pairs the implicit reward prefers the chosen answer far above the reference's 0.5."""
    out = run(dpo_config(tiny_model, tmp_path, lora=lora), log=lambda _: None)
    losses = train_losses(out["records"])
    evaluation = [r for r in out["records"] if r["split"] == "eval"][-1]
    print("losses", np.round(losses, 3), "held out", evaluation)
    assert len(losses) == 3 * 40
    assert math.isclose(losses[0], math.log(2.0), rel_tol=1e-5)
    assert np.mean(losses[-10:]) < 0.7 * math.log(2.0)
    assert evaluation["pairs"] == 160 and evaluation["accuracy"] > 0.75
    assert evaluation["margin"] > 0 and evaluation["chosen_reward"] > evaluation["rejected_reward"]
