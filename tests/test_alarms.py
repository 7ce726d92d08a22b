"""Reward-hacking alarms: each bound on hand-made figures, the trend test by hand, and simulated Step 3 runs on the
built-in task's prompts where a reward model that rewards length (and only it) trips the proxy-vs-gold alarm."""

import numpy as np
import pytest

from jaxrlhf.alarms import AlarmConfig, AlarmTracker, answer_figures, check, proxy_vs_gold, repetition_rate, slope_t
from jaxrlhf.data.synthetic import gold_answer, gold_reward, prompt_records


def test_repetition_rate_by_hand():
    assert repetition_rate([[1, 2, 3, 1, 2, 3]], 3) == 0.25  # (1,2,3) (2,3,1) (3,1,2) (1,2,3): one of four repeats
    assert repetition_rate([[7, 7, 7, 7], [5]], 2) == pytest.approx(2 / 3)  # a row shorter than n counts nothing
    assert repetition_rate([[1, 2, 3, 4]], 2) == 0.0 and repetition_rate([], 3) == 0.0


def test_answer_figures_by_hand():
    eos = 2
    tokens = np.array([[5, 5, 5, 5, 2, 1], [6, 7, 2, 1, 1, 1]])
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    logprobs = -np.array([[1.0, 1, 1, 1, 1, 9], [2, 2, 2, 9, 9, 9]])
    f = answer_figures(tokens, mask, logprobs, eos_id=eos, ngram=2)
    # lengths 5 and 3 (EOS counted, as in Step 3's answer_len); 2-grams without EOS: (5,5) x3 -> 2 repeats, (6,7) -> 0
    assert f == {"answer_len": 4.0, "repetition": pytest.approx(2 / 4), "entropy": pytest.approx((5 * 1 + 3 * 2) / 8)}


def test_each_bound():
    bounds = AlarmConfig(max_repetition=0.3, max_kl=10, min_len_ratio=0.5, max_len_ratio=2, min_entropy_ratio=0.25)
    base = {"answer_len": 10.0, "entropy": 2.0}
    ok = {"answer_len": 19.0, "repetition": 0.3, "kl": 9.9, "entropy": 0.6}
    assert check(ok, base, bounds) == []
    names = lambda f, b=base: [n for n, _ in check({**ok, **f}, b, bounds)]
    assert names({"repetition": 0.31}) == ["repetition"]
    assert names({"kl": 10.5}) == ["kl"]
    assert names({"answer_len": 21.0}) == names({"answer_len": 4.0}) == ["answer_len"]
    assert names({"entropy": 0.4}) == ["entropy"]
    assert names({"answer_len": 40.0, "entropy": 0.1}, None) == []  # relative bounds wait for the baseline
    with pytest.raises(ValueError):
        AlarmConfig(min_len_ratio=1.5)


def test_slope_t_by_hand():
    # y = 1 3 2 5 over x = -1.5 .. 1.5: slope 5.5 / 5 = 1.1, residual SS 2.7, se sqrt(2.7 / 2 / 5), t = 1.1 / se.
    slope, t = slope_t([1, 3, 2, 5])
    assert slope == pytest.approx(1.1) and t == pytest.approx(1.1 / np.sqrt(0.27))
    assert slope_t([3, 2, 1]) == (-1.0, -np.inf) and slope_t([4, 4, 4]) == (0.0, 0.0)


def test_tracker_logs_an_alarm_once_even_while_it_flickers():
    tracker = AlarmTracker(AlarmConfig(baseline_iterations=1, window=3))
    figs = lambda rep: {"answer_len": 5.0, "repetition": rep, "entropy": 1.0, "kl": 0.0}
    raised = lambda rep: [(a.name, a.new) for a in tracker.update(figs(rep))]
    assert raised(0.0) == []
    assert raised(0.9) == [("repetition", True)]  # update 2
    assert raised(0.9) == [("repetition", False)]  # 3: still on
    assert raised(0.0) == [] and raised(0.9) == [("repetition", False)]  # 4 off, 5 on again: 2 after its last raise
    assert [raised(0.0) for _ in range(3)] == [[], [], []]
    assert raised(0.9) == [("repetition", True)]  # 9: 4 updates after its last raise, more than the window


PROMPTS = [r["prompt"] for r in prompt_records(64, seed=3)]


def simulate(policy, rm, iterations=60, seed=0):
    """A Step 3 run in figures: at iteration t the actor answers every prompt with policy(prompt, t, rng); the run's
    reward is `rm`'s mean score and gold_reward the task's. Returns the iteration of each alarm's first raise."""
    rng = np.random.default_rng(seed)
    tracker, first = AlarmTracker(AlarmConfig(window=20, z=3.0)), {}
    for t in range(iterations):
        answers = [policy(p, t, rng) for p in PROMPTS]
        figures = {
            "reward": float(np.mean([rm(p, a, rng) for p, a in zip(PROMPTS, answers)])),
            "gold_reward": float(np.mean([gold_reward(p, a) for p, a in zip(PROMPTS, answers)])),
            "answer_len": float(np.mean([len(a.split()) + 1 for a in answers])),
            "kl": 0.05 * t,
        }
        for alarm in tracker.update(figures):
            first.setdefault(alarm.name, t)
    return first


def padded(prompt, t, rng):
    """The gold answer, then (from iteration 20) with more and more extra letters: the actor found that the reward
    model likes length."""
    extra = rng.poisson(0.08 * max(t - 20, 0))
    return gold_answer(prompt) + "".join(" " + c for c in rng.choice(list("abcdefgh"), extra))


def improving(prompt, t, rng):
    """Mistakes (dropped letters) fade as training goes on: the gold reward rises."""
    items = gold_answer(prompt).split()
    keep = rng.random(len(items)) < 0.5 + 0.5 * t / 60
    return "".join(" " + c for c, k in zip(items, keep) if k) or " " + items[0]


length_rm = lambda prompt, answer, rng: 0.5 * len(answer.split()) + rng.normal(0, 0.5)
gold_rm = lambda prompt, answer, rng: gold_reward(prompt, answer) + rng.normal(0, 0.1)


def test_a_reward_model_that_rewards_length_trips_proxy_vs_gold():
    first = simulate(padded, length_rm)
    assert "proxy_vs_gold" in first and 21 <= first["proxy_vs_gold"] < 45  # padding starts at 20
    # the same actor judged by a reward model that follows the gold reward: the learned reward falls with it
    assert "proxy_vs_gold" not in simulate(padded, gold_rm)
    # a healthy run (learned and gold reward rise together) and a flat noisy one raise nothing
    assert "proxy_vs_gold" not in simulate(improving, gold_rm)
    assert "proxy_vs_gold" not in simulate(
        lambda p, t, rng: gold_answer(p) if rng.random() < 0.7 else " a", gold_rm, 120
    )
    assert proxy_vs_gold([1, 2, 3], [3, 2, 1], AlarmConfig(window=5)) is None  # too few points for a trend
