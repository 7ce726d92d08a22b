"""Pallas GPU kernels for decoding (each file: kernel, wrapper, reference), and the few helpers they share:
which mesh axis splits generation's rows, running per shard, and a row's mean square read in power-of-two pieces."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def rows_axis(mesh, batch: int):
    """The mesh axis that generation's rows are split over per shard: "data" when it divides the batch, else none
    (every shard then holds all rows of its heads; also without a mesh)."""
    return "data" if mesh is not None and batch % mesh.shape["data"] == 0 else None


def per_shard(fn, mesh, in_specs, out_specs):
    """`fn` run per shard of `mesh` (shard_map: each device its heads or columns, and its rows where "data" splits
    them), or `fn` itself without a mesh of several devices."""
    if mesh is None or mesh.size == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def rows_per_shard(mesh, batch: int) -> int:
    """How many of generation's rows each shard holds (see rows_axis)."""
    return batch // mesh.shape["data"] if rows_axis(mesh, batch) else batch


def row_mean_square(x_ref, row):
    """mean(x^2) of row `row` of x_ref [B, D] in float32, read in pieces of the largest power of two dividing D (at
    most 4096): Triton loads power-of-two shapes only."""
    D = x_ref.shape[-1]
    piece = min(D & -D, 4096)
    add = lambda i, total: total + jnp.sum(jnp.square(x_ref[row, pl.ds(i * piece, piece)].astype(jnp.float32)))
    return jax.lax.fori_loop(0, D // piece, add, jnp.zeros((), jnp.float32)) / D
