"""python -m jaxrlhf.chat: the multi-turn Human/Assistant protocol, clear and quit, on a tiny model."""

import json

import jax
import numpy as np
import pytest
from test_data_chat import EOT, VOCAB, chatml_tokenizer, ids

from helpers import PRE_LN, make_hf_opt
from jaxrlhf.chat import Chatbot, ChatConfig, chat, main
from jaxrlhf.checkpoint import load_hf
from jaxrlhf.data.messages import ChatFormat
from jaxrlhf.generate import generate
from jaxrlhf.train import builtin_model, builtin_tokenizer


def greedy(folder, text, n):
    """The reference answer: greedy generation on the unpadded conversation, cut like the chatbot cuts."""
    config, params = load_hf(folder)
    tok = builtin_tokenizer()
    ids = np.array([[tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]], np.int32)
    out = generate(
        config, params, ids, np.ones_like(ids), jax.random.key(0), max_new_tokens=n, temperature=0.0, eos_id=2
    )
    tokens = [int(t) for t, m in zip(np.asarray(out.tokens)[0], np.asarray(out.mask)[0]) if m and t != 2]
    return tok.decode(tokens).split("\n\nHuman:")[0].rstrip()


class StandIn:
    """A chatbot whose answer names the turns it was sent, so the test can see the history the loop keeps."""

    def __init__(self, cfg):
        self.cfg, self.params, self.format = cfg, {}, ChatFormat(builtin_tokenizer(), "none")

    def answer(self, conversation):
        return f" {sum(role == 'user' for role, _ in conversation)} turns, {self.cfg.max_new_tokens} tokens"


def test_the_conversation_protocol_with_a_stand_in_model(monkeypatch, capsys):
    monkeypatch.setattr("jaxrlhf.chat.Chatbot", StandIn)
    lines = iter(["hi", "again", "", "clear", "new", "quit", "never read"])
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    main(["--path", "some/folder", "--max-new-tokens", "7"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("model: some/folder (0.0M parameters)")
    assert out[1:] == [
        "Assistant: 1 turns, 7 tokens",
        "Assistant: 2 turns, 7 tokens",
        "(a new conversation)",
        "Assistant: 1 turns, 7 tokens",
    ]

    def read(_, lines=iter(["hi"])):  # the end of the input (EOFError, as input() raises) ends the conversation too
        for line in lines:
            return line
        raise EOFError

    log = chat(ChatConfig(path="x"), read=read, write=print)
    assert log == [("\n\nHuman: hi\n\nAssistant:", " 1 turns, 128 tokens")]


@pytest.mark.slow
def hh_reply(reply: str) -> str:
    return reply if reply[:1].isspace() else " " + reply


def test_multi_turn_clear_and_quit(tmp_path, monkeypatch, capsys):
    folder = builtin_model(tmp_path / "m", seed=3)
    lines = iter(
        [
            "Sort these letters: c a b",
            "Sort these letters: d e",
            "clear",
            "",
            "Sort these letters: x y",
            "quit",
            "never read",
        ]
    )
    printed = []
    log = chat(ChatConfig(path=str(folder), max_new_tokens=6), read=lambda _: next(lines), write=printed.append)
    first = "\n\nHuman: Sort these letters: c a b\n\nAssistant:"
    assert [c for c, _ in log] == [
        first,
        # the history carries over, as HH text: a reply not starting with whitespace gets the separating space
        first + hh_reply(log[0][1]) + "\n\nHuman: Sort these letters: d e\n\nAssistant:",
        "\n\nHuman: Sort these letters: x y\n\nAssistant:",  # ... until `clear`
    ]
    assert log[1][1] == greedy(folder, log[1][0], 6)  # the answer is the model's greedy continuation
    assert printed[1:] == [
        f"Assistant:{hh_reply(log[0][1])}",
        f"Assistant:{hh_reply(log[1][1])}",
        "(a new conversation)",
        f"Assistant:{hh_reply(log[2][1])}",
    ]
    # The entry point, with DeepSpeed-Chat's --path flag and input() from the terminal.
    lines = iter(["Sort these letters: c a b", "quit"])
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    main(["--path", str(folder), "max_new_tokens=6"])
    assert f"Assistant:{hh_reply(log[0][1])}\n" in capsys.readouterr().out


def test_a_chat_template_renders_every_turn_and_answers_stop_at_its_end_of_turn(tmp_path):
    """A tiny random OPT with the ChatML tokenizer: each turn sends the template's rendering of the whole
    conversation (earlier answers included) with the generation prompt; generation stops at <|im_end|>."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = make_hf_opt(tmp_path / "m", **{**PRE_LN, "vocab_size": len(VOCAB), "max_position_embeddings": 128})
    tok = chatml_tokenizer(folder)
    question = "What colour is the sky?" + " Hi" * 8  # both turns' prompts pad to 64 tokens: one compilation
    lines = iter([question, "Hi", "quit"])
    printed = []
    log = chat(ChatConfig(path=str(folder), max_new_tokens=4), read=lambda _: next(lines), write=printed.append)
    first = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    second = f"{first}{log[0][1]}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert [c for c, _ in log] == [first, second]
    assert tok(first, add_special_tokens=False)["input_ids"] == ids(first)  # no BOS: the template writes none
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for text, reply in log:  # the reference: transformers' greedy answer to the rendered text, cut at <|im_end|>
        prompt = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        out = hf.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=EOT, pad_token_id=0)
        tokens = out[0, prompt.shape[1] :].tolist()
        tokens = tokens[: next((i for i, t in enumerate(tokens) if t in (EOT, tok.eos_token_id)), len(tokens))]
        assert reply == tok.decode(tokens, skip_special_tokens=True).strip()
    assert printed[1:] == [f"Assistant: {reply}" for _, reply in log]
    # Generation stops at the template's end of turn and at the tokenizer's EOS (<|endoftext|>: a chat model may end
    # with either, tokenizer.stop_ids), the end of turn first; HH text stops at EOS first, then at the folder's
    # generation_config.json eos_token_id (OPT's 2, in this vocabulary <|im_end|>).
    assert Chatbot(ChatConfig(path=str(folder))).sampling["eos_id"] == (EOT, tok.eos_token_id)
    assert Chatbot(ChatConfig(path=str(folder), chat_template="none")).sampling["eos_id"] == (tok.eos_token_id, EOT)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == EOT
