"""Where a Step 1 training step spends its time on the GPU: the pieces of forward + backward, timed apart.

    PYTHONPATH=. python tools/bench_breakdown.py --model opt-1.3b --batch 8 --seq 512 [--out DIR]

Pure bf16 weights, no optimizer: (1) forward of the token log-probs; (2) forward + backward of the full
SFT loss; (3) the same with the decoder layers only (loss on the last hidden state, no LM head);
(4) the embedding + LM head + loss alone (zero layers); (5) a single layer's forward + backward x L.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrlhf.losses import lm_loss, token_logprobs  # noqa: E402
from jaxrlhf.models import Backend, OPTConfig, init_params, logits  # noqa: E402
from jaxrlhf.models.opt import PRESETS, OPTLayer  # noqa: E402
from tools import common  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-1.3b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    B, T = args.batch, args.seq
    config = OPTConfig(**PRESETS[args.model], dtype="bfloat16", dropout=0.0, backend=Backend.detect())
    params = jax.jit(lambda k: init_params(config, k, dtype=jnp.bfloat16))(jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (B, T), 3, config.vocab_size)
    mask = jnp.ones_like(ids)
    sft = lambda p, cfg=config: lm_loss(token_logprobs(logits(cfg, p, ids, mask), ids), mask)[0] / (B * (T - 1))

    def decoder_only(p):
        from jaxrlhf.models.opt import OPTDecoder

        h = OPTDecoder(config).apply({"params": p["decoder"]}, ids, mask)
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    head_params = {"decoder": {k: v for k, v in params["decoder"].items() if k != "layers"}}

    def head_only(p):
        emb = p["decoder"]["embed_tokens"]["embedding"]
        h = emb[ids]  # [B, T, E]
        out = jnp.einsum("bte,ve->btv", h, emb, preferred_element_type=jnp.float32)
        return lm_loss(token_logprobs(out, ids), mask)[0] / (B * (T - 1))

    layer = OPTLayer(config)
    layer_params = jax.tree.map(lambda x: x[0], params["decoder"]["layers"])
    h0 = jax.random.normal(jax.random.key(2), (B, T, config.hidden_size), jnp.bfloat16)

    def one_layer(p):
        h, _ = layer.apply({"params": p}, h0, None)
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    pieces = {
        "forward_logprobs": (jax.jit(sft), params),
        "fwd_bwd_full": (jax.jit(jax.grad(sft)), params),
        "fwd_bwd_decoder_no_head": (jax.jit(jax.grad(decoder_only)), params),
        "fwd_bwd_head_only": (jax.jit(jax.grad(head_only)), head_params),
        "fwd_bwd_one_layer": (jax.jit(jax.grad(one_layer)), layer_params),
        "fwd_one_layer": (jax.jit(one_layer), layer_params),
    }
    result = {"benchmark": "breakdown", **common.environment(), "model": args.model, "batch": B, "seq": T, "runs": {}}
    for name, (fn, p) in pieces.items():
        t = common.timeit(lambda: fn(p), 10)
        result["runs"][name] = t
        scale = (
            f" (x {config.num_hidden_layers} = {t['median_s'] * config.num_hidden_layers * 1e3:.1f} ms)"
            if "layer" in name
            else ""
        )
        print(f"{name:26s} {t['median_s'] * 1e3:8.2f} ms{scale}", flush=True)
    common.write("breakdown", f"breakdown-{args.model}", result, args.out)


if __name__ == "__main__":
    main()
