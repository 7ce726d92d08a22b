"""The mixture LM loss in the actor's PPO step (ours) against a second optimizer step (DeepSpeed-Chat), on the CPU.

    PYTHONPATH=. python tools/mixture_step.py [--iterations 20] [--unsup-coef 27.8] [--lr 1e-3] [--out FILE]

DeepSpeed-Chat's Step 3 takes the actor's PPO step, then `train_unsupervised`: a second step of the same optimizer
(the same Adam moments, each step clipped on its own) on unsup_coef * LM loss. Ours adds unsup_coef * LM loss to the
PPO loss of the one step. Both schemes run here from the same tiny random OPT models, prompts and LM batches (Adam
(0.9, 0.95), clip 1.0, DeepSpeed-Chat's unsup_coef 27.8); per iteration, on that iteration's experience and LM
batch: the PPO surrogate and the LM loss before and after the actor's step(s), and the norms of the two gradients
at the start of the step. Prints (and with --out writes) JSON: each scheme's means over the iterations.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import losses
from jaxrlhf.models import OPTConfig, init_params, logits
from jaxrlhf.optim import OptimConfig
from jaxrlhf.rl import EngineConfig, HybridEngine, ModelSide
from jaxrlhf.rl import losses as ppo_losses
from jaxrlhf.rl.experience import advantages
from jaxrlhf.sharding import make_mesh
from jaxrlhf.trainer import make_train_step

ACTOR = OPTConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    ffn_dim=64,
    max_position_embeddings=40,
    word_embed_proj_dim=32,
    dropout=0.0,
)
CRITIC = OPTConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    ffn_dim=48,
    max_position_embeddings=40,
    word_embed_proj_dim=16,
    do_layer_norm_before=False,
    dropout=0.0,
)
B, PROMPT, G, LM_LEN = 8, 6, 8, 16


def lm_mean(params, u):
    lp = losses.token_logprobs(logits(ACTOR, params, u["input_ids"], u["attention_mask"]), u["input_ids"])
    total, count, _ = losses.lm_loss(lp, u["loss_mask"])
    return total / count


def ppo_mean(engine, params, exp):
    seq, G = exp["seq"], exp["mask"].shape[1]  # padded rows: answer token g at position P + g, its logits one earlier
    lp = losses.token_logprobs(logits(ACTOR, params, seq, exp["seq_mask"], last=G + 1), seq[:, -G - 1 :])
    return ppo_losses.actor_loss(lp, exp["logprobs"], exp["advantages"], exp["mask"], engine.cfg.clip_ratio)


def run(scheme: str, args) -> dict:
    side = ModelSide(optim=OptimConfig(learning_rate=args.lr, warmup_steps=0, schedule="constant"))
    cfg = EngineConfig(actor=side, critic=side, precision="fp32", max_answer_len=G, unsup_coef=args.unsup_coef, seed=3)
    models = [
        jax.device_get(init_params(c, jax.random.key(i), value_head=i == 1, std=0.3))
        for i, c in enumerate((ACTOR, CRITIC))
    ]
    mesh = make_mesh(1, jax.devices()[:1])
    engine = HybridEngine(
        cfg, mesh, (ACTOR, models[0]), (CRITIC, models[1]), total_steps=2 * args.iterations, eos_id=2, pad_id=1
    )
    lm_step = jax.jit(
        make_train_step(
            lambda p, u, k: (lambda t, c, m: (args.unsup_coef * t, c, m))(
                *losses.lm_loss(
                    losses.next_token_logprobs(ACTOR, p, u["input_ids"], u["attention_mask"]), u["loss_mask"]
                )
            ),
            engine.static.tx("actor"),
            cfg.actor.lora,
        )
    )
    grad_ppo = jax.jit(jax.grad(lambda p, e: ppo_mean(engine, p, e)))
    grad_lm = jax.jit(jax.grad(lm_mean))
    norm = lambda t: float(jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(t))))
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(args.iterations):
        ids = rng.integers(3, 64, (B, PROMPT)).astype(np.int32)
        ids[:, 0] = 2
        exp = engine.generate_experience({"prompt_ids": ids, "prompt_mask": np.ones_like(ids)})
        lm_ids = rng.integers(3, 64, (B, LM_LEN)).astype(np.int32)
        u = {"input_ids": lm_ids, "attention_mask": np.ones_like(lm_ids), "loss_mask": np.ones_like(lm_ids)}
        keys = ("seq", "seq_mask", "mask", "logprobs", "ref_logprobs", "values", "scores")
        scored, _ = advantages(engine.static.returns, {k: exp[k] for k in keys}, exp["kl_coef"])
        before = engine.actor_params()
        row = {
            "ppo_before": float(ppo_mean(engine, before, scored)),
            "lm_before": float(lm_mean(before, u)),
            "ppo_grad_norm": norm(grad_ppo(before, scored)),
            "lm_grad_norm": args.unsup_coef * norm(grad_lm(before, u)),
        }
        if scheme == "same step":
            stats = engine.train_rlhf(exp, u)
        else:  # DeepSpeed-Chat: the PPO step, then a second step of the same optimizer on the LM loss
            stats = engine.train_rlhf(exp)
            engine.state["actor"], _ = lm_step(engine.state["actor"], jax.tree.map(lambda x: x[None], u))
        after = engine.actor_params()
        row.update(
            ppo_after=float(ppo_mean(engine, after, scored)),
            lm_after=float(lm_mean(after, u)),
            reward=stats["reward"],
            kl=stats["kl"],
        )
        rows.append(row)
    mean = lambda k: float(np.mean([r[k] for r in rows]))
    return {
        "ppo_gain_per_iteration": mean("ppo_before") - mean("ppo_after"),
        "lm_gain_per_iteration": mean("lm_before") - mean("lm_after"),
        "ppo_grad_norm": mean("ppo_grad_norm"),
        "unsup_coef_x_lm_grad_norm": mean("lm_grad_norm"),
        "lm_loss_first": rows[0]["lm_before"],
        "lm_loss_last": rows[-1]["lm_after"],
        "reward_last5": float(np.mean([r["reward"] for r in rows[-5:]])),
        "kl_last5": float(np.mean([r["kl"] for r in rows[-5:]])),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--unsup-coef", type=float, default=27.8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"config": vars(args), **{scheme: run(scheme, args) for scheme in ("same step", "two steps")}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
