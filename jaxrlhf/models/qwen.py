"""Qwen2 / Qwen2.5 and Qwen3: Llama's decoder (models/llama.py runs them) with these differences.

    Qwen2 (model_type "qwen2")  biases on q_proj, k_proj and v_proj only (none on o_proj or the MLP)
    Qwen3 (model_type "qwen3")  no biases by default (attention_bias: on q/k/v and o_proj, as Llama's), and
                                an RMSNorm over each head's K dims on q and on k before the rotary embedding:
                                q_norm, k_norm [K] (common.SelfAttention); head_dim given, not hidden / heads

Both: grouped-query attention with few KV heads (Qwen2.5-1.5B: 12 query heads over 2), rope_theta 1e6, often a
tied LM head, a 151,936-token vocabulary. Parameter tree: Llama's (llama.py), plus for Qwen3

    model/layers/self_attn/{q,k}_norm/scale     [L, K]

One config class for both (`QwenConfig`, its `model_type` read from config.json); the sliding-window attention that
Qwen2's config.json can switch on is refused (checkpoint.py).
"""

from __future__ import annotations

import dataclasses

from jaxrlhf.models import llama
from jaxrlhf.models.llama import LlamaConfig

MODEL_TYPES = ("qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class QwenConfig(LlamaConfig):
    """Qwen2 or Qwen3 (`model_type`): LlamaConfig's fields with Qwen's defaults (the released models' values)."""

    vocab_size: int = 151936
    max_position_embeddings: int = 32768
    rope_theta: float = 1e6
    tie_word_embeddings: bool = True
    # <|endoftext|>: the base models' bos and eos (and the tokenizer's pad); Qwen3's eos is <|im_end|> (151645)
    pad_token_id: int = 151643
    bos_token_id: int = 151643
    eos_token_id: int = 151643
    model_type: str = "qwen2"  # config.json's model_type: "qwen2" (Qwen2, Qwen2.5) or "qwen3"

    def __post_init__(self):
        super().__post_init__()
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"QwenConfig.model_type: expected one of {MODEL_TYPES}, got {self.model_type!r}")
        wrong = dict(mlp_bias=self.mlp_bias, rope_interleaved=self.rope_interleaved)
        if self.model_type == "qwen2":  # Qwen2's o_proj has no bias; its head dim is hidden / heads
            wrong["attention_bias"] = self.attention_bias
            if self.head_dim * self.num_attention_heads != self.hidden_size:
                raise ValueError(
                    f"QwenConfig.head_dim: Qwen2's is hidden_size / num_attention_heads "
                    f"({self.hidden_size // self.num_attention_heads}), got {self.head_dim}"
                )
        for field, value in wrong.items():
            if value:
                raise ValueError(f"QwenConfig.{field}: {self.model_type} has none; expected False, got {value}")

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"


# The released shapes, for random-weight models (`preset("qwen2.5-1.5b")`, `random:qwen3-8b`).
PRESETS = {
    name: dict(
        model_type=model_type,
        num_hidden_layers=L,
        hidden_size=D,
        intermediate_size=F,
        num_attention_heads=H,
        num_key_value_heads=Hkv,
        tie_word_embeddings=tied,
        **(
            dict(head_dim=128, max_position_embeddings=40960, eos_token_id=151645)
            if model_type == "qwen3"
            else dict(max_position_embeddings=32768)
        ),
        **(dict(vocab_size=152064) if name == "qwen2.5-7b" else {}),  # the 7B's table has 128 more rows
    )
    for name, (model_type, L, D, F, H, Hkv, tied) in {
        "qwen2.5-0.5b": ("qwen2", 24, 896, 4864, 14, 2, True),
        "qwen2.5-1.5b": ("qwen2", 28, 1536, 8960, 12, 2, True),
        "qwen2.5-7b": ("qwen2", 28, 3584, 18944, 28, 4, False),
        "qwen3-0.6b": ("qwen3", 28, 1024, 3072, 16, 8, True),
        "qwen3-1.7b": ("qwen3", 28, 2048, 6144, 16, 8, True),
        "qwen3-8b": ("qwen3", 36, 4096, 12288, 32, 8, False),
    }.items()
}

Model = llama.Model  # the forward: Llama's layers, which read the config's qkv_bias and qk_norm
decode_layer = llama.decode_layer  # q_norm's scale takes the attention's scale (common.stack_qkv)

# What Llama's table (llama.PARAM_AXES) does not cover: the per-head norms, replicated (K is not split).
PARAM_AXES = [(r"layers/self_attn/[qk]_norm/scale", ("layers", None))]

_KEYS = ("model_type", *(k for k in llama.HF.config_keys if k not in ("mlp_bias", "attention_bias", "head_dim")))
_MODULES = {
    **llama.HF.modules,
    **{f"model.layers.{{i}}.self_attn.{n}": (f"model/layers/self_attn/{n}", "norm") for n in ("q_norm", "k_norm")},
}
# Hugging Face's names per model type (checkpoint.py): Llama's modules, plus Qwen3's q_norm / k_norm; Qwen2's
# config.json has no attention_bias or head_dim.
HF = {
    "qwen2": dataclasses.replace(
        llama.HF, architecture="Qwen2ForCausalLM", config_keys={k: k for k in _KEYS}, modules=_MODULES
    ),
    "qwen3": dataclasses.replace(
        llama.HF,
        architecture="Qwen3ForCausalLM",
        config_keys={k: k for k in (*_KEYS, "attention_bias", "head_dim")},
        modules=_MODULES,
    ),
}
