"""python -m jaxrlhf.chat: the multi-turn Human/Assistant protocol, clear and quit, on a tiny model."""

import jax
import numpy as np
import pytest

from jaxrlhf.chat import ChatConfig, chat, main
from jaxrlhf.checkpoint import load_hf
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
        self.cfg, self.params = cfg, {}

    def answer(self, conversation):
        return f" {conversation.count('Human:')} turns, {self.cfg.max_new_tokens} tokens"


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
        first + log[0][1] + "\n\nHuman: Sort these letters: d e\n\nAssistant:",  # the history carries over
        "\n\nHuman: Sort these letters: x y\n\nAssistant:",  # ... until `clear`
    ]
    assert log[1][1] == greedy(folder, log[1][0], 6)  # the answer is the model's greedy continuation
    assert printed[1:] == [
        f"Assistant:{log[0][1]}",
        f"Assistant:{log[1][1]}",
        "(a new conversation)",
        f"Assistant:{log[2][1]}",
    ]
    # The entry point, with DeepSpeed-Chat's --path flag and input() from the terminal.
    lines = iter(["Sort these letters: c a b", "quit"])
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    main(["--path", str(folder), "max_new_tokens=6"])
    assert f"Assistant:{log[0][1]}\n" in capsys.readouterr().out
