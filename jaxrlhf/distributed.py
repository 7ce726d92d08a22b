"""Several processes (hosts) as one JAX program, through JAX's own distributed runtime.

Every entry point calls `initialize` before JAX starts. It joins the other processes when

- the flags say so: `--coordinator-address HOST:PORT --num-processes N --process-id I` (or the environment
  variables JAXRLHF_COORDINATOR_ADDRESS, JAXRLHF_NUM_PROCESSES, JAXRLHF_PROCESS_ID), or
- the process runs as one of several SLURM tasks (`srun`; JAX reads the cluster from SLURM's variables),

and otherwise does nothing. Then `jax.devices()` lists every process's devices, one mesh spans them all,
each process loads its own rows of every batch (`data.Batches`), Orbax checkpoints are written by all
processes together (and restore on any process count), and process 0 alone logs and writes HF folders.
On the CPU the processes talk through gloo (tests/test_multiprocess.py runs Steps 1 and 3 as two processes).
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np
from jax.experimental import multihost_utils


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several processes (multi-node; see the README)")
    group.add_argument(
        "--coordinator-address",
        metavar="HOST:PORT",
        help="process 0's address, the same for every process (env JAXRLHF_COORDINATOR_ADDRESS)",
    )
    group.add_argument("--num-processes", type=int, metavar="N", help="how many processes (env JAXRLHF_NUM_PROCESSES)")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0 .. N-1 (env JAXRLHF_PROCESS_ID)")


def initialize(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Join the other processes if the arguments, the environment or SLURM describe several; True if joined."""
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    for key in given:
        var = f"JAXRLHF_{key.upper()}"  # JAXRLHF_COORDINATOR_ADDRESS, JAXRLHF_NUM_PROCESSES, JAXRLHF_PROCESS_ID
        if given[key] is None and os.environ.get(var):
            given[key] = os.environ[var] if key == "coordinator_address" else int(os.environ[var])
    explicit = any(v is not None for v in given.values())
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
    if not explicit and not slurm:
        return False
    if explicit and None in given.values():
        missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None]
        raise ValueError(f"several processes: also give {', '.join(missing)} (every process needs all three)")
    if explicit and not 0 <= given["process_id"] < given["num_processes"]:
        raise ValueError(f"--process-id {given['process_id']} is outside 0 .. {given['num_processes'] - 1}")
    if jax.distributed.is_initialized():
        return True
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU runs; GPUs use NCCL regardless
    jax.distributed.initialize(**given) if explicit else jax.distributed.initialize()
    return True


def to_host(tree):
    """A tree of (possibly multi-process) arrays as numpy, whole, on every process."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)
