"""Chat templates and TRL's conversational rows: a ChatML tokenizer built with `tokenizers` (no Hub), rendered
prompts, answers ending with <|im_end|>, the HH fallback, bad rows, the cache key, and every step's data path."""

import dataclasses
import json

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from jaxrlhf.data import DataConfig, DataError, Record, make_batch, prepare, read_source, step_records, tokenize
from jaxrlhf.data.messages import ChatFormat
from jaxrlhf.data.pipeline import cache_key
from jaxrlhf.losses import answer_mask
from jaxrlhf.tokenizer import decode_rows, load_tokenizer, opt_tokenizer, stop_id

# Qwen2's ChatML template, without its default system message.
CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<unk>"]
# 32 tokens in all: a tiny model's vocabulary
WORDS = "system user assistant Human Assistant System You are kind What colour is the sky It blue green Hi Hello"
WORDS += " again yes no"
VOCAB = {t: i for i, t in enumerate(SPECIAL + WORDS.split() + ["\n", " ", "?", ".", ":"])}
EOT, START, BOS = VOCAB["<|im_end|>"], VOCAB["<|im_start|>"], VOCAB["<|begin_of_text|>"]


def chatml_tokenizer(folder, bos: bool = False, template: str | None = CHATML):
    """A Qwen-style word-level tokenizer saved to `folder`: EOS <|endoftext|> (as Qwen2.5's base models), the
    ChatML template ending each turn with <|im_end|>. With `bos`, Llama 3's way: the tokenizer prepends
    <|begin_of_text|> and so does the template, which must not give two."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s|[?.:]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    kw = {}
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", BOS)]
        )
        kw, template = {"bos_token": "<|begin_of_text|>"}, "{{- bos_token }}" + template
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=template,
        **kw,
    )
    fast.save_pretrained(folder)
    return load_tokenizer(folder)  # as every entry point reads it: tokenizer.json, chat_template.jinja


def ids(text: str) -> list[int]:
    """The word-level ids of `text`, written out independently of the tokenizer."""
    import re

    return [VOCAB[p] for p in re.split(r"(<\|[a-z_]+\|>|\s|[?.:])", text) if p]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


SYSTEM, USER = {"role": "system", "content": "You are kind."}, {"role": "user", "content": "What colour is the sky?"}
BLUE, GREEN = {"role": "assistant", "content": "It is blue."}, {"role": "assistant", "content": "It is green."}
PROMPT_TEXT = "<|im_start|>system\nYou are kind.<|im_end|>\n<|im_start|>user\nWhat colour is the sky?<|im_end|>\n"
PROMPT_TEXT += "<|im_start|>assistant\n"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_template_renders_prompts_with_the_generation_prompt_and_finds_its_end_of_turn(tok, tmp_path):
    fmt = ChatFormat(tok)
    assert (fmt.end_of_turn, fmt.stop_id, tok.eos_token_id, stop_id(tok)) == (EOT, EOT, VOCAB["<|endoftext|>"], EOT)
    record = read_source(_jsonl(tmp_path / "p.jsonl", [{"prompt": [SYSTEM, USER]}]))["train"][0][0]
    assert record == Record((("system", "You are kind."), ("user", "What colour is the sky?")), None)
    arrays, _ = tokenize([record], tok, 3, DataConfig())
    assert arrays["tokens"].tolist() == ids(PROMPT_TEXT)  # the template's text, no BOS of ours
    assert arrays["tokens"].tolist()[-3:] == [START, VOCAB["assistant"], VOCAB["\n"]]  # the generation prompt
    assert decode_rows(tok, arrays["tokens"][None], np.ones((1, len(arrays["tokens"]))), skip_first=True) == [
        PROMPT_TEXT
    ]
    # chat_template none: HH text, as for a tokenizer without a template; EOS ends answers then.
    none = ChatFormat(tok, "none")
    assert none.stop_id == tok.eos_token_id and none.prompt_ids(record.prompt) == ids(
        "\n\nSystem: You are kind.\n\nHuman: What colour is the sky?\n\nAssistant:"
    )


def test_sft_messages_train_on_the_answer_and_its_end_of_turn_only(tok, tmp_path):
    src = _jsonl(tmp_path / "sft.jsonl", [{"messages": [SYSTEM, USER, BLUE]}] * 4)
    config = DataConfig(data_path=(src,), data_split="1,0,0", eval_fraction=0, max_seq_len=48, mask_prompt=True)
    records = step_records(config, 1)[0]["train"]
    arrays, stats = tokenize(records, tok, 1, config)
    b = make_batch(arrays, [0], 1, config, tok.pad_token_id)
    answer = ids("It is blue.<|im_end|>")  # the template's "\n" after <|im_end|> is no target
    n = len(ids(PROMPT_TEXT))
    assert b["input_ids"][0, : n + len(answer)].tolist() == ids(PROMPT_TEXT) + answer
    assert b["loss_mask"][0].tolist() == [0] * n + [1] * len(answer) + [0] * (48 - n - len(answer))
    assert stats == {"sequences": 4, "prompts_cut": 0, "chosen_truncated": 0}


def test_conversational_pairs_give_the_text_of_the_equivalent_string_rows(tok, assets, tmp_path):
    conv = {"prompt": [SYSTEM, USER], "chosen": [BLUE], "rejected": [GREEN]}
    implicit = {"chosen": [SYSTEM, USER, BLUE], "rejected": [SYSTEM, USER, GREEN]}  # TRL's implicit prompt
    src = _jsonl(tmp_path / "conv.jsonl", [conv, implicit])
    first, second = read_source(src)["train"][0]
    assert first == second and first.chosen == (("assistant", "It is blue."),)
    # With the template: the rendered prompt as a string row, the answers' content (the stop token is appended).
    string = Record(PROMPT_TEXT, "It is blue.", "It is green.")
    config = DataConfig(max_seq_len=64)
    got, want = tokenize([first], tok, 2, config)[0], tokenize([string], tok, 2, config)[0]
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
    assert got["chosen_tokens"][got["prompt_len"][0] :].tolist() == ids("It is blue.<|im_end|>")
    # Without a template (OPT's tokenizer, or chat_template none): HH text, EOS after the answer, BOS first.
    hh = Record(
        "\n\nSystem: You are kind.\n\nHuman: What colour is the sky?\n\nAssistant:", " It is blue.", " It is green."
    )
    opt = opt_tokenizer(assets / "opt-tokenizer")
    for tokenizer, setting in ((opt, "auto"), (tok, "none")):
        config = DataConfig(max_seq_len=64, chat_template=setting)
        got, want = tokenize([first], tokenizer, 2, config)[0], tokenize([hh], tokenizer, 2, config)[0]
        assert all(np.array_equal(got[k], want[k]) for k in want)
    assert got["chosen_tokens"].tolist() == ids(hh.prompt + hh.chosen + "<|endoftext|>")


def test_a_template_with_its_own_bos_gets_no_second_one(tmp_path):
    tok = chatml_tokenizer(tmp_path, bos=True)
    assert tok("Hi")["input_ids"] == [BOS, VOCAB["Hi"]]  # the tokenizer adds BOS to plain text ...
    arrays, _ = tokenize([Record(((("user", "Hi"),)), ((("assistant", "Hello"),)))], tok, 1, DataConfig())
    want = [BOS] + ids("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>")
    assert arrays["tokens"].tolist() == want  # ... and the template writes it: once
    assert arrays["prompt_len"].tolist() == [len(want) - 2]
    plain = tokenize([Record("Hi", " Hello")], tok, 1, DataConfig())[0]  # plain strings: BOS + text + stop
    assert plain["tokens"].tolist() == [BOS] + ids("Hi Hello<|im_end|>")
    assert decode_rows(tok, arrays["tokens"][None], np.ones((1, len(want))), skip_first=True) == [
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello"
    ]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": [USER, {"role": "assistant"}]}, r"field 'messages' message 1: expected .* role and content"),
        ({"prompt": [{"role": "robot", "content": "Hi"}]}, r"field 'prompt' message 0: role 'robot' is not one of"),
        ({"prompt": [], "chosen": [BLUE]}, r"field 'prompt' must be a non-empty list .* got an empty list"),
        ({"prompt": [USER], "chosen": [BLUE, USER]}, r"field 'chosen': the last message is the user's; it must be"),
        ({"prompt": [USER], "chosen": "It is blue."}, r"field 'chosen' must be a list of \{role, content\} messages"),
        (
            {"prompt": [USER], "chosen": [BLUE], "rejected": [{"role": "assistant", "content": " "}]},
            r"prompt with no response \(field 'rejected' is empty\)",
        ),
        (
            {"chosen": [USER, BLUE], "rejected": [SYSTEM, GREEN]},
            r"fields 'chosen' and 'rejected' share no leading messages",
        ),
        ({"messages": [BLUE]}, r"field 'messages' has no message before the last assistant message"),
        ({"messages": [USER, BLUE, USER]}, r"field 'messages': the last message is the user's"),
        ({"prompt": [USER], "answer": "42"}, r"a prompt alone may carry only 'metadata'"),
        ({"prompt": "Hi", "chosen": [BLUE]}, r"field 'prompt' must be a non-empty list .* got str"),
    ],
)
def test_bad_conversational_rows_name_file_line_and_field(tmp_path, row, message):
    src = _jsonl(tmp_path / "x.jsonl", [{"messages": [USER, BLUE]}, row])
    with pytest.raises(DataError, match=r"x\.jsonl:2: " + message):
        read_source(src)


def test_the_cache_key_changes_with_the_template_and_the_setting(tmp_path):
    tok = chatml_tokenizer(tmp_path / "a")
    config = DataConfig()
    key = cache_key(config, 1, tok)
    assert cache_key(config, 1, chatml_tokenizer(tmp_path / "b")) == key  # the same files: the same key
    other = chatml_tokenizer(tmp_path / "c", template=CHATML.replace("'\\n' }}{%- endfor", "'\\n\\n' }}{%- endfor"))
    assert cache_key(config, 1, other) != key
    assert cache_key(dataclasses.replace(config, chat_template="none"), 1, tok) != key
    with pytest.raises(ValueError, match="chat_template: expected 'auto' or 'none', got 'off'"):
        DataConfig(chat_template="off")


def test_the_templates_own_variables_reach_it(tmp_path):
    """data.chat_template_kwargs=[enable_thinking=false] (Qwen3's): the template gets the variable, prompts render
    with what it writes for it, the cache key changes; an item that is not name=value is refused naming the setting."""
    thinking = CHATML.replace(
        "'<|im_start|>assistant\\n' }}",
        "'<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and not enable_thinking %}"
        "{{- 'It is\\n' }}{%- endif %}",
    )
    tok = chatml_tokenizer(tmp_path / "t", template=thinking)
    record = Record(((("user", "What colour is the sky?"),)), None)
    base = DataConfig()
    quiet = DataConfig(chat_template_kwargs=("enable_thinking=false",))
    plain, off = (tokenize([record], tok, 3, c)[0]["tokens"].tolist() for c in (base, quiet))
    want = "<|im_start|>user\nWhat colour is the sky?<|im_end|>\n<|im_start|>assistant\n"
    assert plain == ids(want) and off == ids(want + "It is\n")
    assert cache_key(quiet, 3, tok) != cache_key(base, 3, tok)
    with pytest.raises(ValueError, match=r"chat_template_kwargs: expected name=value \(e\.g\. enable_thinking=false\)"):
        DataConfig(chat_template_kwargs=("enable_thinking",))


def test_every_step_reads_conversational_jsonl(tok, tmp_path):
    """Step 1 (sft: messages), Step 2 (reward and DPO: prompt/chosen/rejected lists) and Step 3 (ppo: a prompt
    list) through `prepare`, the door of every entry point's data."""
    questions = ["What colour is the sky?" + " Hi" * i for i in range(10)]
    user = lambda q: {"role": "user", "content": q}
    rows = {
        1: [{"messages": [user(q), BLUE]} for q in questions],
        2: [{"prompt": [user(q)], "chosen": [BLUE], "rejected": [GREEN]} for q in questions],
        3: [{"prompt": [user(q)], "metadata": {"n": i}} for i, q in enumerate(questions)],
    }
    for step, step_rows in rows.items():
        src = _jsonl(tmp_path / f"step{step}.jsonl", step_rows)
        split = ",".join("1" if s == step else "0" for s in (1, 2, 3))
        config = DataConfig(data_path=(src,), data_split=split, cache_dir=str(tmp_path / "cache"), max_seq_len=48)
        b = make_batch(prepare(config, step, tok, log=lambda _: None)["train"], [0], step, config, tok.pad_token_id)
        q = step_records(config, step)[0]["train"][0].prompt[-1][1]  # the batch's row 0 is the blended set's first
        prompt = ids(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
        if step == 1:
            targets = b["input_ids"][0][b["loss_mask"][0] == 1].tolist()
            assert b["input_ids"][0, : len(prompt)].tolist() == prompt
            assert targets == prompt[1:] + ids("It is blue.<|im_end|>")  # mask_prompt off: all but the first
        elif step == 2:  # reward: whole sequences; DPO: the answers after prompt_len
            for field, text in (("chosen", "It is blue."), ("rejected", "It is green.")):
                seq, mask = b[f"{field}_ids"], b[f"{field}_mask"]
                assert seq[0][mask[0] == 1].tolist() == prompt + ids(text + "<|im_end|>")
                answer = np.asarray(answer_mask(mask, b["prompt_len"]))[0] == 1
                assert seq[0][answer].tolist() == ids(text + "<|im_end|>")
        else:
            assert b["prompt_ids"][0][b["prompt_mask"][0] == 1].tolist() == prompt
            assert b["metadata"][0] == {"n": q.count("Hi")}
    with pytest.raises(DataError, match="has prompts without a response, which only Step 3 can use"):
        step_records(dataclasses.replace(config, data_split="1,1,1"), 1)


def test_step3_reward_functions_see_answers_ended_by_the_end_of_turn(tok):
    """reward_starter (Step 3's hook to the reward functions): an answer that reached <|im_end|> or the tokenizer's EOS
    (<|endoftext|>: generation stops at either, tokenizer.stop_ids) is not truncated, one that ends with nothing is;
    chat_template none goes back to EOS."""
    from jaxrlhf.ppo import reward_starter

    seen = []

    class Spy:
        def start(self, prompts, answers, metadata, **extras):
            seen.append((prompts, answers, extras["truncated"]))

    prompt = np.array([ids(PROMPT_TEXT)] * 3, np.int32)
    batch = {"prompt_ids": prompt, "prompt_mask": np.ones_like(prompt), "metadata": [{}] * 3}
    blue = ids("It is blue.")
    answers = np.array([blue + [EOT], blue + [tok.eos_token_id], blue + ids("?")], np.int32)
    for setting, truncated in (("auto", [False, False, True]), ("none", [True, False, True])):
        reward_starter(Spy(), tok, setting)(batch, answers, np.ones_like(answers))
        assert seen[-1] == ([PROMPT_TEXT] * 3, ["It is blue.", "It is blue.", "It is blue.?"], truncated)
