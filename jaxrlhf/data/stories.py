"""A story task for a real pretrained model (llama2.c's stories260K): tell a story that uses a requested word.

    prompt        "\\n\\nHuman: Tell me a story about a dog.\\n\\nAssistant:"
    answer        " Once upon a time, there was a little dog named Max. ..."        gold reward 1.0
                  " Once upon a time, there was a little girl named Lily. ..."       gold reward 0.0

The gold reward of an answer is 1.0 when the requested word (or its plural) appears in it as a word, else
0.0. The data come from the pretrained model itself, so nothing here is hand-written text: `jaxrlhf.stories` samples
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
WORDS = (
    "ball",
    "dog",
    "cat",
    "tree",
    "bird",
    "toy",
    "cake",
    "car",
    "flower",
    "fish",
    "box",
    "boat",
    "bear",
    "sun",
    "apple",
    "bunny",
    "kite",
    "frog",
)
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


def records(
    stories: list[str], n: int, seed: int = 0, label_noise: float = 0.0, min_hits: int = 20, off_topic: float = 0.5
) -> list[dict]:
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
    answer = lambda r: r["chosen"] if rng.random() < on_request else stories[rng.integers(len(stories))]
    return [{"prompt": r["prompt"], "chosen": answer(r)} for r in rows]


def write(
    stories: list[str],
    out_dir: str | Path,
    *,
    n: int = 1500,
    demos: int = 500,
    seed: int = 0,
    on_request: float = 0.5,
    **kwargs,
) -> Path:
    """From a pool of the model's own stories, `n` preference records to OUT_DIR/pairs.jsonl and `demos` Step 1
    demonstrations to OUT_DIR/demos.jsonl (JSON lines). jaxrlhf.stories samples the pool."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = records(stories, n + demos, seed, **kwargs)
    for name, part in (("pairs", rows[:n]), ("demos", demonstrations(stories, rows[n:], seed, on_request))):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return out_dir
