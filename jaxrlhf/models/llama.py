"""Llama-family decoder in Flax Linen (Llama 1/2/3 shapes, TinyLlama, llama2.c's stories models).

Differences from OPT, all in this file: RMSNorm instead of LayerNorm, rotary position embeddings instead
of a learned table, a SwiGLU FFN (down(silu(gate x) * up x)), grouped-query attention (Hkv KV heads, query
head h reads KV head h // (H / Hkv)), no biases by default, and an LM head that may be untied. What the
two families share (attention, the KV cache, the padding layout, the scan over layers, the functional
API) lives in models/common.py; shapes use its vocabulary.

Parameter tree (mirrors Hugging Face's LlamaForCausalLM module names):

    model/embed_tokens/embedding           [V, D]       also the LM head when tie_word_embeddings
    model/layers/...                       every layer leaf stacked on a leading [L] axis:
        input_layernorm/scale              [L, D]
        self_attn/q_proj/kernel            [L, D, H*K]      bias [L, H*K] if attention_bias
        self_attn/{k,v}_proj/kernel        [L, D, Hkv*K]    bias [L, Hkv*K] if attention_bias
        self_attn/o_proj/kernel            [L, H*K, D]      bias [L, D] if attention_bias
        post_attention_layernorm/scale     [L, D]
        mlp/{gate,up}_proj/kernel          [L, D, F]        bias [L, F] if mlp_bias
        mlp/down_proj/kernel               [L, F, D]        bias [L, D] if mlp_bias
    model/norm/scale                       [D]
    lm_head/kernel                         [D, V]       only when the head is untied
    value_head/kernel                      [D, 1]       reward model and critic only

Rotary embeddings rotate, per head, pairs of the head dim by angle position * rope_theta^(-2i/K). Hugging
Face's layout pairs dims (i, i + K/2) ("rotate half"); Meta's original and llama2.c pair (2i, 2i + 1)
(`rope_interleaved=True`). The two are the same model up to a permutation of the q/k projection rows,
which is how convert.py turns a llama2.c file into an HF folder.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from jaxrlhf.kernels.swiglu import rms_swiglu
from jaxrlhf.models import common
from jaxrlhf.models.common import Backend, Mode


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The architecture (from Hugging Face's config.json) plus how to run it (dtype, remat, dropout, backend)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0  # 0 (the usual case): hidden_size // num_attention_heads, filled in at construction
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleaved: bool = False  # pair dims (2i, 2i+1) as Meta / llama2.c do; HF's layout pairs (i, i+K/2)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dropout: float = 0.0  # on each residual branch (HF's Llama has none; for fine-tuning)
    attention_dropout: float = 0.0
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    # How to run it (not part of the checkpoint); see OPTConfig:
    dtype: str = "float32"
    remat: bool = False
    backend: Backend = Backend()

    model_type = "llama"  # config.json's model_type (a class attribute, not a field)

    def __post_init__(self):
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        rules = dict(head_dim=f"[0, {2**31})", rms_norm_eps="> 0", rope_theta="> 0")
        common.check_config(self, (*sizes, "num_key_value_heads", "max_position_embeddings"), **rules)
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{type(self).__name__}: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads} (set head_dim)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{type(self).__name__}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2:
            raise ValueError(f"{type(self).__name__}: rotary embeddings need an even head dim, got {self.head_dim}")

    @property
    def qkv_bias(self) -> bool:
        """Biases on q/k/v (Llama: with attention_bias, as on o_proj; Qwen2: always, none on o_proj)."""
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """A per-head RMSNorm on q and on k before the rotation (Qwen3's q_norm, k_norm; none in Llama)."""
        return False

    @property
    def word_embed_proj_dim(self) -> int:
        """Width of the last hidden state (the value head's input), named as OPTConfig names it."""
        return self.hidden_size

    @property
    def compute_dtype(self):
        return common.DTYPES[self.dtype]


# The Llama-family shapes, for random-weight models in benchmarks: `LlamaConfig(**PRESETS["llama-2-7b"])`.
# "llama-7b-gqa": Llama-2-7B's shape with grouped-query attention (8 KV heads), the target of the issue-9 benchmark.
PRESETS = {
    name: dict(
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=32,
        num_key_value_heads=Hkv,
        max_position_embeddings=positions,
        rms_norm_eps=1e-5,
    )
    for name, (L, D, F, Hkv, positions) in {
        "llama-2-7b": (32, 4096, 11008, 32, 4096),
        "llama-7b-gqa": (32, 4096, 11008, 8, 4096),
        "tinyllama-1.1b": (22, 2048, 5632, 4, 2048),
    }.items()
}


def rope_tables(positions, head_dim: int, theta: float):
    """cos, sin [B, T, 1, K/2] (float32) of angle position * theta^(-2i/K) for i < K/2; positions [B, T]."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # [K/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, K/2]
    return jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    config: LlamaConfig
    mode: Mode = Mode()

    def setup(self):
        c = self.config
        dense = lambda n: common.Dense(n, use_bias=c.mlp_bias, dtype=c.compute_dtype)
        self.gate_proj, self.up_proj = dense(c.intermediate_size), dense(c.intermediate_size)
        self.down_proj = dense(c.hidden_size)

    def __call__(self, h):
        """The training layout: h [B, T, D] (normalised)."""
        return self.down_proj(nn.silu(self.gate_proj(h)) * self.up_proj(h))

    def decode(self, h, norm):
        """The decode layout: gate and up stacked as "gate_up_proj" [D, 2, F] (decode_layer), the RMSNorm's scale folded
        into it; h [B, T, D] is the norm's input, `norm` its rows (common.norm_rows). A decode step with
        mode.kernels.swiglu runs the norm's 1 / rms(h), silu and the product in one kernel (3 kernels unfused)."""
        c, mode = self.config, self.mode
        gate_up = self.get_variable("params", "gate_up_proj")
        if mode.kernels.swiglu:
            B, _, D = h.shape
            gate_up = common.stacked_dense(gate_up, h, c.compute_dtype).reshape(B, 2, -1)
            act = rms_swiglu(gate_up, h.reshape(B, D), c.rms_norm_eps, interpret=c.backend.interpret, mesh=mode.mesh)
            return self.down_proj(act[:, None])
        gate_up = common.stacked_dense(gate_up, h, c.compute_dtype, norm)
        return self.down_proj(nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :])


class LlamaLayer(nn.Module):
    """One pre-norm decoder layer; `nn.scan` stacks it L times (see common.run_layers). Carry: h [B, T, D] and the
    cache's k/v; where: "rope", "segment_ids", and "slot", "start" when generating."""

    config: LlamaConfig
    mode: Mode = Mode()

    def setup(self):
        c = self.config
        self.input_layernorm = nn.RMSNorm(epsilon=c.rms_norm_eps, dtype=c.compute_dtype)
        self.post_attention_layernorm = nn.RMSNorm(epsilon=c.rms_norm_eps, dtype=c.compute_dtype)
        self.self_attn = common.SelfAttention(
            c, self.mode, c.qkv_bias, c.rms_norm_eps, "o_proj", c.attention_bias, c.qk_norm, c.rope_interleaved
        )
        self.mlp = LlamaMLP(c, self.mode)
        self.dropout = nn.Dropout(c.dropout)

    def __call__(self, carry, layer, where):
        """The training layout."""
        h, kv = carry
        cache = common.layer_cache(kv, where, layer)
        drop = lambda x: self.dropout(x, deterministic=self.mode.deterministic)
        a, cache = self.self_attn(self.input_layernorm(h), cache, where["segment_ids"], where["rope"])
        h = h + drop(a)
        h = h + drop(self.mlp(self.post_attention_layernorm(h)))
        return common.carry_out(h, cache)

    def decode(self, carry, layer, where):
        """The decode layout (decode_layer; generation: no dropout): each RMSNorm's scale is folded into the next
        product's kernel, which reads h itself; its output rows are scaled by 1 / rms(h) in the consumer's fusion, or
        in a decode step inside the kernel that consumes it (decode_step, rms_swiglu): the normalised copy of h is
        never written."""
        h, kv = carry
        cache = common.layer_cache(kv, where, layer)
        rows = lambda h: common.norm_rows(h, self.config.rms_norm_eps, centred=False)
        a, cache = self.self_attn.decode(h, cache, rows(h), where["rope"])
        h = h + a
        h = h + self.mlp.decode(h, rows(h))
        return common.carry_out(h, cache)


class LlamaModel(nn.Module):
    """Embedding, the scanned layers, the final RMSNorm. Returns h [B, T, D] (and the cache when given one)."""

    config: LlamaConfig
    mode: Mode = Mode()

    @nn.compact
    def __call__(self, input_ids, attention_mask, cache=None, positions=None, segment_ids=None):
        # Without a cache: any padding (positions come from the mask unless given). With one (generation):
        # `positions` [B, T] are given and attention_mask is unused (cache["start"] says where each row's real
        # tokens begin).
        c = self.config
        input_ids, positions, segment_ids, order = common.layout_inputs(
            input_ids, attention_mask, positions, cache, segment_ids
        )
        h = nn.Embed(c.vocab_size, c.hidden_size, name="embed_tokens")(input_ids).astype(c.compute_dtype)
        rope = rope_tables(positions, c.head_dim, c.rope_theta)  # computed once, shared by all layers
        shared = {"rope": rope, "segment_ids": segment_ids}
        h, cache = common.run_layers(self, LlamaLayer, c, self.mode, h, cache, shared)
        h = nn.RMSNorm(epsilon=c.rms_norm_eps, dtype=c.compute_dtype, name="norm")(h)
        return (h, cache) if cache is not None else common.restore_layout(h, order)


class Llama(common.CausalLM):
    """LlamaForCausalLM (logits [B, T, V]) or, with `value_head=True`, the reward/critic model (values [B, T])."""

    body, body_name = LlamaModel, "model"


Model = Llama  # the family's forward (models/__init__.py)


def decode_layer(config: LlamaConfig, layer: dict) -> dict:
    """One layer's parameters (no leading L axis) in the decode layout: q/k/v stacked per KV head
    (common.stack_qkv), gate and up stacked as "gate_up_proj" [D, 2, F] (bias [2, F]), and each RMSNorm's scale
    folded into the rows of the kernel it feeds (the norms' entries go: see LlamaLayer)."""
    mlp = layer["mlp"]
    gate_up = {leaf: jnp.stack([mlp["gate_proj"][leaf], mlp["up_proj"][leaf]], axis=-2) for leaf in mlp["gate_proj"]}
    mlp = {
        **{n: x for n, x in mlp.items() if n not in ("gate_proj", "up_proj")},
        "gate_up_proj": common.fold_norm(gate_up, layer["post_attention_layernorm"]["scale"]),
    }
    attn = common.stack_qkv(layer["self_attn"], config.num_key_value_heads, config.qk_norm)
    attn["qkv_proj"] = common.fold_norm(attn["qkv_proj"], layer["input_layernorm"]["scale"])
    rest = {n: x for n, x in layer.items() if n not in ("input_layernorm", "post_attention_layernorm")}
    return {**rest, "self_attn": attn, "mlp": mlp}


# Parameter path (a regex matched against the end of the '/'-joined path) -> logical axis per dimension (see
# opt.PARAM_AXES).
PARAM_AXES = [
    (r"layers/self_attn/o_proj/kernel", ("layers", "heads", "embed")),
    (r"layers/mlp/(gate|up)_proj/kernel", ("layers", "embed", "mlp")),
    (r"layers/mlp/(gate|up)_proj/bias", ("layers", "mlp")),
    (r"layers/mlp/down_proj/kernel", ("layers", "mlp", "embed")),
    (r"layers/(self_attn/o_proj|mlp/down_proj)/bias", ("layers", "embed")),
    (r"layers/(input|post_attention)_layernorm/scale", ("layers", "embed")),
    (r"model/norm/scale", ("embed",)),
    (r"lm_head/kernel", ("embed", "vocab")),
    # the decode layout (decode_layer): gate and up stacked
    (r"layers/mlp/gate_up_proj/kernel", ("layers", "embed", None, "mlp")),
    (r"layers/mlp/gate_up_proj/bias", ("layers", None, "mlp")),
]

# Hugging Face's names (LlamaForCausalLM; checkpoint.py): lm_head exists only when the head is untied.
HF = common.HFNames(
    architecture="LlamaForCausalLM",
    config_keys={
        n: n
        for n in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "rms_norm_eps",
            "tie_word_embeddings",
            "attention_bias",
            "mlp_bias",
            "attention_dropout",
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
        )
    },
    modules={
        "model.embed_tokens": ("model/embed_tokens", "embed"),
        "model.norm": ("model/norm", "norm"),
        "lm_head": ("lm_head", "linear"),
        "model.layers.{i}.input_layernorm": ("model/layers/input_layernorm", "norm"),
        "model.layers.{i}.post_attention_layernorm": ("model/layers/post_attention_layernorm", "norm"),
        **{
            f"model.layers.{{i}}.self_attn.{n}": (f"model/layers/self_attn/{n}", "linear")
            for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        },
        **{
            f"model.layers.{{i}}.mlp.{n}": (f"model/layers/mlp/{n}", "linear")
            for n in ("gate_proj", "up_proj", "down_proj")
        },
    },
    prefixes=("",),
    save_prefix="",
    root="model.embed_tokens.weight",
)
