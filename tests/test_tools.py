"""The benchmarks' own arithmetic (their timings are never tested)."""

import jax
import numpy as np

from jaxrlhf import make_mesh, reshard
from tools import common
from tools.bench_reshard import bytes_per_device, received_bytes


def test_received_bytes_counts_what_device_0_lacks():
    tree = {"decoder": {"embed_tokens": {"embedding": np.ones((64, 32), np.float32)}}}
    replicate = make_mesh(tp=1)  # generation layout replicated over data = 8
    fsdp = reshard(tree, "fsdp", replicate)
    assert received_bytes(fsdp, reshard(fsdp, "tp", replicate)) == 56 * 32 * 4  # has 8 of 64 rows
    assert bytes_per_device(fsdp) == 8 * 32 * 4
    aligned = make_mesh(tp=8)  # FSDP already holds exactly the tp shard
    fsdp = reshard(tree, "fsdp", aligned)
    assert received_bytes(fsdp, reshard(fsdp, "tp", aligned)) == 0
    two = make_mesh(tp=2)  # 8 rows held; the tp shard is 32 rows
    fsdp = reshard(tree, "fsdp", two)
    assert received_bytes(fsdp, reshard(fsdp, "tp", two)) == 24 * 32 * 4
    assert jax.device_count() == 8


def test_safely_and_the_child_process_report_errors_per_run():
    assert common.safely(lambda a, b: {"sum": a + b}, 2, 3) == {"sum": 5}
    assert common.safely(lambda: 1 / 0) == {"error": "division by zero"}
    assert common.torch_child(["-c", "import os; print('noise'); print('{\"8\": ' + repr(os.environ['JAX_PLATFORMS']) .replace(\"'\", '\"') + '}')"], [8]) == {"8": "cpu"}
    failed = common.torch_child(["-c", "raise SystemExit('out of memory')"], [16, 64])
    assert failed == {k: {"error": "child process failed: out of memory"} for k in ("16", "64")}
