"""What every decoder family shares: attention (training and cached), the padding layout, the scan over layers,
the KV cache, the heads (`CausalLM`) and the decode layout's products.

Shape vocabulary (used in comments and einsum strings throughout jaxrlhf):
    B batch, T sequence, S cache slots, D model width, H query heads, Hkv key/value heads (Hkv divides H;
    query head h reads KV head h // (H / Hkv)), K head dim, F FFN width, V vocab, L layers.

A family module (models/opt.py, models/llama.py) owns its config dataclass (the architecture from config.json
plus dtype, remat, dropout and the `Backend`), its PRESETS, its Hugging Face name table (`HF`), its sharding table
(`PARAM_AXES`), its decode layout (`decode_layer`) and its forward: `Model(config, value_head, mode, last)(input_ids,
attention_mask, cache=None, positions=None, head_at=None, segment_ids=None)`, a `CausalLM` over its decoder.

Each layer (SelfAttention, the MLPs, the decoder layers) has two entries sharing its submodules, as Levanter's
layers have `__call__` and `decode`:

    __call__   the training layout (the tree of Hugging Face's names): train, score, and generation's calls on the
               model's own parameters
    decode     the decode layout (`decode_layer`: shared-input products stacked, norms folded): generation's
               prefill and decode steps on generate.decode_params' tree, running the kernels of `mode.kernels`

`run_layers` picks the entry from `mode.decode_layout`. What a call does is explicit: the model config carries the
`Backend` (made once at start-up by `Backend.detect`; the default is plain XLA), and every module gets the call's
`Mode`: its kind (train, score, prefill or decode), the layout, generation's mesh, whether LoRA adapters ride in the
tree, and for a decode step the kernels it runs (`DecodeKernels`, chosen once by models.decode_kernels when
generation is set up). The functional API (models/__init__.py) is the one place that looks at the parameter tree,
to fill in the Mode (`in_decode_layout`, `lora_attached`); below it, no module asks the platform, the global mesh or
the tree's shape, except that a `Dense` fuses the LoRA adapters it finds beside its own kernel (lora.attach puts
them on the adapted modules only).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxrlhf.config import check_fields
from jaxrlhf.kernels import decode_matmul, per_shard, rows_axis, rows_per_shard
from jaxrlhf.kernels.decode_attention import DecodeAttentionConfig, decode_attention, decode_step

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Backend:
    """How this machine runs the models: chosen once at start-up (`Backend.detect`), carried by the model config
    (`config.backend`). The default is the portable path: plain XLA on any platform, no kernels."""

    attention: str = "xla"  # training, scoring, prefill: "cudnn" (flash attention where cuDNN takes it) or "xla"
    decode_attention: str = "xla"  # decode steps: "auto" (our Pallas kernels where the shapes suit), "pallas", "xla"
    interpret: bool = False  # the Pallas kernels in interpret mode (CPU tests)
    scan_unroll: int = 1  # layers per iteration of the loop over layers; 0: all of them (no loop)

    def __post_init__(self):
        if self.attention not in ("cudnn", "xla"):
            raise ValueError(f"Backend.attention: expected 'cudnn' or 'xla', got {self.attention!r}")
        if self.decode_attention not in ("auto", "pallas", "xla"):
            raise ValueError(
                f"Backend.decode_attention: expected 'auto', 'pallas' or 'xla', got {self.decode_attention!r}"
            )
        if self.scan_unroll < 0:
            raise ValueError(f"Backend.scan_unroll: expected >= 0 (0: all layers), got {self.scan_unroll}")

    @classmethod
    def detect(cls, attention: str = "auto", decode_attention: str = "auto", scan_unroll: int = 0) -> Backend:
        """This machine's backend, the one place that asks the platform. "auto" (and scan_unroll 0): on a GPU cuDNN
        attention, the decode kernels and no loop over layers (faster steps for longer compiles); elsewhere plain
        XLA and a rolled loop. Kernels asked for off a GPU run in interpret mode."""
        gpu = jax.default_backend() == "gpu"
        attention = ("cudnn" if gpu else "xla") if attention == "auto" else attention
        decode = ("auto" if gpu else "xla") if decode_attention == "auto" else decode_attention
        unroll = scan_unroll or (0 if gpu else 1)
        return cls(attention, decode, interpret=not gpu and decode != "xla", scan_unroll=unroll)

    @property
    def kernels(self) -> DecodeAttentionConfig:
        """The decode-attention kernel's settings (its implementation "xla": the kernels are off)."""
        return DecodeAttentionConfig(implementation=self.decode_attention, interpret=self.interpret)


KINDS = ("train", "score", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class DecodeKernels:
    """The kernels a decode step runs, chosen once when generation is set up (models.decode_kernels, which also names
    why each kernel the backend asks for is off) and carried by the decode call's `Mode`: the layers' `decode` reads
    them and never falls back. The default: plain XLA throughout."""

    attention: DecodeAttentionConfig = DecodeAttentionConfig()  # decode attention's settings; "xla": XLA's attention
    fused_step: bool = False  # the decode layout's q/k/v epilogue, rotation, cache write and attention: decode_step
    matmul: tuple[str, ...] = ()  # the FFN products run by kernels.decode_matmul (OPT's "fc1", "fc2")
    swiglu: bool = False  # Llama's activation with its folded RMSNorm's end in one kernel (kernels.swiglu)
    off: tuple[str, ...] = ()  # why each kernel the backend asks for does not run, one line each

    @property
    def layers(self) -> bool:
        """Whether any kernel of the decode layout's layers runs (they need the decode layout)."""
        return self.fused_step or bool(self.matmul) or self.swiglu


@dataclasses.dataclass(frozen=True)
class Mode:
    """What one forward call does, passed to every layer (nothing below guesses it):

        "train"    dropout on (the caller's key), no cache
        "score"    no dropout, no cache
        "prefill"  prompts' K/V written into an empty cache (at its slot); causal attention over the prompt
        "decode"   one token per row at each row's own slot, attending over the cache (the kernels of `kernels`)

    decode_layout: the parameters are in the decode layout (`decode_layer`, generate.decode_params): the layers'
    `decode` entries run. mesh: generation's mesh, the decode kernels and the prefill's attention running per shard of
    it (None: unsharded). lora: LoRA adapters ride beside the adapted kernels (lora.attach): the loop over layers runs
    one layer per iteration. kernels: a decode step's kernels (models.decode_kernels)."""

    kind: str = "score"
    decode_layout: bool = False
    mesh: Any = None
    lora: bool = False
    kernels: DecodeKernels = DecodeKernels()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Mode.kind: expected one of {KINDS}, got {self.kind!r}")
        if self.kernels != DecodeKernels() and not self.decoding:
            raise ValueError(f"Mode.kernels: a decode step's, got kind {self.kind!r}")
        if self.kernels.layers and not self.decode_layout:
            raise ValueError("Mode.kernels: the layers' kernels (fused step, products) need the decode layout")

    @property
    def deterministic(self) -> bool:
        return self.kind != "train"

    @property
    def decoding(self) -> bool:
        return self.kind == "decode"


@dataclasses.dataclass(frozen=True)
class HFNames:
    """How one family's Hugging Face folders look (checkpoint.py reads and writes them through this)."""

    architecture: str
    config_keys: dict  # config.json key -> our config field
    modules: dict  # HF module name -> (our path, kind); "{i}" marks a per-layer module, stacked on axis 0
    prefixes: tuple  # prefixes under which the names of `modules` may appear when reading
    save_prefix: str  # the prefix written (OPTForCausalLM's "model.")
    root: str  # a tensor every checkpoint of the family has (finds the prefix)


def check_config(config, sizes: tuple, **rules: str) -> None:
    """Validate a family's config: dtype and dropouts (the backend validates itself), each of `sizes` in [1, 2**31)
    (larger sizes overflow the shape arithmetic), the token ids in the vocabulary, and `rules` (config.check_fields)."""
    name = type(config).__name__
    if config.dtype not in DTYPES:
        raise ValueError(f"{name}.dtype: expected one of {sorted(DTYPES)}, got {config.dtype!r}")
    for field in ("dropout", "attention_dropout"):
        if not 0.0 <= getattr(config, field) < 1.0:
            raise ValueError(f"{name}.{field}: expected a probability in [0, 1), got {getattr(config, field)}")
    tokens = dict.fromkeys(("pad_token_id", "bos_token_id", "eos_token_id"), f"[0, {config.vocab_size})")
    check_fields(config, **dict.fromkeys(sizes, f"[1, {2**31})"), **tokens, **rules)


# ------------------------------------------------------------------------------------------- attention


_TOLD = set()  # what tell_once has said in this process


def tell_once(why: str) -> None:
    """Log `why` (a kernel the models leave off, and why) once per process, as a WARNING of jaxrlhf.models."""
    if why not in _TOLD:
        _TOLD.add(why)
        logging.getLogger("jaxrlhf.models").warning("%s", why)


def segment_mask(segment_ids):
    """[B, 1, T, T]: token t may attend to token s of its row only within its own segment (None: no segments)."""
    return None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def causal_attention(q, k, v, implementation: str = "xla", segment_ids=None):
    """Causal softmax(q k^T) v through `jax.nn.dot_product_attention`; q [B, T, H, K], k, v [B, T, Hkv, K],
    q pre-scaled; with segment_ids [B, T] each token attends within its segment only (packed rows).

    "cudnn" is cuDNN's flash attention (16-bit dtypes; the [B, H, T, T] scores never exist in memory), taken
    where cuDNN accepts the dtype and shapes, else XLA; "xla" the plain XLA graph (scores in float32). Padding needs
    no mask tensor (the decoder moved it out of the way). Segments go to cuDNN as their boolean [B, 1, T, T] mask,
    which it adds as a constant bias (jax 0.11 computes no gradient for a boolean mask).
    """
    if implementation == "cudnn" and q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            mask = segment_mask(segment_ids)
            return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0, is_causal=True, implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError) as refused:  # a shape or dtype cuDNN does not take
            tell_once(
                f"cuDNN's flash attention refused q {q.shape} {q.dtype.name}, k {k.shape}: XLA's attention "
                f"instead, its [B, H, T, T] scores in memory ({type(refused).__name__}: {refused})"
            )
    return jax.nn.dot_product_attention(
        q, k, v, mask=segment_mask(segment_ids), scale=1.0, is_causal=True, implementation="xla"
    )


def dropout_attention(q, k, v, dropout: nn.Dropout, segment_ids=None):
    """Causal attention with dropout on the probabilities (training with attention_dropout > 0)."""
    B, T, H, K = q.shape
    qg = q.reshape(B, T, k.shape[2], H // k.shape[2], K)
    scores = jnp.einsum("bqhgk,bshk->bhgqs", qg, k, preferred_element_type=jnp.float32)
    allowed = jnp.tril(jnp.ones((T, T), bool))
    if segment_ids is not None:
        allowed = allowed & segment_mask(segment_ids)[:, :, None]  # [B, 1, 1, T, T]
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = dropout(jax.nn.softmax(scores, axis=-1))
    return jnp.einsum("bhgqs,bshk->bqhgk", probs.astype(v.dtype), v).reshape(B, T, H, K)


def cached_attention(q, k, v, cache, mode: Mode, backend: Backend):
    """Attention over a KV cache, writing this call's keys and values into it first (generation).

    q [B, T, H, K], k, v [B, T, Hkv, K] for T new tokens (the prompt at prefill, 1 when decoding); cache:
    "k", "v" [L, B, Hkv, S, K] (each row's and head's slots contiguous, as the decode kernel streams them),
    "layer" (this layer's index), "slot" (where the T tokens go: slots slot .. slot+T-1, the same for every
    row; or, decoding, [B]: each row's own slot), "start" [B] (each row's first valid slot: the slots before it
    are left padding). The write is one dynamic_update_slice into the cache carried through the loops, so XLA
    updates it in place.

    A decode step (T = 1) runs decode attention with mode.kernels.attention's settings (the Pallas kernel, grouped-
    query heads included, which reads only the slots start .. slot of the layer straight from the whole cache; or
    XLA's). The prefill writes left-padded prompts into an empty cache (at `slot`): each row rolled
    by its padding so that its real tokens come first is plain causal attention over the T tokens
    (`causal_attention` with backend.attention: cuDNN's flash attention on a GPU, never a [B, H, T, S] score tensor;
    the padding, rolled to the end, computes outputs nobody reads), rolled back after; under tensor parallelism
    per shard (`shard_map`), like the decode kernel.
    Returns (out [B, T, H, K], cache with k and v updated).
    """
    layer, slot = cache["layer"], cache["slot"]
    ck, cv = write_cache(cache["k"], k, layer, slot), write_cache(cache["v"], v, layer, slot)
    cache = {**cache, "k": ck, "v": cv}
    B, T = q.shape[:2]
    mesh = mode.mesh
    if mode.decoding:
        kernel = mode.kernels.attention
        out = decode_attention(q[:, 0], ck, cv, cache["start"], slot + 1, layer, config=kernel, mesh=mesh)
        return out[:, None], cache
    t = jnp.arange(T)[None, :]
    roll = lambda x, by: jnp.take_along_axis(x, ((t + by[:, None]) % T)[:, :, None, None], axis=1)
    # k and v as the decode steps will read them back (the cache's dtype)
    k, v = (x.astype(ck.dtype).astype(q.dtype) for x in (k, v))
    attend = lambda q, k, v: causal_attention(q, k, v, backend.attention)
    spec = jax.sharding.PartitionSpec(rows_axis(mesh, B), None, "model", None)  # per shard, as the decode kernel
    attend = per_shard(attend, mesh, (spec,) * 3, spec)
    pad = cache["start"] - slot  # each row's padding among the T tokens
    out = roll(attend(*(roll(x, pad) for x in (q, k, v))), -pad)
    # The next layer waits for this layer's cache write: nothing else reads it here, and XLA deferred all the writes
    # to the end of the prefill, holding every layer's K/V meanwhile (a quarter more peak memory in Step 3).
    ck, cv, out = jax.lax.optimization_barrier((ck, cv, out))
    return out, {**cache, "k": ck, "v": cv}


def write_cache(c, x, layer, slot):
    """Cache c [L, B, Hkv, S, K] with x [B, T, Hkv, K] written at `layer`, slots slot .. slot + T - 1: one
    dynamic_update_slice for a scalar slot (every row at the same place); for a [B] slot (continuous batching: each
    row at its own length; T = 1) one scatter of the B rows. Either way XLA writes in place."""
    x = x.astype(c.dtype)
    if jnp.ndim(slot) == 0:
        return jax.lax.dynamic_update_slice(c, x.transpose(0, 2, 1, 3)[None], (layer, 0, 0, slot, 0))
    return c.at[layer, jnp.arange(x.shape[0]), :, slot, :].set(x[:, 0], mode="promise_in_bounds")


def row_sums(x):
    """(sums, sums of squares) of x's rows [B, D], float32: what a folded LayerNorm's kernel finishes itself (one XLA
    reduction; given mean and 1 / std instead, XLA ran the rsqrt as a kernel of its own)."""
    x = x.astype(jnp.float32)
    return jnp.sum(x, axis=-1), jnp.sum(x * x, axis=-1)


def decode_product(p: dict, x, config, mesh, *, eps: float | None = None, relu: bool = False):
    """A decode step's FFN product with parameters `p` (kernel [K, N], bias [N]) in one kernel (kernels.decode_matmul,
    where models.decode_kernels chose it): [B, 1, N] in the compute dtype. eps: the product's LayerNorm is folded into
    it (fold_norm, opt.decode_layer) and x is the norm's input. With eps or relu the bias and the rest end the product
    inside the kernel (fc1); otherwise K is split and the partials' sum, plus the bias, fuses into what follows (fc2).
    Measured and not used (docs/benchmarks.md): OPT's out_proj and Llama's o_proj and down_proj, where the kernel's
    time does not pay for the residual add that cuBLAS runs in its epilogue."""
    B, _, D = x.shape
    columns = eps is not None or relu  # the epilogue runs in the kernel: each shard its output columns (fc1)
    dtype, x = config.compute_dtype, x.reshape(B, D)
    layer_norm = None
    if eps is not None:  # the rows' statistics: one reduction, finished in each program (as decode_step's)
        layer_norm = (*row_sums(x), p["colsum"], eps)
    bias = p.get("bias")  # (in its own dtype: a cast before a kernel's operand is a kernel of its own)
    y = decode_matmul.decode_matmul(
        x.astype(dtype),
        p["kernel"].astype(dtype),
        bias=bias if columns else None,
        layer_norm=layer_norm,
        relu=relu,
        interpret=config.backend.interpret,
        mesh=mesh,
    )
    if not columns and bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)[:, None]


def decode_product_applies(mesh, batch: int, k: int, n: int, columns: bool) -> bool:
    """Whether kernels.decode_matmul takes a decode step's [batch, k] x [k, n] product per shard of `mesh` (`columns`:
    each shard its output columns, as fc1; else its rows of k, as fc2)."""
    rows = batch
    if mesh is not None:
        rows = rows_per_shard(mesh, batch)
        n, k = (n // mesh.shape["model"], k) if columns else (n, k // mesh.shape["model"])
    return decode_matmul.applies(rows, k, n)


def apply_rope(x, cos, sin, interleaved: bool = False):
    """Rotate x [B, T, H, K] by the tables cos, sin [B, T, 1, K/2] (llama.rope_tables): pairs (i, i + K/2) ("rotate
    half"), or (2i, 2i + 1) if interleaved."""
    xf = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
    else:
        x1, x2 = jnp.split(xf, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class SelfAttention(nn.Module):
    """Self-attention (grouped-query where Hkv < H), the softmax in float32: q, k, v (Qwen3: each head's q and k
    RMS-normalised, `qk_norm`), q times the attention's scale K^-1/2 after its bias as OPT does, the rotary embedding
    where `rope` (cos, sin) [B, T, 1, K/2] is given, the attention (cached when generating, else causal, with dropout
    if training), and the output projection `out_name`. Returns (out [B, T, D], cache).

    `__call__` runs the training layout (q/k/v from three Linear layers); `decode` the decode layout, q/k/v from one
    product with "qkv_proj" [D, Hkv, (G + 2) K] (per KV head: its G query heads, its key, its value; stack_qkv folded
    the scale into its kernel, or into q_norm's scale), and a decode step's fused kernel where mode.kernels says so."""

    config: Any
    mode: Mode
    use_bias: bool  # biases on q/k/v (and on the output projection unless out_bias says otherwise)
    eps: float  # the epsilon of the norm folded into qkv_proj (the decode layout), and of q_norm / k_norm
    out_name: str
    out_bias: bool | None = None  # the output projection's bias (None: use_bias); Qwen2 has q/k/v biases only
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's K dims ("q_norm", "k_norm" [K]) on q and k before RoPE
    interleaved: bool = False  # the rotary embedding pairs dims (2i, 2i + 1) (llama.rope_interleaved)

    def setup(self):
        c = self.config
        H, Hkv, K = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        proj = lambda heads: Dense(heads * K, use_bias=self.use_bias, dtype=c.compute_dtype)
        self.q_proj, self.k_proj, self.v_proj = proj(H), proj(Hkv), proj(Hkv)
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(epsilon=self.eps, dtype=c.compute_dtype)
            self.k_norm = nn.RMSNorm(epsilon=self.eps, dtype=c.compute_dtype)
        out_bias = self.use_bias if self.out_bias is None else self.out_bias
        # (named by the family: OPT's out_proj, Llama's o_proj)
        setattr(self, self.out_name, Dense(c.hidden_size, use_bias=out_bias, dtype=c.compute_dtype))
        self.dropout = nn.Dropout(c.attention_dropout, deterministic=False)

    def __call__(self, h, cache=None, segment_ids=None, rope=None):
        """The training layout: h [B, T, D] (normalised), segment_ids [B, T] (packed rows) or None."""
        B, T, _ = h.shape
        H, Hkv, K = self.config.num_attention_heads, self.config.num_key_value_heads, self.config.head_dim
        q = self.q_proj(h).reshape(B, T, H, K)
        k, v = (proj(h).reshape(B, T, Hkv, K) for proj in (self.k_proj, self.v_proj))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out, cache = self._attend(q * K**-0.5, k, v, cache, segment_ids, rope)
        return self._out(out), cache

    def decode(self, h, cache, norm=None, rope=None):
        """The decode layout: h [B, T, D] (the input of the norm folded into qkv_proj, whose rows `norm` gives:
        norm_rows; None: no norm folded) into the cache: a prefill (T prompt tokens) or a decode step (T = 1)."""
        c = self.config
        B, T, _ = h.shape
        if self.mode.kernels.fused_step:
            step_rope = None if rope is None else tuple(x[:, 0, 0] for x in rope)  # [B, K/2]: each row's one token
            out, cache = self._fused_step(h, cache, norm, step_rope)
            return self._out(out), cache
        H, Hkv, K = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        G = H // Hkv
        y = stacked_dense(self.get_variable("params", "qkv_proj"), h, c.compute_dtype, norm)  # [B, T, Hkv, (G + 2) K]
        q, k, v = y[..., : G * K].reshape(B, T, H, K), y[..., G * K : (G + 1) * K], y[..., (G + 1) * K :]
        if self.qk_norm:  # (q_norm's scale holds K^-1/2: a norm after the product would undo a scale folded into it)
            q, k = self.q_norm(q), self.k_norm(k)
        out, cache = self._attend(q, k, v, cache, None, rope)
        return self._out(out), cache

    def _attend(self, q, k, v, cache, segment_ids, rope):
        """q [B, T, H, K] (scaled), k, v [B, T, Hkv, K] rotated, then attended: (out [B, T, H, K], cache)."""
        c, mode = self.config, self.mode
        if rope is not None:  # q is scaled already: the rotation is linear
            q, k = (apply_rope(x, *rope, self.interleaved) for x in (q, k))
        if cache is not None:
            return cached_attention(q, k, v, cache, mode, c.backend)
        if mode.deterministic or c.attention_dropout == 0.0:
            return causal_attention(q, k, v, c.backend.attention, segment_ids), None
        return dropout_attention(q, k, v, self.dropout, segment_ids), None

    def _out(self, out):
        """The output projection of out [B, T, H, K]: [B, T, D]."""
        B, T, H, K = out.shape
        return getattr(self, self.out_name)(out.reshape(B, T, H * K))

    def _fused_step(self, h, cache, norm, rope):
        """A decode step's q/k/v product, then the rest in one kernel (kernels.decode_attention.decode_step: the folded
        norm's end, the bias, the per-head q/k norm, the rotation, the cache write and the attention): (out
        [B, 1, H, K], cache). norm: as `decode`'s; an RMSNorm (no mean) is reduced inside the kernel from h, a
        LayerNorm's row sums come from one reduction before it (decode_step says why); the layer's own statistics are
        then dead code. rope (cos, sin) [B, K / 2], rotate-half."""
        c, mode, eps = self.config, self.mode, self.eps
        B, K, kv_heads = h.shape[0], c.head_dim, c.num_key_value_heads
        p = self.get_variable("params", "qkv_proj")
        per_head = lambda x: x.reshape(kv_heads, -1, K)
        rms = layer_norm = None
        if norm is not None and norm[1] is None:
            rms = (h.reshape(B, -1), eps)
        elif norm is not None:
            layer_norm = (*row_sums(h.reshape(B, -1)), h.shape[-1], eps, per_head(p["colsum"]))
        # The bias goes to the kernel, after the norm: cuBLAS runs the product without an epilogue. A folded LayerNorm
        # subtracts mean(h) colsum from the product, which therefore stays float32 (no cancellation in bf16).
        out_dtype = jnp.float32 if layer_norm is not None else c.compute_dtype
        qkv = stacked_dense(p, h, c.compute_dtype, bias=False, out_dtype=out_dtype)
        bias = per_head(p["bias"]) if "bias" in p else None
        heads_norm = None
        if self.qk_norm:
            heads_norm = (jnp.stack([self.get_variable("params", n)["scale"] for n in ("q_norm", "k_norm")]), eps)
        operands = (qkv.reshape(B, kv_heads, -1, K), *(cache[n] for n in ("k", "v", "start", "slot", "layer")))
        norms = dict(rms=rms, layer_norm=layer_norm, qk_norm=heads_norm)
        out, k, v = decode_step(*operands, rope=rope, bias=bias, **norms, config=mode.kernels.attention, mesh=mode.mesh)
        return out[:, None], {**cache, "k": k, "v": v}


# --------------------------------------------------------------------------------------- padding layout


def positions_from_mask(attention_mask):
    """Position ids [B, T] from the attention mask, as Hugging Face computes them for generation.

    Real tokens count 0, 1, 2, ... from the first real token of their row (so left padding does not shift
    them); padding gets -1. (OPT then adds its table offset of 2.)
    """
    mask = attention_mask.astype(jnp.int32)
    return jnp.cumsum(mask, axis=1) * mask - 1


def layout_inputs(input_ids, attention_mask, positions, cache, segment_ids=None):
    """(input_ids, positions, segment_ids, order) as the decoder runs them. Without a cache the real tokens go first,
    in their order (`order` [B, T] undoes it later), so that "attend to earlier real tokens" is plain causal attention
    with no mask tensor, whatever the padding (its outputs, last, are computed and never read); positions counted
    from the mask unless given (packed rows: each segment's own). With one the caller's positions are used as given
    and order is None."""
    if cache is not None:
        return input_ids, positions, None, None
    order = jnp.argsort(attention_mask.astype(jnp.int32) == 0, axis=1, stable=True)
    positions = positions_from_mask(attention_mask) if positions is None else positions
    first = lambda x: None if x is None else jnp.take_along_axis(x, order, 1)
    return first(input_ids), first(positions), first(segment_ids), order


def restore_layout(h, order):
    """Hidden states [B, T, D] back to the caller's token order (identity when order is None)."""
    if order is None:
        return h
    return jnp.take_along_axis(h, jnp.argsort(order, axis=1)[..., None], 1)


# ------------------------------------------------------------------------------------ scan over layers


def run_layers(parent: nn.Module, layer_cls, config, mode: Mode, h, cache, shared: dict, name: str = "layers"):
    """Run L copies of `layer_cls`: in the training layout its `__call__` under one `nn.scan` (optionally
    rematerialised per layer); in the decode layout (`mode.decode_layout`: `parent`'s parameters hold the layers as a
    tuple of per-layer trees) its `decode`, one layer after the other in a Python loop.

    Both entries are `(carry, layer_index, where) -> (carry, None)` with carry (h [B, T, D], kv) where kv is None or
    {"k", "v"} [L, B, Hkv, S, K] (carried, updated in place), and `where` what all layers share: the cache fields
    ("slot", "start") when generating, plus `shared` ("segment_ids", Llama's rotary tables). Returns (h, cache with
    the new k and v, or None).
    """
    kv = None if cache is None else {"k": cache["k"], "v": cache["v"]}
    where = {} if cache is None else {n: cache[n] for n in ("slot", "start")}
    where.update(shared)
    if mode.decode_layout:  # each layer its own arrays: no slice of a stacked [L, ...] leaf
        for i, params in enumerate(parent.variables["params"][name]):
            layer = layer_cls(config, mode, parent=None)
            (h, kv), _ = layer.apply({"params": params}, (h, kv), jnp.int32(i), where, method=layer_cls.decode)
        return h, (None if cache is None else {**cache, **kv})
    L = config.num_hidden_layers
    layer = nn.remat(layer_cls, prevent_cse=False) if config.remat else layer_cls
    layers = nn.scan(
        layer,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(0, nn.broadcast),
        length=L,
        # LoRA attached: one layer per iteration, so one layer's fused kernels exist at a time; unrolled, XLA computed
        # them all up front (OPT-30B's scoring ran out of memory)
        unroll=1 if mode.lora else min(config.backend.scan_unroll or L, L),
    )(config, mode, name=name)
    (h, kv), _ = layers((h, kv), jnp.arange(L), where)
    return h, (None if cache is None else {**cache, **kv})


def layer_cache(kv, where, layer):
    """The cache one layer sees (the carried k/v, the cache fields of `where`, its index), or None."""
    return None if kv is None else {**kv, "slot": where["slot"], "start": where["start"], "layer": layer}


def carry_out(h, cache):
    """A layer's new carry: (h, the cache's k/v or None)."""
    return (h, None if cache is None else {"k": cache["k"], "v": cache["v"]}), None


# ------------------------------------------------------------------------------- KV cache, parameters


def init_cache(config, valid, dtype=None, multiple: int = 64) -> dict:
    """An empty KV cache for generation: "k", "v" [L, B, Hkv, S, K] zeros, "start" [B] (each row's first valid
    slot), "slot" 0. `valid` [B, S] says which slots will hold real tokens: each row False (left padding),
    then True.

    S is valid.shape[1] (prompt + answer length) rounded up to `multiple` (the decode kernel reads the
    cache in blocks); the extra slots are never read.
    """
    B, S = valid.shape
    shape = (config.num_hidden_layers, B, config.num_key_value_heads, cache_length(S, multiple), config.head_dim)
    zeros = jnp.zeros(shape, dtype or config.compute_dtype)
    start = jnp.argmax(valid.astype(bool), axis=1).astype(jnp.int32)
    return {"k": zeros, "v": zeros, "start": start, "slot": jnp.zeros((), jnp.int32)}


def cache_length(length: int, multiple: int = 64) -> int:
    """The slots S of a cache for `length` tokens per row (init_cache): rounded up to a multiple of `multiple`."""
    return length + -length % multiple


def lora_attached(params) -> bool:
    """Whether LoRA adapters ride in `params` beside their kernels (lora.attach): the functional API's one look, for
    Mode.lora."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return any(getattr(path[-1], "key", None) == "lora_a" for path, _ in leaves)


def random_params(shapes: Any, key, *, dtype=jnp.float32, std: float = 0.02):
    """Random parameters for a tree of shapes: normal(0, std) weights, zero biases, unit norm scales."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    out = []
    for (path, leaf), k in zip(leaves, jax.random.split(key, len(leaves))):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        fill = jnp.ones if name.endswith("scale") else jnp.zeros if name.endswith("bias") else None
        normal = lambda: (std * jax.random.normal(k, leaf.shape, jnp.float32)).astype(dtype)
        out.append(fill(leaf.shape, dtype) if fill else normal())
    return jax.tree_util.tree_unflatten(treedef, out)


def lm_head(h, embedding):
    """Tied LM head: logits [B, T, V] in float32 from h [B, T, E] and the embedding table [V, E]."""
    return float32_logits("bte,ve->btv", h, embedding.astype(h.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def float32_logits(equation: str, h, kernel):
    """einsum(equation, h, kernel) accumulated and returned in float32 (the log-softmax needs it), whose backward
    runs in h's dtype: the float32 cotangent is cast down first, as PyTorch's autocast does. JAX's own transpose
    would multiply a float32 cotangent by a bf16 operand, which XLA runs as two float32 GEMMs (five times the
    bf16 forward's time for OPT-1.3B's Step 3 actor step)."""
    return jnp.einsum(equation, h, kernel, preferred_element_type=jnp.float32)


def _float32_logits_fwd(equation, h, kernel):
    return float32_logits(equation, h, kernel), (h, kernel)


def _float32_logits_bwd(equation, residuals, g):
    h, kernel = residuals
    a, b_out = equation.split(",")
    b, out = b_out.split("->")
    g = g.astype(h.dtype)
    dh = jnp.einsum(f"{out},{b}->{a}", g, kernel, preferred_element_type=jnp.float32).astype(h.dtype)
    # The weight's gradient sums over every token: kept in float32 until the cast to its own dtype.
    dk = jnp.einsum(f"{a},{out}->{b}", h, g, preferred_element_type=jnp.float32).astype(kernel.dtype)
    return dh, dk


float32_logits.defvjp(_float32_logits_fwd, _float32_logits_bwd)


def head_logprobs(h, kernel, targets, *, tied: bool, temperature: float = 1.0, chunk: int = 0, entropy: bool = False):
    """log p(targets) [B, T] float32 under softmax(z / temperature), z = the LM head's logits on h [B, T, E] (kernel:
    the embedding [V, E] if `tied`, else the untied head's [E, V]); with `entropy`, (log-probs, the entropy [B, T] of
    that distribution), else (log-probs, None). The logits are float32 (float32_logits), whatever h's dtype.

    chunk > 0 tokens: the head and its log-softmax run on one chunk of c = max(1, chunk // B) positions of every row
    at a time (T padded up to a multiple of c), each under jax.checkpoint: neither the forward nor the backward holds
    more than one chunk's [B, c, V] float32 logits (the backward recomputes them: one more head product). A chunk
    covering the whole batch, or chunk = 0, is the plain computation in one piece ([B, T, V])."""
    equation = "bte,ve->btv" if tied else "bte,ev->btv"
    kernel = kernel.astype(h.dtype)

    def one(h, targets):  # [b, c, E], [b, c] -> [b, c] (twice)
        logp = jax.nn.log_softmax(float32_logits(equation, h, kernel) / temperature, axis=-1)
        lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return lp, (-jnp.sum(jnp.exp(logp) * logp, axis=-1) if entropy else None)

    B, T = targets.shape
    if not chunk or chunk >= B * T:
        return one(h, targets)
    c = max(1, chunk // B)
    n = -(-T // c)
    # [B, T, ...] -> [n, B, c, ...]: the loop runs over chunks of positions, each chunk keeping the rows' layout (the
    # batch stays split over the devices inside every step)
    split = lambda x: jnp.moveaxis(
        jnp.pad(x, [(0, 0), (0, n * c - T)] + [(0, 0)] * (x.ndim - 2)).reshape(B, n, c, *x.shape[2:]), 1, 0
    )
    joined = lambda x: None if x is None else jnp.moveaxis(x, 0, 1).reshape(B, n * c)[:, :T]
    lp, ent = jax.lax.map(jax.checkpoint(lambda xs: one(*xs)), (split(h), split(targets)))
    return joined(lp), joined(ent)


def value_head(h, dtype):
    """The reward/critic head: `Linear(E, 1)`, no bias, on the last hidden state; [B, T] float32."""
    return Dense(1, use_bias=False, dtype=dtype, name="value_head")(h)[..., 0].astype(jnp.float32)


class LMHead(nn.Module):
    """An untied LM head: logits [B, T, V] in float32 from h [B, T, D] (kernel [D, V])."""

    vocab_size: int

    @nn.compact
    def __call__(self, h):
        kernel = self.param("kernel", nn.initializers.normal(0.02), (h.shape[-1], self.vocab_size))
        return float32_logits("btd,dv->btv", h, kernel.astype(h.dtype))


class CausalLM(nn.Module):
    """A family's forward (its `Model`): the decoder `body` (a module class, named `body_name` in the tree), then on
    its h [B, T, E] the LM head, tied (the embedding [V, E]) or not (config.tie_word_embeddings False: "lm_head"),
    or with `value_head=True` the reward/critic head; with `hidden=True` no head: h itself (what the LM head reads,
    for head_logprobs). Returns logits [B, T, V] or values [B, T] in float32 (or h [B, T, E] in the compute dtype),
    and the cache when given one."""

    config: Any
    value_head: bool = False
    mode: Mode = Mode()
    last: int = 0  # > 0: the head runs on the last `last` positions only
    hidden: bool = False  # return the final hidden states h (after `last` / head_at), no head
    body = None  # the family's decoder class and its name (class attributes, not fields)
    body_name = ""

    @nn.compact
    def __call__(self, input_ids, attention_mask, cache=None, positions=None, head_at=None, segment_ids=None):
        c = self.config
        body = self.body(c, self.mode, name=self.body_name)
        h = body(input_ids, attention_mask, cache, positions, segment_ids)  # [B, T, E] (and the cache)
        if cache is not None:
            h, cache = h
        if self.last:
            h = h[:, -self.last :]
        if head_at is not None:  # [B, A] positions: the head runs there only (packed rows: each row's answer)
            h = jnp.take_along_axis(h, head_at[..., None], axis=1)
        if self.hidden:
            return h if cache is None else (h, cache)
        untied = None if c.tie_word_embeddings else LMHead(c.vocab_size, name="lm_head")
        if self.value_head:
            out = value_head(h, c.compute_dtype)
            if untied is not None and self.is_initializing():  # keep the LM head in the tree (saved with the model)
                untied(h[:, :0])
        elif untied is None:
            out = lm_head(h, body.variables["params"]["embed_tokens"]["embedding"])
        else:
            out = untied(h)
        return out if cache is None else (out, cache)


def _dot(x, kernel, dtype):
    return jax.lax.dot_general(x.astype(dtype), kernel.astype(dtype), (((x.ndim - 1,), (0,)), ((), ())))


def fused_kernel(kernel, a, b_scaled):
    """kernel + a @ b_scaled in float32, cast back to kernel's dtype ([..., in, out], batched over a leading L): a
    LoRA adapter fused into its kernel (jaxrlhf.lora)."""
    # HIGHEST: a true float32 product (not TF32) on GPUs; a rank-dim matmul, cheap next to the model.
    delta = jnp.matmul(a.astype(jnp.float32), b_scaled.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)


def _lora_dot(x, kernel, a, b_scaled, dtype):
    return checkpoint_name(_dot(x, fused_kernel(kernel, a, b_scaled), dtype), "lora_dot")


# The fused kernel is recomputed in the backward pass (a rank-r product) instead of kept as a residual, which
# under the scan over layers would stack every layer's fused kernel into a whole second copy; the product's
# output is kept as usual.
_lora_dot = jax.checkpoint(
    _lora_dot, policy=jax.checkpoint_policies.save_only_these_names("lora_dot"), static_argnums=(4,)
)


class Dense(nn.Module):
    """flax's nn.Dense (params kernel [in, out], bias [out]; inputs and weights cast to `dtype`), plus LoRA:
    when its own parameters carry lora_a and lora_b beside the kernel (lora.attach adds them to the adapted modules
    only), the kernel is fused here, for this layer only (fused_kernel)."""

    features: int
    use_bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), jnp.float32)
        dtype = self.dtype or jnp.result_type(x, kernel)
        if self.has_variable("params", "lora_a"):
            a, b = (self.get_variable("params", n) for n in ("lora_a", "lora_b"))
            y = _lora_dot(x, kernel, a, b, jnp.dtype(dtype))
        else:
            y = _dot(x, kernel, dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32).astype(dtype)
        return y


# ------------------------------------------------------------------------------------ decode layout
# Generation reads every weight once per step, so the weights it runs with are laid out for it (built by
# generate.decode_params): each layer its own arrays, since a slice of a stacked [L, ...] leaf is a copy
# before each matmul (a fifth of OPT-1.3B's decode step), and the products that share an input stacked into
# one kernel, since XLA otherwise concatenates their kernels before every step.


def stacked_dense(p: dict, h, dtype, norm=None, *, bias: bool = True, out_dtype=None):
    """h [B, T, D] times a decode layout's stacked kernel p["kernel"] [D, *out] (plus its bias [*out]): [B, T, *out].
    One product with a [D, prod(out)] kernel and a flat bias: cuBLAS adds a vector bias in the product's epilogue,
    where a [*out] one took a broadcast kernel and a C-matrix read per layer and step. `norm` (the norm folded into
    the kernel, see fold_norm; from norm_rows): (1 / std [B, T, 1], mean [B, T, 1] or None), the product's rows
    finished before the bias, y -> (y - mean colsum) / std. bias=False leaves the bias out (a kernel adds it);
    out_dtype: the product's (default `dtype`)."""
    out = p["kernel"].shape[1:]
    centred = norm is not None and norm[1] is not None  # float32 out: y - mean colsum cancels in bf16
    y = jax.lax.dot_general(
        h.astype(dtype),
        p["kernel"].reshape(p["kernel"].shape[0], -1).astype(dtype),
        (((h.ndim - 1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32 if centred else out_dtype or dtype,
    )
    if norm is not None:
        scale, mean = norm
        y = y.astype(jnp.float32)
        if mean is not None:
            y = y - mean * p["colsum"].reshape(-1)
        y = (y * scale).astype(out_dtype or dtype)
    if bias and "bias" in p:
        y = y + p["bias"].reshape(-1).astype(y.dtype)
    return y.reshape(*y.shape[:-1], *out)


def fold_norm(dense: dict, scale, shift=None, colsum_dtype=None) -> dict:
    """A product's parameters {"kernel" [D, ...], "bias"} with a norm's scale [D] folded into the kernel's rows:
    (x * scale) @ W = x @ (scale[:, None] W). With a LayerNorm's `shift` [D] too, (x * scale + shift) @ W + c =
    x @ W' + (shift @ W + c), and the kernel's column sums W'.sum(0) (float32, of W' rounded to `colsum_dtype`, the
    dtype it runs in) as "colsum": the product of the centred rows is x @ W' - mean(x) colsum."""
    kernel = dense["kernel"]
    folded = kernel * scale.reshape(-1, *(1,) * (kernel.ndim - 1)).astype(kernel.dtype)
    out = {**dense, "kernel": folded}
    if shift is not None:
        f32 = lambda x: x.astype(jnp.float32)
        out["bias"] = (jnp.tensordot(f32(shift), f32(kernel), 1) + f32(dense.get("bias", 0.0))).astype(kernel.dtype)
        out["colsum"] = jnp.sum(f32(folded.astype(colsum_dtype or folded.dtype)), axis=0)
    return out


def norm_rows(h, eps: float, centred: bool):
    """(1 / std [..., 1], mean [..., 1] or None) of a folded norm's input h, float32: LayerNorm's (`centred`, as flax
    computes it) or RMSNorm's (stacked_dense's `norm`)."""
    x = h.astype(jnp.float32)
    mean_sq = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    if not centred:
        return jax.lax.rsqrt(mean_sq + eps), None
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return jax.lax.rsqrt(jnp.maximum(mean_sq - jnp.square(mean), 0.0) + eps), mean


# The sharding rows of what every family shares (each family's PARAM_AXES says the rest; see sharding.py): the token
# embedding, q/k/v, the value head, and the decode layout's stacked q/k/v (stack_qkv) and a folded LayerNorm's column
# sums. k/v_proj are [D, Hkv * K], so "heads" splits the KV heads over "model" too.
PARAM_AXES = [
    (r"embed_tokens/embedding", ("vocab", "embed")),
    (r"layers/self_attn/[qkv]_proj/kernel", ("layers", "embed", "heads")),
    (r"layers/self_attn/[qkv]_proj/bias", ("layers", "heads")),
    (r"value_head/kernel", ("embed", None)),
    (r"layers/self_attn/qkv_proj/kernel", ("layers", "embed", "heads", None)),
    (r"layers/self_attn/qkv_proj/(bias|colsum)", ("layers", "heads", None)),
]


def stack_qkv(attn: dict, kv_heads: int, qk_norm: bool = False) -> dict:
    """One layer's attention parameters in the decode layout: the q/k/v kernels [D, n K] (biases [n K]) as
    "qkv_proj" [D, Hkv, (G + 2) K] ([Hkv, (G + 2) K]): query head h = j G + g sits with KV head j, so tensor
    parallelism splits the stacked kernel by KV heads as it splits the three. The query part is multiplied by
    the attention's scale K^-1/2 (rotary embeddings are linear, so scaling before them is the same); with a
    per-head q norm (`qk_norm`, Qwen3), which would undo that, the norm's scale [K] is multiplied instead."""
    names = ("q_proj", "k_proj", "v_proj")
    parts = [attn[n] for n in names]
    K = parts[1]["kernel"].shape[-1] // kv_heads
    scaled = lambda tree: jax.tree.map(lambda x: x * K**-0.5, tree)
    per_head = lambda x: x.reshape(*x.shape[:-1], kv_heads, -1)
    rest = {n: x for n, x in attn.items() if n not in names}
    if qk_norm:
        rest["q_norm"] = scaled(rest["q_norm"])
    else:
        parts[0] = scaled(parts[0])
    fused = {leaf: jnp.concatenate([per_head(p[leaf]) for p in parts], axis=-1) for leaf in parts[0]}
    return {**rest, "qkv_proj": fused}
