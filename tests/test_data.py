"""Sources, per-step splits, tokenization, cache and batches, on real HH-RLHF text and the OPT tokenizer."""

import dataclasses
import gzip
import json

import numpy as np
import pytest

from jaxrlhf.data import (
    Batches,
    DataConfig,
    DataError,
    Record,
    make_batch,
    prepare,
    read_source,
    step_indices,
    step_records,
    tokenize,
)
from jaxrlhf.data.sources import HUB_ADAPTERS, read_texts
from jaxrlhf.tokenizer import opt_tokenizer


@pytest.fixture(scope="module")
def hh(assets):
    return assets / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"


@pytest.fixture(scope="module")
def tok(assets):
    return opt_tokenizer(assets / "opt-tokenizer")


def test_hh_rlhf_parses_and_reconstructs_the_dialogues(hh):
    with gzip.open(hh, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2312
    records, report = read_source(str(hh), on_bad_row="skip")["train"]
    # 4 pairs have an empty chosen response; 5 have chosen/rejected dialogues with different prompts.
    assert (report.kept, report.skipped) == (2303, 9)
    assert "harmless-base-test.jsonl.gz:87: prompt with no response (field 'chosen' is empty)" in report.reasons[0]
    by_dialogue = {row["chosen"]: row["rejected"] for row in rows}
    for r in records:
        assert r.prompt.endswith("\n\nAssistant:") and r.prompt.startswith("\n\nHuman:")
        assert by_dialogue[r.prompt + r.chosen] == r.prompt + r.rejected  # exact reconstruction


def test_hh_rlhf_without_skip_stops_at_the_first_bad_row(hh):
    with pytest.raises(
        DataError, match=r"jsonl\.gz:87: prompt with no response \(field 'chosen' is empty\) \(set on_bad_row to 'skip'"
    ):
        read_source(str(hh))


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "Hi", "chosen": 3}', r"x\.jsonl:2: field 'chosen' must be a string, got int"),
        (
            '{"prompt": "Hi", "answer": "yo"}',
            r"x\.jsonl:2: expected fields prompt \+ chosen .* got \['answer', 'prompt'\]",
        ),
        ('{"prompt": "Hi", "chosen": "  "}', r"x\.jsonl:2: prompt with no response \(field 'chosen' is empty\)"),
        ('{"prompt": "Hi", "chosen": ', r"x\.jsonl:2: invalid JSON"),
        ("[1, 2]", r"x\.jsonl:2: expected an object with fields, got list"),
        ('{"chosen": "no assistant turn", "rejected": "x"}', r"x\.jsonl:2: no 'Assistant:' turn"),
        (
            '{"prompt": "Hi \\ud800", "chosen": " b"}',  # JSON's escape of half a character: the tokenizer's TypeError
            r"x\.jsonl:2: field 'prompt' holds a lone UTF-16 surrogate \('\\ud800' at character 3\)",
        ),
    ],
)
def test_bad_rows_name_file_line_and_field(tmp_path, line, message):
    f = _write(
        tmp_path / "x.jsonl", ['{"prompt": "\\n\\nHuman: a\\n\\nAssistant:", "chosen": " b", "rejected": " c"}', line]
    )
    with pytest.raises(DataError, match=message):
        read_source(str(f))
    if "invalid JSON" not in message:  # a broken line is not a row we can skip past safely
        records, report = read_source(str(f), on_bad_row="skip")["train"]
        assert (len(records), report.skipped) == (1, 1)


def test_other_bad_inputs(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: the file is empty"):
        read_source(str(tmp_path / "empty.jsonl"))
    with pytest.raises(DataError, match="synthetic:ten: expected 'synthetic' or 'synthetic:N'"):  # was a ValueError
        read_source("synthetic:ten")
    with pytest.raises(DataError, match="Dahoas/rm-statik: not a file, a folder, or a known dataset name"):
        read_source("Dahoas/rm-statik")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        read_source(str(tmp_path / "data.csv"))
    (tmp_path / "arr.json").write_text('[\n{"prompt": "p",\n "chosen" "x"}\n]')
    with pytest.raises(DataError, match=r"arr\.json:3: invalid JSON"):
        read_source(str(tmp_path / "arr.json"))


def _one_line_error(spec, match, **kwargs):
    with pytest.raises(DataError, match=match) as e:
        read_source(str(spec), **kwargs)
    assert "\n" not in str(e.value)


def test_broken_files_are_one_line_errors_naming_the_file(tmp_path):
    text = "".join(
        json.dumps({"prompt": f" Human: q{i} Assistant:", "chosen": f" a{i}"}) + "\n" for i in range(50)
    ).encode()
    packed = gzip.compress(text)
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])  # was EOFError
    _one_line_error(
        tmp_path / "cut.jsonl.gz", r"cut\.jsonl\.gz: cannot decompress \(.*\); the file is truncated or corrupt"
    )
    (tmp_path / "plain.jsonl.gz").write_bytes(text)  # was gzip.BadGzipFile
    _one_line_error(tmp_path / "plain.jsonl.gz", r"plain\.jsonl\.gz: cannot decompress \(Not a gzipped file")
    latin = text + '{"prompt": " Human: caf\u00e9 Assistant:", "chosen": " a"}\n'.encode("latin-1")
    (tmp_path / "latin.jsonl").write_bytes(latin)  # was a UnicodeDecodeError without the file's name
    _one_line_error(tmp_path / "latin.jsonl", r"latin\.jsonl:51: not UTF-8 \(byte 0xe9\); save the file as UTF-8")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + text[:100] + b"PAR1")  # was an ArrowInvalid
    _one_line_error(
        tmp_path / "bad.parquet", r"bad\.parquet: cannot read parquet \(.*\); the file is truncated or corrupt"
    )
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "\n")  # was a RecursionError
    _one_line_error(tmp_path / "deep.jsonl", r"deep\.jsonl:1: invalid JSON \(nested too deeply\)")


def test_json_lines_end_at_newline_only(tmp_path):
    # U+2028 and U+0085 are line breaks to str.splitlines, but JSON allows them unescaped inside a string.
    rows = [
        {"prompt": " Human: a\u2028b\u0085c Assistant:", "chosen": " d\u2029e"},
        {"prompt": " Human: f Assistant:", "chosen": 3},
    ]
    f = tmp_path / "x.jsonl"
    f.write_bytes(b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\r\n" for r in rows))
    _one_line_error(f, r"x\.jsonl:2: field 'chosen' must be a string")  # the line count is the file's
    assert read_source(str(f), on_bad_row="skip")["train"][0] == [Record(**rows[0])]


def test_pairs_missing_rejected_are_refused_for_step_2_in_eval_too(tmp_path):
    rows = [{"prompt": f" Human: q{i} Assistant:", "chosen": f" a{i}", "rejected": f" b{i}"} for i in range(9)]
    f = _write(
        tmp_path / "x.jsonl", [json.dumps(r) for r in rows] + ['{"prompt": " Human: q Assistant:", "chosen": " a"}']
    )
    for seed in range(6):  # wherever the SFT row lands: train or eval (before: eval rows reached the tokenizer as None)
        with pytest.raises(DataError, match=r"x\.jsonl: has rows without a rejected response"):
            step_records(DataConfig(data_path=(str(f),), eval_fraction=0.5, seed=seed), 2)


def test_local_formats_json_parquet_datasets_folder(tmp_path):
    import datasets

    rows = [{"prompt": f" Human: q{i} Assistant:", "chosen": f" good {i}", "rejected": f" bad {i}"} for i in range(6)]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:2])}
    ).save_to_disk(str(tmp_path / "d"))
    want = [Record(**r) for r in rows]
    for name in ("a.json", "b.jsonl.gz", "c.parquet"):
        assert read_source(str(tmp_path / name))["train"][0] == want
    folder = read_source(str(tmp_path / "d"))
    assert folder["train"][0] == want and folder["eval"][0] == want[:2]
    sft = _write(tmp_path / "sft.jsonl", ['{"prompt": " Human: hi Assistant:", "response": " hello"}'])
    assert read_source(str(sft))["train"][0] == [Record(" Human: hi Assistant:", " hello", None)]


def test_hub_adapters_follow_deepspeed_chat():
    webgpt = {
        "question": {"full_text": "Why?"},
        "answer_0": "Because [1] it is (2).",
        "answer_1": "No.",
        "score_0": 1.0,
        "score_1": -1.0,
    }
    assert HUB_ADAPTERS["openai/webgpt_comparisons"].to_record(webgpt) == Record(
        " Human: Why? Assistant:", " Because it is.", " No."
    )
    shp = {"history": "Q", "human_ref_A": "a", "human_ref_B": "b", "labels": 0}
    assert HUB_ADAPTERS["stanfordnlp/SHP"].to_record(shp) == Record(" Human: Q Assistant:", " b", " a")
    yx = {"prompt": "Human: Q ", "chosen": "Human: Q Assistant: yes", "rejected": "Human: Q Assistant: no"}
    assert HUB_ADAPTERS["yitingxie/rlhf-reward-datasets"].to_record(yx) == Record("Human: Q Assistant:", " yes", " no")
    gptj = {"prompt": "Q", "chosen": "a", "rejected": "b"}
    assert HUB_ADAPTERS["Dahoas/synthetic-instruct-gptj-pairwise"].to_record(gptj) == Record(
        " Human: Q Assistant:", " a", " b"
    )


def test_step_shares_are_disjoint_cover_and_are_reproducible():
    shares = [step_indices(1000, "2,4,4", s, seed=7, name="x") for s in (1, 2, 3)]
    assert [len(s) for s in shares] == [200, 400, 400]
    assert np.array_equal(np.sort(np.concatenate(shares)), np.arange(1000))
    assert all(np.array_equal(a, step_indices(1000, "2,4,4", s, seed=7, name="x")) for s, a in zip((1, 2, 3), shares))
    assert not np.array_equal(shares[0], step_indices(1000, "2,4,4", 1, seed=8, name="x"))
    assert (
        len(step_indices(10, "1,0,0", 1, seed=0, name="x")) == 10
        and len(step_indices(10, "1,0,0", 2, seed=0, name="x")) == 0
    )
    for bad in ("2,4", "nan,1,1", "inf,1,1"):  # a NaN share passed `< 0` and cut the sources at garbage bounds
        with pytest.raises(ValueError, match="data_split: expected three non-negative numbers"):
            DataConfig(data_split=bad)


def test_step_records_blend_sources_and_keep_sft_only_data_in_step_1(tmp_path, hh):
    sft = _write(
        tmp_path / "sft.jsonl",
        [json.dumps({"prompt": f" Human: {i} Assistant:", "response": f" r{i}"}) for i in range(30)],
    )
    config = DataConfig(data_path=(str(hh),), sft_only_data_path=(str(sft),), on_bad_row="skip", eval_fraction=0.1)
    steps = {s: step_records(config, s)[0] for s in (1, 2, 3)}
    hh_train = {(r.prompt, r.chosen) for s in (1, 2, 3) for r in steps[s]["train"] if r.rejected is not None}
    hh_eval = {(r.prompt, r.chosen) for s in (1, 2, 3) for r in steps[s]["eval"] if r.rejected is not None}
    assert len(hh_train) + len(hh_eval) == len(
        {(r.prompt, r.chosen) for r in read_source(str(hh), on_bad_row="skip")["train"][0]}
    )
    assert not hh_train & hh_eval
    sft_rows = [r for r in steps[1]["train"] + steps[1]["eval"] if r.rejected is None]
    assert len(sft_rows) == 30 and all(r.rejected is not None for s in (2, 3) for r in steps[s]["train"])
    assert steps[1] == step_records(config, 1)[0]  # reproducible, including the blend order
    with pytest.raises(DataError, match="sft.jsonl: has rows without a rejected response.*sft_only_data_path"):
        step_records(dataclasses.replace(config, data_path=(str(sft),), sft_only_data_path=()), 2)


def test_the_splits_do_not_depend_on_where_the_files_are(tmp_path):
    """The same files in another folder (a pytest tmp_path, another machine's checkout) give the same held-out rows,
    step shares and blend: the seeded shuffles are keyed on the file's name, not its path. Keyed on the path, the
    stories slow test drew another Step 2 / Step 3 split in every run (its gold reward 0.36 to 0.94)."""
    rows = [
        json.dumps({"prompt": f" Human: {i} Assistant:", "chosen": f" c{i}", "rejected": f" r{i}"}) for i in range(60)
    ]
    demos = [json.dumps({"prompt": f" Human: {i} Assistant:", "response": f" d{i}"}) for i in range(40)]
    configs = []
    for where in ("a", "b/deeper", "c"):
        (tmp_path / where).mkdir(parents=True)
    for where in ("a", "b/deeper"):
        pairs, sft = _write(tmp_path / where / "pairs.jsonl", rows), _write(tmp_path / where / "demos.jsonl", demos)
        configs.append(DataConfig(data_path=(str(pairs),), sft_only_data_path=(str(sft),), data_split="1,1,1"))
    for step in (1, 2, 3):
        assert step_records(configs[0], step)[0] == step_records(configs[1], step)[0], step
    renamed = _write(tmp_path / "c" / "other.jsonl", rows)  # another name: another (seeded) split
    other = step_records(dataclasses.replace(configs[0], data_path=(str(renamed),)), 2)[0]
    assert other != step_records(configs[0], 2)[0]


def test_tokenized_batches_for_each_step(hh, tok):
    records = read_source(str(hh), on_bad_row="skip")["train"][0][:64]
    config = DataConfig(max_seq_len=128, max_prompt_len=96)
    r0 = records[0]
    prompt_ids = tok(r0.prompt, add_special_tokens=False)["input_ids"]
    chosen_ids = tok(r0.chosen, add_special_tokens=False)["input_ids"]

    # Record 0 (206 + 28 tokens, rejected 63) is too long: its prompt loses its oldest tokens after BOS, so that
    # the whole answer and EOS still fit; in Step 2 by the same count in both halves, set by the longer answer.
    arrays, stats = tokenize(records, tok, 1, config)
    b = make_batch(arrays, [0, 1], 1, config, tok.pad_token_id)
    assert b["input_ids"].shape == (2, 128)
    kept = prompt_ids[len(prompt_ids) + len(chosen_ids) + 2 - 128 :]
    assert len(kept) == 98 and b["input_ids"][0].tolist() == [2] + kept + chosen_ids + [2]  # BOS ... EOS, fills 128
    assert b["attention_mask"][0].sum() == 128 and b["loss_mask"][0].tolist() == [0] + [1] * 127
    masked = make_batch(arrays, [0], 1, dataclasses.replace(config, mask_prompt=True), tok.pad_token_id)
    assert masked["loss_mask"][0].tolist() == [0] * (1 + len(kept)) + [1] * (len(chosen_ids) + 1)
    assert (
        tok.decode(b["input_ids"][1][b["attention_mask"][1] == 1][1:-1]) == (records[1].prompt + records[1].chosen)
        or stats["prompts_cut"]
    )

    arrays, stats = tokenize(records, tok, 2, config)
    b = make_batch(arrays, [0], 2, config, tok.pad_token_id)
    assert b["chosen_ids"].shape == b["rejected_ids"].shape == (1, 128)
    rejected_ids = tok(r0.rejected, add_special_tokens=False)["input_ids"]
    kept = prompt_ids[len(prompt_ids) + len(rejected_ids) + 2 - 128 :]
    assert b["rejected_ids"][0].tolist() == [2] + kept + rejected_ids + [2]
    n = 1 + len(kept) + len(chosen_ids) + 1
    assert b["chosen_ids"][0, :n].tolist() == [2] + kept + chosen_ids + [2] and b["chosen_mask"][0].sum() == n
    # The prompt keeps what the longer answer leaves of the 126 tokens besides BOS and EOS, and at least 63.
    lengths = [
        [len(tok(t, add_special_tokens=False)["input_ids"]) for t in (r.prompt, r.chosen, r.rejected)] for r in records
    ]
    kept = [min(p, max(126 - max(c, r), 63)) for p, c, r in lengths]
    assert stats["prompts_cut"] == sum(k < p for k, (p, _, _) in zip(kept, lengths)) > 0
    assert stats["chosen_truncated"] == sum(k + c > 126 for k, (_, c, _) in zip(kept, lengths)) > 0

    arrays, stats = tokenize(records, tok, 3, config)
    lengths = [len(tok(r.prompt, add_special_tokens=False)["input_ids"]) + 1 for r in records]
    assert stats["dropped_too_long"] == sum(length > 96 for length in lengths) > 0
    kept = [i for i, length in enumerate(lengths) if length <= 96]
    b = make_batch(arrays, [0], 3, config, tok.pad_token_id)
    want = [2] + tok(records[kept[0]].prompt, add_special_tokens=False)["input_ids"]
    assert b["prompt_ids"][0, 96 - len(want) :].tolist() == want  # LEFT-padded
    assert (b["prompt_ids"][0, : 96 - len(want)] == 1).all() and b["prompt_mask"][0].sum() == len(want)


def test_cache_is_hit_and_rebuilt_when_a_source_changes(tmp_path, tok):
    rows = [
        json.dumps({"prompt": f" Human: {i} Assistant:", "chosen": f" yes {i}", "rejected": f" no {i}"})
        for i in range(50)
    ]
    src = _write(tmp_path / "pairs.jsonl", rows)
    config = DataConfig(data_path=(str(src),), cache_dir=str(tmp_path / "cache"), max_seq_len=32)
    logs = []
    first = prepare(config, 2, tok, log=logs.append)
    assert not any("from cache" in line for line in logs)
    second = prepare(config, 2, tok, log=logs.append)
    assert "from cache" in logs[-1]
    for part in ("train", "eval"):
        for key in first[part]:
            np.testing.assert_array_equal(first[part][key], second[part][key])
    assert second["stats"] == first["stats"]
    _write(src, rows[:-1] + [rows[-1].replace("yes", "YES")])
    logs.clear()
    prepare(config, 2, tok, log=logs.append)
    assert not any("from cache" in line for line in logs)
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2 and not list((tmp_path / "cache").glob("*.tmp"))


def test_batches_are_deterministic_and_resume_mid_epoch(tok):
    records = [Record(f" Human: {i} Assistant:", f" a{i}", f" b{i}") for i in range(40)]
    config = DataConfig(max_seq_len=16, seed=3)
    arrays, _ = tokenize(records, tok, 1, config)
    it = iter(Batches(arrays, 1, 8, config, tok.pad_token_id))
    run = [next(it)["input_ids"] for _ in range(7)]  # 5 batches per epoch: crosses into epoch 1
    again = iter(Batches(arrays, 1, 8, config, tok.pad_token_id))
    assert all(np.array_equal(a, next(again)["input_ids"]) for a in run)
    epoch0 = np.concatenate(run[:5])
    assert len({tuple(r) for r in epoch0}) == 40  # every row once per epoch
    resumed = Batches(arrays, 1, 8, config, tok.pad_token_id, epoch=0, position=3)
    it = iter(resumed)
    assert np.array_equal(next(it)["input_ids"], run[3]) and np.array_equal(next(it)["input_ids"], run[4])
    assert np.array_equal(next(it)["input_ids"], run[5]) and resumed.state() == {"epoch": 1, "position": 1}
    halves = [
        next(iter(Batches(arrays, 1, 8, config, tok.pad_token_id, process_index=p, process_count=2)))["input_ids"]
        for p in (0, 1)
    ]
    assert np.array_equal(np.concatenate(halves), run[0])  # two processes split every global batch
    with pytest.raises(ValueError, match="fewer than one batch of 64"):
        Batches(arrays, 1, 64, config, tok.pad_token_id)


def test_place_splits_the_batch_over_the_mesh(tok):
    import jax

    from jaxrlhf import make_mesh
    from jaxrlhf.optim import place

    mesh = make_mesh(tp=2)
    batch = {"prompt_ids": np.arange(8 * 4, dtype=np.int32).reshape(8, 4)}
    placed = place(batch, mesh, "tp")
    assert placed["prompt_ids"].sharding.spec == jax.sharding.PartitionSpec("data")
    np.testing.assert_array_equal(np.asarray(placed["prompt_ids"]), batch["prompt_ids"])
    with pytest.raises(ValueError, match="batch of 6 rows does not split over the 8 devices"):
        place({"x": np.zeros((6, 2))}, mesh, "fsdp")


def test_synthetic_source_is_the_default_and_feeds_every_step(tok):
    from jaxrlhf.data.synthetic import gold_reward

    config = DataConfig()
    assert config.data_path == ("synthetic",)
    sizes = {s: len(step_records(config, s)[0]["train"]) for s in (1, 2, 3)}
    assert sizes == {1: 720, 2: 1440, 3: 1440}  # 4000 pairs, 10 % held out for eval, then 2:4:4
    pairs = step_records(config, 2)[0]["train"]
    rewards = np.array([[gold_reward(r.prompt, r.chosen), gold_reward(r.prompt, r.rejected)] for r in pairs])
    assert 0.85 < np.mean(rewards[:, 0] > rewards[:, 1]) < 0.95  # labels by the gold rule, 10 % flipped


def test_unsupervised_blocks_for_the_mixture_loss(tmp_path, tok, assets):
    lines = (assets / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()
    texts = [json.loads(line)["question"] for line in lines][:50]
    src = _write(tmp_path / "texts.jsonl", [json.dumps({"text": t}) for t in texts])
    config = DataConfig(unsupervised_data_path=(str(src),), unsupervised_block_size=64, cache_dir=str(tmp_path / "c"))
    data = prepare(config, "unsupervised", tok, log=lambda _: None)
    stream = [t for ids in tok(texts, add_special_tokens=False)["input_ids"] for t in ids + [2]]
    n = len(stream) // 64
    assert data["stats"]["train"]["blocks"] == n
    b = make_batch(data["train"], [0, n - 1], "unsupervised", config, tok.pad_token_id)
    assert b["input_ids"][0].tolist() == stream[:64] and b["input_ids"][1].tolist() == stream[(n - 1) * 64 : n * 64]
    assert b["attention_mask"].all() and b["loss_mask"][:, 1:].all()
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: expected a row with a string field 'text', got \['txt'\]"):
        prepare(dataclasses.replace(config, unsupervised_data_path=(str(tmp_path / "bad.jsonl"),)), "unsupervised", tok)


def test_prepare_cli(assets, tmp_path, capsys):
    from jaxrlhf.data.__main__ import main

    main([f"tokenizer={assets / 'opt-tokenizer'}", "steps=[3]", f"data.cache_dir={tmp_path}", "data.max_prompt_len=32"])
    out = capsys.readouterr().out
    assert "step 3: 1440 train, 160 eval" in out and "prompt_ids sample: '</s>\\n\\nHuman: Sort these letters:" in out
    for args, message in (
        (["steps=[1]"], "error: tokenizer: required"),
        ([f"tokenizer={tmp_path}"], "no tokenizer found"),
    ):
        with pytest.raises(SystemExit):
            main(args)
        assert message in capsys.readouterr().err


def test_hub_datasets_come_through_huggingface_hub_and_fail_at_once_offline(tmp_path, monkeypatch):
    """A Hub name is downloaded by huggingface_hub (offline: an error at once; `datasets` alone retried for a
    minute), then read from the snapshot folder like a local one."""
    import time

    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    start = time.perf_counter()
    with pytest.raises(
        DataError, match=r"^Dahoas/rm-static: not a file, a folder, or a dataset the hub returned \(LocalEntryNot"
    ):
        read_source("Dahoas/rm-static")
    with pytest.raises(DataError, match=r"^wikitext:wikitext-2-raw-v1: not a file, a folder, or a dataset the hub"):
        read_texts("wikitext:wikitext-2-raw-v1")
    assert time.perf_counter() - start < 2.0
    snapshot = tmp_path / "snapshot"
    (snapshot / "data").mkdir(parents=True)
    for split, answer in [("train", " a"), ("test", " c")]:
        row = {"prompt": " Human: Q Assistant:", "response": answer, "chosen": answer, "rejected": " b"}
        (snapshot / "data" / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda name, repo_type: str(snapshot))
    data = read_source("Dahoas/rm-static")
    assert (data["train"][0], data["eval"][0]) == (
        [Record(" Human: Q Assistant:", " a", " b")],
        [Record(" Human: Q Assistant:", " c", " b")],
    )


def test_gsm8k_rows_and_metadata_reach_step_3_batches(tmp_path, tok):
    gsm = [
        {
            "question": f"Tom has {i} apples and buys {i + 1}. How many now?",
            "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}",
        }
        for i in range(8)
    ]
    long = {"question": "Why? " * 300, "answer": "#### 0"}  # over max_prompt_len: dropped, and its metadata with it
    src = _write(tmp_path / "gsm8k.jsonl", [json.dumps(r) for r in [long] + gsm])
    assert read_source(str(src))["train"][0][1] == Record(
        gsm[0]["question"], " " + gsm[0]["answer"], None, {"reference": gsm[0]["answer"]}
    )
    own = _write(
        tmp_path / "own.jsonl",
        [
            '{"prompt": " Human: 1+1? Assistant:", "chosen": " 2", "metadata": {"tests": ["2"]}}',
            '{"prompt": " Human: hi Assistant:", "chosen": " hello"}',
        ],
    )
    assert [r.metadata for r in read_source(str(own))["train"][0]] == [{"tests": ["2"]}, None]
    bad = _write(tmp_path / "bad.jsonl", ['{"prompt": " Human: hi Assistant:", "chosen": " hello", "metadata": [1]}'])
    _one_line_error(bad, r"bad\.jsonl:1: field 'metadata' must be an object, got list")
    config = DataConfig(
        data_path=(str(src), str(own)), data_split="0,0,1", eval_fraction=0.0, cache_dir=str(tmp_path / "cache")
    )
    for _ in range(2):  # tokenized, then from the cache
        data = prepare(config, 3, tok, log=lambda _: None)
        assert data["stats"]["train"]["dropped_too_long"] == 1
        batch = next(iter(Batches(data["train"], 3, 8, config, tok.pad_token_id)))
        prompts = [tok.decode(r[m.astype(bool)][1:]) for r, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
        want = {r["question"]: {"reference": r["answer"]} for r in gsm} | {
            " Human: 1+1? Assistant:": {"tests": ["2"]},
            " Human: hi Assistant:": {},
        }
        assert set(prompts) <= set(want) and len(set(prompts)) == 8 and batch["metadata"] == [want[p] for p in prompts]
