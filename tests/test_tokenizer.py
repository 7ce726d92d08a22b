"""OPT's tokenizer from the raw BPE files, and tokenizer folders in and out."""

import json

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


def test_stop_ids_read_the_model_folders_generation_config(tmp_path):
    """End-of-turn first (what answers are trained to end with), then EOS, then generation_config.json's
    eos_token_id, an int or a list (Qwen2.5 instruct: [<|im_end|>, <|endoftext|>]; Llama 3 instruct: three), each
    once."""
    from test_data_chat import EOT, VOCAB, chatml_tokenizer

    from jaxrlhf.tokenizer import stop_ids

    tok = chatml_tokenizer(tmp_path / "tok")
    eos = VOCAB["<|endoftext|>"]
    assert stop_ids(tok) == (EOT, eos) and stop_ids(tok, "none") == (eos,)
    folder = tmp_path / "model"
    folder.mkdir()
    assert stop_ids(tok, "auto", folder) == (EOT, eos)  # no generation_config.json
    for written, want in (([EOT, eos], (EOT, eos)), ([eos, 9, EOT, 4], (EOT, eos, 9, 4)), (9, (EOT, eos, 9))):
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": written, "max_length": 20}))
        assert stop_ids(tok, "auto", folder) == want
    assert stop_ids(tok, "none", folder) == (eos, 9)
    assert stop_ids(tok, "auto", "random:qwen2.5-0.5b") == (EOT, eos)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ["<|im_end|>"]}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id must be an integer or a list"):
        stop_ids(tok, "auto", folder)
