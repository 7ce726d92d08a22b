"""SwiGLU of a decode step, finishing the RMSNorm folded into its product.

    gate_up  [B, 2, F]  h @ gate_up_proj, the decode layout's stacked gate and up kernels with the post-attention
                        RMSNorm's scale folded into their rows (llama.decode_layer): not yet divided by rms(h)
    h        [B, D]     the product's input, the residual stream
    out      [B, F]     silu(gate * r) * (up * r), r = 1 / sqrt(mean(h^2) + eps)

Unfused, XLA runs three kernels for this per layer and step on the GPU: the mean square's reduction, its rsqrt
(XLA does not repeat an rsqrt in every element of the product, so it gets a kernel of its own) and silu * up.
The Pallas (Triton) kernel does it in one: one program per (row, block of columns), each reducing its row of h
(a few KiB, from L2 after the row's first program) and writing its block of the output. Under tensor parallelism
(`mesh` with a "model" axis) it runs per shard: each device its columns of F, h whole.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.sharding import PartitionSpec as P

from jaxrlhf.kernels import per_shard, row_mean_square, rows_axis

BLOCK_F = 2048  # output columns per program (a power of two for Triton; the last block masked): faster than 1024
NUM_WARPS = 8


def rms_swiglu_reference(gate_up, h, eps: float):
    """The definition, in float32; gate_up's dtype out."""
    r = jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), axis=-1) + eps)[:, None]
    gate, up = (gate_up[:, i].astype(jnp.float32) * r for i in (0, 1))
    return (jax.nn.silu(gate) * up).astype(gate_up.dtype)


def _kernel(h_ref, gate_up_ref, o_ref, *, eps: float, block_f: int):
    # h_ref [B, D], gate_up_ref [B, 2, F], o_ref [B, F] (whole; this program: row b, columns [j * block_f, ...))
    b, j = pl.program_id(0), pl.program_id(1)
    F = o_ref.shape[-1]
    r = jax.lax.rsqrt(row_mean_square(h_ref, b) + eps)
    cols = pl.ds(pl.multiple_of(j * block_f, block_f), block_f)
    mask = None
    if F % block_f:
        mask = j * block_f + jax.lax.broadcasted_iota(jnp.int32, (block_f,), 0) < F
    gate, up = (
        pltriton.load(gate_up_ref.at[b, jnp.int32(i), cols], mask=mask, other=0).astype(jnp.float32) * r for i in (0, 1)
    )
    pltriton.store(o_ref.at[b, cols], (gate * jax.nn.sigmoid(gate) * up).astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _pallas(gate_up, h, *, eps: float, interpret: bool):
    B, _, F = gate_up.shape
    block_f = min(BLOCK_F, pl.next_power_of_2(F))
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, block_f=block_f),
        grid=(B, pl.cdiv(F, block_f)),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((B, F), gate_up.dtype),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="jaxrlhf_rms_swiglu",
    )(h, gate_up)


def rms_swiglu(gate_up, h, eps: float, *, interpret: bool = False, mesh=None):
    """silu(gate * r) * (up * r) with r = 1 / rms(h), in one kernel (shapes in the module docstring). interpret:
    Pallas interpret mode (CPU tests). `mesh` (with "data" and "model" axes): per shard, F
    over "model", rows over "data" where they divide."""
    if gate_up.ndim != 3 or gate_up.shape[1] != 2 or h.shape[0] != gate_up.shape[0]:
        raise ValueError(f"rms_swiglu: expected gate_up [B, 2, F] and h [B, D], got {gate_up.shape} and {h.shape}")
    fn = functools.partial(_pallas, eps=float(eps), interpret=interpret)
    rows = rows_axis(mesh, gate_up.shape[0])
    return per_shard(fn, mesh, (P(rows, None, "model"), P(rows, None)), P(rows, "model"))(gate_up, h)
