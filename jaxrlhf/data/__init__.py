"""Data: sources -> Record(prompt, chosen, rejected) -> per-step shares -> tokenized, cached -> batches."""

from jaxrlhf.data.batches import Batches, make_batch
from jaxrlhf.data.pipeline import DataConfig, prepare, step_indices, step_records, tokenize
from jaxrlhf.data.sources import HUB_ADAPTERS, DataError, Record, read_source

__all__ = [
    "HUB_ADAPTERS",
    "Batches",
    "DataConfig",
    "DataError",
    "Record",
    "make_batch",
    "prepare",
    "read_source",
    "step_indices",
    "step_records",
    "tokenize",
]
