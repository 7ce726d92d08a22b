"""Rows longer than the model's positions are refused before anything compiles, in Steps 1, 2 and DPO (Step 3:
test_ppo) and by `python -m jaxrlhf.data`, with the setting to change; a refused run leaves no output folder."""

import json
import re

import jax
import pytest

from jaxrlhf import OPTConfig, init_params, opt_tokenizer, save_hf
from jaxrlhf.data.__main__ import main as data_main
from jaxrlhf.dpo import main as dpo_main
from jaxrlhf.reward import main as reward_main
from jaxrlhf.sft import main as sft_main

# 64 positions: the rows below (prompts of ~50 tokens, answers of ~40) do not fit at max_seq_len 256
TINY = dict(vocab_size=50272, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32)
TOO_LONG = "data.max_seq_len (256) exceeds the model's 64 positions (sequences of "


@pytest.fixture(scope="module")
def model(assets, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lengths") / "model"
    config = OPTConfig(**TINY, max_position_embeddings=64, word_embed_proj_dim=16)
    params = jax.device_get(init_params(config, jax.random.key(0)))
    return save_hf(folder, config, params, opt_tokenizer(assets / "opt-tokenizer"))


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory):
    file = tmp_path_factory.mktemp("lengths") / "long.jsonl"
    rows = [
        {
            "prompt": f"\n\nHuman: tell me a story about {'a cat and a dog ' * (5 + i % 8)}\n\nAssistant:",
            "chosen": " Once upon a time there was a cat" * 5,
            "rejected": " No." * (10 + i),
        }
        for i in range(30)
    ]
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return file


@pytest.fixture
def compiles():
    """The names of the functions XLA compiles during a test (eager ops like a fresh value head's random draw too)."""
    seen = []
    listener = lambda event, _, fun_name="", **__: (
        seen.append(fun_name) if event.endswith("backend_compile_duration") else None
    )
    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


def data_args(rows, tmp_path, max_seq_len):
    return [f"data.data_path=[{rows}]", "data.data_split=1,1,1", f"data.max_seq_len={max_seq_len}"] + [
        f"data.cache_dir={tmp_path / 'cache'}"
    ]


@pytest.mark.parametrize("main", [sft_main, reward_main, dpo_main], ids=["sft", "reward", "dpo"])
def test_each_step_refuses_rows_longer_than_the_model_before_compiling(
    main, model, long_rows, tmp_path, capsys, compiles
):
    out = tmp_path / "runs" / "step"
    with pytest.raises(SystemExit) as e:
        main(
            [f"model={model}", f"output_dir={out}", "max_steps=2", "batch_size=8", *data_args(long_rows, tmp_path, 256)]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and TOO_LONG in err and "set data.max_seq_len=64 or lower" in err, err
    assert not [name for name in compiles if "train_step" in name], compiles  # jit(train_step) never compiled
    assert not (tmp_path / "runs").exists()  # the refused run left no output folder (nor its parent)


def test_the_samples_must_fit_after_their_prompts(model, long_rows, tmp_path, capsys, compiles):
    """Step 1's prompt_eval answers held-out prompts (cut to fit max_seq_len 64) with sample_tokens more tokens."""
    args = [
        f"model={model}",
        f"output_dir={tmp_path / 'sft'}",
        "sample_tokens=40",
        "batch_size=8",
        *data_args(long_rows, tmp_path, 64),
    ]
    with pytest.raises(SystemExit):
        sft_main(args)
    err = capsys.readouterr().err
    assert "sample_tokens (40) after a prompt exceeds the model's 64 positions" in err, err
    assert "lower sample_tokens, or sample_prompts=0" in err and not [name for name in compiles if "train_step" in name]


def test_data_command_reports_rows_longer_than_the_model(model, long_rows, tmp_path, capsys):
    with pytest.raises(SystemExit):
        data_main([f"tokenizer={model}", "steps=[2]", *data_args(long_rows, tmp_path, 256)])
    captured = capsys.readouterr()
    longest = re.search(r"step 2: 9 train, 1 eval, the longest (\d+) tokens", captured.out).group(1)
    assert f"{TOO_LONG}{longest} tokens)" in captured.err and int(longest) > 64
    fit = [*data_args(long_rows, tmp_path, 64), "data.max_prompt_len=48"]  # rows cut to fit, long prompts dropped
    data_main([f"tokenizer={model}", "steps=[1, 2, 3]", *fit])
    out = capsys.readouterr().out
    assert "step 1: 9 train, 1 eval, the longest 64 tokens" in out and "step 2: 9 train, 1 eval, the longest 64" in out


def test_data_command_checks_the_unsupervised_blocks(model, long_rows, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("A cat and a dog went for a walk in the park. " * 40)
    args = [f"tokenizer={model}", "steps=[]", f"data.unsupervised_data_path=[{texts}]", f"data.cache_dir={tmp_path}"]
    with pytest.raises(SystemExit):
        data_main([*args, "data.unsupervised_block_size=128"])
    assert "data.unsupervised_block_size (128) exceeds the model's 64 positions" in capsys.readouterr().err
    data_main([*args, "data.unsupervised_block_size=64"])


def test_a_refused_run_writes_nothing_where_it_was_started(model, tmp_path, monkeypatch, capsys):
    """The default output_dir is relative (runs/sft): a run refused after start_run wrote its settings there (an
    unreachable Hub, rows too long) must not leave runs/ in the folder it was started from (a checkout)."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("the Hub is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        sft_main(["model=facebook/opt-125m"])
    assert "facebook/opt-125m: no such folder, and the Hugging Face Hub is unreachable" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "runs" / "sft").mkdir(parents=True)  # a folder that was there before stays
    with pytest.raises(SystemExit):
        sft_main(["model=facebook/opt-125m"])
    assert (tmp_path / "runs" / "sft").is_dir()


def test_step_3_says_which_setting_dropped_its_prompts(model, long_rows, tmp_path, capsys):
    """Prompts over data.max_prompt_len are dropped (DeepSpeed-Chat's way); where that leaves less than a batch, the
    error names the setting and the longest prompt, not 'use more data'."""
    from jaxrlhf.ppo import main as ppo_main

    args = [f"actor.model={model}", f"output_dir={tmp_path / 'ppo'}", "batch_size=8", "algorithm=grpo"]
    args += ["num_samples_per_prompt=2", "reward.functions=[jaxrlhf.rewards:gsm8k]"]  # no reward model to load
    with pytest.raises(SystemExit) as e:
        ppo_main([*args, "max_answer_len=8", *data_args(long_rows, tmp_path, 64), "data.max_prompt_len=20"])
    err = capsys.readouterr().err
    said = re.search(
        r"data\.max_prompt_len \(20\): (\d+) of the step 3 set's (\d+) prompts are longer and were dropped", err
    )
    longest = re.search(r"raise data\.max_prompt_len \(the longest prompt has (\d+) tokens", err)
    assert e.value.code == 2 and said and said[1] == said[2] and longest and int(longest[1]) > 20, err
    assert not (tmp_path / "ppo").exists()
