"""Step 2 on real preference data: Anthropic HH-RLHF harmless-base pairs from ../shared/assets."""

import math

import jax
import numpy as np
import pytest

from helpers import pairs_config, run_on_one_device
from jaxrlhf import OPTConfig, init_params, opt_tokenizer, save_hf
from jaxrlhf.data import DataConfig, make_batch, read_source, tokenize
from jaxrlhf.optim import OptimConfig
from jaxrlhf.reward import RewardConfig
from jaxrlhf.reward import run as run_reward

HH = "data/hh-rlhf/harmless-base-test.jsonl.gz"


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson 95 % interval of a proportion."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def test_wilson_interval():
    low, high = wilson(60, 100)  # textbook value: 0.5020 .. 0.6906
    assert abs(low - 0.5020) < 1e-4 and abs(high - 0.6906) < 1e-4


@pytest.mark.slow
def test_long_hh_pairs_keep_their_differing_answers(assets):
    """HH pairs share a long prompt and differ at the end: at 64 tokens a right cut would leave most pairs as two
    identical sequences; the prompt's start goes instead, by the same count in both halves, down to half the room."""
    tok = opt_tokenizer(assets / "opt-tokenizer")
    records = read_source(str(assets / HH), on_bad_row="skip")["train"][0]
    config = DataConfig(max_seq_len=64)
    arrays, stats = tokenize(records, tok, 2, config)
    b = make_batch(arrays, range(len(records)), 2, config, tok.pad_token_id)
    enc = lambda texts: [len(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]
    p, c, r = (np.array(enc([getattr(x, f) for x in records])) for f in ("prompt", "chosen", "rejected"))
    assert np.mean(1 + p + 1 >= 64) > 0.6  # the share of pairs a right cut would have made identical
    # 62 tokens besides BOS and EOS: the prompt keeps what the longer answer leaves, and at least 31.
    kept = np.minimum(p, np.maximum(62 - np.maximum(c, r), 31))
    assert (arrays["prompt_len"] == 1 + kept).all() and stats["prompts_cut"] == np.sum(kept < p) > 1400  # of 2,303
    differ = b["chosen_ids"] != b["rejected_ids"]
    assert differ.any(1).all()
    # Both halves keep the same prompt (BOS + its last tokens), and they part where the answers do.
    assert (np.argmax(differ, 1) >= arrays["prompt_len"]).all()
    # End scores are read at EOS wherever the answer fits whole.
    for field, n in (("chosen", c), ("rejected", r)):
        last = b[f"{field}_ids"][np.arange(len(records)), b[f"{field}_mask"].sum(1) - 1]
        fits = 1 + kept + n + 1 <= 64
        assert (last[fits] == tok.eos_token_id).all() and stats[f"{field}_truncated"] == np.sum(~fits)


@pytest.mark.slow
def test_reward_model_beats_chance_on_held_out_hh_pairs(assets, tmp_path):
    """A 2-layer, 32-wide OPT from random weights, 200 steps of 32 pairs at 64 tokens (4 epochs over 1,612 pairs):
    held-out accuracy on 672 other pairs with the lower end of its 95 % interval above 0.5.

    Measured here: 0.579 (0.541-0.616). Other random weights (512 position embeddings) with three data seeds, so
    three different held-out sets of 672: 0.573, 0.560, 0.588; at 96 tokens 0.595 (this test), 0.565, 0.632. Had
    the prompt alone been cut (answers whole): 0.610 here, 0.613, 0.597, 0.622; at lr 3e-3 0.604, 0.570, 0.585.
    A right cut (DeepSpeed-Chat's) gave 0.31 at 128 tokens: most pairs became two identical sequences, which
    count as wrong. On these pairs "the shorter answer wins" scores 0.547 and a bag-of-words logistic
    regression 0.60-0.62: the signal in harmless-base is weak.
    """
    tok = opt_tokenizer(assets / "opt-tokenizer")
    config = OPTConfig(
        vocab_size=50272,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=128,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        dropout=0.0,
    )
    model = save_hf(tmp_path / "base", config, jax.device_get(init_params(config, jax.random.key(0), std=0.1)), tok)
    data = dict(on_bad_row="skip", eval_fraction=0.3, max_seq_len=64)
    optim = OptimConfig(learning_rate=1e-2, weight_decay=0.1)
    fields = dict(batch_size=32, epochs=4, log_every=50, loss_kind="span", optim=optim)
    _, evaluation = run_on_one_device(
        run_reward, pairs_config(RewardConfig, model, tmp_path, assets / HH, data, **fields)
    )
    n = evaluation["pairs"]
    low, high = wilson(round(evaluation["accuracy"] * n), n)
    print(f"held-out HH accuracy {evaluation['accuracy']:.3f} over {n} pairs, 95 % interval {low:.3f}-{high:.3f}")
    assert n == 672  # 691 held-out pairs in whole batches of 32
    assert low > 0.5
    assert evaluation["chosen_score"] > evaluation["rejected_score"]
