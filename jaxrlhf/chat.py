"""`python -m jaxrlhf.chat --path MODEL`: a multi-turn conversation with a trained model (DeepSpeed-Chat's chat.py).

    python -m jaxrlhf.chat --path runs/train/step3-models/actor [max_new_tokens=128 temperature=0.7 ...]

The conversation is kept as a list of messages and rendered each turn the way the data of the training steps is
(jaxrlhf.data.messages): through the model's chat template when its tokenizer has one (the generation prompt opening
the assistant's turn, the answer ending at the template's end-of-turn token, e.g. <|im_end|>), else as HH text,
"\\n\\nHuman: ...\\n\\nAssistant: ..." turn after turn, which the model continues after each "Assistant:"; an HH
answer ends at its EOS or where it starts a new "Human:" turn. chat_template=none uses HH text whatever the tokenizer
has. Type `clear` to start a new conversation and `quit` to leave.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import jax
import numpy as np

from jaxrlhf.checkpoint import load_hf
from jaxrlhf.config import check_fields, run_cli
from jaxrlhf.data.batches import pad_rows
from jaxrlhf.data.messages import ChatFormat, Messages, template_variables
from jaxrlhf.generate import decode_params, generate
from jaxrlhf.tokenizer import load_tokenizer, stop_ids


@dataclasses.dataclass(frozen=True)
class ChatConfig:
    #: the model: a Hugging Face folder (OPT, Llama, Qwen2, Qwen3) with its tokenizer (e.g. OUT/step3-models/actor)
    path: str = ""
    #: tokens per answer at most
    max_new_tokens: int = 128
    #: sampling temperature (0: greedy), top-k (0: off) and top-p (1: off)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    #: compute dtype
    dtype: Literal["float32", "bfloat16"] = "float32"
    #: seed of the sampling
    seed: int = 0
    #: "auto": the tokenizer's chat template renders the conversation (HH text without one); "none": HH text
    chat_template: Literal["auto", "none"] = "auto"
    #: the chat template's own variables as name=value, e.g. [enable_thinking=false] (data.chat_template_kwargs)
    chat_template_kwargs: tuple[str, ...] = ()

    def __post_init__(self):
        check_fields(self, max_new_tokens=">= 1")
        template_variables(self.chat_template_kwargs)  # raises on an item that is not name=value


class Chatbot:
    """A model and its tokenizer, answering a conversation held as messages."""

    def __init__(self, cfg: ChatConfig):
        if not cfg.path:
            raise ValueError("path: required, a Hugging Face model folder (e.g. --path runs/train/step3-models/actor)")
        self.cfg = cfg
        self.config, params = load_hf(cfg.path, dtype=jax.numpy.dtype(cfg.dtype))
        # the decode layout, built once: every answer's decode steps read each layer's own arrays
        self.params = decode_params(self.config, {k: v for k, v in params.items() if k != "value_head"})
        self.tokenizer = load_tokenizer(cfg.path)
        self.format = ChatFormat(self.tokenizer, cfg.chat_template, template_variables(cfg.chat_template_kwargs))
        self.sampling = {k: getattr(cfg, k) for k in ("temperature", "top_k", "top_p")}
        # a chat model may end with its EOS or another id of its generation_config.json instead of end-of-turn
        self.stops = stop_ids(self.tokenizer, cfg.chat_template, cfg.path)
        self.sampling.update(eos_id=self.stops, pad_id=self.tokenizer.pad_token_id)
        self.max_new = min(cfg.max_new_tokens, self.config.max_position_embeddings // 2)
        self.turns = 0

    def answer(self, conversation: Messages) -> str:
        """The model's next answer to `conversation` (which ends with the user's turn), as text."""
        tok = self.tokenizer
        ids = self.format.prompt_ids(conversation)
        room = self.config.max_position_embeddings - self.max_new
        ids = ids[-room:]  # a long conversation keeps its latest part
        width = min(room, 1 << (len(ids) - 1).bit_length())  # a few prompt shapes, so few compilations
        prompt, mask = pad_rows([ids], width, tok.pad_token_id, left=True)
        key = jax.random.key(self.cfg.seed + self.turns)
        out = generate(self.config, self.params, prompt, mask, key, max_new_tokens=self.max_new, **self.sampling)
        self.turns += 1
        ends = set(self.stops)
        tokens = [int(t) for t, m in zip(np.asarray(out.tokens)[0], np.asarray(out.mask)[0]) if m]
        tokens = tokens[: next((i for i, t in enumerate(tokens) if t in ends), len(tokens))]
        if self.format.template:
            return tok.decode(tokens, skip_special_tokens=True).strip()
        return tok.decode(tokens).split("\n\nHuman:")[0].rstrip()


def chat(
    cfg: ChatConfig, read: Callable[[str], str] | None = None, write: Callable[[str], None] = print
) -> list[tuple[str, str]]:
    """The conversation loop (reading with `input` unless given `read`); returns every (conversation sent to
    the model as text, answer) pair."""
    read = read or input
    bot = Chatbot(cfg)
    write(
        f"model: {cfg.path} ({sum(x.size for x in jax.tree.leaves(bot.params)) / 1e6:.1f}M parameters). "
        "Type 'clear' for a new conversation, 'quit' to leave."
    )
    conversation, log = (), []
    while True:
        try:
            text = read("Human: ").strip()
        except EOFError:
            break
        if text == "quit":
            break
        if text == "clear":
            conversation = ()
            write("(a new conversation)")
            continue
        if not text:
            continue
        conversation += (("user", text),)
        reply = bot.answer(conversation)
        log.append((bot.format.render(conversation, True), reply))
        conversation += (("assistant", reply),)
        write(f"Assistant:{reply if reply[:1].isspace() else ' ' + reply}")
    return log


def flags(parser):
    """DeepSpeed-Chat's flags, the same as the settings path= and max_new_tokens=."""
    parser.add_argument("--path", help="the model folder (e.g. OUT/step3-models/actor)")
    parser.add_argument("--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=int, metavar="N")


def main(argv=None):
    run_cli(ChatConfig, __doc__, "python -m jaxrlhf.chat", chat, argv, flags=flags)


if __name__ == "__main__":
    main()
