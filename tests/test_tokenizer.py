"""OPT's tokenizer from the raw BPE files, and tokenizer folders in and out."""

import pytest

from helpers import PRE_LN, make_hf_opt
from jaxrlhf import CheckpointError, load_hf, load_tokenizer, opt_tokenizer, save_hf

TEXT = (
    "Building a website can be done in 10 simple steps. This message is for general people, "
    "so we assume they don't have basic concepts."
)
IDS = [37500, 10, 998, 64, 28, 626, 11, 158, 2007, 2402, 4, 152, 1579, 16, 13, 937, 82, 6, 98, 52, 6876, 51, 218, 75, 33, 3280, 14198, 4]  # fmt: skip  # noqa: E501


def test_opt_tokenizer_reproduces_the_test_vector(assets):
    tok = opt_tokenizer(assets / "opt-tokenizer")
    assert tok(TEXT)["input_ids"] == [2] + IDS  # OPT prepends </s> as BOS
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 2, 1)
    assert len(tok) == 50265
    assert tok.decode(IDS) == TEXT
    # Left padding for prompts uses <pad> = 1 and a zero mask.
    batch = tok(["Hello there", "Hi"], padding=True, padding_side="left")
    assert batch["input_ids"][1][0] == 1 and batch["attention_mask"][1][0] == 0


def test_tokenizer_travels_with_the_checkpoint(assets, tmp_path):
    tok = opt_tokenizer(assets / "opt-tokenizer")
    config, params = load_hf(make_hf_opt(tmp_path / "hf", **PRE_LN))
    out = save_hf(tmp_path / "out", config, params, tokenizer=tok)
    again = load_tokenizer(out)
    assert again(TEXT)["input_ids"] == [2] + IDS
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)(TEXT)["input_ids"] == [2] + IDS
    assert load_tokenizer(assets / "opt-tokenizer")(TEXT)["input_ids"] == [2] + IDS


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer found") as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(CheckpointError, match="missing merges.txt"):
        opt_tokenizer(tmp_path)
