"""The built-in verifiable task (jaxrlhf.data.arithmetic): questions, references and the verifier, noisy
demonstrations and labels, the data source, the tokenizer, train's wiring, and (slow) GRPO learning it."""

import json

import numpy as np
import pytest

from jaxrlhf import rewards
from jaxrlhf.config import ConfigError
from jaxrlhf.data import DataError, arithmetic, read_source
from jaxrlhf.data.arithmetic import ArithmeticTask, gold_answer, make_prompt, make_response, preference_splits


def test_the_reference_is_the_value_the_question_asks_for_and_the_verifier_agrees():
    assert make_prompt(7, "-", 9) == "\n\nHuman: What is 7 - 9?\n\nAssistant:"
    assert [gold_answer(make_prompt(7, op, 9)) for op in "+-*"] == [16, -2, 63]
    records = ArithmeticTask(max_operand=12, ops="+-*", seed=3).pairs(60)
    assert {r["prompt"].split()[4] for r in records} == {"+", "-", "*"}
    for r in records:
        value = gold_answer(r["prompt"])
        assert r["metadata"] == {"reference": str(value)}
        # the verifier on the rows' own metadata: the right value, boxed, is right; one off is wrong
        answers = [make_response(value), make_response(value + 1), f" so #### {value}", f" {value}.0"]
        assert rewards.math_verify(None, answers, [r["metadata"]] * 4) == [1.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"not an arithmetic prompt: expected .*What is <a> <op> <b>"):
        gold_answer("\n\nHuman: Sort these letters: b a\n\nAssistant:")


def test_demonstrations_slip_and_labels_are_noisy_at_the_set_rates_and_the_eval_split_is_ruled():
    task = ArithmeticTask(error_rate=0.3, flip_rate=0.1, seed=1)
    pairs = task.pairs(4000)
    right = lambda r, f: float(int(r[f][len(" \\boxed{") : -1]) == int(r["metadata"]["reference"]))
    chosen_right = np.mean([right(r, "chosen") for r in pairs])
    assert chosen_right == pytest.approx(0.7 * 0.9, abs=0.03)  # slips, then flips to the always-wrong rejected
    assert not any(right(r, "rejected") and right(r, "chosen") for r in pairs)
    assert pairs == ArithmeticTask(error_rate=0.3, flip_rate=0.1, seed=1).pairs(4000)  # the seed alone decides
    splits = preference_splits(1000, seed=2, eval_fraction=0.1)
    assert len(splits["train"]) == 900 and len(splits["eval"]) == 100
    assert all(arithmetic._distance(r, "chosen") < arithmetic._distance(r, "rejected") for r in splits["eval"])
    with pytest.raises(ValueError, match=r"ArithmeticTask\.ops: expected distinct operators among '\+-\*', got '/'"):
        ArithmeticTask(ops="/")


def test_the_source_reads_arithmetic_n_with_each_rows_reference():
    out = read_source("arithmetic:200", seed=4, eval_fraction=0.1)
    train, evaluation = out["train"][0], out["eval"][0]
    assert len(train) == 180 and len(evaluation) == 20
    assert all(r.metadata == {"reference": str(gold_answer(r.prompt))} for r in train + evaluation)
    with pytest.raises(DataError, match=r"^arithmetic:ten: expected 'arithmetic' or 'arithmetic:N'"):
        read_source("arithmetic:ten")


def test_the_builtin_tokenizer_covers_the_task_and_the_evaluation_scores_by_the_verifier():
    from jaxrlhf.eval import gold_rewards
    from jaxrlhf.train import builtin_tokenizer

    tok = builtin_tokenizer("arithmetic")
    for text in ArithmeticTask().texts():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and tok.decode(ids) == text
    prompts = [make_prompt(3, "+", 4), make_prompt(3, "-", 4), make_prompt(9, "+", 9)]
    answers = [" \\boxed{7}", " \\boxed{1}", " #### 18"]
    assert gold_rewards(prompts, [None] * 3, answers) == [1.0, 0.0, 1.0]


def test_train_makes_the_verifier_the_reward_of_an_arithmetic_run():
    from jaxrlhf.train import parse

    cfg = parse(["algorithm=grpo", "data.data_path=[arithmetic:6000]"])
    assert cfg.ppo.reward.functions == ("jaxrlhf.rewards:math_verify",) and cfg.ppo.reward.model_scale == 0
    assert cfg.ppo.overlong_filter  # the verifier does not punish writing on past the answer: no EOS, no loss
    assert parse(["algorithm=grpo"]).ppo.reward.functions == ()  # the sorting task keeps its reward model
    # the KL loss weight: 0.04 where the demo's tiny reward model could be gamed, veRL's 0.001 beside a verifier
    assert parse(["algorithm=grpo"]).ppo.kl_loss_coef == 0.04 and cfg.ppo.kl_loss_coef == 0.001
    assert parse(["algorithm=grpo", "ppo.kl_loss_coef=0.01"]).ppo.kl_loss_coef == 0.01  # the command line wins
    assert parse(["algorithm=grpo", "--deployment-type", "single_gpu"]).ppo.kl_loss_coef == 0.001
    mixed = parse(["data.data_path=[arithmetic:600]", "ppo.reward.functions=[jaxrlhf.rewards:boxed_format]"])
    assert mixed.ppo.reward.functions == ("jaxrlhf.rewards:boxed_format",)  # the command line wins
    with pytest.raises(ConfigError, match=r"functions: cannot import 'nope_x'"):
        parse(["data.data_path=[arithmetic:600]", "ppo.reward.functions=[nope_x:f]"])


@pytest.mark.slow
def test_grpo_with_the_verifier_raises_held_out_accuracy_over_step1(tmp_path):
    """`python -m jaxrlhf.train algorithm=grpo 'data.data_path=[arithmetic:6000]' --step 1 3` (no Step 2: the
    verifier is Step 3's reward; the reward model would only judge the evaluation report): the final actor answers
    held-out questions right clearly more often than the Step 1 model, sampled and greedy, and still ends them."""
    import jax

    from jaxrlhf.sharding import make_mesh
    from jaxrlhf.train import parse
    from jaxrlhf.train import run as run_train

    args = ["algorithm=grpo", "data.data_path=[arithmetic:6000]", "--step", "1", "3", "--output-dir", str(tmp_path)]
    args += [f"data.cache_dir={tmp_path / 'cache'}", "eval_prompts=128", "eval_samples=2"]
    result = run_train(parse(args), mesh=make_mesh(1, jax.devices()[:1]))
    c, VERIFIER = result["comparison"], "jaxrlhf.rewards:math_verify"
    assert not (tmp_path / "reward-models").exists()
    report = json.loads((tmp_path / "eval" / "report.json").read_text())  # judged by the verifier alone
    assert report["reward"] == {"weights": {VERIFIER: 1.0}, "binary": [VERIFIER]} and result["report"]
    actor = report["models"][1]
    assert actor["parts"][VERIFIER] == actor["gold_reward"] > report["models"][0]["gold_reward"]
    print({k: v for k, v in c.items() if k != "examples"}, f"{result['seconds']:.0f} s")
    assert c["actor_gold_reward_sampled"] > c["step1_gold_reward_sampled"] + 0.1
    assert c["actor_gold_reward_greedy"] > c["step1_gold_reward_greedy"] + 0.05
    assert 0 < c["kl_actor_to_step1"] < 5
    assert result["step3"].keys() == {"actor", "actor_ema"}  # GRPO: no critic
    truncated = [r["truncated"] for r in map(json.loads, (tmp_path / "step3-models" / "metrics.jsonl").open())]
    assert max(truncated[-5:]) < 0.2  # the answers still end with EOS
