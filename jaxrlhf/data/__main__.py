"""`python -m jaxrlhf.data`: read, split and tokenize the datasets of every step, cache them, show a sample.

Run it before training to find bad rows, over-long prompts and truncation in seconds, not after minutes
of compiling. A second run reads the cache. Each step's line gives its longest row; when the tokenizer folder is a
model's (its config.json), rows longer than the model's positions are refused as the training steps refuse them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxrlhf.config import ConfigError, run_cli
from jaxrlhf.data.batches import make_batch, num_rows
from jaxrlhf.data.pipeline import DataConfig, check_rows, longest_row, prepare


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    #: tokenizer folder: an HF model or tokenizer folder, or one holding OPT's vocab.json + merges.txt
    tokenizer: str = ""
    #: which steps to prepare (1, 2, 3); the unsupervised set too when data.unsupervised_data_path is set
    steps: tuple[int, ...] = (1, 2, 3)
    data: DataConfig = DataConfig()


def model_positions(folder: str) -> int | None:
    """max_position_embeddings of the model in `folder` (OPT, Llama and Qwen's config.json), None without one."""
    file = Path(folder) / "config.json"
    return json.loads(file.read_text()).get("max_position_embeddings") if file.is_file() else None


def run(cfg: PrepareConfig, out=print) -> dict:
    from jaxrlhf.tokenizer import load_tokenizer

    if not cfg.tokenizer:
        raise ConfigError("tokenizer: required, e.g. tokenizer=/data/opt-1.3b")
    tok = load_tokenizer(cfg.tokenizer)
    positions = model_positions(cfg.tokenizer)
    steps = list(cfg.steps) + (["unsupervised"] if cfg.data.unsupervised_data_path else [])
    results = {}
    for step in steps:
        results[step] = data = prepare(cfg.data, step, tok, log=out)
        longest = max(longest_row(data[part]) for part in ("train", "eval"))
        rows = f"{num_rows(data['train'])} train, {num_rows(data['eval'])} eval, the longest {longest} tokens"
        out(f"\nstep {step}: {rows}; {data['stats']}")
        if positions:
            check_rows(data, step, cfg.data, positions)
        if num_rows(data["train"]):
            batch = make_batch(data["train"], [0], step, cfg.data, tok.pad_token_id)
            for key, value in batch.items():
                if key.endswith("ids"):
                    mask = batch[key.replace("ids", "mask")] if key != "input_ids" else batch["attention_mask"]
                    out(f"  {key} sample: {tok.decode(value[0][mask[0] == 1])!r}")
    return results


def main(argv=None):
    run_cli(PrepareConfig, __doc__, "python -m jaxrlhf.data", run, argv)


if __name__ == "__main__":
    main()
