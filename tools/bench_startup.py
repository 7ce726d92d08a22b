"""Time to start: `python -m jaxrlhf.train` on the CPU, in new output folders sharing one compilation cache folder.

    PYTHONPATH=. python tools/bench_startup.py [--repeats N] [--out DIR] [key=value ...]

The built-in task of the README's quick start, with few steps (STEPS; key=value adds to or overrides them), run as
new processes, each into a new output folder, all sharing one data cache:

    cold      an empty compilation cache folder (jaxrlhf.compile_cache): every program compiles and is written
    warm      the same folder again, as a user's second start: the programs are read back
    no_cache  the cache off (JAXRLHF_COMPILE_CACHE=off), the data cache as warm: a second start without it

Each run's wall time, and its time to the first iteration of each step (process start to the first "1/N" of the step's
progress bar, timed as the line arrives), the programs in the cache folder after it, and the ratio warm / cold (the
target of issue 44: at most 0.6 on two CPU cores) go to bench/results/startup/train-cpu-STAMP.json.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the runs are timed on the CPU; so is the record of the device

from tools import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Few steps of each (the defaults train 1,500 / 300 / 300): the start, not the training, is what is timed.
STEPS = (
    "sft.max_steps=20",
    "sft.log_every=10",
    "reward.max_steps=20",
    "reward.log_every=10",
    "ppo.max_steps=4",
    "ppo.log_every=2",
    "eval_prompts=32",
    "eval_samples=2",
)
STEP = re.compile(r"=== Step (\d)")
FIRST = re.compile(r"^\w+:\s+\d+%\|[^|]*\|\s*(\d+)/\d+")  # a tqdm line: "train:  25%|██▌   | 1/4 [...]"


def timed_run(out_dir: Path, env: dict, overrides: list[str]) -> dict:
    """One `python -m jaxrlhf.train` process: its wall time and when each step reached its first iteration."""
    argv = [sys.executable, "-m", "jaxrlhf.train", "--output-dir", str(out_dir), *overrides]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    first, step, pending, log = {}, None, b"", []
    while chunk := proc.stdout.read1(65536):
        now = time.perf_counter() - start
        *lines, pending = re.split(rb"[\r\n]", pending + chunk)
        for line in (raw.decode(errors="replace") for raw in lines):
            log.append(line)
            if m := STEP.search(line):
                step = f"step{m.group(1)}"
            elif step and step not in first and (m := FIRST.match(line)) and int(m.group(1)) >= 1:
                first[step] = now
    rc, wall = proc.wait(), time.perf_counter() - start
    if rc:
        tail = "\n".join(line for line in log[-20:] if line.strip())
        raise RuntimeError(f"python -m jaxrlhf.train exited with {rc}:\n{tail}")
    return {"wall_s": wall, "first_iteration_s": first, "time_to_first_iteration_s": first.get("step1")}


def cache_entries(folder: Path) -> int:
    return len(list(folder.glob("*-cache"))) if folder.is_dir() else 0


def pair(work: Path, overrides: list[str]) -> dict:
    """cold, warm and no_cache runs (see the module docstring) in `work`."""
    base = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "JAXRLHF_CACHE": str(work / "data")}
    xla = work / "xla"
    runs = {}
    for name, cache in (("cold", str(xla)), ("warm", str(xla)), ("no_cache", "off")):
        before = cache_entries(xla)
        runs[name] = timed_run(work / name, {**base, "JAXRLHF_COMPILE_CACHE": cache}, overrides)
        runs[name]["programs_written"] = cache_entries(xla) - before
        r = runs[name]
        print(
            f"{name:8s} {r['wall_s']:6.1f} s, first iteration at {r['time_to_first_iteration_s']:.1f} s, "
            f"{r['programs_written']} programs written",
            flush=True,
        )
    runs["warm_over_cold"] = runs["warm"]["wall_s"] / runs["cold"]["wall_s"]
    runs["warm_over_no_cache"] = runs["warm"]["wall_s"] / runs["no_cache"]["wall_s"]
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="more settings of python -m jaxrlhf.train")
    ap.add_argument("--repeats", type=int, default=1, help="cold/warm/no_cache sets, each in fresh folders")
    ap.add_argument("--out", default=None, help="the result's folder (default bench/results/startup)")
    args = ap.parse_args()
    overrides = [*STEPS, *args.overrides]
    sets = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="bench-startup-") as work:
            sets.append(pair(Path(work), overrides))
    result = {
        "benchmark": "startup",
        **common.environment(),
        "cpu_cores": os.cpu_count(),
        "load_average_after": os.getloadavg(),
        "command": "python -m jaxrlhf.train --output-dir NEW " + " ".join(overrides),
        "runs": sets,
        "warm_over_cold": [s["warm_over_cold"] for s in sets],
    }
    common.write("startup", "train-cpu", result, args.out)


if __name__ == "__main__":
    main()
