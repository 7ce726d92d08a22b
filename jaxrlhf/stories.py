"""The story task's model side (the task itself, model-free, is jaxrlhf.data.stories): sample a pool of stories from
a pretrained model and write the task, and evaluate a run on it.

    python -m jaxrlhf.stories MODEL OUT     OUT/pairs.jsonl and OUT/demos.jsonl from MODEL's own stories
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np

from jaxrlhf.checkpoint import load_hf
from jaxrlhf.data.batches import pad_rows
from jaxrlhf.data.stories import OPENING, WORDS, make_prompt, uses, write
from jaxrlhf.eval import gold_and_kl
from jaxrlhf.generate import generate
from jaxrlhf.tokenizer import load_tokenizer


def sample_pool(model_dir: str | Path, n: int, max_new_tokens: int, seed: int = 0, batch: int = 512) -> list[str]:
    """`n` stories sampled (temperature 1) from the model in `model_dir`, each the continuation of OPENING."""
    config, params = load_hf(model_dir)
    tok = load_tokenizer(model_dir)
    prompt = np.asarray(tok(OPENING.strip())["input_ids"], np.int32)  # BOS + the opening words
    stories, ids = [], np.tile(prompt, (batch, 1))
    ends = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    for i in range(0, n, batch):
        key = jax.random.key(seed * 1000 + i)
        out = generate(config, params, ids, np.ones_like(ids), key, max_new_tokens=max_new_tokens, **ends)
        for row, m in zip(np.asarray(out.tokens), np.asarray(out.mask)):
            text = tok.decode(np.concatenate([prompt, row[m.astype(bool)]]).tolist(), skip_special_tokens=True)
            stories.append(" " + text.strip())
    return stories[:n]


def build(
    model_dir: str | Path, out_dir: str | Path, *, pool: int = 1024, max_new_tokens: int = 24, seed: int = 0, **kwargs
) -> Path:
    """Sample a pool of `pool` stories from the model and write the task from it (jaxrlhf.data.stories.write)."""
    return write(sample_pool(model_dir, pool, max_new_tokens, seed), out_dir, seed=seed, **kwargs)


def evaluate(
    step1_dir: str | Path,
    actor_dir: str | Path,
    words=WORDS,
    *,
    samples: int = 16,
    max_new_tokens: int = 32,
    seed: int = 7,
) -> dict:
    """Gold reward of the Step 1 model and of the final actor on each word's prompt: sampled (temperature 1)
    `samples` times, and greedy once; and the KL from the actor to the Step 1 model (nats per sampled answer)."""
    tok = load_tokenizer(actor_dir)
    enc = [tok(make_prompt(w))["input_ids"] for w in words]
    ids, mask = pad_rows(enc, max(map(len, enc)), tok.pad_token_id, left=True)
    models = {"step1": load_hf(step1_dir), "actor": load_hf(actor_dir)}
    out, texts = gold_and_kl(
        models,
        tok,
        ids,
        mask,
        lambda i, a: float(uses(a, words[i])),
        samples=samples,
        max_new_tokens=max_new_tokens,
        model_dir=step1_dir,
        temperature=1.0,
        seed=seed,
    )
    out["answers"] = {"sampled": len(ids) * samples, "greedy": len(words)}
    out["examples"] = {f"{name}_{mode}": dict(zip(words, answers)) for (name, mode), answers in texts.items()}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m jaxrlhf.stories",
        description="Write the story task (pairs.jsonl, demos.jsonl) from a pretrained model's own samples.",
    )
    ap.add_argument("model", help="an HF Llama folder, e.g. from python -m jaxrlhf.convert llama2c ...")
    ap.add_argument(
        "out",
        help="the folder to write (then data.data_path=[OUT/pairs.jsonl], data.sft_only_data_path=[OUT/demos.jsonl])",
    )
    ap.add_argument("--n", type=int, default=3000, help="preference records")
    ap.add_argument("--demos", type=int, default=1000, help="Step 1 demonstrations")
    ap.add_argument("--pool", type=int, default=2048, help="stories sampled from the model")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="tokens per sampled story")
    ap.add_argument("--label-noise", type=float, default=0.0, help="share of pairs with chosen and rejected swapped")
    ap.add_argument("--seed", type=int, default=0)
    args = vars(ap.parse_args(argv))  # the options are build's and write's keywords
    out = build(args.pop("model"), args.pop("out"), **args)
    print(f"wrote {args['n']} preference records and {args['demos']} demonstrations to {out}")


if __name__ == "__main__":
    main()
