"""Every dataset becomes a list of `Record(prompt, chosen, rejected)`; this module holds the adapters.

    source spec                             adapter
    "synthetic"                             the built-in task (jaxrlhf.data.synthetic)
    "arithmetic"                            the built-in verifiable task (jaxrlhf.data.arithmetic)
    "Dahoas/rm-static", ... (HUB_ADAPTERS)  DeepSpeed-Chat's hub datasets, through `datasets` (needs a hub)
    path/to/file.{json,jsonl,jsonl.gz,parquet}   rows in one of the formats below
    path/to/folder                          a folder written by `datasets` (save_to_disk)

Row formats of local files: {prompt, chosen[, rejected]} (pairs, or SFT when rejected is absent or null),
{prompt, response} or {prompt, completion} (SFT), {prompt} alone (Step 3 prompt sets), {chosen, rejected} (raw
Anthropic HH-RLHF dialogues: the prompt is the text up to and including the last "\n\nAssistant:", each response
what follows it; pairs whose two prompts differ are skipped and counted), {question, answer} (GSM8K: the question
is the prompt, " " + answer the SFT response, and the answer is kept as the row's metadata {"reference": answer}
for Step 3's reward function). A prompt row may carry a "metadata" object, which reaches Step 3's reward
functions with its prompt.

TRL's conversational rows hold lists of {role, content} messages instead of strings (jaxrlhf.data.messages
renders them at tokenization): {messages} (SFT: the last assistant message is the answer, the turns before it
the prompt), {prompt, chosen[, rejected]} or {prompt, completion} with every field a list (the answers hold the
assistant turn(s) after the prompt), {chosen, rejected} as whole conversations (TRL's implicit prompt: their
common leading messages), and {prompt} alone.

Prompts keep DeepSpeed-Chat's format ("\n\nHuman: ... \n\nAssistant:" or " Human: ... Assistant:") and
responses start with their leading space, so prompt + response is the original text, exactly.
Bad rows are errors naming the file, line (or row) and field; with `on_bad_row="skip"` they are counted
and the first few reasons reported instead. Nothing is trained on silently.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jaxrlhf.config import InputError, decode_utf8, one_line, parse_json
from jaxrlhf.data import arithmetic, synthetic
from jaxrlhf.data.messages import Messages, MessagesError, common_prefix, parse_messages

ASSISTANT = "\n\nAssistant:"
# The built-in tasks, "name" or "name:N" (N pairs): each one's preference_splits(n, seed, eval_fraction)
BUILTIN_TASKS = {"synthetic": synthetic.preference_splits, "arithmetic": arithmetic.preference_splits}


class DataError(InputError):
    """Input data that cannot be used; the message names the file, line or row, and field."""


class SkipRow(DataError):
    """A row that a format defines as unusable (HH-RLHF pairs whose two prompts differ): always skipped
    and counted in the report, never an error."""


@dataclasses.dataclass(frozen=True)
class Record:
    """One example; a field is a string (used as it is) or Messages (rendered by the tokenizer's chat format)."""

    prompt: str | Messages
    chosen: str | Messages | None  # None in prompt-only (Step 3) data
    rejected: str | Messages | None = None  # None in SFT-only data
    metadata: dict | None = None  # what Step 3's reward functions get with the prompt (GSM8K: {"reference": answer})


@dataclasses.dataclass
class Report:
    """What reading a source kept and dropped, for the log (and for the user who asked to skip rows)."""

    source: str
    kept: int = 0
    skipped: int = 0
    reasons: list[str] = dataclasses.field(default_factory=list)  # the first 5

    def __str__(self):
        text = f"{self.source}: {self.kept} records"
        if self.skipped:
            text += f", {self.skipped} skipped (first reasons: {'; '.join(self.reasons)})"
        return text


# ------------------------------------------------------------------------------------------ row formats


def split_dialogue(dialogue: str) -> tuple[str, str]:
    """HH-RLHF: (prompt up to and including the last "\n\nAssistant:", the response after it)."""
    cut = dialogue.rfind(ASSISTANT)
    if cut < 0:
        raise DataError(f"no '{ASSISTANT.strip()}' turn in the dialogue")
    cut += len(ASSISTANT)
    return dialogue[:cut], dialogue[cut:]


def _text(row: dict, field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str):
        raise DataError(f"field '{field}' must be a string, got {type(value).__name__}")
    try:  # JSON's "\ud800" escape gives a str that no tokenizer (and no UTF-8 file) can hold
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(
            f"field '{field}' holds a lone UTF-16 surrogate ({value[e.start]!r} at character {e.start}), "
            "half of a character; write the file again from the original text"
        ) from None
    return value


def _messages(row: dict, field: str, last: str | None = None) -> Messages:
    try:
        return parse_messages(row.get(field), field, last=last)
    except MessagesError as e:
        raise DataError(str(e)) from None


def _conversation(row: dict) -> Record:
    """TRL's conversational rows: {messages}, {prompt, answers...} as lists, or {chosen, rejected} (implicit prompt)."""
    if "messages" in row:  # SFT: the last assistant message answers the turns before it
        messages = _messages(row, "messages", last="assistant")
        cut = max(i for i, (role, _) in enumerate(messages) if role == "assistant")
        if cut == 0:
            raise DataError("field 'messages' has no message before the last assistant message (the prompt)")
        return Record(messages[:cut], messages[cut:])
    answers = [f for f in ("chosen", "rejected", "completion", "response") if row.get(f) is not None]
    for field in answers:
        if not isinstance(row[field], list):
            raise DataError(
                f"field '{field}' must be a list of {{role, content}} messages, as 'prompt' is "
                f"(TRL's conversational format), got {type(row[field]).__name__}"
            )
    got = {f: _messages(row, f, last="assistant") for f in answers}
    if "prompt" in row:
        prompt = _messages(row, "prompt")
        if not answers and not set(row) <= {"prompt", "metadata"}:
            raise DataError(
                f"a prompt alone may carry only 'metadata' (for the reward functions); got {sorted(row)}; expected "
                "answers in chosen [+ rejected] or completion"
            )
    else:  # TRL's implicit prompt: the leading messages both conversations share
        n = common_prefix(got["chosen"], got["rejected"])
        if n == 0 or n == min(len(got["chosen"]), len(got["rejected"])):
            raise DataError(
                f"fields 'chosen' and 'rejected' share {'no' if n == 0 else 'all their'} leading messages; as "
                "whole conversations they must share the prompt and differ in the answer"
            )
        prompt, got = got["chosen"][:n], {f: m[n:] for f, m in got.items()}
    chosen = got.get("chosen", got.get("completion", got.get("response")))
    return Record(prompt, chosen, got.get("rejected"))


def _blank(value: str | Messages | None) -> bool:
    return value is not None and not "".join(value if isinstance(value, str) else (c for _, c in value)).strip()


def local_record(row: Any) -> Record:
    """One row of a local file in any of the documented formats."""
    if not isinstance(row, dict):
        raise DataError(f"expected an object with fields, got {type(row).__name__}")
    metadata = row.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise DataError(f"field 'metadata' must be an object, got {type(metadata).__name__}")
    answer = next((f for f in ("chosen", "response", "completion") if f in row), None)
    if "messages" in row or isinstance(row.get("prompt"), list) or isinstance(row.get("chosen"), list):
        record = dataclasses.replace(_conversation(row), metadata=metadata)
    elif "prompt" in row and (answer or set(row) <= {"prompt", "metadata"}):  # answers, or a prompt alone (Step 3)
        chosen = _text(row, answer) if answer else None
        rejected = None if row.get("rejected") is None else _text(row, "rejected")
        record = Record(_text(row, "prompt"), chosen, rejected, metadata)
    elif "question" in row and "answer" in row:  # GSM8K
        answer = _text(row, "answer")
        record = Record(_text(row, "question"), " " + answer, None, {"reference": answer})
    elif "chosen" in row and "rejected" in row:  # HH-RLHF dialogues
        prompt, chosen = split_dialogue(_text(row, "chosen"))
        prompt_r, rejected = split_dialogue(_text(row, "rejected"))
        if prompt != prompt_r:
            raise SkipRow("the chosen and rejected dialogues have different prompts")
        record = Record(prompt, chosen, rejected)
    else:
        raise DataError(
            "expected fields prompt + chosen [+ rejected], prompt + response (or completion), prompt alone "
            "(+ metadata), chosen + rejected (HH-RLHF dialogues), question + answer (GSM8K), or messages; "
            f"got {sorted(row)}"
        )
    if _blank(record.prompt):
        raise DataError("empty prompt")
    for field in ("chosen", "rejected"):
        if _blank(getattr(record, field)):
            raise DataError(f"prompt with no response (field '{field}' is empty)")
    return record


# ----------------------------------------------------------------------------------- DeepSpeed-Chat hub


def _webgpt_answer(row: dict, best: bool) -> str:
    first = float(row["score_0"]) >= float(row["score_1"])
    answer = row["answer_0"] if first == best else row["answer_1"]
    # Strip the citation marks ("[1]", "(2)") that only make sense with a browser, as DeepSpeed-Chat does.
    return " " + re.sub(r"[\(\[].*?[\)\]]", "", re.sub(r" [\(\[].*?[\)\]]", "", answer))


def _shp_answer(row: dict, best: bool) -> str:
    a_wins = int(row["labels"]) == 1
    return " " + (row["human_ref_A"] if a_wins == best else row["human_ref_B"])


@dataclasses.dataclass(frozen=True)
class HubAdapter:
    to_record: Callable[[dict], Record]
    eval_split: str | None  # None: carve the eval share out of "train", like DeepSpeed-Chat's "9,1"


# The formats follow DeepSpeed-Chat's raw_datasets.py, so that its users get the same text.
HUB_ADAPTERS: dict[str, HubAdapter] = {
    "Dahoas/rm-static": HubAdapter(lambda r: Record(r["prompt"], r["chosen"], r["rejected"]), "test"),
    "Dahoas/full-hh-rlhf": HubAdapter(lambda r: Record(r["prompt"], r["chosen"], r["rejected"]), "test"),
    "Dahoas/synthetic-instruct-gptj-pairwise": HubAdapter(
        lambda r: Record(" Human: " + r["prompt"] + " Assistant:", " " + r["chosen"], " " + r["rejected"]), None
    ),
    "yitingxie/rlhf-reward-datasets": HubAdapter(
        lambda r: Record(
            r["prompt"] + "Assistant:", r["chosen"].split("Assistant:")[-1], r["rejected"].split("Assistant:")[-1]
        ),
        "test",
    ),
    "openai/webgpt_comparisons": HubAdapter(
        lambda r: Record(
            " Human: " + r["question"]["full_text"] + " Assistant:", _webgpt_answer(r, True), _webgpt_answer(r, False)
        ),
        None,
    ),
    "stanfordnlp/SHP": HubAdapter(
        lambda r: Record(" Human: " + r["history"] + " Assistant:", _shp_answer(r, True), _shp_answer(r, False)),
        "validation",
    ),
}


# -------------------------------------------------------------------------------------------- reading


def _read_text(path: Path) -> str:
    """The whole file as text: gunzipped if it ends in .gz, strictly UTF-8; a broken or empty file is a DataError."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.name.lower().endswith(".gz") else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:  # truncated, not gzip at all, or a corrupt stream
        raise DataError(
            f"{path}: cannot decompress ({one_line(e)}); the file is truncated or corrupt: "
            "download or compress it again"
        ) from None
    text = decode_utf8(data, path, DataError)
    if not text.strip():
        raise DataError(f"{path}: the file is empty")
    return text


SUFFIXES = (".json", ".jsonl", ".jsonl.gz", ".json.gz", ".parquet")


def _rows(path: Path) -> Iterable[tuple[str, Any]]:
    """(location, row) for every row of a local file; location is "file:line" or "file row N"."""
    name = path.name.lower()
    if not name.endswith(SUFFIXES):
        raise DataError(f"{path}: unsupported file type; expected one of {', '.join(SUFFIXES)}")
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
            raise DataError(
                f"{path}: cannot read parquet ({one_line(e)}); the file is truncated or corrupt: write it again"
            ) from None
        yield from ((f"{path} row {i}", row) for i, row in enumerate(rows))
        return
    text = _read_text(path)
    if name.endswith(".json") and text.lstrip().startswith("["):
        yield from ((f"{path} row {i}", row) for i, row in enumerate(parse_json(text, path, error=DataError)))
        return
    # JSON lines end at "\n" only: str.splitlines would also split at U+2028 and other Unicode line breaks,
    # which JSON allows unescaped inside strings.
    for lineno, line in enumerate(text.split("\n"), 1):
        if line.strip():
            yield f"{path}:{lineno}", parse_json(line, path, lineno, DataError)


def _collect(source: str, rows: Iterable[tuple[str, Any]], convert, on_bad_row: str) -> tuple[list[Record], Report]:
    records, report = [], Report(source)
    for where, row in rows:
        try:
            records.append(convert(row))
        except (DataError, KeyError, TypeError, ValueError) as e:
            reason = f"{where}: {e if isinstance(e, DataError) else f'missing or bad field {e}'}"
            if on_bad_row != "skip" and not isinstance(e, SkipRow):
                raise DataError(reason + " (set on_bad_row to 'skip' to drop such rows)") from None
            report.skipped += 1
            if len(report.reasons) < 5:
                report.reasons.append(reason)
    if not records:
        raise DataError(f"{source}: no usable records" + (f" ({report})" if report.skipped else ""))
    report.kept = len(records)
    return records, report


def read_source(
    spec: str, *, on_bad_row: str = "error", seed: int = 1234, eval_fraction: float = 0.1
) -> dict[str, tuple[list[Record], Report]]:
    """The records of one source by split: {"train": ...} and, where the source has one, {"eval": ...}.

    The synthetic task has its own eval split (`eval_fraction` of its pairs), labelled without noise."""
    task, n = _builtin(spec)
    if task:
        splits = BUILTIN_TASKS[task](n, seed, eval_fraction)
        return {
            part: ([Record(**r) for r in rows], Report(f"{spec} [{part}]", kept=len(rows)))
            for part, rows in splits.items()
        }
    path = Path(spec)
    if path.is_file():
        return {"train": _collect(spec, _rows(path), local_record, on_bad_row)}
    if not path.is_dir() and spec not in HUB_ADAPTERS:
        known = ", ".join([*BUILTIN_TASKS, *HUB_ADAPTERS])
        raise DataError(f"{spec}: not a file, a folder, or a known dataset name (known: {known})")
    splits = _load_datasets(spec)
    if path.is_dir():
        convert, parts = local_record, {("eval" if s in ("test", "validation", "eval") else s): s for s in splits}
    else:
        adapter = HUB_ADAPTERS[spec]
        convert, parts = adapter.to_record, {"train": "train", "eval": adapter.eval_split}
    out = {}
    for part, split in parts.items():
        if split:
            rows = ((f"{spec} [{split}] row {i}", r) for i, r in enumerate(splits[split]))
            out[part] = _collect(f"{spec} [{split}]", rows, convert, on_bad_row)
    return out


def _load_datasets(spec: str) -> dict:
    """{split: rows} of a folder written by `datasets` (save_to_disk), else of a Hub dataset "name[:config]",
    downloaded into the Hub cache by huggingface_hub: where the Hub is unreachable this fails at once, where
    `load_dataset(name)` would retry for a minute first."""
    try:
        from datasets import DatasetDict, load_dataset, load_from_disk
    except ImportError:
        raise DataError(f"{spec}: reading `datasets` folders and Hub datasets needs `pip install datasets`") from None
    if Path(spec).is_dir():
        try:
            data = load_from_disk(spec)
        except FileNotFoundError:
            raise DataError(f"{spec}: not a folder written by datasets.save_to_disk (no dataset_info.json)") from None
    else:
        from huggingface_hub import snapshot_download

        name, _, config = spec.partition(":")
        try:
            data = load_dataset(snapshot_download(name, repo_type="dataset"), config or None)
        except Exception as e:  # noqa: BLE001 - offline, unknown name or revision, auth: all end the same way for the user
            raise DataError(
                f"{spec}: not a file, a folder, or a dataset the hub returned ({type(e).__name__}: "
                f"{one_line(e, 120)}); download it where a hub is reachable and pass the saved folder instead"
            ) from None
    splits = data if isinstance(data, DatasetDict) else {"train": data}
    if "train" not in splits:
        raise DataError(f"{spec}: no 'train' split (found {sorted(splits)})")
    return splits


def _builtin(spec: str) -> tuple[str | None, int]:
    """(task, N) of a built-in task's spec "task" or "task:N" (N pairs, 4000 by default), else (None, 0)."""
    task, _, n = spec.partition(":")
    if task not in BUILTIN_TASKS:
        return None, 0
    if not (n or "4000").isdecimal():
        raise DataError(f"{spec}: expected '{task}' or '{task}:N', N the number of pairs")
    return task, int(n or "4000")


# Rows of a built-in task generated for its cache key: a changed default or generator changes them.
BUILTIN_PROBE = 256


def fingerprint(spec: str) -> str:
    """A hash of a source's identity and content (file bytes; a built-in task's first BUILTIN_PROBE rows, generated
    with seed 0, so a changed task default serves no stale cache; for hub names, the name), for the cache key."""
    path = Path(spec)
    h = hashlib.sha256(spec.encode())
    task, n = _builtin(spec)
    if task:
        probe = BUILTIN_TASKS[task](min(n, BUILTIN_PROBE), 0, 0.1)
        return hashlib.sha256(h.digest() + json.dumps(probe, sort_keys=True, default=str).encode()).hexdigest()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def read_texts(spec: str) -> list[str]:
    """Plain texts for the unsupervised (pretraining-mixture) set: a .txt file (one text), rows with a
    "text" field in json/jsonl/parquet files or datasets folders, or a hub dataset "name[:config]"."""
    path = Path(spec)
    if path.is_file() and path.suffix == ".txt":
        return [_read_text(path)]

    def text_field(row):
        if not isinstance(row, dict) or "text" not in row:
            raise DataError(
                f"expected a row with a string field 'text', got {sorted(row) if isinstance(row, dict) else row!r}"
            )
        return _text(row, "text")

    if path.is_file():
        return _collect(spec, _rows(path), text_field, "error")[0]
    rows = ((f"{spec} row {i}", row) for i, row in enumerate(_load_datasets(spec)["train"]))
    return _collect(spec, rows, text_field, "error")[0]
