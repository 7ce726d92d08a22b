"""jaxrlhf: DeepSpeed-Chat's three-step RLHF recipe in JAX/Flax, with a hybrid FSDP / tensor-parallel engine."""

import logging

# jaxrlhf uses transformers for tokenizers and configs only (the models are ours; torch is for the parity tests), so
# its import-time "PyTorch was not found" advice is noise on a default install. Only that message is dropped; a filter
# on transformers' own logger, set before any module here imports it.
logging.getLogger("transformers").addFilter(lambda record: not record.getMessage().startswith("PyTorch was not found"))

from jaxrlhf.checkpoint import CheckpointError, load_hf, save_hf
from jaxrlhf.generate import generate
from jaxrlhf.models import Backend, LlamaConfig, OPTConfig, QwenConfig, init_params, logits, preset, values
from jaxrlhf.rl import EngineConfig, HybridEngine
from jaxrlhf.sharding import LayoutError, batch_sharding, describe, make_mesh, reshard, shardings_for
from jaxrlhf.tokenizer import load_tokenizer, opt_tokenizer

__all__ = [
    "Backend",
    "CheckpointError",
    "EngineConfig",
    "HybridEngine",
    "LayoutError",
    "LlamaConfig",
    "OPTConfig",
    "QwenConfig",
    "batch_sharding",
    "describe",
    "generate",
    "init_params",
    "load_hf",
    "load_tokenizer",
    "logits",
    "make_mesh",
    "opt_tokenizer",
    "preset",
    "reshard",
    "save_hf",
    "shardings_for",
    "values",
]
