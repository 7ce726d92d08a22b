"""Fuzz the readers of user input: data files, YAML config files and Hugging Face checkpoint folders.

    python tools/fuzz.py [--count 3000] [--seed 0] [--kinds data,config,checkpoint] [--show 3]

Each case copies a valid seed input, mutates it (bytes flipped, cut or inserted; a JSON/YAML value replaced
by NaN, 2**63, [], a lone surrogate, ...; a line duplicated, so a key repeats; a tensor cast to int or bool,
reshaped, set to NaN, dropped or renamed) and loads it as a run would. The oracle: the input either loads,
and what it gives passes the checks below, or raises jaxrlhf's `InputError` with one line that names the
input. Anything else (a raw traceback, a multi-line message, an invalid input accepted) is a failure.

    data        step_records for Steps 1-3 on the mutated file, then tokenize with OPT's tokenizer
                accepted: every text a str that encodes as UTF-8
    config      config.load(entry point's settings, mutated YAML [, a mutated key=value override])
                accepted: every float finite, seeds in [0, 2**32), counts that must be >= 1 are
    checkpoint  load_hf on the mutated folder (OPT and Llama; safetensors, sharded, pytorch_model.bin, value head)
                accepted: every tensor floating, finite, shaped as the config says

tests/test_fuzz.py runs a few hundred cases of each kind; this tool runs as many as you ask for.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import math
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO.parent / "shared" / "assets"

# ------------------------------------------------------------------------------------------ mutations

# Values a structured mutation puts in place of a JSON/YAML value.
VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    -(2**63),
    10**30,
    0.5,
    1e308,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "x",
    "\ud800",
    "a\u2028b",
    "a\x00b",
    "\n\nAssistant:",
    [],
    [1],
    ["a", 2],
    {},
    {"a": 1},
    {"1": None},
]
# Byte strings a byte-level mutation inserts.
TOKENS = [
    b"\xff",
    b"\x00",
    b"\xc3",
    b"\xe2\x80\xa8",
    b"\\ud800",
    b"\n",
    b"\r",
    b"\t",
    b'"',
    b"'",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b": ",
    b"- ",
    b"? ",
    b"NaN",
    b".nan",
    b"-1",
    b"0",
    b"1e999",
    b"null",
    b"true",
    b"&a ",
    b"*a",
    b"<<: ",
    b"!!python/object/apply:os.system ['true']",
    b"!!binary x",
    b"2001-13-45",
    b"%YAML 1.1\n---\n",
]


def mutate_bytes(rng: np.random.Generator, data: bytes) -> bytes:
    """One random byte-level edit of `data`."""
    n = len(data)
    i = int(rng.integers(0, n + 1))
    j = min(n, i + int(rng.integers(1, 16)))
    op = int(rng.integers(0, 6))
    if op == 0 and n:  # flip one bit
        i = min(i, n - 1)
        return data[:i] + bytes([data[i] ^ (1 << int(rng.integers(0, 8)))]) + data[i + 1 :]
    if op == 1:  # delete a span
        return data[:i] + data[j:]
    if op == 2:  # truncate
        return data[:i]
    if op == 3:  # duplicate a span
        return data[:j] + data[i:j] + data[j:]
    if op == 4:  # overwrite a span with random bytes
        return data[:i] + rng.bytes(j - i) + data[j:]
    return data[:i] + TOKENS[int(rng.integers(0, len(TOKENS)))] + data[i:]


def _slots(tree, out=None):
    """(container, key) of every value in a JSON-like tree."""
    out = [] if out is None else out
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        out.append((tree, k))
        _slots(v, out)
    return out


def mutate_tree(rng: np.random.Generator, tree):
    """A copy of a JSON-like tree with one value replaced, one key deleted or one key added."""
    tree = json.loads(json.dumps(tree))
    slots = _slots(tree)
    if not slots:
        return VALUES[int(rng.integers(0, len(VALUES)))]
    parent, key = slots[int(rng.integers(0, len(slots)))]
    op = int(rng.integers(0, 4))
    if op == 0 and isinstance(parent, dict):
        del parent[key]
    elif op == 1 and isinstance(parent, dict):
        parent[str(key) + "_x"] = parent[key]
    else:
        parent[key] = VALUES[int(rng.integers(0, len(VALUES)))]
    return tree


def mutate_lines(rng: np.random.Generator, data: bytes) -> bytes:
    """Duplicate, delete or swap whole lines (a duplicated YAML line repeats a key)."""
    lines = data.split(b"\n")
    i, j = (int(x) for x in rng.integers(0, len(lines), 2))
    op = int(rng.integers(0, 3))
    if op == 0:
        lines.insert(j, lines[i])
    elif op == 1:
        del lines[i]
    else:
        lines[i], lines[j] = lines[j], lines[i]
    return b"\n".join(lines)


def dump_json(rng: np.random.Generator, tree) -> bytes:
    """JSON text; with ensure_ascii off a lone surrogate becomes bytes that are not UTF-8, as a broken writer makes."""
    return json.dumps(tree, ensure_ascii=bool(rng.integers(0, 2))).encode("utf-8", "surrogatepass")


def mutate_json(rng: np.random.Generator, data: bytes) -> bytes:
    """A structured edit of a JSON document when it parses and the dice say so, else a byte edit."""
    if rng.random() < 0.6:
        try:
            return dump_json(rng, mutate_tree(rng, json.loads(data)))
        except ValueError:
            pass
    return mutate_bytes(rng, data)


# ------------------------------------------------------------------------------------------------ oracle


@dataclasses.dataclass
class Tally:
    """Outcomes of a fuzz run; `failures` holds (case, traceback or reason) of the cases the oracle refused."""

    loaded: int = 0
    refused: int = 0
    failures: list = dataclasses.field(default_factory=list)

    @property
    def cases(self) -> int:
        return self.loaded + self.refused + len(self.failures)

    def __str__(self):
        return (
            f"{self.cases} cases: {self.loaded} loaded, {self.refused} refused with our error, "
            f"{len(self.failures)} failures"
        )


def judge(
    tally: Tally, case: str, names: list[str], load: Callable[[], object], accept: Callable[[object], str | None]
):
    """Run `load()`: it must return something `accept` finds no fault with (a reason string is a fault), or raise
    InputError with one line naming one of `names`; anything else goes into the tally's failures."""
    from jaxrlhf.config import InputError

    try:
        result = load()
    except InputError as e:
        message = str(e)
        if "\n" in message or not any(n in message for n in names):
            tally.failures.append((case, f"{type(e).__name__} message is not one line naming {names[0]}: {message!r}"))
        else:
            tally.refused += 1
        return
    except Exception:  # noqa: BLE001 - the point: any other exception is a raw traceback for the user
        tally.failures.append((case, traceback.format_exc(limit=-4)))
        return
    fault = accept(result)
    if fault:
        tally.failures.append((case, f"accepted an invalid input: {fault}"))
    else:
        tally.loaded += 1


# ----------------------------------------------------------------------------------------------- data

_DATA_ROWS = [
    {"prompt": "\n\nHuman: What is 2+2?\n\nAssistant:", "chosen": " 4.", "rejected": " 5."},
    {"prompt": "\n\nHuman: Name a colour.\n\nAssistant:", "chosen": " Blue \u00e9\u4e2d.", "rejected": " Seven."},
    {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!", "rejected": "\n\nHuman: Hi\n\nAssistant: Go away."},
    {"prompt": "\n\nHuman: Count.\n\nAssistant:", "chosen": " 1 2 3", "rejected": " 3 2 1"},
]
_SFT_ROWS = [
    {"prompt": "\n\nHuman: Say yes.\n\nAssistant:", "response": " Yes."},
    {"prompt": "\n\nHuman: Say no.\n\nAssistant:", "chosen": " No.", "rejected": None},
]


def _data_seed(suffix: str, rows: list[dict]) -> bytes:
    if suffix == ".json":
        return json.dumps(rows, indent=1).encode()
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    return gzip.compress(text, mtime=0) if suffix == ".jsonl.gz" else text


def _mutate_data(rng, suffix: str) -> bytes:
    rows = [dict(r) for r in _DATA_ROWS + (_SFT_ROWS if rng.random() < 0.3 else [])]  # SFT rows: Step 2 refuses
    if suffix == ".parquet":
        return b""  # written by _write_parquet
    if suffix == ".jsonl.gz" and rng.random() < 0.5:  # the compressed stream itself: truncated, a flipped bit
        return mutate_bytes(rng, _data_seed(suffix, rows))
    if rng.random() < 0.5:  # one row's value, kept as text so that the other rows still parse
        r = int(rng.integers(0, len(rows)))
        rows[r] = mutate_tree(rng, rows[r]) if rng.random() < 0.8 else VALUES[int(rng.integers(0, len(VALUES)))]
        text = dump_json(rng, rows) if suffix == ".json" else b"".join(dump_json(rng, row) + b"\n" for row in rows)
    else:
        plain = _data_seed(".json" if suffix == ".json" else ".jsonl", rows)
        text = mutate_lines(rng, plain) if rng.random() < 0.3 else mutate_bytes(rng, plain)
    return gzip.compress(text, mtime=0) if suffix == ".jsonl.gz" else text


def _write_parquet(rng, file: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dict(r, rejected=r.get("rejected") or "") for r in _DATA_ROWS if "prompt" in r and "chosen" in r]
    column = ("prompt", "chosen", "rejected")[int(rng.integers(0, 3))]
    values = [r[column] for r in rows]
    values[int(rng.integers(0, len(values)))] = VALUES[int(rng.integers(0, len(VALUES)))]
    table = {k: [r[k] for r in rows] for k in ("prompt", "chosen", "rejected")}
    try:
        table[column] = pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):  # a column of mixed types: store them as text
        table[column] = pa.array([repr(v) for v in values])
    pq.write_table(pa.table(table), file)
    if rng.random() < 0.3:
        file.write_bytes(mutate_bytes(rng, file.read_bytes()))


def fuzz_data(n: int, seed: int, tally: Tally, workdir: Path, tokenizer) -> Tally:
    """`n` mutated data files through every step's records and tokenization."""
    from jaxrlhf.data import DataConfig, step_records, tokenize

    suffixes = (".jsonl", ".json", ".jsonl.gz", ".parquet")
    for k in range(n):
        rng = np.random.default_rng([seed, 1, k])
        suffix = suffixes[k % len(suffixes)]
        file = workdir / f"data{k}{suffix}"
        if suffix == ".parquet":
            _write_parquet(rng, file)
        else:
            file.write_bytes(_mutate_data(rng, suffix))
        cfg = DataConfig(
            data_path=(str(file),),
            data_split="1,1,1",
            eval_fraction=0.4,
            on_bad_row="skip" if k % 3 == 0 else "error",
            cache_dir=str(workdir / "cache"),
        )

        def load():
            records = {step: step_records(cfg, step)[0] for step in (1, 2, 3)}
            for step, parts in records.items():
                for rows in parts.values():
                    tokenize(rows, tokenizer, step, cfg)
            return [r for parts in records.values() for rows in parts.values() for r in rows]

        judge(tally, f"data #{k} {file.name}", [file.name], load, _bad_record)
        file.unlink()
    return tally


def _bad_record(records) -> str | None:
    for r in records:
        for field in ("prompt", "chosen", "rejected"):
            value = getattr(r, field)
            if value is None and field == "rejected":
                continue
            if not isinstance(value, str):
                return f"{field} is a {type(value).__name__}"
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return f"{field} holds a lone surrogate"
    return None


# --------------------------------------------------------------------------------------------- config

CONFIG_SEEDS = {
    "sft.yaml": "jaxrlhf.sft:SFTConfig",
    "reward.yaml": "jaxrlhf.reward:RewardConfig",
    "ppo.yaml": "jaxrlhf.ppo:PPOConfig",
    "train.yaml": "jaxrlhf.train:TrainConfig",
}
# Settings that only make sense as 1 or more: the oracle checks every field of these names in what loaded.
AT_LEAST_ONE = {
    "batch_size",
    "epochs",
    "log_every",
    "gradient_accumulation_steps",
    "keep_checkpoints",
    "tp",
    "ppo_epochs",
    "generation_batches",
    "max_answer_len",
    "kl_horizon",
    "unsupervised_block_size",
    "inference_tp_size",
}


def _settings_class(spec: str):
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _bad_settings(cfg, prefix="") -> str | None:
    for f in dataclasses.fields(cfg):
        value, name = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            fault = _bad_settings(value, name + ".")
            if fault:
                return fault
            continue
        items = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            return f"{name} = {value}"
        if f.name == "seed" and not 0 <= value < 2**32:
            return f"{name} = {value}"
        if f.name in AT_LEAST_ONE and isinstance(value, int) and value < 1:
            return f"{name} = {value}"
    return None


def fuzz_config(n: int, seed: int, tally: Tally, workdir: Path) -> Tally:
    """`n` mutated YAML files (and command-line overrides) loaded as an entry point's settings."""
    import yaml

    from jaxrlhf import config

    seeds = [(REPO / "configs" / name, _settings_class(spec)) for name, spec in CONFIG_SEEDS.items()]
    for k in range(n):
        rng = np.random.default_rng([seed, 2, k])
        source, cls = seeds[k % len(seeds)]
        data = source.read_bytes()
        op = rng.random()
        if op < 0.35:
            data = mutate_bytes(rng, data)
        elif op < 0.6:
            data = mutate_lines(rng, data)
        elif op < 0.9:
            tree = mutate_tree(rng, yaml.safe_load(data))
            try:
                data = yaml.safe_dump(tree, allow_unicode=bool(rng.integers(0, 2))).encode("utf-8", "surrogatepass")
            except yaml.YAMLError:
                data = mutate_bytes(rng, data)
        overrides = []
        if op >= 0.9 or rng.random() < 0.1:  # key=value on the command line, its value YAML too
            keys = [k for k in yaml.safe_load(source.read_bytes()) if isinstance(k, str)]
            value = TOKENS[int(rng.integers(0, len(TOKENS)))].decode("utf-8", "surrogateescape")
            overrides = [f"{keys[int(rng.integers(0, len(keys)))]}={value}"]
        file = workdir / f"config{k}.yaml"
        file.write_bytes(data)
        judge(
            tally,
            f"config #{k} from {source.name} {overrides}",
            [file.name, "command line"],
            lambda: config.load(cls, str(file), overrides),
            _bad_settings,
        )
        file.unlink()
    return tally


# ----------------------------------------------------------------------------------------- checkpoint

TINY_OPT = dict(
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    ffn_dim=32,
    max_position_embeddings=32,
    word_embed_proj_dim=16,
)
TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)


def checkpoint_seeds(root: Path) -> list[Path]:
    """Valid tiny HF folders: OPT (safetensors), OPT with a value head, OPT sharded, OPT as pytorch_model.bin,
    Llama (safetensors)."""
    import jax

    from jaxrlhf.checkpoint import SAFETENSORS_FILE, TORCH_FILE, read_tensors, save_hf
    from jaxrlhf.models import LlamaConfig, OPTConfig, init_params

    key = jax.random.PRNGKey(0)
    opt, llama = OPTConfig(**TINY_OPT), LlamaConfig(**TINY_LLAMA)
    folders = [
        save_hf(root / "opt", opt, init_params(opt, key)),
        save_hf(root / "opt_head", opt, init_params(opt, key, value_head=True)),
        save_hf(root / "opt_sharded", opt, init_params(opt, key), max_shard_bytes=4000),
        save_hf(root / "llama", llama, init_params(llama, key)),
    ]
    torch_folder = shutil.copytree(folders[0], root / "opt_torch")
    _write_torch(torch_folder / TORCH_FILE, read_tensors(torch_folder))
    (torch_folder / SAFETENSORS_FILE).unlink()
    return folders + [torch_folder]


def _write_torch(file: Path, tensors: dict):
    import torch

    torch.save({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, file)


def _mutate_tensors(rng, tensors: dict) -> dict:
    name = sorted(tensors)[int(rng.integers(0, len(tensors)))]
    value = np.array(tensors[name])
    op = int(rng.integers(0, 7))
    if op == 0:
        value.flat[int(rng.integers(0, value.size))] = [np.nan, np.inf, -np.inf][int(rng.integers(0, 3))]
    elif op == 1:
        value = value.astype([np.int32, np.int64, np.bool_, np.uint8, np.float16, np.float64][int(rng.integers(0, 6))])
    elif op == 2:
        value = value.reshape(-1) if value.ndim > 1 else value[:-1]
    elif op == 3:
        value = value.T.copy() if value.ndim == 2 else value[None]
    elif op == 4:
        del tensors[name]
        return tensors
    elif op == 5:
        tensors[name + "x"] = tensors.pop(name)
        return tensors
    else:
        value.flat[int(rng.integers(0, value.size))] = 1e30
    tensors[name] = value
    return tensors


def _mutate_checkpoint(rng, folder: Path):
    """One random edit of one file of an HF folder, in place."""
    from safetensors.numpy import load_file, save_file

    files = sorted(p for p in folder.iterdir() if p.suffix in (".json", ".safetensors", ".bin"))
    file = files[int(rng.integers(0, len(files)))]
    data = file.read_bytes()
    if file.suffix == ".json":
        file.write_bytes(
            VALUES_JSON[int(rng.integers(0, len(VALUES_JSON)))] if rng.random() < 0.1 else mutate_json(rng, data)
        )
        return
    if rng.random() > 0.3:  # a tensor edit, when an earlier edit left the file readable
        try:
            if file.suffix == ".safetensors":
                return save_file(_mutate_tensors(rng, load_file(str(file))), str(file))
            import torch

            state = torch.load(file, weights_only=True)
            return _write_torch(file, _mutate_tensors(rng, {k: v.numpy() for k, v in state.items()}))
        except Exception:  # noqa: BLE001 - unreadable already: edit its bytes instead
            pass
    file.write_bytes(mutate_bytes(rng, data[:400]) + data[400:] if rng.random() < 0.7 else mutate_bytes(rng, data))


VALUES_JSON = [
    b"[]",
    b'"config"',
    b"1",
    b"null",
    b"",
    b'{"model_type": "opt"}',
    b'{"weight_map": []}',
    b'{"weight_map": {"a": 3}}',
    b'{"weight_map": {"a": "../../etc/passwd"}}',
]


def fuzz_checkpoint(n: int, seed: int, tally: Tally, workdir: Path) -> Tally:
    """`n` mutated checkpoint folders through load_hf."""
    from jaxrlhf.checkpoint import load_hf

    seeds = checkpoint_seeds(workdir / "seeds")
    for k in range(n):
        rng = np.random.default_rng([seed, 3, k])
        source = seeds[k % len(seeds)]
        folder = shutil.copytree(source, workdir / f"ckpt{k}")
        for _ in range(1 + int(rng.random() < 0.2)):
            _mutate_checkpoint(rng, folder)
        judge(tally, f"checkpoint #{k} from {source.name}", [folder.name], lambda: load_hf(folder), _bad_params)
        shutil.rmtree(folder)
    return tally


@functools.lru_cache(maxsize=8)
def _shapes(config, value_head: bool):
    from jaxrlhf.models import param_shapes

    return param_shapes(config, value_head=value_head)


def _bad_params(loaded) -> str | None:
    import jax
    import jax.numpy as jnp

    config, params = loaded
    want = _shapes(config, "value_head" in params)
    for (path, x), w in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(want)):
        name = jax.tree_util.keystr(path)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return f"{name} has dtype {x.dtype}"
        if x.shape != w.shape:
            return f"{name} has shape {x.shape}, expected {w.shape}"
        if not np.isfinite(np.asarray(x, np.float32)).all():
            return f"{name} holds non-finite values"
    return None


# ---------------------------------------------------------------------------------------------- driver


def run(kinds: list[str], count: int, seed: int = 0, assets: Path = ASSETS) -> dict[str, Tally]:
    """`count` cases of each kind; the tallies by kind."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="jaxrlhf-fuzz-") as tmp:
        for kind in kinds:
            workdir = Path(tmp) / kind
            workdir.mkdir()
            tally = Tally()
            if kind == "data":
                from jaxrlhf.tokenizer import opt_tokenizer

                fuzz_data(count, seed, tally, workdir, opt_tokenizer(assets / "opt-tokenizer"))
            elif kind == "config":
                fuzz_config(count, seed, tally, workdir)
            else:
                fuzz_checkpoint(count, seed, tally, workdir)
            out[kind] = tally
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=3000, help="cases of each kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="data,config,checkpoint")
    parser.add_argument("--show", type=int, default=3, help="failures printed in full, per kind")
    parser.add_argument("--assets", type=Path, default=ASSETS, help="the shared assets folder (OPT's tokenizer)")
    args = parser.parse_args(argv)
    tallies = run(args.kinds.split(","), args.count, args.seed, args.assets)
    for kind, tally in tallies.items():
        print(f"{kind}: {tally}")
        for case, detail in tally.failures[: args.show]:
            print(f"  {case}\n    " + detail.strip().replace("\n", "\n    "))
    return 1 if any(t.failures for t in tallies.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
