"""The device mesh, the two parameter layouts, and `reshard`, the one door between them.

    mesh: axes ("data", "model"), shape (N / tp, tp); tp = the generation tensor-parallel size
          ("model" is the inner axis, so a tensor-parallel group sits on the closest devices)

    layout "fsdp"  (training, ZeRO-3)  every leaf is split over ALL N devices along one dimension that
                                       divides evenly: the one "tp" splits if it can (so the switch is a
                                       plain all-gather), else the largest; never the stacked layer axis
                                       (the layer scan gathers one layer at a time). Leaves with no such
                                       dimension are replicated. The batch is split over all devices.
    layout "tp"    (generation)        Megatron: q/k/v and fc1 (Llama: gate/up) split by output columns,
                                       out_proj and fc2 (o_proj, down_proj) by input rows, the embedding and
                                       LM head by vocab, all over "model"; replicated over "data". Grouped-query
                                       k/v split by KV heads, so each device keeps the KV heads its query heads
                                       read. The prompt batch splits over "data".

Which dimension of a parameter is which is data: each model family's `PARAM_AXES` (models/opt.py,
models/llama.py, models/qwen.py; all of them: models.PARAM_AXES) maps parameter paths to a logical axis per dimension;
`TP_RULES` here maps logical axes to mesh axes. A leaf that no entry covers is an error, never
a silent replica. Optimizer-state trees shard like the parameters they mirror (paths end the same way);
LoRA factors (`.../lora_a`, `.../lora_b`) take the axes of their kernel, with none on the rank dimension.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.models import PARAM_AXES

AXES = ("data", "model")
LAYOUTS = ("fsdp", "tp")
# FSDP splits a dimension over both axes with "model" major: device (d, m) then holds a piece of exactly
# the slice that tensor parallelism gives it, so FSDP -> TP is an all-gather over "data" and nothing more.
FSDP_AXES = ("model", "data")

# Generation layout: logical axis -> mesh axis. Logical axes not listed are replicated.
TP_RULES = {"vocab": "model", "heads": "model", "mlp": "model"}


class LayoutError(ValueError):
    """A tree that cannot be laid out on the mesh as asked; the message names the leaf and the fix."""


def make_mesh(tp: int = 1, devices=None) -> Mesh:
    """The ("data", "model") mesh of shape (N / tp, tp) over `devices` (default: all devices of all hosts)."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if tp < 1 or n % tp:
        raise LayoutError(f"inference_tp_size {tp} must be >= 1 and divide the number of devices ({n})")
    try:  # topology-aware order (the "model" axis on the closest devices) where JAX knows the topology
        grid = mesh_utils.create_device_mesh((n // tp, tp), devices)
    except (AssertionError, NotImplementedError, ValueError):
        # JAX has no topology for these devices (CPU, a subset of a host's GPUs, an unknown kind) or cannot fit the
        # shape to it: the devices in their given order, which is what the mesh needs to be correct, only slower
        grid = np.asarray(devices).reshape(n // tp, tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def path_str(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axis of each dimension of the leaf at `path` (a '/'-joined parameter path)."""
    if ndim == 0:  # scalars (optimizer step counts) are replicated everywhere
        return ()
    one_layer = re.search(r"(^|/)layers/\d+/", path)
    if one_layer:  # one layer of the decode layout (layers/3/...): the stacked leaf's axes but the layer axis
        return logical_axes(path[: one_layer.end() - 1].rpartition("/")[0] + path[one_layer.end() - 1 :], ndim + 1)[1:]
    leaf = path.rpartition("/")[2]
    if leaf in ("lora_a", "lora_b"):  # LoRA factors (jaxrlhf.lora): their kernel's axes, None on the rank
        axes = list(logical_axes(path[: -len(leaf)] + "kernel", ndim))
        axes[-1 if leaf == "lora_a" else -2] = None
        return tuple(axes)
    for pattern, axes in PARAM_AXES:
        if re.search(f"(^|/){pattern}$", path):
            if len(axes) != ndim:
                raise LayoutError(f"{path}: has {ndim} dimensions, but the layout table expects {len(axes)} {axes}")
            return axes
    raise LayoutError(f"{path}: no layout rule covers this parameter; add it to its family's PARAM_AXES (models/)")


def partition_spec(path: str, shape: tuple[int, ...], layout: str, mesh: Mesh) -> P:
    """The PartitionSpec of one leaf in `layout` ("fsdp" or "tp")."""
    axes = logical_axes(path, len(shape))
    if layout == "fsdp":
        n = mesh.size
        # Prefer the dimension that the generation layout splits, then the largest; never the layer axis.
        candidates = [
            (ax in TP_RULES, size, -i)
            for i, (size, ax) in enumerate(zip(shape, axes))
            if ax != "layers" and size % n == 0
        ]
        spec = [None] * len(shape)
        if candidates and n > 1:
            spec[-max(candidates)[2]] = FSDP_AXES
        return P(*spec)
    if layout == "tp":
        spec = [TP_RULES.get(ax) for ax in axes]
        for i, (size, ax, mesh_axis) in enumerate(zip(shape, axes, spec)):
            if ax == "vocab" and mesh_axis and size % mesh.shape[mesh_axis]:
                spec[i] = None  # a vocabulary of added tokens (50,267): the LM head whole on each device, not refused
            elif mesh_axis and size % mesh.shape[mesh_axis]:
                raise LayoutError(
                    f"{path}: its '{ax}' dimension ({size}) does not divide over the "
                    f"{mesh.shape[mesh_axis]} devices of mesh axis '{mesh_axis}'; choose an "
                    "inference_tp_size that divides it"
                )
        return P(*spec)
    raise LayoutError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def shardings_for(tree: Any, layout: str, mesh: Mesh) -> Any:
    """A tree of `NamedSharding`s for `tree` (arrays or ShapeDtypeStructs) in `layout` on `mesh`."""
    spec = lambda path, x: NamedSharding(mesh, partition_spec(path_str(path), np.shape(x), layout, mesh))
    return jax.tree_util.tree_map_with_path(spec, tree)


def batch_sharding(mesh: Mesh, layout: str) -> NamedSharding:
    """Where a batch's leading axis lives: over all devices for training, over "data" for generation."""
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    return NamedSharding(mesh, P(AXES if layout == "fsdp" else "data"))


def check_tp(num_attention_heads: int, mesh: Mesh, num_key_value_heads: int | None = None):
    """Tensor parallelism splits whole heads: refuse a "model" axis that does not divide the (KV) heads."""
    tp = mesh.shape["model"]
    for name, n in (("num_attention_heads", num_attention_heads), ("num_key_value_heads", num_key_value_heads)):
        if n is not None and n % tp:
            raise LayoutError(
                f"{name} ({n}) is not divisible by inference_tp_size ({tp}); choose a tp size that divides it"
            )


@functools.lru_cache(maxsize=64)
def _identity(shardings: tuple):
    return jax.jit(lambda leaves: leaves, out_shardings=list(shardings))


def reshard(tree: Any, layout: str, mesh: Mesh, *, donate: bool = False) -> Any:
    """Move `tree` into `layout` on `mesh`.

    Device arrays move through a compiled identity with `out_shardings` (cached per set of target
    shardings): XLA emits the collectives, so the bytes stay on the devices and cross the interconnect, far
    faster than `jax.device_put` between shardings (tools/bench_reshard.py). Leaves that
    are already in place are passed through untouched (no copy). With `donate=True` the moved source
    buffers are freed as soon as the copy exists (XLA cannot alias buffers whose shard shapes differ, so
    this is done by hand), and the two layouts never stay in memory together.
    Host (NumPy) trees are placed with `jax.device_put`, each device receiving only its shard.
    """
    shardings = shardings_for(tree, layout, mesh)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    targets = jax.tree.leaves(shardings)
    if not all(isinstance(x, jax.Array) for x in leaves):
        return jax.device_put(tree, shardings)
    moving = [i for i, (x, s) in enumerate(zip(leaves, targets)) if not x.sharding.is_equivalent_to(s, x.ndim)]
    if not moving:
        return tree
    moved = _identity(tuple(targets[i] for i in moving))([leaves[i] for i in moving])
    out = list(leaves)
    for i, y in zip(moving, moved):
        out[i] = y
    if donate:
        jax.block_until_ready(moved)
        for i in moving:
            leaves[i].delete()
    return jax.tree_util.tree_unflatten(treedef, out)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def describe(tree: Any, *, file=None) -> str:
    """A table of every leaf: path, shape, dtype, PartitionSpec and bytes per device; returns and prints it.

    Works on device arrays, ShapeDtypeStructs with a sharding, and host arrays (shown as "host").
    """
    rows, per_device, total = [], 0, 0
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape, dtype = tuple(np.shape(x)), np.dtype(x.dtype)
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            spec = str(sharding.spec) if isinstance(sharding, NamedSharding) else type(sharding).__name__
            local = int(np.prod(sharding.shard_shape(shape), dtype=np.int64)) * dtype.itemsize
        else:
            spec, local = "host", int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        per_device += local
        total += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        rows.append((path_str(path), str(shape), dtype.name, spec, _human(local)))
    rows.append(("total", "", "", f"global {_human(total)}", _human(per_device)))
    header = ("path", "shape", "dtype", "spec", "bytes/device")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    text = "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])
    print(text, file=file)
    return text
