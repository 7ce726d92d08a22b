"""A decode step's product of few rows with a weight matrix, and what comes after it, in one Pallas (Triton) kernel.

    x     [M, K]  the step's rows (M = the batch, 16, 32 or 64)
    w     [K, N]  the weight matrix, read once: the call is bound by that read
    out   [M, N]  x @ w, then optionally a folded LayerNorm's end, a bias and a ReLU (OPT's fc1); or, split over K,
                  the float32 sum of `split` partial products (OPT's fc2: the sum fuses into the residual add after)

At 64 rows cuBLAS reads OPT-1.3B's FFN matrices well below the memory's bandwidth, and a decode step's FFN ran five
kernels per layer: the LayerNorm's statistics, the normalised copy of h, fc1 (bias and ReLU in cuBLAS's epilogue), fc2
split over K, and cuBLAS's reduction of the split. Here fc1 reads h itself (the norm folded into its kernel, models.
common.fold_norm) and each program ends the norm from the rows' sums and sums of squares (one XLA reduction before
it): LN(h) W + c = (h W' - mean(h) colsum) / std(h) + c' (summing them in the kernel's loop over K was slower).
fc2 writes `split` float32 partials, summed by the residual add's fusion.

Each program owns BLOCK_N output columns (with a split, of a 1 / split share of K) and loops over K in blocks of
BLOCK_K, its loads pipelined over NUM_STAGES buffers. Under tensor parallelism (`mesh` with a "model" axis) it runs
per shard: fc1 on its output columns, fc2 on its rows of K, the shards' sums then all-reduced.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.sharding import PartitionSpec as P

from jaxrlhf.kernels import per_shard, rows_axis

# The sweep's best at 64 rows (tools/bench_decode_matmul.py, docs/benchmarks.md), for fc1 and fc2 alike
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 128, 4, 4
ROWS = (16, 32, 64)  # tensor-core products need >= 16 rows; above 64 (not measured) cuBLAS runs
MAX_PROGRAMS = 160  # a split over K doubles while the programs stay within about one wave of a GPU's SMs


def split_for(k: int, n: int) -> int:
    """How many ways K is split: doubled while the (N / BLOCK_N) x split programs stay within MAX_PROGRAMS and
    each share of K keeps at least two whole blocks. fc1 2048 x 8192: 1 (128 programs); fc2 8192 x 2048: 4."""
    split = 1
    while (
        n // BLOCK_N * 2 * split <= MAX_PROGRAMS and k % (2 * split * BLOCK_K) == 0 and k // (2 * split) >= 2 * BLOCK_K
    ):
        split *= 2
    return split


def applies(rows: int, k: int, n: int) -> bool:
    """Whether the kernel takes an [rows, k] x [k, n] product (per shard): rows 16, 32 or 64, whole blocks."""
    return rows in ROWS and n % BLOCK_N == 0 and k % BLOCK_K == 0


def decode_matmul_reference(x, w, *, bias=None, layer_norm=None, relu: bool = False):
    """The definition, in float32 (the kernel's output dtype aside)."""
    y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
    if layer_norm is not None:
        sums, squares, colsum, eps = layer_norm
        mean = sums[:, None] / x.shape[-1]
        var = jnp.maximum(squares[:, None] / x.shape[-1] - mean * mean, 0.0)
        y = (y - mean * colsum.astype(jnp.float32)) * jax.lax.rsqrt(var + eps)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return jnp.maximum(y, 0.0) if relu else y


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class MatmulOperands:
    """The kernel's inputs by name, each whole to every program; a part not in use is None (no operand, no ref). The
    field order is the kernel's argument order."""

    x: Any  # [M, K]: the step's rows
    w: Any  # [K, N]: the weight matrix
    sums: Any = None  # [M] float32: a folded LayerNorm's input rows' sums (layer_norm)
    squares: Any = None  # [M] float32: and their sums of squares
    colsum: Any = None  # [N] float32: the folded kernel's column sums
    bias: Any = None  # [N]


def _kernel(ins: MatmulOperands, o_ref, *, steps: int, eps: float | None, relu: bool):
    """Program (j, s): output columns [j * BLOCK_N, (j + 1) * BLOCK_N) of share s of K, into o_ref [split, M, N]."""
    j, s = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(j * BLOCK_N, BLOCK_N), BLOCK_N)

    def body(i, carry):
        k = pl.ds(pl.multiple_of((s * steps + i) * BLOCK_K, BLOCK_K), BLOCK_K)
        return carry + jnp.dot(ins.x[:, k], ins.w[k, cols], preferred_element_type=jnp.float32)

    y = jax.lax.fori_loop(0, steps, body, jnp.zeros((ins.x.shape[0], BLOCK_N), jnp.float32))
    if eps is not None:
        D = ins.x.shape[1]
        mean = ins.sums[...] / D
        var = jnp.maximum(ins.squares[...] / D - mean * mean, 0.0)
        y = (y - mean[:, None] * ins.colsum[cols][None, :]) * jax.lax.rsqrt(var + eps)[:, None]
    if ins.bias is not None:
        y = y + ins.bias[cols].astype(jnp.float32)[None, :]
    if relu:
        y = jnp.maximum(y, 0.0)
    o_ref[s, :, cols] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "relu", "split", "interpret"))
def _pallas(x, w, norm, bias, *, eps, relu: bool, split: int, interpret: bool):
    (M, K), N = x.shape, w.shape[1]
    sums, squares, colsum = norm or (None, None, None)
    ins = MatmulOperands(x=x, w=w, sums=sums, squares=squares, colsum=colsum, bias=bias)
    return pl.pallas_call(
        functools.partial(_kernel, steps=K // split // BLOCK_K, eps=eps, relu=relu),
        grid=(N // BLOCK_N, split),
        in_specs=(jax.tree.map(lambda _: pl.no_block_spec, ins),),  # every operand whole
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((split, M, N), x.dtype if split == 1 else jnp.float32),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="jaxrlhf_decode_matmul",
    )(ins)


def decode_matmul(x, w, *, bias=None, layer_norm=None, relu: bool = False, interpret: bool = False, mesh=None):
    """x [M, K] @ w [K, N] for a decode step (module docstring; the shapes per shard must pass `applies`). With bias
    [N], layer_norm (sums [M], squares [M]: x's row sums and sums of squares, float32; colsum [N] float32; eps: x
    is the norm's input, w and bias have its scale and shift folded in) or relu, the product is whole per program
    and ends in the kernel: x's dtype out. Without them K is split (split_for) and the float32 sum of the partials
    is returned. interpret: Pallas interpret mode (CPU tests). `mesh` (with "data" and "model"
    axes): per shard, rows over "data" where they divide; with an epilogue N over "model" (column-parallel, fc1),
    else K over "model" and the shards' sums all-reduced (row-parallel, fc2)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"decode_matmul: expected x [M, K] and w [K, N], got {x.shape} and {w.shape}")
    norm, eps = (tuple(layer_norm[:3]), float(layer_norm[3])) if layer_norm is not None else (None, None)
    epilogue = bias is not None or layer_norm is not None or relu

    def product(x, w, norm, bias):
        if not applies(x.shape[0], *w.shape):
            raise ValueError(
                f"decode_matmul: {x.shape[0]} rows and a {w.shape[0]} x {w.shape[1]} matrix per shard; "
                f"the kernel takes {', '.join(map(str, ROWS))} rows, K a multiple of {BLOCK_K} and N of "
                f"{BLOCK_N} (check `applies` first and run the product in XLA otherwise)"
            )
        split = 1 if epilogue else split_for(*w.shape)
        out = _pallas(x, w, norm, bias, eps=eps, relu=relu, split=split, interpret=interpret)
        return out[0] if epilogue else jnp.sum(out, axis=0)

    rows = rows_axis(mesh, x.shape[0])
    if epilogue or mesh is None or mesh.size == 1:  # with an epilogue column-parallel: each shard its N, x whole
        norm_specs = None if norm is None else (P(rows), P(rows), P("model"))
        specs = (P(rows, None), P(None, "model"), norm_specs, None if bias is None else P("model"))
        return per_shard(product, mesh, specs, P(rows, "model"))(x, w, norm, bias)
    row_parallel = lambda x, w: jax.lax.psum(product(x, w, None, None), "model")
    return per_shard(row_parallel, mesh, (P(rows, "model"), P("model", None)), P(rows, None))(x, w)
