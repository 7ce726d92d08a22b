"""How far generation's per-token log-probs are from the training forward's (issue 44 item 4), on random weights.

    PYTHONPATH=. python tools/bench_logprob_gap.py --actor opt-1.3b --critic opt-350m --batch 256 \\
        --lengths ../shared/assets/data/hh-rlhf/hh_lengths.json [--precision pure_bf16 bf16] [--out DIR]
    PYTHONPATH=. python tools/bench_logprob_gap.py --actor qwen2.5-1.5b --critic qwen2.5-0.5b --lengths ...

Per precision, the Step 3 engine (random weights of the real shapes, made as tools/bench_ppo.py makes them) answers
random prompts of drawn lengths (bench_ppo's draws from --lengths, answers forced to end at their drawn length, EOS
off; sampling at temperature 1) and records generation's own log-probs of the tokens it drew: what
`old_logprobs: generation` would use as the old log-probs. Its scoring phase computes the old log-probs with
the training forward, in packed micro-batches of max_tokens_per_micro_batch tokens. The same answers are then
scored by the training forward a second time, another way: padded rows of the whole prompt + answer width, --micro
rows at a time (models.logprobs on the actor's weights as training reads them). Two training forwards differ by as
much as that (the micro-batch and its width change the products' shapes and so their rounding).

Per answer token (the answer mask) the result gives, for generation − training and for training − training: the
mean, 99th percentile and max |difference|, the mean signed difference, and the share of tokens whose PPO ratio
exp(difference) lies outside [1 − 0.2, 1 + 0.2] (the first epoch's clip, at identical weights); `gap_ratio` is
generation's mean |difference| over training's (None where the two training forwards agree exactly). Written as
JSON under --out (default bench/results/logprob-gap/).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxrlhf.models import Backend, init_params, logprobs, param_shapes, preset  # noqa: E402
from jaxrlhf.optim import OptimConfig  # noqa: E402
from jaxrlhf.rl import EngineConfig, HybridEngine, ModelSide  # noqa: E402
from jaxrlhf.sharding import make_mesh, shardings_for  # noqa: E402
from tools import common  # noqa: E402
from tools.bench_ppo import draw_lengths, prompt_batch, vocab  # noqa: E402

CLIP = 0.2  # PPO's ratio clip (EngineConfig's default)


def gap(a, b, mask) -> dict:
    """Per answer token where mask [B, G] is 1: statistics of d = a - b (log-probs [B, G])."""
    m = np.asarray(mask) > 0
    d = (np.asarray(a, np.float64) - np.asarray(b, np.float64))[m]
    ad = np.abs(d)
    return {
        "tokens": int(m.sum()),
        "mean_abs": float(ad.mean()),
        "p99_abs": float(np.quantile(ad, 0.99)),
        "max_abs": float(ad.max()),
        "mean": float(d.mean()),
        "outside_clip": float(np.mean(np.abs(np.expm1(d)) > CLIP)),
    }


@partial(jax.jit, static_argnums=(0, 1, 2))
def padded_logprobs(config, temperature: float, chunk: int, params, seq, seq_mask, tokens):
    """log p of the answer tokens [B, G] of padded rows seq, seq_mask [B, P + G] (prompt left-padded, then the answer):
    answer token g at column P + g, the LM head at column P + g - 1 (models.logprobs' `at`)."""
    B, G = tokens.shape
    at = jnp.broadcast_to(seq.shape[1] - G - 1 + jnp.arange(G), (B, G))
    return logprobs(config, params, seq, seq_mask, tokens, temperature=temperature, chunk=chunk, at=at)


def rescore(engine: HybridEngine, exp: dict, micro: int) -> np.ndarray:
    """The experience's answers scored again by the training forward: padded rows, `micro` at a time."""
    cfg, mesh = engine.cfg, engine.mesh
    seq, seq_mask, mask = (np.asarray(jax.device_get(exp[k])) for k in ("seq", "seq_mask", "mask"))
    G = mask.shape[1]
    params, whole = engine.actor_params(), NamedSharding(mesh, P())
    out = []
    for i in range(0, len(seq), micro):
        rows = [jax.device_put(x[i : i + micro], whole) for x in (seq, seq_mask, seq[:, -G:])]
        out.append(padded_logprobs(engine.actor_config, cfg.temperature, cfg.actor.logits_chunk, params, *rows))
    return np.concatenate([np.asarray(jax.device_get(x)) for x in out])


def engine_for(args, precision: str) -> HybridEngine:
    """The Step 3 engine on random weights of --actor and --critic (bench_ppo's), old log-probs from scoring."""
    mesh = make_mesh(1)
    dtype = jnp.float32 if precision in ("bf16", "fp32") else jnp.bfloat16
    compute = "float32" if precision == "fp32" else "bfloat16"
    models = []
    for i, (name, head) in enumerate(((args.actor, False), (args.critic, True))):
        config = preset(name, dtype=compute, dropout=0.0, backend=Backend.detect())
        shardings = shardings_for(param_shapes(config, value_head=head), "fsdp", mesh)
        make = jax.jit(
            lambda k, c=config, h=head: init_params(c, k, value_head=h, dtype=dtype), out_shardings=shardings
        )
        models.append((config, jax.device_get(make(jax.random.key(i)))))
    side = lambda lr: ModelSide(optim=OptimConfig(learning_rate=lr, warmup_steps=0), dropout=0.0)
    cfg = EngineConfig(
        actor=side(9.65e-6),
        critic=side(5e-6),
        precision=precision,
        max_answer_len=args.new,
        enable_ema=False,
        old_logprobs="scoring",  # the old log-probs from the training forward, generation's beside them
        decode_slots=args.slots,
        max_tokens_per_micro_batch=args.tokens,
    )
    return HybridEngine(cfg, mesh, *models, total_steps=1000, eos_id=-1, pad_id=1)  # EOS off: drawn lengths


def measure(args, precision: str) -> dict:
    """One precision: generation's and two training forwards' log-probs of the same answers, compared."""
    engine = engine_for(args, precision)
    batch = prompt_batch(
        args.batch, args.prompt, *draw_lengths(args.lengths, args.batch, args.prompt, args.new), vocab(args.actor)
    )
    exp = engine.generate_experience(batch)
    mask = np.asarray(jax.device_get(exp["mask"]))
    generation, scoring = (np.asarray(jax.device_get(exp[k])) for k in ("generation_logprobs", "logprobs"))
    padded = rescore(engine, exp, args.micro)
    out = {
        "generation_vs_training": gap(generation, scoring, mask),
        "generation_vs_training_padded": gap(generation, padded, mask),
        "training_vs_training": gap(scoring, padded, mask),
        "answer_tokens": int(mask.sum()),
        "mean_logprob": float((scoring * mask).sum() / mask.sum()),
    }
    train = out["training_vs_training"]["mean_abs"]  # 0 where both forwards round alike (None: no ratio)
    out["gap_ratio"] = out["generation_vs_training"]["mean_abs"] / train if train else None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actor", default="opt-1.3b")
    ap.add_argument("--critic", default="opt-350m")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--lengths", default=None, help="a lengths file (bench_ppo's --lengths; default: full lengths)")
    ap.add_argument("--precision", nargs="+", default=["pure_bf16", "bf16"], choices=["pure_bf16", "bf16", "fp32"])
    ap.add_argument("--slots", type=int, default=0, help="decode slots (EngineConfig.decode_slots)")
    ap.add_argument("--tokens", type=int, default=16384, help="max_tokens_per_micro_batch of the engine's scoring")
    ap.add_argument("--micro", type=int, default=16, help="rows per padded micro-batch of the second forward")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = {}
    for precision in args.precision:
        runs[precision] = common.safely(measure, args, precision)
        r = runs[precision]
        if "error" in r:
            print(f"{precision:10s} {r['error']}", flush=True)
            continue
        for pair in ("generation_vs_training", "generation_vs_training_padded", "training_vs_training"):
            g = r[pair]
            print(
                f"{precision:10s} {pair:30s} mean |d| {g['mean_abs']:.2e}  p99 {g['p99_abs']:.2e}  max "
                f"{g['max_abs']:.2e}  mean d {g['mean']:+.1e}  outside clip {g['outside_clip']:.2%}",
                flush=True,
            )
    result = {"benchmark": "logprob_gap", **common.environment(), "args": vars(args), "runs": runs}
    return common.write("logprob-gap", f"logprob-gap-{args.actor}", result, args.out)


if __name__ == "__main__":
    main()
