"""A chat model end to end: a tiny random Qwen2 folder made with transformers, with a ChatML tokenizer built with
`tokenizers` and an eos_token_id list as Qwen's chat models have, through `python -m jaxrlhf.train` (Steps 1-3 and
the evaluation report) on TRL's conversational rows: `messages` for Step 1, prompt/chosen/rejected message lists for
Steps 2 and 3. Every prompt the steps tokenized is transformers' apply_chat_template(..., add_generation_prompt=True),
every answer ends at <|im_end|>, Step 3's and eval's answers stop there (not at the tokenizer's EOS), and the exports
load in transformers with our logits."""

import itertools
import json

import jax
import numpy as np
import pytest
from test_data_chat import CHATML

from jaxrlhf.checkpoint import load_hf, save_hf
from jaxrlhf.data import DataConfig, step_records
from jaxrlhf.models import init_params, logits
from jaxrlhf.optim import OptimConfig
from jaxrlhf.reward import RewardConfig
from jaxrlhf.rl import ModelSide, PPOConfig
from jaxrlhf.sft import SFTConfig
from jaxrlhf.sharding import make_mesh
from jaxrlhf.tokenizer import load_tokenizer

EXTRA = ["yes", "no", "Hi", "again", "kind", "green"]
QUESTIONS = [f"What colour is the sky? {a} {b}" for a in EXTRA for b in EXTRA]  # 36 prompts of one length
user = lambda text: {"role": "user", "content": text}
assistant = lambda text: {"role": "assistant", "content": text}
SYSTEM = {"role": "system", "content": "You are kind."}
NO = assistant("no.")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT, EOT = 0, 2
V = 384  # the model's vocabulary: the 256 bytes, the special tokens and the merges the texts give


def qwen_tokenizer(folder):
    """A byte-level BPE tokenizer built as Qwen2's is (NFC, its split regex, byte-level pieces), trained with
    `tokenizers` on this test's texts, with the ChatML template, saved to `folder`, read back as every entry point
    reads it (in a qwen2 folder transformers builds a Qwen2Tokenizer from tokenizer.json's vocabulary and merges)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer, tok.decoder = normalizers.NFC(), decoders.ByteLevel()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    texts = QUESTIONS + ["system user assistant You are kind. It is blue. It is green. no. Hi Hello.\n"]
    trainer = trainers.BpeTrainer(
        vocab_size=V, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
        chat_template=CHATML,
    )
    fast.save_pretrained(folder)
    loaded = load_tokenizer(folder)
    text = "<|im_start|>user\nWhat colour is the sky? no Hi<|im_end|>\n"
    assert loaded(text)["input_ids"] == tok.encode(text).ids and EOT in tok.encode(text).ids  # read as built
    return loaded


def qwen2_chat_folder(folder, seed: int, std: float | None = None):
    """A random tiny Qwen2ForCausalLM with `qwen_tokenizer`; config.json lists two EOS ids, <|im_end|> first (as
    Qwen2.5-Instruct's generation config lists [<|im_end|>, <|endoftext|>]). `std`: every weight normal(0, std), norms
    1 + noise (0.2: logits of O(1), so greedy choices are far from ties), else transformers' initialisation."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=ENDOFTEXT,
        bos_token_id=ENDOFTEXT,
        eos_token_id=[EOT, ENDOFTEXT],
    )
    model = Qwen2ForCausalLM(config)
    if std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():  # biases included
                if "norm" in name:
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
                else:
                    p.normal_(0.0, std)
    model.save_pretrained(folder)
    return folder, qwen_tokenizer(folder)


def conversational_files(tmp_path):
    """Step 1's `messages` rows (one and two turns, some with a system message) and Steps 2-3's prompt/chosen/rejected
    message lists (TRL's explicit prompt, and its implicit one: whole conversations sharing their first messages)."""
    sft, pairs = [], []
    for i, q in enumerate(QUESTIONS):
        head = [SYSTEM, user(q)] if i % 2 else [user(q)]
        sft.append({"messages": head + [assistant("It is blue.")]})
        sft.append({"messages": [user("Hi"), assistant("Hello."), user(q), assistant("It is blue.")]})
        if i % 3:
            pairs.append({"prompt": head, "chosen": [assistant("It is blue.")], "rejected": [NO]})
        else:
            pairs.append({"chosen": head + [assistant("It is blue.")], "rejected": head + [assistant("It is green.")]})
    files = {}
    for name, rows in (("sft", sft * 2), ("pairs", pairs)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


def template_ids(tok, messages, generation_prompt: bool) -> list[int]:
    """transformers' own rendering and tokenization of a conversation (Messages: (role, content) pairs)."""
    conversation = [{"role": r, "content": c} for r, c in messages]
    return tok.apply_chat_template(conversation, add_generation_prompt=generation_prompt, return_dict=True)["input_ids"]


def answer_ids(tok, prompt, answer) -> list[int]:
    """An answer's tokens as the template writes them after the prompt, up to and including its <|im_end|>."""
    whole, head = template_ids(tok, prompt + answer, False), template_ids(tok, prompt, True)
    assert whole[: len(head)] == head
    rest = whole[len(head) :]
    return rest[: len(rest) - rest[::-1].index(EOT)]


def check_tokenized(data: DataConfig, tok, cache):
    """Every sequence in the steps' cached data (what they trained on) against apply_chat_template's, row by row."""
    for step in (1, 2, 3):
        (file,) = cache.glob(f"step{step}-*.npz")
        with np.load(file) as z:
            arrays = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("train/")}
        records = step_records(data, step)[0]["train"]
        fields = {1: [("", "chosen")], 2: [("chosen_", "chosen"), ("rejected_", "rejected")], 3: [("", None)]}[step]
        for prefix, field in fields:
            tokens, offsets = arrays[f"{prefix}tokens"], arrays[f"{prefix}offsets"]
            rows = [tokens[a:b].tolist() for a, b in itertools.pairwise(offsets)]
            assert len(rows) == len(records) > 0
            for i, (row, r) in enumerate(zip(rows, records)):
                prompt = template_ids(tok, r.prompt, True)
                answer = [] if field is None else answer_ids(tok, r.prompt, getattr(r, field))
                assert row == prompt + answer, (step, field, i)
                if field is not None:
                    assert arrays["prompt_len"][i] == len(prompt) and row[-1] == EOT


def test_eval_reads_prompt_only_and_conversational_rows(tmp_path):
    """eval on TRL's prompt-only rows (a GRPO prompt set) reports what needs no answer, says what it leaves out
    (perplexity, the reward model's accuracy) and takes a gold reward from metadata's reference; on conversational
    pairs the reference is the chosen message's content. Every prompt is the template's rendering."""
    from jaxrlhf.eval import EvalConfig, evaluate, final_number

    folder, tok = qwen2_chat_folder(tmp_path / "m", seed=0)
    config = load_hf(folder)[0]
    rm = save_hf(tmp_path / "rm", config, jax.device_get(init_params(config, jax.random.key(1), value_head=True)), tok)
    rows = {
        "prompt_only": [{"prompt": [user(q)], "metadata": {"reference": "It is #### 4"}} for q in QUESTIONS],
        "pairs": [{"prompt": [user(q)], "chosen": [assistant("It is #### 4")], "rejected": [NO]} for q in QUESTIONS],
    }
    for name, lines in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        data = DataConfig(
            data_path=(str(tmp_path / f"{name}.jsonl"),),
            eval_fraction=0.5,  # 7 held-out Step 3 prompts
            max_seq_len=48,
            max_prompt_len=40,
            cache_dir=str(tmp_path),
        )
        cfg = EvalConfig(
            models=(str(folder),), reward_model=str(rm), num_prompts=4, batch_size=4, max_answer_len=8, data=data
        )
        logs = []
        report = evaluate(cfg, log=logs.append)
        (row,), answers = report["models"], report["per_prompt"]["m"]["answers"]
        assert row["gold_reward"] == np.mean([final_number(a) == 4.0 for a in answers])  # the reference was read
        prompts = report["per_prompt"]["prompts"]
        want = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]
        assert len(prompts) == 4 and set(prompts) <= set(want)
        left_out = [line for line in logs if line.startswith("eval: no held-out Step")]
        if name == "prompt_only":
            assert row["perplexity"] is None and report["reward_model"] == {"path": str(rm)}
            assert [line[: line.index(":", 6)] for line in left_out] == [
                "eval: no held-out Step 1 sequences (no perplexity)",
                "eval: no held-out Step 2 pairs (no reward-model accuracy)",
            ]
        else:
            assert row["perplexity"] > 1 and report["reward_model"]["pairs"] > 0 and not left_out


def test_chat_renders_each_turn_with_the_template_and_answers_as_transformers(tmp_path):
    """python -m jaxrlhf.chat on the Qwen2 chat folder: each turn sends apply_chat_template(conversation so far,
    add_generation_prompt=True), and each answer is transformers' greedy answer to it, cut at <|im_end|>."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxrlhf.chat import ChatConfig, chat

    folder, tok = qwen2_chat_folder(tmp_path / "m", seed=0, std=0.2)
    lines = iter([QUESTIONS[0], "Hi", "quit"])
    log = chat(ChatConfig(path=str(folder), max_new_tokens=6), read=lambda _: next(lines), write=lambda _: None)
    conversation = [user(QUESTIONS[0])]
    render = lambda c: tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
    assert log[0][0] == render(conversation)
    assert log[1][0] == render(conversation + [assistant(log[0][1]), user("Hi")])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for text, reply in log:
        prompt = torch.tensor([tok(text)["input_ids"]])
        out = hf.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=EOT, pad_token_id=ENDOFTEXT)
        tokens = out[0, prompt.shape[1] :].tolist()
        tokens = tokens[: next((i for i, t in enumerate(tokens) if t in (EOT, ENDOFTEXT)), len(tokens))]
        assert reply == tok.decode(tokens, skip_special_tokens=True).strip()


def metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").open()]


@pytest.mark.slow
def test_a_qwen2_chat_model_through_steps_1_2_3_and_eval(tmp_path):
    """Steps 1-3 (PPO) and the report on conversational files. Step 1 learns to end its answers with <|im_end|>, so
    Step 3's and the report's answers stop there: none is truncated, and each ends with <|im_end|> and nothing after
    it (stopping at the tokenizer's EOS, <|endoftext|>, would run every answer to max_answer_len)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxrlhf.train import TrainConfig
    from jaxrlhf.train import run as run_train

    actor, tok = qwen2_chat_folder(tmp_path / "actor", seed=0)
    critic, _ = qwen2_chat_folder(tmp_path / "critic", seed=1)
    files = conversational_files(tmp_path)
    data = DataConfig(
        data_path=(str(files["pairs"]),),
        sft_only_data_path=(str(files["sft"]),),
        data_split="0,1,1",
        eval_fraction=0.25,
        max_seq_len=48,
        max_prompt_len=40,
        mask_prompt=True,  # Step 1 learns the answers alone: "It is blue.<|im_end|>" after every prompt
        cache_dir=str(tmp_path / "cache"),
    )
    step = dict(batch_size=8, precision="fp32", log_every=10)
    cfg = TrainConfig(
        actor_model=str(actor),
        reward_model=str(critic),
        output_dir=str(tmp_path / "run"),
        eval_prompts=4,
        data=data,
        sft=SFTConfig(
            **step,
            max_steps=60,
            sample_prompts=1,
            sample_tokens=12,
            optim=OptimConfig(learning_rate=1e-2, warmup_steps=0),
        ),
        reward=RewardConfig(**step, max_steps=2, optim=OptimConfig(learning_rate=1e-3, warmup_steps=0)),
        ppo=PPOConfig(
            batch_size=4,
            max_steps=2,
            max_answer_len=12,
            precision="fp32",
            log_every=1,
            actor=ModelSide(optim=OptimConfig(learning_rate=1e-4, warmup_steps=0)),
            critic=ModelSide(optim=OptimConfig(learning_rate=1e-4, warmup_steps=0)),
        ),
    )
    result = run_train(cfg, log=lambda _: None, mesh=make_mesh(1, jax.devices()[:1]))
    check_tokenized(data, tok, tmp_path / "cache")

    # Step 1's sample answers (greedy, at each evaluation) and Step 3's: each stopped at <|im_end|> (the engine's
    # truncation flags, in the metrics log), which decoding drops: "It is blue." and not the "\n" the template writes
    # after it. Stopping at the tokenizer's EOS (<|endoftext|>) would run every answer to its length limit.
    answer = tok("It is blue.")["input_ids"] + [EOT]
    samples = [r["samples"] for r in metrics(tmp_path / "run" / "actor-models") if "samples" in r][-1]
    assert [(s["prompt"][:12], s["after"]) for s in samples] == [("<|im_start|>", "It is blue.")]
    step3 = [r for r in metrics(tmp_path / "run" / "step3-models") if "truncated" in r]
    assert [(r["truncated"], r["answer_len"]) for r in step3] == [(0.0, len(answer))] * 2
    # The report: the same for every model's answers (sampled as Step 3 samples), on prompts rendered by the template.
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    n = report["settings"]["prompts"]
    assert [m["truncated"] for m in report["models"]] == [0.0, 0.0] and n == 4
    for name in ("step1", "actor"):
        assert report["per_prompt"][name]["answers"] == ["It is blue."] * n
        assert report["per_prompt"][name]["lengths"] == [len(answer)] * n
    for prompt in report["per_prompt"]["prompts"]:
        assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")

    # The exports: transformers loads them, with the chat template, and computes our logits.
    ids = np.array([template_ids(tok, (("user", QUESTIONS[3]),), True)], np.int32)
    for folder in (result["step1"], result["step3"]["actor"]):
        config, params = load_hf(folder)
        assert config.eos_token_id == EOT  # the first of config.json's list
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
        assert type(hf).__name__ == "Qwen2ForCausalLM" and AutoTokenizer.from_pretrained(folder).chat_template == CHATML
        ours = np.asarray(logits(config, params, ids, np.ones_like(ids)))
        np.testing.assert_allclose(ours, hf(torch.tensor(ids, dtype=torch.long)).logits.detach().numpy(), atol=1e-4)
