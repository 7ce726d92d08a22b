"""The package's layers point one way: the import graph (module-level imports, read with ast) has no cycle, and
every module imports only from its own layer or the layers below it.

    kernels        self-contained Pallas kernels: nothing else of jaxrlhf
    base           config, the compilation cache, distributed, hooks (the plan's view of programs), metrics,
                   losses, alarms
    data           sources, pipeline, batches, the tasks' text and reward functions: nothing of models or training
    models         the families, sharding, LoRA, checkpoints, tokenizers
    generate       decoding
    training       the one loop (loop.py), the training state and optimizer (optim.py), Steps 1 and 2 (trainer.py)
    rl             Step 3's engine, experience, steps, packing, losses and config
    entry points   python -m jaxrlhf.X and the package's front (jaxrlhf/__init__.py); eval knows nothing of RL

Importing jaxrlhf.a.b also runs jaxrlhf/__init__.py and jaxrlhf/a/__init__.py; those implicit edges are left out
(Python runs a parent package first and lets its children import each other).
"""

import ast
import fnmatch
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxrlhf"

LAYERS = [
    ("kernels", ["jaxrlhf.kernels", "jaxrlhf.kernels.*"]),
    (
        "base",
        [
            "jaxrlhf.config",
            "jaxrlhf.compile_cache",
            "jaxrlhf.distributed",
            "jaxrlhf.hooks",
            "jaxrlhf.metrics",
            "jaxrlhf.losses",
            "jaxrlhf.alarms",
        ],
    ),
    ("data", ["jaxrlhf.data", "jaxrlhf.data.*", "jaxrlhf.rewards"]),
    (
        "models",
        [
            "jaxrlhf.models",
            "jaxrlhf.models.*",
            "jaxrlhf.sharding",
            "jaxrlhf.lora",
            "jaxrlhf.checkpoint",
            "jaxrlhf.tokenizer",
        ],
    ),
    ("generate", ["jaxrlhf.generate"]),
    ("training", ["jaxrlhf.loop", "jaxrlhf.optim", "jaxrlhf.trainer"]),
    ("rl", ["jaxrlhf.rl", "jaxrlhf.rl.*"]),
    (
        "entry points",
        [
            "jaxrlhf",
            "jaxrlhf.sft",
            "jaxrlhf.dpo",
            "jaxrlhf.reward",
            "jaxrlhf.ppo",
            "jaxrlhf.plan",
            "jaxrlhf.eval",
            "jaxrlhf.stories",
            "jaxrlhf.train",
            "jaxrlhf.chat",
            "jaxrlhf.inspect",
            "jaxrlhf.convert",
        ],
    ),
]
# Edges the layer order allows that the design still rules out: (importer, what it must not import).
FORBIDDEN = [("jaxrlhf.eval", "jaxrlhf.rl*"), ("jaxrlhf.eval", "jaxrlhf.ppo")]


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports at module level (`from a import b`: a.b where that is a module)."""
    mods = modules(root)
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + [base] * bool(base)
                    )
                edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
        graph[name] = {e for e in edges if e in mods and e != name}
    return graph


def layer(name: str) -> int:
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return i
    raise AssertionError(f"{name}: in no layer of tests/test_layers.py; give the new module its place there")


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for a, edges in sorted(graph.items()):
        for b in sorted(edges):
            if layer(b) > layer(a):
                out.append(f"{a} ({LAYERS[layer(a)][0]}) imports {b} ({LAYERS[layer(b)][0]})")
            if any(fnmatch.fnmatchcase(a, x) and fnmatch.fnmatchcase(b, y) for x, y in FORBIDDEN):
                out.append(f"{a} imports {b}")
    return out


def test_the_import_graph_has_no_cycle():
    assert cycle(import_graph()) is None, " -> ".join(cycle(import_graph()))


def test_every_import_points_down_the_layers():
    graph = import_graph()
    assert {"jaxrlhf.trainer", "jaxrlhf.loop"} <= graph["jaxrlhf.ppo"]  # the graph sees real edges
    assert violations(graph) == []


@pytest.mark.parametrize(
    "back_import, target, expect, cycles",
    [
        (
            "jaxrlhf/data/batches.py",
            "jaxrlhf.generate",
            "jaxrlhf.data.batches (data) imports jaxrlhf.generate (generate)",
            False,
        ),
        ("jaxrlhf/optim.py", "jaxrlhf.rl.engine", "jaxrlhf.optim (training) imports jaxrlhf.rl.engine (rl)", True),
        ("jaxrlhf/eval.py", "jaxrlhf.rl.engine", "jaxrlhf.eval imports jaxrlhf.rl.engine", False),
        (
            "jaxrlhf/kernels/swiglu.py",
            "jaxrlhf.models",
            "jaxrlhf.kernels.swiglu (kernels) imports jaxrlhf.models (models)",
            True,
        ),
    ],
)
def test_a_back_import_is_caught(tmp_path, back_import, target, expect, cycles):
    """The checks fail on a copy of the package with one import added against the layers."""
    root = tmp_path / "jaxrlhf"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / back_import
    path.write_text(path.read_text() + f"\nimport {target}  # noqa\n")
    graph = import_graph(root)
    assert expect in violations(graph)
    assert (
        cycle(graph) is not None
    ) == cycles  # rl imports optim, models the kernels; nothing imports data or eval back


def test_each_kernel_file_is_self_contained():
    """A kernel file holds its kernel, wrapper and reference: it imports nothing of jaxrlhf but the few helpers all
    kernels share (jaxrlhf/kernels/__init__.py, which imports nothing of jaxrlhf); no kernel imports another."""
    graph = import_graph()
    assert {k: v - {"jaxrlhf.kernels"} for k, v in graph.items() if k.startswith("jaxrlhf.kernels")} == {
        k: set() for k in graph if k.startswith("jaxrlhf.kernels")
    }


def test_a_cycle_is_found():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
