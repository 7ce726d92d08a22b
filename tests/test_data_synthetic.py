"""The synthetic sorting task: gold answers and rewards, noisy demonstrations and labels, determinism."""

import pytest

from jaxrlhf.data.synthetic import (
    SyntheticTask,
    gold_answer,
    gold_reward,
    make_prompt,
    preference_splits,
    prompt_items,
    prompt_records,
)


def sft_records(n, seed, **task):
    return SyntheticTask(seed=seed, **task).records("sft", n)


def preference_records(n, seed, **task):
    return SyntheticTask(seed=seed, **task).records("preference", n)


PROMPT = "\n\nHuman: Sort these letters: d a f b\n\nAssistant:"


def test_gold_answer_parses_the_prompt_and_scores_one():
    assert make_prompt(["d", "a", "f", "b"]) == PROMPT
    assert prompt_items(PROMPT) == ["d", "a", "f", "b"]
    assert gold_answer(PROMPT) == " a b d f"
    for record in prompt_records(300, seed=3):
        assert record["chosen"] == gold_answer(record["prompt"])
        assert record["rejected"] is None
        assert gold_reward(record["prompt"], gold_answer(record["prompt"])) == 1.0


@pytest.mark.parametrize(
    "response, reward",
    [
        (" a d b f", 3 / 4),  # adjacent swap: LCS 3 (a b f), 4 items
        (" a b f", 3 / 4),  # dropped d: LCS 3, gold has 4
        (" a b b d f", 4 / 5),  # duplicated b: LCS 4, response has 5
        (" d a f b", 2 / 4),  # the input copied unsorted: LCS 2 (a b or a f or d f)
        (" a b d f g h", 4 / 6),  # two extra items
        ("a  b d   f", 1.0),  # whitespace between items does not matter
        (" a b d f\n\nHuman: thanks", 1.0),  # only the first line counts
        (" a b\nd f", 2 / 4),
    ],
)
def test_partial_credit_by_hand(response, reward):
    assert gold_reward(PROMPT, response) == pytest.approx(reward)


@pytest.mark.parametrize("response", ["", " ", "\n a b d f", " hello world", " a,b,d,f", " A B D F", "</s>"])
def test_empty_or_garbage_scores_zero(response):
    assert gold_reward(PROMPT, response) == 0.0


@pytest.mark.parametrize(
    "prompt",
    [
        "\n\nHuman: What is 2 + 2?\n\nAssistant:",
        "\n\nHuman: Sort these letters:\n\nAssistant:",  # no letters
        "\n\nHuman: Sort these letters: ab c\n\nAssistant:",  # an item of two characters
        "Human: Sort these letters: a b\n\nAssistant:",  # not the HH format
        PROMPT + " a b d f",  # a prompt with its response attached
    ],
)
def test_other_prompts_are_refused(prompt):
    with pytest.raises(ValueError, match="not a synthetic sorting prompt") as e:
        gold_reward(prompt, " a b")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not a synthetic sorting prompt"):
        gold_answer(prompt)


def test_prompts_follow_the_config():
    task = SyntheticTask(min_items=2, max_items=4, alphabet="0123456789")
    lengths = set()
    for record in task.records("prompt", 500):
        items = prompt_items(record["prompt"])
        lengths.add(len(items))
        assert set(items) <= set("0123456789") and len(set(items)) == len(items)
    assert lengths == {2, 3, 4}


def test_sft_demonstrations_err_at_the_error_rate():
    for error_rate in (0.0, 0.3, 1.0):
        records = sft_records(2000, seed=1, error_rate=error_rate)
        rewards = [gold_reward(r["prompt"], r["chosen"]) for r in records]
        wrong = sum(r < 1.0 for r in rewards) / len(rewards)
        assert wrong == pytest.approx(error_rate, abs=0.04)
        assert all(r["rejected"] is None for r in records)
        # One mistake costs about one letter: never garbage.
        assert min(rewards) >= 0.5


def test_preferences_differ_by_a_mistake_and_flip_at_the_flip_rate():
    for flip_rate in (0.0, 0.1, 1.0):
        records = preference_records(2000, seed=2, flip_rate=flip_rate)
        chosen = [gold_reward(r["prompt"], r["chosen"]) for r in records]
        rejected = [gold_reward(r["prompt"], r["rejected"]) for r in records]
        # Never a near-tie: the two differ by at least the cheapest mistake (a duplicate, 1 / (n + 1)).
        cheapest = [1 / (len(prompt_items(r["prompt"])) + 1) for r in records]
        assert all(abs(c - r) >= m - 1e-9 for c, r, m in zip(chosen, rejected, cheapest))
        flipped = sum(c < r for c, r in zip(chosen, rejected)) / len(records)
        assert flipped == pytest.approx(flip_rate, abs=0.03)
    # The pairs are informative: both better and worse answers than the gold one appear.
    assert 0.3 < sum(c == 1.0 for c in chosen + rejected) / len(records) < 0.9


def test_held_out_pairs_are_labelled_by_the_gold_reward():
    splits = preference_splits(2000, seed=5, eval_fraction=0.1)
    assert len(splits["train"]) == 1800 and len(splits["eval"]) == 200
    records = preference_records(2000, seed=5)
    assert splits["train"] == records[:1800]  # the same pairs, the same noisy labels
    assert {(r["prompt"], frozenset((r["chosen"], r["rejected"]))) for r in splits["eval"]} == {
        (r["prompt"], frozenset((r["chosen"], r["rejected"]))) for r in records[1800:]
    }
    assert all(gold_reward(r["prompt"], r["chosen"]) > gold_reward(r["prompt"], r["rejected"]) for r in splits["eval"])
    flipped = sum(
        gold_reward(r["prompt"], r["chosen"]) < gold_reward(r["prompt"], r["rejected"]) for r in records[1800:]
    )
    assert flipped > 5  # relabelling had something to fix


def test_seed_is_the_only_randomness():
    for make in (sft_records, preference_records, prompt_records, preference_splits):
        assert make(50, seed=7) == make(50, seed=7)
        assert make(50, seed=7) != make(50, seed=8)
    assert SyntheticTask(seed=7).records("sft", 20) == sft_records(50, seed=7)[:20]  # n does not change the first ones
    assert sft_records(0, seed=7) == []


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"min_items": 5, "max_items": 3}, "min_items <= max_items"),
        ({"min_items": 1}, "2 <= min_items"),
        ({"alphabet": "abca"}, "distinct non-space"),
        ({"alphabet": "ab c"}, "distinct non-space"),
        ({"alphabet": "abcd", "max_items": 6}, "exceeds the 4 letters"),
        ({"error_rate": 1.5}, "error_rate: expected a probability"),
        ({"flip_rate": -0.1}, "flip_rate: expected a probability"),
        ({"seed": -1}, "seed: expected a non-negative int"),
    ],
)
def test_config_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        SyntheticTask(**fields)


def test_records_arguments_are_checked():
    with pytest.raises(ValueError, match="kind must be one of"):
        SyntheticTask().records("rl", 3)
    with pytest.raises(ValueError, match="n must be a non-negative int"):
        SyntheticTask().records("sft", -1)


def test_opt_tokenizer_sees_one_token_per_letter(assets):
    from jaxrlhf.tokenizer import opt_tokenizer

    tok = opt_tokenizer(assets / "opt-tokenizer")
    for record in preference_records(20, seed=4):
        prompt_ids = tok(record["prompt"], add_special_tokens=False)["input_ids"]
        assert len(prompt_ids) <= 20
        for response in (record["chosen"], record["rejected"]):
            ids = tok(response, add_special_tokens=False)["input_ids"]
            assert len(ids) == len(response.split())  # " a" is one token
            # Tokenizing prompt + response splits exactly at the boundary, so response masks line up.
            assert tok(record["prompt"] + response, add_special_tokens=False)["input_ids"] == prompt_ids + ids
            assert tok.decode(ids) == response


@pytest.mark.parametrize("task", ["synthetic", "arithmetic"])
def test_a_builtin_tasks_cache_key_follows_the_rows_it_generates(task, monkeypatch):
    """The data cache's key for "synthetic:N" / "arithmetic:N" changes when what generates the rows changes (a
    task default such as the demonstrations' error rate), not only with the name: else a stale cache is served."""
    import functools

    from jaxrlhf.data import sources

    spec = f"{task}:300"
    key = sources.fingerprint(spec)
    assert sources.fingerprint(spec) == key != sources.fingerprint(f"{task}:301")
    generate = sources.BUILTIN_TASKS[task]
    monkeypatch.setitem(sources.BUILTIN_TASKS, task, functools.partial(generate, flip_rate=0.3))  # a new default
    assert sources.fingerprint(spec) != key
