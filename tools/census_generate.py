"""The per-step work of generation's compiled decode loop, as an op census, for an A/B between two checkouts (no GPU).

    PYTHONPATH=. python tools/census_generate.py [--tree /tmp/old] --model opt-1.3b --batch 768 --prompt 256 \\
        --new 256 [--slots 0] [--platform cpu|cuda] [--out FILE.json]
    PYTHONPATH=. python tools/census_generate.py --compare BEFORE.json AFTER.json

Lowers (never runs) `generate` of the checkout at --tree (default: this one) on random weights given as shapes only
(jax.eval_shape: no memory), in the decode layout Step 3 uses (decode_params), sampling at temperature 1 with a stop
id that never matches (bench_ppo's fixed workload: every row runs to --new), and counts the operations of the loop
body that runs once per decode step: the innermost `while` whose body holds the model's products. For each HLO
opcode it counts the instructions (and the instructions inside fusions, by the fusion's name), and it lists every
instruction of the body whose result is at least --big elements (work over the whole cache or the [B, V] logits).
--platform cpu compiles for this machine's CPU (optimized HLO: fusions); cuda lowers for a GPU without one
(StableHLO converted to HLO before optimization, the Pallas kernels as custom calls), with the checkout's GPU
backend (Pallas decode kernels).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def checkout(tree: str | None):
    """The jaxrlhf package of `tree` (a checkout) importable, before anything imports this one's."""
    root = Path(tree).resolve() if tree else HERE
    sys.path.insert(0, str(root))
    return root


_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%?([\w.\-]+(?:, %?[\w.\-]+)*)\}?")


def computations(hlo: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """HLO text as {computation: [(name, result type, opcode, rest of the line)]}."""
    comps, current = {}, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and not line[0].isspace():  # a computation's header; its instructions are indented
            current = comps.setdefault(m.group(1), [])
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            current.append(m.groups())
    return comps


def callees(rest: str) -> list[str]:
    """The computations an instruction calls (fusion bodies, loop bodies and conditions, reducers, branches)."""
    return [n.strip().lstrip("%") for m in _CALLS.finditer(rest) for n in m.group(1).split(",")]


def body_of(rest: str) -> str:
    """The body computation of a while instruction."""
    return re.search(r"body=%?([\w.\-]+)", rest).group(1)


def elements(shape: str) -> int:
    """The largest array's element count in an HLO result type (a tuple: its largest member)."""
    sizes = [1]
    for dims in re.findall(r"[a-z]\w*\[([\d,]*)\]", shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        sizes.append(n)
    return max(sizes)


def decode_body(comps) -> str:
    """The innermost while body that holds dot products (the model's) in itself or in what it calls, not in a loop."""

    def has_dots(name, seen=()):
        for _, _, op, rest in comps.get(name, ()):
            if op in ("dot", "convolution", "custom-call") and (
                op == "dot" or "__cublas" in rest or op != "custom-call"
            ):
                return True
            if op != "while" and any(has_dots(c, seen + (name,)) for c in callees(rest) if c not in seen):
                return True
        return False

    bodies = [body_of(rest) for c in comps.values() for _, _, op, rest in c if op == "while"]
    bodies = [b for b in bodies if has_dots(b)]
    if not bodies:
        raise SystemExit("no while loop with dot products in the program")
    nested = lambda b: any(op == "while" and has_dots(body_of(r)) for _, _, op, r in comps[b])
    return next(b for b in bodies if not nested(b))


VIEWS = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant", "while")  # no work of their own
NOTABLE = ("scatter", "gather", "dynamic-update-slice", "dynamic-slice", "reduce", "sort", "dot", "custom-call")


def census(comps, body: str, big: int) -> dict:
    """Opcode counts of `body` (its own instructions, and inside each fusion or call it makes, by opcode), the big
    results, and every while loop in the program with its body's size."""
    top, inner, fusions, big_ops = collections.Counter(), collections.Counter(), collections.Counter(), []

    def walk(name, depth, seen):
        for iname, shape, op, rest in comps.get(name, ()):
            (top if depth == 0 else inner)[op] += 1
            if depth == 0 and op not in VIEWS and elements(shape) >= big:
                big_ops.append(f"{op} {shape.split('{')[0]} {iname}")
            if depth == 0 and op == "fusion":  # what kind of work each fusion holds
                held = collections.Counter()
                walk_into(callees(rest), held)
                fusions["+".join(sorted(k for k in held if k in NOTABLE)) or "elementwise"] += 1
            if op != "while":
                for c in callees(rest):
                    walk(c, depth + 1, seen)

    def walk_into(names, held):
        for n in names:
            for _, _, op, rest in comps.get(n, ()):
                held[op] += 1
                walk_into(callees(rest), held)

    walk(body, 0, ())
    loops = [
        {"body": body_of(rest), "in": name, "backend_config": rest.split("backend_config=")[-1][:80]}
        for name, c in comps.items()
        for _, _, op, rest in c
        if op == "while"
    ]
    for loop in loops:
        loop["instructions"] = len(comps.get(loop["body"], ()))
    return {
        "body": body,
        "instructions": sum(top.values()),
        "ops": dict(sorted(top.items())),
        "ops_inside_fusions_and_calls": dict(sorted(inner.items())),
        "fusions_by_notable_ops": dict(sorted(fusions.items())),
        "big_results": big_ops,
        "while_loops": loops,
    }


def lower(args):
    """The HLO text of generate at the given shapes (optimized for the CPU, or lowered for a GPU)."""
    import importlib

    import jax
    import jax.numpy as jnp

    gen = importlib.import_module("jaxrlhf.generate")  # the package exports a function of that name
    models = importlib.import_module("jaxrlhf.models")
    assert Path(gen.__file__).is_relative_to(args.root), f"{gen.__file__} is not under {args.root}"

    overrides = dict(dtype="bfloat16", dropout=0.0)
    if hasattr(models, "Backend"):  # HEAD: the backend is the config's; e977f8f picked it from the platform
        gpu = args.platform == "cuda"
        overrides["backend"] = models.Backend(
            attention="cudnn" if gpu else "xla", decode_attention="auto" if gpu else "xla", scan_unroll=0 if gpu else 1
        )
    elif args.platform == "cuda":
        overrides["decode_attention"] = "pallas"
    config = models.preset(args.model, **overrides)
    shapes = models.param_shapes(config)
    params = jax.eval_shape(lambda p: gen.decode_params(config, p), shapes)
    B, P, G = args.batch, args.prompt, args.new
    kwargs = dict(max_new_tokens=G, temperature=1.0, eos_id=-1, pad_id=1)
    if "slots" in inspect.signature(gen.generate).parameters:
        kwargs["slots"] = args.slots

    def run(params, ids, mask, key):
        out = gen.generate(config, params, ids, mask, key, **kwargs)
        return out.tokens, out.mask, out.logprobs

    ids = jax.ShapeDtypeStruct((B, P), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    if args.platform == "cpu":
        return jax.jit(run).trace(params, ids, ids, key).lower().compile().as_text()
    from jax._src.mesh import AbstractDevice, AbstractMesh

    # Triton lowers for an abstract H200 (tests/test_decode_attention.py); e977f8f's kernels asked the platform
    jax.default_backend = lambda: "gpu"
    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    with jax.sharding.use_abstract_mesh(h200):
        traced = jax.jit(run).trace(params, ids, ids, key)
        return traced.lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")


def compare(before: dict, after: dict) -> dict:
    """Two censuses' differing counts: {section: {opcode or kind: [before, after]}}."""
    out = {"instructions": [before["instructions"], after["instructions"]]}
    for section in ("ops", "ops_inside_fusions_and_calls", "fusions_by_notable_ops"):
        a, b = before[section], after[section]
        out[section] = {k: [a.get(k, 0), b.get(k, 0)] for k in sorted(set(a) | set(b)) if a.get(k, 0) != b.get(k, 0)}
    kinds = lambda c: collections.Counter(" ".join(x.split()[:2]) for x in c["big_results"])  # opcode and shape
    a, b = kinds(before), kinds(after)
    out["big_results"] = {k: [a[k], b[k]] for k in sorted(set(a) | set(b)) if a[k] != b[k]}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", nargs=2, metavar="JSON", help="print what differs between two censuses and exit")
    parser.add_argument("--tree", help="a checkout of the commit to census (e.g. a git worktree); default: this one")
    parser.add_argument("--model", default="opt-1.3b")
    parser.add_argument("--batch", type=int, default=768)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--slots", type=int, default=0, help="decode slots (0: one per prompt); ignored before slots")
    parser.add_argument("--platform", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--big", type=int, default=0, help="list results of at least this many elements (0: B x 1024)")
    parser.add_argument("--hlo", help="also write the HLO text here")
    parser.add_argument("--out", help="write the census as JSON here (default: print it)")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(f).read_text()) for f in args.compare)
        return print("\n".join(f"{k}: {json.dumps(v)}" for k, v in compare(before, after).items()))
    root = args.root = checkout(args.tree)
    hlo = lower(args)
    if args.hlo:
        Path(args.hlo).write_text(hlo)
    comps = computations(hlo)
    result = {
        "tree": str(root),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **census(comps, decode_body(comps), args.big or args.batch * 1024),
    }
    text = json.dumps(result, indent=1)
    Path(args.out).write_text(text) if args.out else print(text)


if __name__ == "__main__":
    main()
