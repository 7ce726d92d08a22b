"""Records -> each step's tokenized set: split per step, blend, tokenize, cache.

    sources ──read──► records per source ──data_split "2,4,4"──► this step's share of each source
            ──blend (concatenate, seeded shuffle)──► tokenize for the step ──► cached on disk (npz, atomic)

Shares are a seeded permutation of each source cut at the cumulative fractions of `data_split`, so they
are disjoint, cover the source, and are the same whichever step asks (DeepSpeed-Chat's scheme). Sources
without their own eval split give `eval_fraction` of their rows to eval first. SFT-only sources
(`sft_only_data_path`) go to Step 1 whole.

Tokenized sets are ragged (tokens + offsets), padded only when batched (batches.py):
    step 1   sequence = BOS + prompt + chosen + EOS, cut to max_seq_len (see tokenize); `prompt_len` for the loss mask
    step 2   chosen and rejected sequences as in step 1
    step 3   BOS + prompt; prompts longer than max_prompt_len are dropped (and counted), never cut; each
             prompt's metadata (Record.metadata) as a JSON string, for the reward functions (jaxrlhf.rewards)
    conversational rows: the chat template's rendering with no BOS of ours, answers ending with its end-of-turn
             token in place of EOS (jaxrlhf.data.messages); HH text without a template or with chat_template none
    "unsupervised"  texts joined with EOS between them and cut into blocks of unsupervised_block_size
             (DeepSpeed-Chat's group_texts), for the mixture LM loss of Step 3
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Literal

import numpy as np

from jaxrlhf.config import ConfigError, check_fields
from jaxrlhf.data.messages import CHAT_TEMPLATE_SETTINGS, ChatFormat, MessagesError, template_variables
from jaxrlhf.data.sources import DataError, Record, Report, fingerprint, read_source, read_texts

CACHE_VERSION = 8  # bump when the tokenized format or any adapter's output changes


@dataclasses.dataclass(frozen=True)
class DataConfig:
    #: datasets: DeepSpeed-Chat hub names, local json/jsonl/jsonl.gz/parquet files or datasets folders,
    #: or "synthetic" (the built-in task, offline)
    data_path: tuple[str, ...] = ("synthetic",)
    #: SFT-only datasets (prompt + response), used whole by Step 1 and never by Steps 2 and 3
    sft_only_data_path: tuple[str, ...] = ()
    #: shares of every dataset for Steps 1, 2, 3 (DeepSpeed-Chat's data_split)
    data_split: str = "2,4,4"
    #: share of a dataset held out for evaluation when it has no eval split of its own
    eval_fraction: float = 0.1
    #: seed of the splits and the shuffles
    seed: int = 1234
    #: Steps 1 and 2: tokens per sequence (longer ones lose the start of the prompt, down to half, then the end
    #: of the answer)
    max_seq_len: int = 512
    #: Step 3: tokens per prompt (longer prompts are dropped, not cut)
    max_prompt_len: int = 256
    #: Step 1: train only on the response tokens (DeepSpeed-Chat trains on the prompt too)
    mask_prompt: bool = False
    #: conversational rows (lists of {role, content}): "auto" renders them with the tokenizer's chat template
    #: (HH text "\n\nHuman: ...\n\nAssistant:" when it has none), "none" always as HH text; plain strings are
    #: used as they are either way
    chat_template: Literal["auto", "none"] = "auto"
    #: the chat template's own variables as name=value (values in YAML), e.g. [enable_thinking=false]: Qwen3's
    #: prompts with an empty thinking block, answers without one (TRL's chat_template_kwargs)
    chat_template_kwargs: tuple[str, ...] = ()
    #: what to do with a malformed row: stop with its file and line ("error"), or count and drop it ("skip")
    on_bad_row: Literal["error", "skip"] = "error"
    #: plain-text datasets for Step 3's mixture LM loss (.txt, rows with "text", or hub "name:config")
    unsupervised_data_path: tuple[str, ...] = ()
    #: tokens per block of the unsupervised set (DeepSpeed-Chat: max prompt + max answer)
    unsupervised_block_size: int = 512
    #: where tokenized sets are cached (default: ~/.cache/jaxrlhf/data)
    cache_dir: str | None = None

    def __post_init__(self):
        split_shares(self.data_split)  # raises on a malformed split
        if self.chat_template not in CHAT_TEMPLATE_SETTINGS:
            raise ConfigError(f"chat_template: expected 'auto' or 'none', got {self.chat_template!r}")
        template_variables(self.chat_template_kwargs)  # raises on an item that is not name=value
        # At least 2 tokens: BOS plus one (a block: one input and its target).
        check_fields(
            self, eval_fraction="[0, 1)", max_seq_len=">= 2", max_prompt_len=">= 2", unsupervised_block_size=">= 2"
        )


def split_shares(data_split: str) -> list[float]:
    try:
        parts = [float(p) for p in data_split.split(",")]
    except ValueError:
        parts = []
    if len(parts) != 3 or not all(0 <= p < float("inf") for p in parts) or sum(parts) <= 0:  # NaN fails too
        raise ValueError(f"data_split: expected three non-negative numbers like '2,4,4', got {data_split!r}")
    return [p / sum(parts) for p in parts]


def _rng(seed: int, *names: str) -> np.random.Generator:
    words = [int.from_bytes(hashlib.sha256(n.encode()).digest()[:4], "little") for n in names]
    return np.random.default_rng([seed, *words])


def step_indices(n: int, data_split: str, step: int, seed: int, name: str) -> np.ndarray:
    """Indices of `step`'s share (1, 2 or 3) of a source of n rows: a seeded permutation cut at the
    cumulative shares, rounded; the same for every step, so shares are disjoint and cover 0..n-1."""
    bounds = np.rint(np.cumsum([0.0] + split_shares(data_split)) * n).astype(int)
    bounds[-1] = n
    order = _rng(seed, "data_split", name).permutation(n)
    return np.sort(order[bounds[step - 1] : bounds[step]])


def step_records(config: DataConfig, step: int) -> tuple[dict[str, list[Record]], list[Report]]:
    """{"train": [...], "eval": [...]} records of `step`, blended over the sources, and the read reports."""
    if step not in (1, 2, 3):
        raise ValueError(f"step: expected 1, 2 or 3, got {step}")
    out = {"train": [], "eval": []}
    reports = []
    sources = [(s, False) for s in config.data_path] + [(s, True) for s in config.sft_only_data_path if step == 1]
    if not sources:
        raise DataError("no datasets given: set data_path (e.g. data_path: [synthetic])")
    for spec, sft_only in sources:
        split = read_source(spec, on_bad_row=config.on_bad_row, seed=config.seed, eval_fraction=config.eval_fraction)
        # the shuffles are keyed on the source's name, not where it is: the same files give the same splits anywhere
        name = Path(spec).name if Path(spec).exists() else spec
        reports += [report for _, report in split.values()]
        train, evaluation = split["train"][0], split["eval"][0] if "eval" in split else None
        if evaluation is None:  # no eval split of its own: hold out eval_fraction of the rows
            order = _rng(config.seed, "eval", name).permutation(len(train))
            held = set(order[: round(config.eval_fraction * len(train))].tolist())
            train, evaluation = [r for i, r in enumerate(train) if i not in held], [train[i] for i in sorted(held)]
        if step == 2 and any(r.rejected is None and r.chosen is not None for r in train + evaluation):
            raise DataError(
                f"{spec}: has rows without a rejected response, so it cannot train a reward model; "
                "list it under sft_only_data_path"
            )
        for part, rows in (("train", train), ("eval", evaluation)):
            share = step_indices(len(rows), config.data_split, step, config.seed, f"{name}/{part}")
            used = rows if sft_only else [rows[i] for i in share]
            if step < 3 and any(r.chosen is None for r in used):
                raise DataError(
                    f"{spec}: has prompts without a response, which only Step 3 can use; give it no share of "
                    "Steps 1 and 2 (data_split like 0,0,10), or add the answers"
                )
            out[part] += used
    for part in out:  # blend: one seeded shuffle over all sources
        out[part] = [out[part][i] for i in _rng(config.seed, "blend", str(step), part).permutation(len(out[part]))]
    return out, reports


# ------------------------------------------------------------------------------------------ tokenize


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def _ragged(seqs: list[list[int]]) -> dict[str, np.ndarray]:
    lengths = np.array([len(s) for s in seqs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.fromiter((t for s in seqs for t in s), np.int32, count=int(offsets[-1]))
    return {"tokens": tokens, "offsets": offsets}


def chat_format(tokenizer, config: DataConfig) -> ChatFormat:
    """How `tokenizer` writes the data's conversations: data.chat_template and its chat_template_kwargs."""
    return ChatFormat(tokenizer, config.chat_template, template_variables(config.chat_template_kwargs))


def tokenize(records: list[Record], tokenizer, step: int, config: DataConfig) -> tuple[dict[str, np.ndarray], dict]:
    """The ragged arrays of `step` for `records`, and counts of what was cut or dropped."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token; jaxrlhf needs one (set eos_token in tokenizer_config.json)")
    fmt = chat_format(tokenizer, config)
    try:
        prompts = [fmt.prompt_ids(r.prompt) for r in records]
        if step == 3:
            answers = {}
        else:
            fields = ("chosen",) if step == 1 else ("chosen", "rejected")
            answers = {f: [fmt.answer_ids(r.prompt, getattr(r, f)) for r in records] for f in fields}
    except MessagesError as e:
        raise DataError(str(e)) from None
    if step == 3:
        keep = [i for i, p in enumerate(prompts) if len(p) <= config.max_prompt_len]
        arrays = _ragged([prompts[i] for i in keep])
        arrays["record_index"] = np.array(keep, np.int64)
        arrays["metadata"] = np.array([json.dumps(records[i].metadata or {}) for i in keep], str)
        longest = max(map(len, prompts), default=0)
        return arrays, {"prompts": len(keep), "dropped_too_long": len(prompts) - len(keep), "longest_prompt": longest}
    arrays, stats = {}, {"sequences": len(records)}
    # An over-long sequence loses the oldest prompt tokens after BOS first, the same number in both halves
    # of a pair (so they still share the prompt and differ where the answers do), but the prompt keeps at
    # least half of the room; then the answer loses its end. Cutting the end alone (DeepSpeed-Chat) drops
    # the answer, which is what both steps learn from: a pair whose prompt fills max_seq_len becomes two
    # identical sequences. Cutting the prompt alone would leave a long answer without its question.
    heads = [int(fmt.bos_id is not None and p[:1] == [fmt.bos_id]) for p in prompts]  # a leading BOS stays
    longest = [max(len(a[i]) for a in answers.values()) for i in range(len(records))]  # answers end with EOS
    keep = [
        max(config.max_seq_len - h - n, min(len(p) - h, (config.max_seq_len - h - 1) // 2))
        for p, h, n in zip(prompts, heads, longest)
    ]
    cut = [max(0, len(p) - h - k) for p, h, k in zip(prompts, heads, keep)]
    stats["prompts_cut"] = sum(c > 0 for c in cut)
    prompts = [p[:h] + p[h + c :] for p, h, c in zip(prompts, heads, cut)]
    for field, ids in answers.items():
        seqs = [p + a for p, a in zip(prompts, ids)]
        stats[f"{field}_truncated"] = sum(len(s) > config.max_seq_len for s in seqs)
        for key, value in _ragged([s[: config.max_seq_len] for s in seqs]).items():
            arrays[key if step == 1 else f"{field}_{key}"] = value
    arrays["prompt_len"] = np.array([min(len(p), config.max_seq_len) for p in prompts], np.int64)
    return arrays, stats


# --------------------------------------------------------------------------------- lengths vs the model

#: the DataConfig field that bounds each step's rows
LENGTH_SETTING = {1: "max_seq_len", 2: "max_seq_len", 3: "max_prompt_len", "unsupervised": "unsupervised_block_size"}


def longest_row(arrays: dict[str, np.ndarray]) -> int:
    """Tokens in the longest sequence of a tokenized set (both halves of pairs; 0 when empty)."""
    return max((int(np.diff(v).max(initial=0)) for k, v in arrays.items() if k.endswith("offsets")), default=0)


def check_positions(positions: int, need: int, setting: str, fix: str, who: str = "model") -> None:
    """Refuse sequences of `need` tokens on a model with `positions` positions, before anything compiles: past its
    table OPT's learned position embedding reads NaN, so every step would be skipped as non-finite (and RoPE models
    would run at positions they never saw). `setting` names what to change, `fix` says how."""
    if need > positions:
        raise ConfigError(f"{setting} exceeds the {who}'s {positions} positions (sequences of {need} tokens); {fix}")


def check_rows(data: dict, step: int | str, config: DataConfig, positions: int, who: str = "model") -> None:
    """Every train and eval row of `step` (prepare's output) within the model's positions, else the ConfigError
    naming the setting that bounds them (LENGTH_SETTING)."""
    name = LENGTH_SETTING[step]
    longest = max(longest_row(data[part]) for part in ("train", "eval"))
    how = {"max_prompt_len": "longer prompts are dropped", "unsupervised_block_size": "the texts are cut in blocks"}
    fix = how.get(name, "a longer row loses its prompt's start, then its answer's end")
    setting, fix = f"data.{name} ({getattr(config, name)})", f"set data.{name}={positions} or lower ({fix})"
    check_positions(positions, longest, setting, fix, who)


# -------------------------------------------------------------------------------------------- cache


def lm_blocks(texts: list[str], tokenizer, block_size: int) -> dict[str, np.ndarray]:
    """Texts joined with EOS between them, cut into equal blocks (the remainder is dropped), as ragged
    arrays so that `Batches(arrays, 1, ...)` serves them like Step 1 sequences."""
    stream = [t for ids in _encode(tokenizer, texts) for t in ids + [tokenizer.eos_token_id]]
    n = len(stream) // block_size
    if n == 0:
        raise DataError(f"the unsupervised texts give {len(stream)} tokens, fewer than one block of {block_size}")
    return {"tokens": np.asarray(stream[: n * block_size], np.int32), "offsets": np.arange(n + 1) * block_size}


def cache_key(config: DataConfig, step: int, tokenizer) -> str:
    """A hash of everything that shapes a step's tokenized set."""
    fields = dataclasses.asdict(config)
    fields.pop("cache_dir")
    sources = [fingerprint(s) for s in (*config.data_path, *config.sft_only_data_path, *config.unsupervised_data_path)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    vocab += json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id])
    fmt = chat_format(tokenizer, config)  # the template renders conversational rows: it shapes them
    vocab += json.dumps([fmt.template, fmt.stop_id])
    blob = {
        "version": CACHE_VERSION,
        "step": step,
        "config": fields,
        "sources": sources,
        "tokenizer": hashlib.sha256(vocab.encode()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:20]


def prepare(config: DataConfig, step: int | str, tokenizer, *, log=print) -> dict[str, dict[str, np.ndarray]]:
    """The tokenized train and eval sets of `step` (1, 2, 3 or "unsupervised"), read from the cache when
    nothing that shapes them changed.

    Returns {"train": arrays, "eval": arrays, "stats": {...}} (see `tokenize` and `lm_blocks`).
    """
    key = cache_key(config, step, tokenizer)
    cache = config.cache_dir or os.environ.get("JAXRLHF_CACHE", Path.home() / ".cache" / "jaxrlhf" / "data")
    file = Path(cache) / f"step{step}-{key}.npz"
    if file.is_file():
        with np.load(file) as z:
            data = {
                part: {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(part + "/")}
                for part in ("train", "eval")
            }
            data["stats"] = json.loads(str(z["stats"]))
        log(f"data: step {step} from cache {file}")
        return data
    if step == "unsupervised":
        if not config.unsupervised_data_path:
            raise DataError("no unsupervised data: set unsupervised_data_path")
        texts = [t for spec in config.unsupervised_data_path for t in read_texts(spec)]
        train = lm_blocks(texts, tokenizer, config.unsupervised_block_size)
        data = {"train": train, "eval": _ragged([]), "stats": {"train": {"blocks": len(train["offsets"]) - 1}}}
    else:
        records, reports = step_records(config, step)
        for report in reports:
            log(f"data: {report}")
        data, stats = {}, {}
        for part in ("train", "eval"):
            data[part], stats[part] = tokenize(records[part], tokenizer, step, config)
        data["stats"] = stats
    _atomic_savez(file, data)
    log(f"data: step {step}: {data['stats']}; cached at {file}")
    return data


def _atomic_savez(file: Path, data: dict):
    file.parent.mkdir(parents=True, exist_ok=True)
    flat = {f"{part}/{k}": v for part in ("train", "eval") for k, v in data[part].items()}
    flat["stats"] = np.array(json.dumps(data["stats"]))
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=file.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **flat)
        os.replace(tmp, file)  # readers see the old file or the whole new one, never half of it
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
