"""Shared by the benchmarks: the environment record, robust timing, and writing bench/results/<benchmark>/*.json."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import jax

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def environment() -> dict:
    """Device, library versions, commit and date: what a result needs to be comparable later."""
    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "transformers", "torch"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    # The GPU machine gets a copy of the tree without .git: pass JAXRLHF_COMMIT=$(git rev-parse --short HEAD).
    commit = os.environ.get("JAXRLHF_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
        except OSError:
            commit = None
    devices = jax.devices()
    return {
        "device": devices[0].device_kind,
        "device_count": len(devices),
        "platform": devices[0].platform,
        "host": platform.node(),
        "versions": versions,
        "commit": commit or None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def timeit(fn, repeats: int = 10, warmup: int = 2, block=jax.block_until_ready) -> dict:
    """Median and spread in seconds of `fn()`; compilation stays in the warm-up. `block(result)` waits for
    the device (PyTorch: `lambda _: torch.cuda.synchronize()`)."""
    for _ in range(warmup):
        block(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "repeats": repeats}


def kernel_profile(fn, log_dir: str | Path, top: int = 40) -> dict:
    """Where the device time of one `fn()` goes: a jax.profiler trace (kept in `log_dir` for Perfetto or
    TensorBoard) summed per kernel name on each device line. Returns {line: {"busy_ms", "kernels": [{name,
    count, total_ms}, ...the `top` largest]}}; on the CPU there are no device lines and it is empty."""
    import gzip

    jax.block_until_ready(fn())  # compile outside the trace
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        jax.block_until_ready(fn())
    trace = max(Path(log_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    return kernel_totals(json.load(gzip.open(trace))["traceEvents"], top)


def kernel_totals(events: list[dict], top: int = 40, phase_prefix: str = "jaxrlhf.") -> dict:
    """Perfetto trace events summed per kernel name on each device line (see kernel_profile). When the host
    timeline holds phase annotations (`jax.profiler.TraceAnnotation(phase_prefix + name)`: HybridEngine marks each
    Step 3 phase, which blocks until its device work is done), a kernel counts on "LINE [name]" of the phase
    whose interval holds its start ("LINE [other]" outside every phase)."""
    import collections

    names = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] in ("process_name", "thread_name")
    }
    process = lambda e: names.get((e.get("pid"), None), "")
    phases = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0.0), e["name"][len(phase_prefix) :])
        for e in events
        if e.get("ph") == "X" and e.get("name", "").startswith(phase_prefix) and not process(e).startswith("/device:")
    )

    def phase(ts):
        return next((f" [{name}]" for start, end, name in phases if start <= ts <= end), " [other]")

    lines = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    for e in events:
        if e.get("ph") == "X" and process(e).startswith("/device:"):
            line = f"{process(e)} {names.get((e['pid'], e.get('tid')), '')}"
            line += phase(e.get("ts", 0.0)) if phases else ""
            total = lines[line][e["name"]]
            total[0] += 1
            total[1] += e.get("dur", 0.0) / 1e3
    return {
        line: {
            "busy_ms": sum(t for _, t in k.values()),
            "kernels": [
                {"name": n[:160], "count": c, "total_ms": t}
                for n, (c, t) in sorted(k.items(), key=lambda kv: -kv[1][1])[:top]
            ],
        }
        for line, k in lines.items()
    }


def read_bandwidth(size: int = 2**31, reads: int = 16) -> float:
    """Bytes read per second by sums over `size` bf16 (4 GiB), `reads` of them in one compiled loop: the roofline
    of a read-bound kernel (decode attention, a decode step). One short sum per call put the host's dispatch in
    the timing and varied from run to run; the loop keeps the device busy long enough. A copy (`a + 1`) reads and
    writes and runs well below it (figures: docs/benchmarks.md)."""
    import jax.numpy as jnp

    a = jnp.ones((size,), jnp.bfloat16)
    # each pass scales by its own factor, so XLA cannot hoist one sum out of the loop
    total = jax.jit(
        lambda x: jax.lax.fori_loop(
            0, reads, lambda i, acc: acc + jnp.sum(x * (i + 1).astype(x.dtype), dtype=jnp.float32), jnp.float32(0)
        )
    )
    t = timeit(lambda: total(a), repeats=5)
    return reads * a.nbytes / t["median_s"]


COMPILES: list[tuple[str, float]] = []  # (function, seconds) of each program XLA compiled in this process


def _on_duration(event: str, seconds: float, **labels) -> None:
    if event == "/jax/core/compile/backend_compile_duration":  # not sent for a program read from the compile cache
        COMPILES.append((labels.get("fun_name", "?"), seconds))


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compiles_since(mark: int, top: int = 12) -> dict:
    """The programs compiled since COMPILES[mark] (mark: len(COMPILES) earlier): how many, their seconds, and the
    `top` functions by seconds ({name: [programs, seconds]}): where a cold start's compilation goes."""
    by: dict[str, list] = {}
    for name, seconds in COMPILES[mark:]:
        entry = by.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
    ranked = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "programs": len(COMPILES) - mark,
        "seconds": round(sum(s for _, s in COMPILES[mark:]), 2),
        "by_function": {name: [n, round(s, 2)] for name, (n, s) in ranked},
    }


def peak_bytes() -> int | None:
    """Peak device memory of device 0 since the process started (None where not reported, e.g. CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def safely(fn, *args) -> dict:
    """fn(*args), or {"error": its first line} (out of memory at a large batch: the other runs go on)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": str(e).splitlines()[0][:300]}


def torch_child(argv: list[str], keys) -> dict:
    """Run `python ARGV` (a benchmark's PyTorch side) in a child process whose JAX stays on the CPU, so that
    it has the whole GPU (JAX preallocates 75% of it), and return the JSON dict of its last stdout line;
    every key in `keys` gets the error where the child fails."""
    child = subprocess.run(
        [sys.executable, *argv], env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True
    )
    if child.returncode:
        lines = child.stderr.strip().splitlines() or ["no output"]
        return {str(k): {"error": f"child process failed: {lines[-1][:300]}"} for k in keys}
    return json.loads(child.stdout.strip().splitlines()[-1])


def write(benchmark: str, name: str, result: dict, out_dir: str | Path | None = None, stamp: str | None = None) -> Path:
    """Write bench/results/BENCHMARK/NAME-STAMP.json (or OUT_DIR/NAME-STAMP.json; STAMP: now). Passing the same stamp
    again rewrites that file, so a long benchmark can save what it has after each part."""
    out = Path(out_dir) if out_dir else RESULTS / benchmark
    out.mkdir(parents=True, exist_ok=True)
    stamp = stamp or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"{name}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path
