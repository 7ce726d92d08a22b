"""OPT decoder in Flax Linen: the language model, reward model and critic of every step.

Shapes use models/common.py's vocabulary, plus E, the embedding width (word_embed_proj_dim; D is hidden_size).

Parameter tree (mirrors Hugging Face's module names so the name table `HF` below is short):

    decoder/embed_tokens/embedding        [V, E]   also the LM head (tied)
    decoder/embed_positions/embedding     [max_position_embeddings + 2, D]
    decoder/project_in/kernel             [E, D]   only when E != D (opt-350m)
    decoder/layers/...                    every layer leaf stacked on a leading [L] axis:
        self_attn_layer_norm/{scale,bias} [L, D]
        self_attn/{q,k,v}_proj/kernel     [L, D, D]   bias [L, D]
        self_attn/out_proj/kernel         [L, D, D]   bias [L, D]
        final_layer_norm/{scale,bias}     [L, D]
        fc1/kernel [L, D, F]  bias [L, F]; fc2/kernel [L, F, D]  bias [L, D]
    decoder/final_layer_norm/{scale,bias} [D]      only for pre-LN models (all but opt-350m)
    decoder/project_out/kernel            [D, E]   only when E != D
    value_head/kernel                     [E, 1]   reward model and critic only
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn

from jaxrlhf.models import common
from jaxrlhf.models.common import DTYPES, Backend, Mode

# OPT's learned positions start at 2: fairseq reserved ids 0 and 1 (padding) in the table.
POSITION_OFFSET = 2


@dataclasses.dataclass(frozen=True)
class OPTConfig:
    """The architecture (from Hugging Face's config.json) plus how to run it (dtype, remat, dropout, backend)."""

    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    word_embed_proj_dim: int = 768
    do_layer_norm_before: bool = True
    remove_final_layer_norm: bool = False
    enable_bias: bool = True
    dropout: float = 0.1
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    bos_token_id: int = 2
    eos_token_id: int = 2
    # How to run it (not part of the checkpoint):
    dtype: str = "float32"  # compute dtype: "float32" or "bfloat16"; parameters keep their own dtype
    remat: bool = False  # recompute each layer's activations in the backward pass
    backend: Backend = Backend()  # attention and decode kernels, loop unrolling: Backend.detect() at start-up

    model_type = "opt"  # config.json's model_type (a class attribute, not a field)
    tie_word_embeddings = True  # the LM head is the embedding (not a field: OPT's always is)

    def __post_init__(self):
        sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim")
        common.check_config(self, (*sizes, "max_position_embeddings", "word_embed_proj_dim"), layer_norm_eps="> 0")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"OPTConfig: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:  # OPT has no grouped-query attention
        return self.num_attention_heads

    @property
    def has_projection(self) -> bool:
        return self.word_embed_proj_dim != self.hidden_size

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]


# The released OPT architectures (vocab 50272, 2048 positions, FFN = 4 x hidden), for random-weight
# models in benchmarks and demos: `OPTConfig(**PRESETS["opt-1.3b"])`.
PRESETS = {
    name: dict(num_hidden_layers=L, hidden_size=D, num_attention_heads=H, ffn_dim=4 * D, word_embed_proj_dim=D)
    for name, (L, D, H) in {
        "opt-125m": (12, 768, 12),
        "opt-1.3b": (24, 2048, 32),
        "opt-2.7b": (32, 2560, 32),
        "opt-6.7b": (32, 4096, 32),
        "opt-13b": (40, 5120, 40),
        "opt-30b": (48, 7168, 56),
        "opt-66b": (64, 9216, 72),
    }.items()
}
PRESETS["opt-350m"] = dict(
    num_hidden_layers=24,
    hidden_size=1024,
    num_attention_heads=16,
    ffn_dim=4096,
    word_embed_proj_dim=512,
    do_layer_norm_before=False,
)


class OPTLayer(nn.Module):
    """One decoder layer; `nn.scan` stacks it L times (common.run_layers). Carry: the hidden state h [B, T, D] and the
    cache's k/v; where: "segment_ids", and "slot", "start" when generating. Post-LN models (opt-350m) normalise after
    each residual add instead of before each block."""

    config: OPTConfig
    mode: Mode = Mode()

    def setup(self):
        c = self.config
        dense = lambda n: common.Dense(n, use_bias=c.enable_bias, dtype=c.compute_dtype)
        norm = lambda: nn.LayerNorm(epsilon=c.layer_norm_eps, dtype=c.compute_dtype)
        self.self_attn = common.SelfAttention(c, self.mode, c.enable_bias, c.layer_norm_eps, "out_proj")
        self.self_attn_layer_norm, self.final_layer_norm = norm(), norm()
        self.fc1, self.fc2 = dense(c.ffn_dim), dense(c.hidden_size)
        self.dropout = nn.Dropout(self.config.dropout)

    def __call__(self, carry, layer, where):
        """The training layout: the self-attention block, then the feed-forward block fc1 -> ReLU -> fc2."""
        h, kv = carry  # h [B, T, D]
        cache = common.layer_cache(kv, where, layer)
        pre = self.config.do_layer_norm_before
        drop = lambda x: self.dropout(x, deterministic=self.mode.deterministic)
        residual = h
        h, cache = self.self_attn(self.self_attn_layer_norm(h) if pre else h, cache, where["segment_ids"])
        h = residual + drop(h)
        if not pre:
            h = self.self_attn_layer_norm(h)
        residual = h
        h = residual + drop(self.fc2(nn.relu(self.fc1(self.final_layer_norm(h) if pre else h))))
        if not pre:
            h = self.final_layer_norm(h)
        return common.carry_out(h, cache)

    def decode(self, carry, layer, where):
        """The decode layout (decode_layer; generation: no dropout). Pre-LN models' norms are folded into the products
        they feed: the product reads h itself and its rows are finished by the mean and 1 / std of h, in the decode
        step's kernels or after it. A decode step runs fc1 (its folded LayerNorm, bias and ReLU) and fc2 (split over
        K) in kernels.decode_matmul where mode.kernels.matmul names them."""
        h, kv = carry  # h [B, T, D]
        cache = common.layer_cache(kv, where, layer)
        c, mesh, matmul = self.config, self.mode.mesh, self.mode.kernels.matmul
        pre, eps = c.do_layer_norm_before, c.layer_norm_eps
        rows = common.norm_rows(h, eps, centred=True) if pre else None
        a, cache = self.self_attn.decode(h, cache, rows)
        h = h + a
        if not pre:
            h = self.self_attn_layer_norm(h)
        fc1 = self.get_variable("params", "fc1")
        if "fc1" in matmul:
            y = common.decode_product(fc1, h, c, mesh, eps=eps if pre else None, relu=True)
        elif pre:  # the norm's end on h; its scale and shift are in fc1's kernel and bias
            scale, mean = common.norm_rows(h, eps, centred=True)
            y = nn.relu(common.stacked_dense(fc1, (h - mean) * scale, c.compute_dtype))
        else:
            y = nn.relu(self.fc1(h))
        fc2 = self.get_variable("params", "fc2")
        h = h + (common.decode_product(fc2, y, c, mesh) if "fc2" in matmul else self.fc2(y))
        if not pre:
            h = self.final_layer_norm(h)
        return common.carry_out(h, cache)


class OPTDecoder(nn.Module):
    """Embeddings, the scanned layers, and the closing LayerNorm/projection. Returns h [B, T, E]."""

    config: OPTConfig
    mode: Mode = Mode()

    @nn.compact
    def __call__(self, input_ids, attention_mask, cache=None, positions=None, segment_ids=None):
        # Without a cache: any padding; returns h. With one (generation): `positions` [B, T] are given,
        # attention_mask is unused (cache["start"] says where each row's real tokens begin); returns (h, cache).
        c = self.config
        input_ids, positions, segment_ids, order = common.layout_inputs(
            input_ids, attention_mask, positions, cache, segment_ids
        )
        positions = positions + POSITION_OFFSET
        embed_tokens = nn.Embed(c.vocab_size, c.word_embed_proj_dim, name="embed_tokens")
        h = embed_tokens(input_ids).astype(c.compute_dtype)  # [B, T, E]
        if c.has_projection:
            h = common.Dense(c.hidden_size, use_bias=False, dtype=c.compute_dtype, name="project_in")(h)
        embed_positions = nn.Embed(c.max_position_embeddings + POSITION_OFFSET, c.hidden_size, name="embed_positions")
        h = h + embed_positions(positions).astype(c.compute_dtype)  # no dropout on the embeddings: HF's OPT has none

        h, cache = common.run_layers(self, OPTLayer, c, self.mode, h, cache, {"segment_ids": segment_ids})

        if c.do_layer_norm_before and not c.remove_final_layer_norm:  # pre-LN models' closing LayerNorm
            h = nn.LayerNorm(epsilon=c.layer_norm_eps, dtype=c.compute_dtype, name="final_layer_norm")(h)
        if c.has_projection:
            h = common.Dense(c.word_embed_proj_dim, use_bias=False, dtype=c.compute_dtype, name="project_out")(h)
        return (h, cache) if cache is not None else common.restore_layout(h, order)


class OPT(common.CausalLM):
    """OPT with its tied LM head (returns logits [B, T, V]) or, with `value_head=True`, the reward/critic
    model (returns one value per position [B, T]: `Linear(E, 1)`, no bias, on the last hidden state)."""

    body, body_name = OPTDecoder, "decoder"


Model = OPT  # the family's forward (models/__init__.py); positions are OPT position ids without the offset


def decode_layer(config: OPTConfig, layer: dict) -> dict:
    """One layer's parameters (no leading L axis) in the decode layout: q/k/v stacked (common.stack_qkv) and, in
    pre-LN models, both LayerNorms folded into the products they feed, the attention's into q/k/v and the FFN's into
    fc1 (common.fold_norm: the norm's scale into the kernel's rows, its shift into the bias, the kernel's column sums
    beside it; the norm's entry goes, see OPTLayer). A decode step then centres and scales inside the kernels that
    consume the products (decode_step, kernels.decode_matmul): the normalised copies of h are never written (one
    kernel per norm and layer less; the rows' statistics remain one reduction each)."""
    attn = common.stack_qkv(layer["self_attn"], config.num_attention_heads)
    if not config.do_layer_norm_before:
        return {**layer, "self_attn": attn}
    ln, ffn = layer["self_attn_layer_norm"], layer["final_layer_norm"]
    attn["qkv_proj"] = common.fold_norm(attn["qkv_proj"], ln["scale"], ln["bias"], config.compute_dtype)
    fc1 = common.fold_norm(layer["fc1"], ffn["scale"], ffn["bias"], config.compute_dtype)
    rest = {n: x for n, x in layer.items() if n not in ("self_attn_layer_norm", "final_layer_norm")}
    return {**rest, "self_attn": attn, "fc1": fc1}


# Parameter path (a regex matched against the end of the '/'-joined path) -> logical axis per dimension, first match
# first (sharding.py maps logical axes to mesh axes; common.PARAM_AXES adds the value head and the decode layout).
PARAM_AXES = [
    (r"embed_positions/embedding", ("position", "embed")),
    (r"project_(in|out)/kernel", ("embed", "embed")),
    (r"layers/self_attn/out_proj/kernel", ("layers", "heads", "embed")),
    (r"layers/fc1/kernel", ("layers", "embed", "mlp")),
    (r"layers/fc1/(bias|colsum)", ("layers", "mlp")),
    (r"layers/fc2/kernel", ("layers", "mlp", "embed")),
    (r"layers/(self_attn/out_proj|fc2)/bias", ("layers", "embed")),
    (r"layers/\w+_layer_norm/(scale|bias)", ("layers", "embed")),
    (r"final_layer_norm/(scale|bias)", ("embed",)),
]

# Hugging Face's names (checkpoint.py). Modules: HF module name (under "model.") -> (our path, kind). Weights appear
# under OPTForCausalLM's "model.", OPTModel's and the original facebook/opt-* checkpoints' "" and DeepSpeed-Chat's
# reward-model checkpoints' "rwtranrsformer." (sic; "rwtransformer." is accepted too).
HF = common.HFNames(
    architecture="OPTForCausalLM",
    config_keys={
        **{
            n: n
            for n in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "ffn_dim",
                "max_position_embeddings",
                "word_embed_proj_dim",
                "do_layer_norm_before",
                "enable_bias",
                "dropout",
                "attention_dropout",
                "pad_token_id",
                "bos_token_id",
                "eos_token_id",
            )
        },
        "_remove_final_layer_norm": "remove_final_layer_norm",
    },
    modules={
        **{
            f"decoder.{n}": (f"decoder/{n}", kind)
            for n, kind in (
                ("embed_tokens", "embed"),
                ("embed_positions", "embed"),
                ("project_in", "linear"),
                ("project_out", "linear"),
                ("final_layer_norm", "norm"),
            )
        },
        **{
            f"decoder.layers.{{i}}.{n}": (f"decoder/layers/{n.replace('.', '/')}", kind)
            for n, kind in (
                ("self_attn_layer_norm", "norm"),
                ("self_attn.q_proj", "linear"),
                ("self_attn.k_proj", "linear"),
                ("self_attn.v_proj", "linear"),
                ("self_attn.out_proj", "linear"),
                ("final_layer_norm", "norm"),
                ("fc1", "linear"),
                ("fc2", "linear"),
            )
        },
    },
    prefixes=("model.", "rwtranrsformer.", "rwtransformer.", ""),
    save_prefix="model.",
    root="decoder.embed_tokens.weight",
)
