"""The story task for stories260K (jaxrlhf.data.stories): prompts, the gold reward, records from a pool."""

from pathlib import Path

import numpy as np
import pytest

from jaxrlhf import stories as story_task
from jaxrlhf.data import stories

PRESET = Path(__file__).resolve().parents[1] / "configs" / "stories.yaml"
# How far above the Step 1 model the final actor's gold reward must be; the seed runs in the README gained
# 0.48-0.72 (sampled) and 0.25-0.75 (greedy, 4 prompts: one more word used is +0.25). Greedy must not fall: with 4
# prompts a Step 1 model at 0.75 (one CI run of seed 1 on 2026-12-02) leaves only 1.0 above it, so the learning is
# asserted on the sampled answers. Runs differed then because the data splits were keyed on the files' paths (each
# pytest tmp_path drew another Step 2 / Step 3 split: 0.36 to 0.94 sampled); keyed on the file names they no longer do.
MARGIN_SAMPLED, MARGIN_GREEDY = 0.15, 0.0


def test_prompt_and_gold_reward():
    p = stories.make_prompt("apple")
    assert p == "\n\nHuman: Tell me a story about an apple.\n\nAssistant:"
    assert stories.prompt_word(p) == "apple"
    assert stories.gold_reward(p, " Once upon a time, Tim ate two Apples.") == 1.0
    assert stories.gold_reward(p, " Once upon a time, Tim ate a pineapple.") == 0.0  # a word, not a substring
    assert stories.gold_reward(stories.make_prompt("box"), " He opened the boxes.") == 1.0
    with pytest.raises(ValueError, match="not a story prompt"):
        stories.prompt_word("\n\nHuman: Sort these letters: a b\n\nAssistant:")


def test_records_pair_a_story_with_the_word_against_one_without():
    pool = [
        " There was a dog.",
        " A big dog ran.",
        " The cat slept.",
        " A bird sang.",
        " The sun was hot.",
        " Lily had a ball and a cat.",
    ]
    rows = stories.records(pool, 2000, seed=0, label_noise=0.1, min_hits=1)
    right = [
        stories.gold_reward(r["prompt"], r["chosen"]) == 1.0 and stories.gold_reward(r["prompt"], r["rejected"]) == 0.0
        for r in rows
    ]
    swapped = [
        stories.gold_reward(r["prompt"], r["chosen"]) == 0.0 and stories.gold_reward(r["prompt"], r["rejected"]) == 1.0
        for r in rows
    ]
    assert all(a or b for a, b in zip(right, swapped))
    assert abs(np.mean(swapped) - 0.1) < 0.03  # the annotator's noise
    assert {stories.prompt_word(r["prompt"]) for r in rows} == {"dog", "cat", "bird", "sun", "ball"}
    assert rows == stories.records(pool, 2000, seed=0, label_noise=0.1, min_hits=1)  # seeded
    assert {stories.prompt_word(r["prompt"]) for r in stories.records(pool, 50, min_hits=2)} == {"dog", "cat"}


def test_demonstrations_answer_some_prompts_on_request():
    pool = [" There was a dog.", " A big dog ran.", " The cat slept.", " A bird sang.", " The sun was hot."]
    rows = stories.records(pool, 2000, seed=3, min_hits=1)
    # A random pooled story uses the requested word 1 time in 4 (dog: 2 of 5 stories; cat, bird, sun: 1 of 5).
    for on_request, want in ((0.0, 0.25), (0.5, 0.625), (1.0, 1.0)):
        demos = stories.demonstrations(pool, rows, seed=3, on_request=on_request)
        assert [d["prompt"] for d in demos] == [r["prompt"] for r in rows] and all(d["chosen"] in pool for d in demos)
        assert abs(np.mean([stories.gold_reward(d["prompt"], d["chosen"]) for d in demos]) - want) < 0.03, on_request


@pytest.mark.slow
def test_stories_preset_raises_the_gold_reward_over_the_step1_model(assets, tmp_path, monkeypatch, capsys):
    """The whole stories preset (configs/stories.yaml, python -m jaxrlhf.stories' defaults) on stories260K: the
    final actor uses the requested word more often than the Step 1 model, sampled and greedy (seed runs: README)."""
    import jax

    from jaxrlhf import train
    from jaxrlhf.convert import llama2c_to_hf
    from jaxrlhf.sharding import make_mesh

    src = assets / "models" / "stories260K"
    model = llama2c_to_hf(src / "stories260K.bin", src / "tok512.bin", tmp_path / "stories260K")
    task = story_task.build(model, tmp_path / "task")
    monkeypatch.setattr("jaxrlhf.eval.pipeline_report", lambda *a, **k: None)  # the report has tests of its own
    cfg = train.parse(
        [
            str(PRESET),
            f"actor_model={model}",
            f"reward_model={model}",
            f"output_dir={tmp_path / 'run'}",
            f"data.data_path=[{task / 'pairs.jsonl'}]",
            f"data.sft_only_data_path=[{task / 'demos.jsonl'}]",
            f"data.cache_dir={tmp_path / 'cache'}",
            *(f"{step}.seed=1" for step in ("sft", "reward", "ppo", "data")),
        ]
    )
    # One device, as the command sees a CPU machine: 8 virtual devices on 2 cores more than double the time, and
    # the meshes' equality is test_train's and test_engine's. Seed 1 (the same at any tmp_path): 0.287 -> 0.787
    # sampled, 0.20 -> 0.80 greedy, KL 6.45 nats.
    train.run(cfg, log=lambda _: None, mesh=make_mesh(1, jax.devices()[:1]))
    words = stories.task_words(task / "pairs.jsonl")
    r = story_task.evaluate(tmp_path / "run/actor-models/model", tmp_path / "run/step3-models/actor", words)
    with capsys.disabled():
        print(
            f"\nstories: {len(words)} words; gold reward sampled / greedy: "
            f"Step 1 {r['step1_gold_reward_sampled']:.3f} / "
            f"{r['step1_gold_reward_greedy']:.3f}, actor {r['actor_gold_reward_sampled']:.3f} / "
            f"{r['actor_gold_reward_greedy']:.3f}; KL {r['kl_actor_to_step1']:.2f} nats per answer"
        )
    for mode, margin in (("sampled", MARGIN_SAMPLED), ("greedy", MARGIN_GREEDY)):  # all of them, if fewer are left
        assert r[f"actor_gold_reward_{mode}"] >= min(1.0, r[f"step1_gold_reward_{mode}"] + margin), mode
    assert 0.0 < r["kl_actor_to_step1"] < 20.0
