"""Conversations as TRL writes them (lists of {role, content}), and how a tokenizer turns them into text.

    row field (TRL's conversational format)        Messages (in a Record)        text (at tokenization)
    [{"role": "user", "content": "Hi"}]      ──►   (("user", "Hi"),)      ──►   the chat template's rendering,
                                                                                or HH text without one

`ChatFormat(tokenizer, setting, variables)` decides, once per tokenizer, how conversations become text (`variables`:
the template's own, data.chat_template_kwargs, e.g. Qwen3's enable_thinking):
  - with a chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja) and setting "auto":
    a prompt is `apply_chat_template(prompt, add_generation_prompt=True)`, an answer is what rendering
    prompt + answer adds after it (TRL's split), cut after its last end-of-turn token (the first special token
    the template writes after an assistant message: Qwen's <|im_end|>, Llama 3's <|eot_id|>). The template
    writes its own special tokens, so no BOS is added in front.
  - otherwise (no template, or setting "none"): HH text, "\\n\\nHuman: ...\\n\\nAssistant:", as DeepSpeed-Chat's
    data is written; the answer is " " + its content.
Plain-string rows are used as they are whatever the setting (TRL's rule): only conversational rows are rendered.
Every answer ends with `stop_id`, the token generation stops at: the end-of-turn token when the template is
used and has one, else the tokenizer's EOS.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from jaxrlhf.config import ConfigError, InputError

ROLES = ("system", "user", "assistant", "tool")
HH_NAMES = {"system": "System", "user": "Human", "assistant": "Assistant", "tool": "Tool"}
CHAT_TEMPLATE_SETTINGS = ("auto", "none")

#: a conversation: (role, content) pairs
Messages = tuple[tuple[str, str], ...]

_PROBE = "jaxrlhf probe answer"  # an assistant message's content, to find what the template writes after it


def template_variables(items) -> dict[str, Any]:
    """data.chat_template_kwargs ("name=value", the value read as YAML: enable_thinking=false) as a dict for
    apply_chat_template; a ConfigError naming the setting for an item that is not name=value."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_]\w*", name.strip()):
            raise ConfigError(f"chat_template_kwargs: expected name=value (e.g. enable_thinking=false), got {item!r}")
        try:
            out[name.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"chat_template_kwargs: {item!r}: the value is not YAML") from None
    return out


class MessagesError(InputError):
    """A list of messages that is not a conversation (jaxrlhf.data.sources turns it into a DataError)."""


def parse_messages(value: Any, field: str, *, last: str | None = None) -> Messages:
    """A row's list of {role, content} as Messages; `last` ("assistant") names the role the last turn must have."""
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else type(value).__name__
        raise MessagesError(f"field '{field}' must be a non-empty list of {{role, content}} messages, got {got}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            what = sorted(m) if isinstance(m, dict) else type(m).__name__
            raise MessagesError(
                f"field '{field}' message {i}: expected an object with string fields role and content, got {what}"
            )
        if m["role"] not in ROLES:
            raise MessagesError(f"field '{field}' message {i}: role {m['role']!r} is not one of {', '.join(ROLES)}")
        out.append((m["role"], m["content"]))
    if last is not None and out[-1][0] != last:
        raise MessagesError(f"field '{field}': the last message is the {out[-1][0]}'s; it must be the {last}'s")
    return tuple(out)


def common_prefix(a: Messages, b: Messages) -> int:
    """The number of leading messages two conversations share (TRL's implicit prompt)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def content(value: str | Messages) -> str:
    """A field's text without any format: a string as it is, a conversation's contents one per line."""
    return value if isinstance(value, str) else "\n".join(c for _, c in value)


def hh_text(messages: Messages, generation_prompt: bool) -> str:
    """HH text: "\\n\\nHuman: content" per turn (System, Assistant, Tool likewise), then "\\n\\nAssistant:" when
    `generation_prompt`. A content that starts with whitespace keeps it in place of the separating space."""
    text = "".join(f"\n\n{HH_NAMES[r]}:{c if c[:1].isspace() else ' ' + c}" for r, c in messages)
    return text + ("\n\nAssistant:" if generation_prompt else "")


class ChatFormat:
    """How `tokenizer` writes conversations (see the module docstring); `setting` is data.chat_template."""

    def __init__(self, tokenizer, setting: str = "auto", variables: dict | None = None):
        if setting not in CHAT_TEMPLATE_SETTINGS:
            raise ValueError(f"chat_template: expected one of {', '.join(CHAT_TEMPLATE_SETTINGS)}, got {setting!r}")
        self.tokenizer, self.variables = tokenizer, variables or {}  # the template's own (template_variables)
        self.template = getattr(tokenizer, "chat_template", None) if setting == "auto" else None
        self.end_of_turn = self._end_of_turn() if self.template else None
        eos = tokenizer.eos_token_id
        self.stop_id = eos if self.end_of_turn is None else self.end_of_turn
        self.bos_id = tokenizer.bos_token_id

    def render(self, messages: Messages, generation_prompt: bool) -> str:
        """The text of a conversation, with the assistant's turn opened after it when `generation_prompt`."""
        if not self.template:
            return hh_text(messages, generation_prompt)
        return self.tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages],
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.variables,
        )

    def answer_text(self, prompt: Messages, answer: Messages) -> str:
        """What rendering prompt + answer adds after the rendered prompt (with its generation prompt)."""
        head, whole = self.render(prompt, True), self.render(prompt + answer, False)
        if not whole.startswith(head):
            raise MessagesError(
                "the chat template renders the prompt differently on its own (with the generation prompt) and "
                f"inside the whole conversation ({head[-40:]!r} vs {whole[len(head) - 40 : len(head)]!r}); "
                "set data.chat_template=none to use HH text"
            )
        return whole[len(head) :]

    def prompt_ids(self, prompt: str | Messages) -> list[int]:
        """A prompt's tokens: a rendered conversation as it is (a template writes its own BOS), a plain string
        (or HH text) after the tokenizer's BOS where it has one."""
        if not isinstance(prompt, str) and self.template:
            return self.encode(self.render(prompt, True))
        text = prompt if isinstance(prompt, str) else self.render(prompt, True)
        return ([] if self.bos_id is None else [self.bos_id]) + self.encode(text)

    def answer_ids(self, prompt: str | Messages, answer: str | Messages) -> list[int]:
        """An answer's tokens, ending with `stop_id`: a rendered answer is cut after its last end-of-turn token
        (what the template writes after it, e.g. a newline, is not a target), any other gets stop_id appended."""
        if isinstance(answer, str):
            return self.encode(answer) + [self.stop_id]
        ids = self.encode(self.answer_text(prompt, answer))
        if self.template and self.end_of_turn in ids:
            return ids[: len(ids) - ids[::-1].index(self.end_of_turn)]
        return ids + [self.stop_id]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _end_of_turn(self) -> int | None:
        """The first special token the template writes after an assistant message's content, or None."""
        user = (("user", "Hi"),)
        try:
            tail = self.render(user + (("assistant", _PROBE),), False).rpartition(_PROBE)[2]
        except Exception as e:  # noqa: BLE001 - jinja's errors, the template's own raise_exception: one message
            raise InputError(
                f"the tokenizer's chat template fails on a user/assistant exchange ({type(e).__name__}: {e}); "
                "fix it, or set chat_template=none to use HH text"
            ) from None
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        special = set(self.tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        return next((i for i in self.encode(tail) if i in special), None)
