"""A story task for a real pretrained model (llama2.c's stories260K): tell a story that uses a requested word.

    prompt        "\\n\\nHuman: Tell me a story about a dog.\\n\\nAssistant:"
    answer        " Once upon a time, there was a little dog named Max. ..."        gold reward 1.0
                  " Once upon a time, there was a little girl named Lily. ..."       gold reward 0.0

The gold reward of an answer is 1.0 when the requested word (or its plural) appears in it as a word, else
0.0. The data come from the pretrained model itself, so nothing here is hand-written text: `build` samples
a pool of short stories from the model ("Once upon a time," continued at temperature 1, short enough to
end, with EOS, inside Step 3's answer length), then writes two JSON-lines files:

    pairs.jsonl   {prompt, chosen, rejected}: a prompt for a word; chosen a pooled story with the word,
                  rejected one without (half of them using another task word, so the reward model must
                  read the prompt); `label_noise` of them swapped (an imperfect annotator)
                  -> data.data_path, shared by Steps 2 and 3 (data_split 0,1,1)
    demos.jsonl   {prompt, chosen}: a prompt answered by a random pooled story, which uses the word only as
                  often as the model's own stories do -> data.sft_only_data_path (Step 1)

The pretrained model knows the stories' world but not the Human/Assistant format: Step 1 teaches it the
format only (its demonstrations ignore the request), so the Step 1 model uses the word about as often as
the pool does; Steps 2 and 3 must teach it to honour the request.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

# Nouns that TinyStories-trained models write often enough to be found in a pool of their own stories.
WORDS = ("ball", "dog", "cat", "tree", "bird", "toy", "cake", "car", "flower", "fish", "box", "boat", "bear",
         "sun", "apple", "bunny", "kite", "frog")
OPENING = " Once upon a time,"
_PROMPT = re.compile(r"\n\nHuman: Tell me a story about an? (\w+)\.\n\nAssistant:")


def make_prompt(word: str) -> str:
    """The HH-style prompt asking for a story about `word`."""
    article = "an" if word[0] in "aeiou" else "a"
    return f"\n\nHuman: Tell me a story about {article} {word}.\n\nAssistant:"


def prompt_word(prompt: str) -> str:
    """The word a story prompt asks for; ValueError for any other prompt."""
    found = _PROMPT.search(prompt)
    if not found:
        raise ValueError(f"not a story prompt: {prompt[:80]!r}")
    return found.group(1)


def uses(text: str, word: str) -> bool:
    """Whether `word` (or its plural) appears in `text` as a word, in any case."""
    return re.search(rf"\b{re.escape(word)}(s|es)?\b", text, re.IGNORECASE) is not None


def gold_reward(prompt: str, answer: str) -> float:
    """1.0 if the answer uses the word the prompt asks for, else 0.0."""
    return float(uses(answer, prompt_word(prompt)))


def sample_pool(model_dir: str | Path, n: int, max_new_tokens: int, seed: int = 0, batch: int = 512) -> list[str]:
    """`n` stories sampled (temperature 1) from the model in `model_dir`, each the continuation of OPENING."""
    import jax

    from jaxrlhf.checkpoint import load_hf
    from jaxrlhf.generate import generate
    from jaxrlhf.tokenizer import load_tokenizer

    config, params = load_hf(model_dir)
    tok = load_tokenizer(model_dir)
    prompt = np.asarray(tok(OPENING.strip())["input_ids"], np.int32)  # BOS + the opening words
    stories = []
    for i in range(0, n, batch):
        ids = np.tile(prompt, (batch, 1))
        out = generate(config, params, ids, np.ones_like(ids), jax.random.key(seed * 1000 + i),
                       max_new_tokens=max_new_tokens, temperature=1.0, eos_id=tok.eos_token_id,
                       pad_id=tok.pad_token_id)
        for row, m in zip(np.asarray(out.tokens), np.asarray(out.mask)):
            text = tok.decode(np.concatenate([prompt, row[m.astype(bool)]]).tolist(), skip_special_tokens=True)
            stories.append(" " + text.strip())
    return stories[:n]


def records(stories: list[str], n: int, seed: int = 0, label_noise: float = 0.0, min_hits: int = 20,
            off_topic: float = 0.5) -> list[dict]:
    """`n` {prompt, chosen, rejected} records from a pool of stories (see the module docstring).

    Only words that at least `min_hits` pooled stories use are asked for (a word with a handful of stories
    would give a reward model those few stories to learn by heart, and PPO a story to repeat for every
    prompt). `off_topic` of the rejected stories use another task word: the reward model must read the
    prompt, not only judge the story.
    """
    rng = np.random.default_rng(seed)
    used = [{w for w in WORDS if uses(s, w)} for s in stories]  # the task words each story uses
    with_word = {w: [s for s, u in zip(stories, used) if w in u] for w in WORDS}
    words = [w for w in WORDS if min_hits <= len(with_word[w]) < len(stories)]
    if not words:
        raise ValueError(f"records: no task word is used by {min_hits} pooled stories; sample a larger pool")
    misses = {w: [s for s, u in zip(stories, used) if w not in u] for w in words}
    others = {w: [s for s, u in zip(stories, used) if w not in u and u & set(words)] for w in words}
    out = []
    for _ in range(n):
        w = words[rng.integers(len(words))]
        pool = others[w] if others[w] and rng.random() < off_topic else misses[w]
        chosen, rejected = with_word[w][rng.integers(len(with_word[w]))], pool[rng.integers(len(pool))]
        if rng.random() < label_noise:
            chosen, rejected = rejected, chosen
        out.append({"prompt": make_prompt(w), "chosen": chosen, "rejected": rejected})
    return out


def task_words(path: str | Path) -> list[str]:
    """The words the records in a task file ask for, in WORDS order."""
    asked = {prompt_word(json.loads(line)["prompt"]) for line in Path(path).read_text().splitlines() if line}
    return [w for w in WORDS if w in asked]


def demonstrations(stories: list[str], rows: list[dict], seed: int = 0, on_request: float = 0.5) -> list[dict]:
    """Step 1 demonstrations {prompt, chosen}: each record's prompt answered by its chosen story (one with the
    requested word) for `on_request` of them, else by a random pooled story, which uses the word only as often
    as the model's own stories do: an uneven demonstrator, so the Step 1 model honours the request sometimes."""
    rng = np.random.default_rng([seed, 1])
    return [{"prompt": r["prompt"], "chosen": r["chosen"] if rng.random() < on_request else stories[rng.integers(len(stories))]}
            for r in rows]


def build(model_dir: str | Path, out_dir: str | Path, *, n: int = 1500, demos: int = 500, pool: int = 1024,
          max_new_tokens: int = 24, seed: int = 0, on_request: float = 0.5, **kwargs) -> Path:
    """Sample a pool from the model; write `n` preference records to OUT_DIR/pairs.jsonl and `demos` Step 1
    demonstrations to OUT_DIR/demos.jsonl (JSON lines)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stories = sample_pool(model_dir, pool, max_new_tokens, seed)
    rows = records(stories, n + demos, seed, **kwargs)
    for name, part in (("pairs", rows[:n]), ("demos", demonstrations(stories, rows[n:], seed, on_request))):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return out_dir


def evaluate(step1_dir: str | Path, actor_dir: str | Path, words=WORDS, *, samples: int = 16,
             max_new_tokens: int = 32, seed: int = 7) -> dict:
    """Gold reward of the Step 1 model and of the final actor on each word's prompt: sampled (temperature 1)
    `samples` times, and greedy once; and the KL from the actor to the Step 1 model (nats per sampled answer)."""
    import jax
    import jax.numpy as jnp

    from jaxrlhf.checkpoint import load_hf
    from jaxrlhf.generate import generate
    from jaxrlhf.losses import token_logprobs
    from jaxrlhf.models import logits
    from jaxrlhf.tokenizer import load_tokenizer

    tok = load_tokenizer(actor_dir)
    enc = [tok(make_prompt(w))["input_ids"] for w in words]
    width = max(map(len, enc))
    ids, mask = np.full((len(enc), width), tok.pad_token_id, np.int32), np.zeros((len(enc), width), np.int32)
    for i, e in enumerate(enc):  # left padding, as generation wants
        ids[i, width - len(e) :], mask[i, width - len(e) :] = e, 1
    rows = {"sampled": (np.tile(ids, (samples, 1)), np.tile(mask, (samples, 1)), 1.0), "greedy": (ids, mask, 0.0)}
    models = {"step1": load_hf(step1_dir), "actor": load_hf(actor_dir)}
    out, examples, sampled = {}, {}, None
    for name, (config, params) in models.items():
        for mode, (ids_m, mask_m, temperature) in rows.items():
            gen = generate(config, params, ids_m, mask_m, jax.random.key(seed), max_new_tokens=max_new_tokens,
                           temperature=temperature, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
            texts = [tok.decode([t for t, k in zip(row, m) if k and t != tok.eos_token_id])
                     for row, m in zip(np.asarray(gen.tokens), np.asarray(gen.mask))]
            prompt_words = list(words) * (len(texts) // len(words))
            out[f"{name}_gold_reward_{mode}"] = float(np.mean([uses(a, w) for w, a in zip(prompt_words, texts)]))
            examples[f"{name}_{mode}"] = dict(zip(words, texts))
            if (name, mode) == ("actor", "sampled"):
                sampled = gen
    ids, mask = rows["sampled"][:2]
    seq, seq_mask = jnp.concatenate([ids, sampled.tokens], 1), jnp.concatenate([mask, sampled.mask], 1)
    logp = {name: token_logprobs(logits(c, p, seq, seq_mask), seq)[:, -max_new_tokens:] for name, (c, p) in models.items()}
    out["kl_actor_to_step1"] = float(jnp.sum((logp["actor"] - logp["step1"]) * sampled.mask) / len(ids))
    out["answers"] = {"sampled": len(ids), "greedy": len(words)}
    out["examples"] = examples
    return out


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(prog="python -m jaxrlhf.data.stories",
                                 description="Write the story task (pairs.jsonl, demos.jsonl) from a pretrained model's own samples.")
    ap.add_argument("model", help="an HF Llama folder, e.g. from python -m jaxrlhf.convert llama2c ...")
    ap.add_argument("out", help="the folder to write (then data.data_path=[OUT/pairs.jsonl], data.sft_only_data_path=[OUT/demos.jsonl])")
    ap.add_argument("--n", type=int, default=3000, help="preference records")
    ap.add_argument("--demos", type=int, default=1000, help="Step 1 demonstrations")
    ap.add_argument("--pool", type=int, default=2048, help="stories sampled from the model")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="tokens per sampled story")
    ap.add_argument("--label-noise", type=float, default=0.0, help="share of pairs with chosen and rejected swapped")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = build(args.model, args.out, n=args.n, demos=args.demos, pool=args.pool, max_new_tokens=args.max_new_tokens,
                seed=args.seed, label_noise=args.label_noise)
    print(f"wrote {args.n} preference records and {args.demos} demonstrations to {out}")


if __name__ == "__main__":
    main()
