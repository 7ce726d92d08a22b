"""Reward functions (jaxrlhf.rewards): the setting, the checks that name the function and the row, the host runner
that overlaps the device, and the built-in rules against the numbers the rest of the package uses."""

import importlib
import json
import sys
import time

import numpy as np
import pytest

from jaxrlhf import rewards
from jaxrlhf.config import ConfigError
from jaxrlhf.data import stories as story_task
from jaxrlhf.data import synthetic as synthetic_task
from jaxrlhf.rewards import HostRewards, RewardConfig, RewardError, checked_scores

# ----------------------------------------------------------------------------------------------- the setting


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """An importable module `my_rewards` of user functions."""
    (tmp_path / "my_rewards.py").write_text(
        "import threading\n"
        "released = threading.Event()\n"
        "def length(prompts, answers, metadata):\n    return [float(len(a)) for a in answers]\n"
        "def blocked(prompts, answers, metadata):\n    assert released.wait(10)\n    return [1.0] * len(answers)\n"
        "def picky(prompts, answers, metadata):\n    return [1.0 / (a != 'boom') for a in answers]\n"
        "def short(prompts, answers, metadata):\n    return [0.0] * (len(answers) - 1)\n"
        "def nan_at_2(prompts, answers, metadata):\n    return [float('nan') if a == 'boom' else 0 for a in answers]\n"
        "def words(prompts, answers, metadata):\n    return ['x'] * len(answers)\n"
        "not_callable = 3\n"
        "def maybe(prompts, answers, metadata):\n    return [None if a == 'boom' else 1.0 for a in answers]\n"
        "def shout(prompts, answers, metadata):\n    return [1 / len(a.strip()) for a in answers]\n"
        "def ids(prompts, answers, metadata, token_ids):\n    return [float(sum(t)) for t in token_ids]\n"
        "def cut(prompts, answers, metadata, *, truncated=None):\n    return [-1.0 if t else 0.0 for t in truncated]\n"
        "def trl(prompts, completions, metadata, **kwargs):\n"
        "    return [len(t) + 10 * c for t, c in zip(kwargs['token_ids'], kwargs['truncated'])]\n"
        "both = threading.Barrier(2, timeout=10)\n"
        "def meet(prompts, answers, metadata):\n    both.wait()\n    return [1.0] * len(answers)\n"
        "meet_too = meet\n"
        "def hang(prompts, answers, metadata):\n    released.wait(10)\n    return [5.0] * len(answers)\n"
        "def missing_lib(prompts, answers, metadata):\n    return [0.0] * len(answers)\n"
        "missing_lib.requires = (('no_such_library_x', 'jaxrlhf[math]'),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # another test's `my_rewards` (the docs' own, tests/test_readme.py) may be loaded in this process
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    yield importlib.import_module("my_rewards")
    sys.modules.pop("my_rewards", None)


def test_config_defaults_to_the_reward_model_and_weights_functions(user_module):
    assert RewardConfig().model_scale == 1.0  # today's behaviour: the reward model alone
    assert RewardConfig(functions=("my_rewards:length",)).model_scale == 0.0  # a function alone loads no reward model
    assert RewardConfig(functions=("my_rewards:length",), model_weight=0.5).model_scale == 0.5
    with pytest.raises(ConfigError, match=r"^weights: expected one weight per function \(1\), got \[1\.0, 2\.0\]"):
        RewardConfig(functions=("my_rewards:length",), weights=(1.0, 2.0))
    with pytest.raises(ConfigError, match=r"^model_weight: 0 leaves no reward"):
        RewardConfig(model_weight=0.0)
    with pytest.raises(ConfigError, match=r"model_weight: expected a finite number"):
        RewardConfig(model_weight=float("nan"))


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "my_rewards.length",
            r"expected 'module:function' \(e\.g\. jaxrlhf\.rewards:gsm8k\), got 'my_rewards\.length'",
        ),
        (
            "no_such_module_x:f",
            r"cannot import 'no_such_module_x' for 'no_such_module_x:f' \(ModuleNotFoundError: .*PYTHONPATH",
        ),
        ("my_rewards:absent", r"'my_rewards:absent': module 'my_rewards' has no callable 'absent'"),
        ("my_rewards:not_callable", r"'my_rewards:not_callable': module 'my_rewards' has no callable 'not_callable'"),
    ],
)
def test_a_bad_function_name_is_a_config_error_naming_the_setting(user_module, spec, message):
    with pytest.raises(ConfigError, match=r"^functions: " + message):
        RewardConfig(functions=(spec,))


def test_a_function_whose_library_is_missing_stops_the_run_at_configuration(user_module, monkeypatch):
    with pytest.raises(ConfigError, match=r"^functions: my_rewards:missing_lib needs the 'no_such_library_x' library"):
        RewardConfig(functions=("my_rewards:missing_lib",))
    real = rewards.importlib.util.find_spec
    monkeypatch.setattr(rewards.importlib.util, "find_spec", lambda name: None if name == "math_verify" else real(name))
    with pytest.raises(
        ConfigError, match=r"math_verify needs the 'math_verify' library: pip install 'jaxrlhf\[math\]'"
    ):
        RewardConfig(functions=("jaxrlhf.rewards:boxed_format", "jaxrlhf.rewards:math_verify"))
    with pytest.raises(ConfigError, match=r"^timeout: expected > 0, got 0\.0"):
        RewardConfig(functions=("my_rewards:length",), timeout=0.0)


def test_the_setting_reads_from_the_command_line(user_module):
    from jaxrlhf.config import parse_cli
    from jaxrlhf.rl import PPOConfig

    argv = [
        "reward.functions=[my_rewards:length,jaxrlhf.rewards:gsm8k]",
        "reward.weights=[0.5,2]",
        "reward.model_weight=1",
    ]
    cfg, _ = parse_cli(PPOConfig, "", argv, processes=False)
    assert cfg.reward == RewardConfig(("my_rewards:length", "jaxrlhf.rewards:gsm8k"), (0.5, 2.0), 1.0)
    with pytest.raises(ConfigError, match=r"command line: reward: functions: cannot import 'nope_x'"):
        parse_cli(PPOConfig, "", ["reward.functions=[nope_x:f]"], processes=False)


# ---------------------------------------------------------------------------------------- checks and runner

PROMPTS, ANSWERS, META = ["p0", "p1", "p2", "p3"], ["a", "bb", "boom", "dddd"], [{}] * 4


def test_checked_scores_name_the_function_and_the_row(user_module):
    mod = user_module
    assert checked_scores("my_rewards:length", mod.length, PROMPTS, ANSWERS, META).tolist() == [1.0, 2.0, 4.0, 4.0]
    with pytest.raises(
        RewardError,
        match=r"^reward function my_rewards:picky raised ZeroDivisionError on row 2 "
        r"\(prompt 'p2', answer 'boom'\): float division by zero",
    ):
        checked_scores("my_rewards:picky", mod.picky, PROMPTS, ANSWERS, META)
    with pytest.raises(RewardError, match=r"my_rewards:short: expected 4 scores \(one per answer\), got shape \(3,\)"):
        checked_scores("my_rewards:short", mod.short, PROMPTS, ANSWERS, META)
    with pytest.raises(RewardError, match=r"my_rewards:nan_at_2: score nan on row 2 \(prompt 'p2', answer 'boom'\)"):
        checked_scores("my_rewards:nan_at_2", mod.nan_at_2, PROMPTS, ANSWERS, META)
    with pytest.raises(RewardError, match=r"my_rewards:words: expected numbers, got \['x', 'x', 'x', 'x'\]"):
        checked_scores("my_rewards:words", mod.words, PROMPTS, ANSWERS, META)


def test_an_empty_answer_shows_as_empty_in_the_error(user_module):
    """one_line("") is its type's name, so an empty answer read 'str' in the message."""
    with pytest.raises(RewardError, match=r"on row 1 \(prompt 'p1', answer '' \(empty\)\): division by zero"):
        checked_scores("my_rewards:shout", user_module.shout, PROMPTS, ["a", "", "b", "c"], META)
    with pytest.raises(RewardError, match=r"on row 0 \(prompt 'p0', answer ' \\n' \(empty\)\)"):
        checked_scores("my_rewards:shout", user_module.shout, PROMPTS, [" \n", "a", "b", "c"], META)


def test_none_leaves_an_answer_out_and_extras_go_to_the_functions_that_take_them(user_module):
    mod = user_module
    np.testing.assert_array_equal(
        checked_scores("my_rewards:maybe", mod.maybe, PROMPTS, ANSWERS, META), [1.0, 1.0, np.nan, 1.0]
    )
    assert rewards.extras_of(mod.length) == () and rewards.extras_of(mod.ids) == ("token_ids",)
    assert rewards.extras_of(mod.cut) == ("truncated",) and rewards.extras_of(mod.trl) == rewards.EXTRAS
    functions = ("my_rewards:maybe", "my_rewards:ids", "my_rewards:cut", "my_rewards:trl", "my_rewards:length")
    runner = HostRewards(RewardConfig(functions=functions, weights=(1.0, 1.0, 1.0, 0.5, 0.25)))
    token_ids, truncated = [[5, 2], [7], [1, 1, 2], [3, 4]], [False, True, False, True]
    out = runner.start(PROMPTS, ANSWERS, META, token_ids=token_ids, truncated=truncated).result(timeout=10)
    # maybe + sum(ids) - truncated + 0.5 (len(ids) + 10 truncated) + 0.25 len(answer); row 2 left out: 0, scored 0
    assert out.scores.dtype == np.float32 and out.scores.tolist() == [9.25, 13.0, 0.0, 14.0]
    assert out.scored.dtype == np.float32 and out.scored.tolist() == [1.0, 1.0, 0.0, 1.0]
    # each function's own scores, unweighted, by column (maybe's None: NaN); what the metrics show per function
    np.testing.assert_array_equal(out.parts[:, 0], [1.0, 1.0, np.nan, 1.0])
    np.testing.assert_array_equal(out.parts[:, 3], [2 + 0, 1 + 10, 3 + 0, 2 + 10])
    np.testing.assert_array_equal(out.parts[:, 4], [len(a) for a in ANSWERS])
    assert rewards.figure_names(functions) == [f"reward/{f.split(':')[1]}" for f in functions]
    assert rewards.figure_names(("a:f", "b:f", "a:g")) == ["reward/a:f", "reward/b:f", "reward/g"]  # shared names
    with pytest.raises(RewardError, match=r"my_rewards:ids takes \['token_ids'\] but this caller does not give them"):
        runner(PROMPTS, ANSWERS, META)


def test_functions_run_in_parallel_and_one_past_its_timeout_leaves_the_batch_out(user_module):
    mod = user_module
    # meet and meet_too each wait for the other at a barrier of two: one after the other, both would time out
    both = HostRewards(RewardConfig(functions=("my_rewards:meet", "my_rewards:meet_too"), weights=(1.0, 2.0)))
    assert both(PROMPTS, ANSWERS, META).scores.tolist() == [3.0] * 4
    lines = []
    mod.released.clear()
    runner = HostRewards(
        RewardConfig(functions=("my_rewards:length", "my_rewards:hang"), timeout=0.3), log=lines.append
    )
    clock = time.monotonic()
    out = runner.start(PROMPTS, ANSWERS, META).result(timeout=10)
    assert time.monotonic() - clock < 5  # the run goes on: the hanging call is not waited for
    mod.released.set()
    assert out.scores.tolist() == [0.0] * 4 and out.scored.tolist() == [0.0] * 4
    assert out.parts[:, 0].tolist() == [len(a) for a in ANSWERS] and np.isnan(out.parts[:, 1]).all()  # hang: none
    assert lines == [
        "warning: reward function my_rewards:hang took over 0.3 s (reward.timeout) on a batch: its 4 answers are "
        "left out of the loss"
    ]
    assert runner(PROMPTS, ANSWERS, META).scores.tolist() == [6.0, 7.0, 9.0, 9.0]  # released: in time again


def test_the_process_workers_give_the_threads_results():
    functions = ("jaxrlhf.rewards:gsm8k", "jaxrlhf.rewards:boxed_format")
    answers, meta = ["#### 4", "so 5", "\\boxed{4}", "4"], [{"reference": "#### 4"}] * 4
    threads = HostRewards(RewardConfig(functions=functions))(PROMPTS, answers, meta)
    processes = HostRewards(RewardConfig(functions=functions, workers="processes"))(PROMPTS, answers, meta)
    assert threads.scores.tolist() == processes.scores.tolist() == [2.0, 0.0, 2.0, 1.0]


def test_the_runner_overlaps_the_caller_and_weights_the_functions(user_module):
    mod = user_module
    runner = HostRewards(RewardConfig(functions=("my_rewards:blocked", "my_rewards:length"), weights=(3.0, -0.5)))
    mod.released.clear()
    pending = runner.start(PROMPTS, ANSWERS, META)  # returns while `blocked` waits: the device work goes on meanwhile
    assert not pending.done()
    mod.released.set()
    scores = pending.result(timeout=10).scores
    assert scores.dtype == np.float32 and scores.tolist() == [2.5, 2.0, 1.0, 1.0]  # 3 * 1 - 0.5 * len(answer)


def test_the_runner_raises_from_result(user_module):
    pending = HostRewards(RewardConfig(functions=("my_rewards:length", "my_rewards:picky"))).start(
        PROMPTS, ANSWERS, META
    )
    with pytest.raises(RewardError, match=r"my_rewards:picky raised ZeroDivisionError on row 2"):
        pending.result(timeout=10)


# ------------------------------------------------------------------------------------------------ built-ins


def test_gsm8k_compares_the_last_number_with_the_reference():
    ref = "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 1,234"
    cases = [
        ("The answer is 1234.", 1.0),
        ("so $1,234", 1.0),
        ("1234.00", 1.0),
        ("1,234 then 12", 0.0),
        ("no number", 0.0),
        ("#### 1234", 1.0),
        ("it is 1233", 0.0),
        ("12 and 1234,", 1.0),
    ]
    got = rewards.gsm8k([""] * len(cases), [a for a, _ in cases], [{"reference": ref}] * len(cases))
    assert got == [want for _, want in cases]
    assert rewards.gsm8k(
        [""] * 3,
        ["-5 degrees", "$0.50", "-5"],
        [{"reference": "#### -5"}, {"reference": "#### 0.5"}, {"reference": "#### 5"}],
    ) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match=r"the reference has no '#### <number>'"):
        rewards.gsm8k([""], ["1"], [{"reference": "7"}])


def test_numbers_are_read_as_whole_tokens():
    """ "1e3" was read as 3 and "1.2.3" as 0.3: a number's pieces were numbers of their own."""
    cases = {
        "1e3": 1000.0,
        "it is 2.5E-1 m": 0.25,
        "1.2.3": None,
        "version v1.2.3 ships": None,
        "12 then 1.2.3": 12.0,
        "3-4": 4.0,
        "$1,234.50": 1234.5,
        "-$5": -5.0,
        "1234.": 1234.0,
        "3 eggs, 4eggs": 4.0,
        ".5": 0.5,
    }
    assert {t: rewards.parse_number(t) for t in cases} == cases
    assert rewards.gsm8k(
        [""] * 3,
        ["1e3", "1.2.3", "0.3"],
        [{"reference": "#### 1000"}, {"reference": "#### 0.3"}] + [{"reference": "#### 0.3"}],
    ) == [1.0, 0.0, 1.0]


def test_math_verify_reads_boxed_and_gsm8k_answers_with_numeric_and_latex_equivalence():
    cases = [  # (answer, reference, right?)
        ("so \\boxed{72}.", "72", 1.0),
        ("The answer is 72.", "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 72", 1.0),
        ("#### 1234", "#### 1,234", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("It is 1/2", "\\frac12", 1.0),
        ("\\boxed{\\dfrac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("first \\boxed{3}, then \\boxed{\\{1, 2\\}}", "Solution ... \\boxed{\\{2, 1\\}}", 1.0),
        ("\\boxed{15.0}", "15", 1.0),
        ("\\boxed{71}", "72", 0.0),
        ("#### 72 then \\boxed{7}", "72", 0.0),  # the box is the final answer
        ("", "72", 0.0),
        ("\\boxed{", "72", 0.0),
    ]
    got = rewards.math_verify([""] * len(cases), [a for a, _, _ in cases], [{"reference": r} for _, r, _ in cases])
    assert got == [want for _, _, want in cases]
    with pytest.raises(ValueError, match=r'row 1: expected metadata \{"reference": "<the answer>"\}, got \{\}'):
        rewards.math_verify([""] * 2, ["1", "2"], [{"reference": "1"}, {}])


def test_math_verify_agrees_with_gsm8k_on_the_real_reference_answers(assets):
    rows = [json.loads(line) for line in (assets / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()][:40]
    meta = [{"reference": r["answer"]} for r in rows]
    answers = [r["answer"] for r in rows] + [r["answer"] for r in rows[1:] + rows[:1]]
    assert rewards.math_verify(None, answers, meta + meta) == rewards.gsm8k(None, answers, meta + meta)
    assert rewards.math_verify(None, answers[:40], meta) == [1.0] * 40


def test_boxed_format_wants_exactly_one_final_answer():
    answers = ["\\boxed{3}", "so #### 3", "3", "\\boxed{3} and \\boxed{4}", "#### 3 \\boxed{3}", "\\boxed{ }", "####"]
    assert rewards.boxed_format(None, answers, None) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_gsm8k_rewards_every_real_reference_answer_as_right(assets):
    rows = [json.loads(line) for line in (assets / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()]
    meta = [{"reference": r["answer"]} for r in rows]
    assert rewards.gsm8k(None, [r["answer"] for r in rows], meta) == [1.0] * len(rows)
    shifted = [r["answer"] for r in rows[1:] + rows[:1]]  # another problem's answer is mostly wrong
    assert np.mean(rewards.gsm8k(None, shifted, meta)) < 0.05


def test_synthetic_is_the_gold_reward_ppo_logs():
    from jaxrlhf.ppo import gold_rewards
    from jaxrlhf.train import builtin_tokenizer

    tok = builtin_tokenizer()
    prompts = [r["prompt"] for r in synthetic_task.prompt_records(6, seed=3)]
    rng = np.random.default_rng(0)
    answers = [
        synthetic_task.gold_answer(p)
        if i % 3 == 0
        else synthetic_task.make_response(synthetic_task.corrupt(synthetic_task.prompt_items(p), 1 + i % 2, rng))
        for i, p in enumerate(prompts)
    ]
    P, G = 24, 12
    seq, seq_mask = np.full((6, P + G), tok.pad_token_id, np.int32), np.zeros((6, P + G), np.int32)
    for b, (p, a) in enumerate(zip(prompts, answers)):
        pi, ai = (
            [tok.bos_token_id] + tok(p, add_special_tokens=False)["input_ids"],
            tok(a, add_special_tokens=False)["input_ids"],
        )
        ai = (ai + [tok.eos_token_id])[:G]
        seq[b, P - len(pi) : P], seq_mask[b, P - len(pi) : P] = pi, 1
        seq[b, P : P + len(ai)], seq_mask[b, P : P + len(ai)] = ai, 1
    logged = gold_rewards(tok, {"seq": seq, "seq_mask": seq_mask, "mask": seq_mask[:, P:]})
    ours = rewards.synthetic(prompts, answers, [{}] * 6)
    assert ours == logged and len(set(ours)) > 2 and ours[0] == 1.0


def test_stories_is_the_rule_the_story_evaluation_uses():
    answers = [
        " Once upon a time, a dog ran.",
        " The dogs played.",
        " A hotdog stand.",
        " The DOG barked.",
        " A cat sat.",
        " Boxes everywhere.",
        " foxes",
    ]
    for word in story_task.WORDS:
        prompt = story_task.make_prompt(word)
        got = rewards.stories([prompt] * len(answers), answers, [{}] * len(answers))
        assert got == [float(story_task.uses(a, word)) for a in answers]  # stories.evaluate's rule for word i
    assert rewards.stories([story_task.make_prompt("dog")] * 4, answers[:4], [{}] * 4) == [1.0, 1.0, 0.0, 1.0]
    assert rewards.stories([story_task.make_prompt("box")] * 2, answers[5:], [{}] * 2) == [1.0, 0.0]


def test_the_runner_runs_the_builtins_by_name():
    runner = HostRewards(
        RewardConfig(functions=("jaxrlhf.rewards:gsm8k", "jaxrlhf.rewards:stories"), weights=(2.0, 1.0))
    )
    prompt = story_task.make_prompt("cat")
    out = runner([prompt] * 2, [" a cat: 4", " a dog: 5"], [{"reference": "#### 4"}] * 2)
    assert out.scores.tolist() == [3.0, 0.0] and out.scored.tolist() == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------- in Step 3


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """The built-in task's tiny actor and critic (random), its tokenizer and a batch of its Step 3 prompts."""
    from jaxrlhf.data import Batches, DataConfig, prepare
    from jaxrlhf.train import builtin_model, builtin_tokenizer

    root = tmp_path_factory.mktemp("rewards")
    tok = builtin_tokenizer()
    data = DataConfig(
        data_path=("synthetic:300",), data_split="1,1,1", max_prompt_len=24, cache_dir=str(root / "cache")
    )
    batch = next(iter(Batches(prepare(data, 3, tok, log=lambda _: None)["train"], 3, 8, data, tok.pad_token_id)))
    return (
        builtin_model(root / "actor", seed=0),
        builtin_model(root / "critic", seed=1, value_head=True),
        tok,
        batch,
        data,
    )


def test_step3_rewards_are_the_weighted_sum_of_the_functions_and_the_model(builtin):
    """Three engines on the same answers: the reward model alone, the gold rule alone (no reward model held or run),
    and 0.5 * model + 2 * gold rule; the functions started by ppo's hook on the decoded answers and prompt metadata."""
    import jax

    from jaxrlhf.checkpoint import load_hf
    from jaxrlhf.ppo import gold_rewards, reward_starter
    from jaxrlhf.rl import EngineConfig, HybridEngine
    from jaxrlhf.rl.engine import tree_bytes
    from jaxrlhf.sharding import make_mesh

    actor, critic, tok, batch, _ = builtin
    models = load_hf(actor), load_hf(critic)
    gold = ("jaxrlhf.rewards:synthetic",)
    out = {}
    for name, reward in [
        ("model", RewardConfig()),
        ("gold", RewardConfig(functions=gold)),
        ("sum", RewardConfig(functions=gold, weights=(2.0,), model_weight=0.5)),
    ]:
        cfg = EngineConfig(precision="fp32", max_answer_len=6, temperature=1.0, seed=5, reward=reward)
        engine = HybridEngine(
            cfg,
            make_mesh(1, jax.devices()[:2]),
            *models,
            total_steps=1,
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
        )
        start = reward_starter(HostRewards(reward), tok) if reward.functions else None
        exp = jax.device_get(engine.generate_experience(batch, start))
        out[name] = exp | {"own": tree_bytes(engine.reward_own)}
    np.testing.assert_array_equal(out["gold"]["seq"], out["model"]["seq"])  # the same answers
    np.testing.assert_array_equal(out["sum"]["seq"], out["model"]["seq"])
    want = np.asarray(gold_rewards(tok, out["model"]), np.float32)  # the rule ppo logs, on the decoded answers
    assert len(set(want.tolist())) > 1 and out["model"]["scores"].std() > 0
    # scores: the reward model's alone (what clip_score clips); function_scores beside it, never clipped
    np.testing.assert_array_equal(out["gold"]["scores"], np.zeros(8))
    np.testing.assert_array_equal(out["gold"]["function_scores"], want)
    np.testing.assert_allclose(out["sum"]["scores"], 0.5 * out["model"]["scores"], rtol=1e-6)
    np.testing.assert_array_equal(out["sum"]["function_scores"], 2.0 * want)
    np.testing.assert_array_equal(out["model"]["function_scores"], np.zeros(8))
    for name in out:
        np.testing.assert_array_equal(out[name]["scored"], np.ones(8))
    assert out["gold"]["own"] == 0 < out["model"]["own"] == out["sum"]["own"]  # no reward model without its weight


def test_the_hook_hands_each_prompt_its_metadata(builtin):
    """reward_starter decodes this process's prompts and answers and passes the batch's metadata in row order."""
    from jaxrlhf.ppo import reward_starter

    _, _, tok, batch, _ = builtin
    seen = []

    class Spy:
        def start(self, prompts, answers, metadata, **extras):
            seen.append((prompts, answers, metadata, extras))

    tagged = batch | {"metadata": [{"row": i} for i in range(8)]}
    ab, eos = tok(" a b", add_special_tokens=False)["input_ids"], tok.eos_token_id
    answers = np.array([ab + [eos]] * 4 + [ab + ab[:1]] * 4, np.int32)
    mask = np.ones_like(answers)
    mask[1, -1] = 0  # " a b" cut at a limit of 2 tokens: no EOS, truncated
    reward_starter(Spy(), tok)(tagged, answers, mask)
    prompts, texts, metadata, extras = seen[0]
    assert metadata == [{"row": i} for i in range(8)] and texts == [" a b"] * 4 + [" a b a"] * 4
    assert extras["token_ids"] == [ab + [eos], ab] + [ab + [eos]] * 2 + [ab + ab[:1]] * 4
    assert extras["truncated"] == [False, True, False, False, True, True, True, True]
    assert prompts == [tok.decode(r[m == 1][1:]) for r, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    assert all(synthetic_task.prompt_items(p) for p in prompts)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_a_step3_run_with_the_gold_rule_as_its_reward(builtin, tmp_path, algorithm):
    """python -m jaxrlhf.ppo with reward.functions=[jaxrlhf.rewards:synthetic]: the reward it trains on is the gold
    reward it logs, and no reward model is planned or held; GRPO then needs no critic.model at all."""
    import jax

    from jaxrlhf import plan as memory_plan
    from jaxrlhf.ppo import run
    from jaxrlhf.rl import ModelSide, PPOConfig
    from jaxrlhf.sharding import make_mesh

    actor, critic, _, _, data = builtin
    grpo = dict(algorithm="grpo", num_samples_per_prompt=2) if algorithm == "grpo" else {}
    cfg = PPOConfig(
        actor=ModelSide(model=str(actor)),
        critic=ModelSide(model="" if grpo else str(critic)),
        output_dir=str(tmp_path / "out"),
        batch_size=8,
        max_steps=2,
        generation_batches=2,
        max_answer_len=6,
        precision="fp32",
        data=data,
        reward=RewardConfig(functions=("jaxrlhf.rewards:synthetic",)),
        report_to=(),
        **grpo,
    )
    mesh = make_mesh(1, jax.devices()[:1])
    out = run(cfg, log=lambda _: None, mesh=mesh)
    assert [r["step"] for r in out["records"]] == [1, 2]
    for r in out["records"]:
        assert r["reward"] == pytest.approx(r["gold_reward"], rel=1e-6) and r["rewards_s"] >= 0
        assert r["reward/synthetic"] == pytest.approx(r["gold_reward"], rel=1e-6)  # the function's own mean
    assert out["engine"].reward_own is None
    assert memory_plan.ppo_plan(cfg, mesh).items["reward (own leaves)"] == 0


@pytest.mark.slow
def test_step3_evaluates_the_held_out_prompts_without_changing_the_training(builtin, tmp_path):
    """eval_every=1: an "eval" record at each iteration (and so at the end) of the held-out prompts' figures, the
    function's own mean the reward it trains on (no reward model) over eval_batches x batch_size prompts; the training
    records are those of the same run without evaluation (the iteration keys, the KL coefficient and the weights
    untouched), and the held-out answers are the same on the same weights (their own sampling key)."""
    import jax

    from jaxrlhf.ppo import run
    from jaxrlhf.rl import ModelSide, PPOConfig
    from jaxrlhf.sharding import make_mesh

    actor, _, _, batch, data = builtin
    mesh = make_mesh(1, jax.devices()[:1])
    base = dict(actor=ModelSide(model=str(actor)), critic=ModelSide(), algorithm="grpo", num_samples_per_prompt=2)
    base |= dict(batch_size=8, max_steps=2, max_answer_len=6, precision="fp32", data=data, report_to=())
    base |= dict(reward=RewardConfig(functions=("jaxrlhf.rewards:synthetic",)), kl_loss="none", kl_target=6.0)
    plain = run(PPOConfig(**base, output_dir=str(tmp_path / "plain")), log=lambda _: None, mesh=mesh)
    lines = []
    cfg = PPOConfig(**base, output_dir=str(tmp_path / "eval"), eval_every=1, eval_batches=1)
    evaluated = run(cfg, log=lines.append, mesh=mesh)
    timed = ("_s", "per_s", "tflops")  # clock figures
    train = lambda out: [{k: v for k, v in r.items() if not any(t in k for t in timed)} for r in out]
    assert train([r for r in evaluated["records"] if r["split"] == "train"]) == train(plain["records"])
    evals = [r for r in evaluated["records"] if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [1, 2] and all(r["prompts"] == 8 for r in evals), evals
    assert set(evals[0]) == {
        "step",
        "split",
        "prompts",
        "reward",
        "reward/synthetic",
        "kl",
        "answer_len",
        "truncated",
    } | {"zero_spread"}
    for r in evals:
        assert r["reward"] == pytest.approx(r["reward/synthetic"], abs=1e-6) and 0 < r["answer_len"] <= 6
    assert any(line.startswith("eval @ 2: ") for line in lines)
    engine = evaluated["engine"]
    held = {k: np.asarray(v) for k, v in batch.items() if k != "metadata"} | {"metadata": batch["metadata"]}
    state = jax.device_get(engine.state["iteration"])
    compiled = []
    listener = lambda event, _, fun_name="", **__: compiled.append(fun_name) if "backend_compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        (first, _), (again, _) = engine.held_out(held), engine.held_out(held)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    big = [n for n in compiled if any(p in n for p in ("generate", "score", "advantages"))]
    assert not big, compiled  # the training batch's shapes: its programs (only eager zeros without a reward hook)
    np.testing.assert_array_equal(np.asarray(first["seq"]), np.asarray(again["seq"]))  # the same held-out key
    assert jax.device_get(engine.state["iteration"]) == state  # the state untouched


def test_clip_score_clips_the_reward_models_score_alone_as_its_help_says():
    """answer_rewards: clip(score, -clip_score, clip_score) + the functions' scores, unclipped; the setting's help
    (python -m jaxrlhf.ppo --help) says so."""
    from jaxrlhf.config import field_help
    from jaxrlhf.rl import EngineConfig
    from jaxrlhf.rl.experience import answer_rewards

    exp = {
        "mask": np.ones((3, 2), np.int32),
        "scores": np.array([3.0, -2.0, 0.5], np.float32),
        "function_scores": np.array([4.0, -3.0, 0.25], np.float32),
    }
    reward, valid = answer_rewards(EngineConfig(clip_score=1.0), exp)
    np.testing.assert_array_equal(reward, [1.0 + 4.0, -1.0 - 3.0, 0.5 + 0.25])
    np.testing.assert_array_equal(valid, np.ones(3))
    text = field_help(EngineConfig)["clip_score"]
    assert "reward model" in text and "unclipped" in text and "model and functions" not in text, text
