"""A story task for a real pretrained model (llama2.c's stories260K): tell a story that uses a requested word.

    prompt        "\\n\\nHuman: Tell me a story about a dog.\\n\\nAssistant:"
    answer        " Once upon a time, there was a little dog named Max. ..."        gold reward 1.0
                  " Once upon a time, there was a little girl named Lily. ..."       gold reward 0.0

The gold reward of an answer is 1.0 when the requested word (or its plural) appears in it as a word, else
0.0. The data come from the pretrained model itself, so nothing here is hand-written text: `build` samples
a pool of stories from the model ("Once upon a time," continued at temperature 1), then writes

    a record                a prompt for a word; chosen: a pooled story with the word, rejected: one
                            without, swapped for `label_noise` of the records (an imperfect annotator)
    Step 1 demonstrations   prompt + chosen of its share of the records (so also imperfect)
    Step 2 preferences      the pairs of its share
    Step 3 prompts          the prompts of its share

as one JSON-lines file of {prompt, chosen, rejected} records for `data.data_path`. The pretrained model
knows the stories' world but not the Human/Assistant format: Step 1 teaches it, Steps 2 and 3 should make
it use the requested word more often than the Step 1 model does.
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


def records(stories: list[str], n: int, seed: int = 0, label_noise: float = 0.1) -> list[dict]:
    """`n` {prompt, chosen, rejected} records from a pool of stories (see the module docstring)."""
    rng = np.random.default_rng(seed)
    with_word = {w: [s for s in stories if uses(s, w)] for w in WORDS}
    words = [w for w in WORDS if with_word[w] and len(with_word[w]) < len(stories)]
    if not words:
        raise ValueError("records: no story in the pool uses any of the task's words; sample a larger pool")
    out = []
    for _ in range(n):
        w = words[rng.integers(len(words))]
        hits, misses = with_word[w], [s for s in stories if not uses(s, w)]
        chosen, rejected = hits[rng.integers(len(hits))], misses[rng.integers(len(misses))]
        if rng.random() < label_noise:
            chosen, rejected = rejected, chosen
        out.append({"prompt": make_prompt(w), "chosen": chosen, "rejected": rejected})
    return out


def build(model_dir: str | Path, out_file: str | Path, *, n: int = 3000, pool: int = 2048,
          max_new_tokens: int = 40, seed: int = 0, **kwargs) -> Path:
    """Sample a pool from the model and write `n` task records as JSON lines to `out_file`."""
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    rows = records(sample_pool(model_dir, pool, max_new_tokens, seed), n, seed, **kwargs)
    out_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out_file
