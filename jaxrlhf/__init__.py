"""jaxrlhf: DeepSpeed-Chat's three-step RLHF recipe in JAX/Flax, with a hybrid FSDP / tensor-parallel engine."""

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
