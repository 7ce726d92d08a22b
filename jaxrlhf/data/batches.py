"""Fixed-shape NumPy batches from a step's ragged tokenized set, a resumable iterator, and placement.

    step 1  input_ids, attention_mask, loss_mask   [B, max_seq_len]     right-padded
    step 2  chosen_ids, chosen_mask, rejected_ids, rejected_mask [B, max_seq_len]   right-padded
            prompt_len [B]: BOS + prompt tokens, shared by both halves (DPO scores the answers alone)
    step 3  prompt_ids, prompt_mask                [B, max_prompt_len]  LEFT-padded (generation appends)
            metadata                               B dicts (host only: each prompt's, for the reward functions)
    "unsupervised"  input_ids, attention_mask, loss_mask  [B, unsupervised_block_size]  (no padding)

`loss_mask[b, t] = 1` where token t is a training target: every real token after BOS, or with
`mask_prompt` only the response and its EOS. The LM loss predicts ids[:, 1:] from logits[:, :-1] and
weights it by loss_mask[:, 1:]. Shapes never change, so a jitted step compiles once.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from jaxrlhf.data.pipeline import DataConfig, _rng


def _rows(arrays, prefix: str, idx) -> list[np.ndarray]:
    tokens, offsets = arrays[prefix + "tokens"], arrays[prefix + "offsets"]
    return [tokens[offsets[i] : offsets[i + 1]] for i in idx]


def pad_rows(rows, length: int, pad_id: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
    """ids and mask [len(rows), length] (int32) of token rows padded with pad_id, on the left or the right."""
    ids = np.full((len(rows), length), pad_id, np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for b, row in enumerate(rows):
        sl = slice(length - len(row), length) if left else slice(0, len(row))
        ids[b, sl], mask[b, sl] = row, 1
    return ids, mask


def make_batch(arrays: dict, idx, step: int, config: DataConfig, pad_id: int) -> dict[str, np.ndarray]:
    """The batch of rows `idx` of a step's tokenized set."""
    if step == 3:
        ids, mask = pad_rows(_rows(arrays, "", idx), config.max_prompt_len, pad_id, left=True)
        meta = arrays.get("metadata")
        metadata = [{} if meta is None else json.loads(meta[i]) for i in idx]
        return {"prompt_ids": ids, "prompt_mask": mask, "metadata": metadata}
    if step == 2:
        batch = {}
        for field in ("chosen", "rejected"):
            rows = _rows(arrays, f"{field}_", idx)
            batch[f"{field}_ids"], batch[f"{field}_mask"] = pad_rows(rows, config.max_seq_len, pad_id, left=False)
        batch["prompt_len"] = arrays["prompt_len"][np.asarray(idx)].astype(np.int32)
        return batch
    length = config.unsupervised_block_size if step == "unsupervised" else config.max_seq_len
    ids, mask = pad_rows(_rows(arrays, "", idx), length, pad_id, left=False)
    loss_mask = mask.copy()
    loss_mask[:, 0] = 0  # BOS (or a block's first token) is never a target
    if config.mask_prompt and step == 1:
        starts = arrays["prompt_len"][np.asarray(idx)]
        loss_mask[np.arange(ids.shape[1])[None, :] < starts[:, None]] = 0
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def num_rows(arrays: dict) -> int:
    return len(arrays.get("offsets", arrays.get("chosen_offsets"))) - 1


@dataclasses.dataclass(eq=False)
class Batches:
    """Shuffled fixed-size batches over epochs, deterministic from the seed, resumable mid-epoch.

    `state()` is {"epoch", "position"}; pass it back as `Batches(..., **state)` to continue with the
    very next batch. With several processes, each yields its own contiguous part of every global batch.
    """

    arrays: dict = dataclasses.field(repr=False)
    step: int | str
    batch_size: int
    config: DataConfig = dataclasses.field(repr=False)
    pad_id: int
    _: dataclasses.KW_ONLY
    epoch: int = 0
    position: int = 0
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self):
        n = num_rows(self.arrays)
        if self.batch_size % self.process_count:
            raise ValueError(f"batch size {self.batch_size} does not divide over {self.process_count} processes")
        if n < self.batch_size:
            raise ValueError(
                f"the step {self.step} set has {n} rows, fewer than one batch of {self.batch_size}; "
                "use more data, a different data_split, or a smaller batch"
            )
        self.per_epoch = n // self.batch_size  # the last partial batch is dropped, as a fixed shape needs

    def __len__(self):
        return self.per_epoch

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def __iter__(self):
        local = self.batch_size // self.process_count
        while True:
            n = num_rows(self.arrays)
            order = _rng(self.config.seed, "batches", str(self.step), str(self.epoch)).permutation(n)
            while self.position < self.per_epoch:
                start = self.position * self.batch_size + self.process_index * local
                self.position += 1
                yield make_batch(self.arrays, order[start : start + local], self.step, self.config, self.pad_id)
            self.epoch, self.position = self.epoch + 1, 0
