"""The story task for stories260K (jaxrlhf.data.stories): prompts, the gold reward, records from a pool."""

import numpy as np
import pytest

from jaxrlhf.data import stories


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
    pool = [" There was a dog.", " A big dog ran.", " The cat slept.", " A bird sang.", " The sun was hot.",
            " Lily had a ball and a cat."]
    rows = stories.records(pool, 2000, seed=0, label_noise=0.1, min_hits=1)
    right = [stories.gold_reward(r["prompt"], r["chosen"]) == 1.0 and stories.gold_reward(r["prompt"], r["rejected"]) == 0.0
             for r in rows]
    swapped = [stories.gold_reward(r["prompt"], r["chosen"]) == 0.0 and stories.gold_reward(r["prompt"], r["rejected"]) == 1.0
               for r in rows]
    assert all(a or b for a, b in zip(right, swapped))
    assert abs(np.mean(swapped) - 0.1) < 0.03  # the annotator's noise
    assert {stories.prompt_word(r["prompt"]) for r in rows} == {"dog", "cat", "bird", "sun", "ball"}
    assert rows == stories.records(pool, 2000, seed=0, label_noise=0.1, min_hits=1)  # seeded
    assert {stories.prompt_word(r["prompt"]) for r in stories.records(pool, 50, min_hits=2)} == {"dog", "cat"}

