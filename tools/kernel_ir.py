"""The Triton programs our decode kernels hand to the GPU, lowered on the CPU: save them, and compare two saves.

    PYTHONPATH=. python tools/kernel_ir.py save DIR           # one text file per configuration
    PYTHONPATH=. python tools/kernel_ir.py compare DIR_A DIR_B [--hlo]
    # another commit's kernels: its package beside a copy of this tool
    mkdir -p /tmp/old/tools && git archive COMMIT jaxrlhf | tar -x -C /tmp/old && cp tools/kernel_ir.py /tmp/old/tools/
    python /tmp/old/tools/kernel_ir.py save /tmp/ir_old

A refactor of a kernel's Python (names, helpers, operand plumbing) should leave the GPU's program as it was. Each
configuration (decode_step with the folded RMSNorm or LayerNorm, bias, Qwen3's q/k norm, rotary or none, query groups
1 to 8, a tensor-parallel mesh; decode_attention with one split and four; decode_matmul's fc1 and fc2) is lowered for
an abstract H200 (no GPU needed, as tests/test_decode_attention.py's Triton test does), and each Pallas call's Triton
module (MLIR bytecode inside the custom call) is printed as text without source locations; the StableHLO around it
is kept too (the bytecode left out), so that a change in the operands the call gets (a dummy removed) shows.
`compare` says per configuration whether the Triton text is the same; else whether it is the same program once
canonicalized (canonicalize and CSE, Triton's first passes: the address arithmetic of an operand never read is dead)
and without the arguments the kernel never reads (a removed dummy operand), or differs (the canonical texts' diff);
and whether the StableHLO is the same (`--hlo`: its diff). The exit status is 1 where a program differs.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src.lib.mlir import ir, passmanager  # noqa: E402
from jax._src.mesh import AbstractDevice, AbstractMesh  # noqa: E402
from jax._src.pallas.triton import lowering as triton_lowering  # noqa: E402

from jaxrlhf.kernels.decode_attention import DecodeAttentionConfig, decode_attention, decode_step  # noqa: E402
from jaxrlhf.kernels.decode_matmul import decode_matmul  # noqa: E402

H200 = AbstractDevice("NVIDIA H200", 132, "gpu")
B, L, S = 4, 2, 512  # rows, layers, cache slots
# name: (Hkv, G, K, dtype of the product, rope, norm (None, "rms", "layer"), bias, qk_norm, mesh (data, model))
STEPS = {
    "llama_gqa4_rope_rms": (2, 4, 64, jnp.bfloat16, True, "rms", False, False, None),
    "qwen3_gqa2_rope_rms_qknorm": (2, 2, 128, jnp.bfloat16, True, "rms", False, True, None),
    "qwen2_gqa8_rope_rms_bias": (2, 8, 128, jnp.bfloat16, True, "rms", True, False, None),
    "qwen25_gqa6_rope_rms_bias": (2, 6, 128, jnp.bfloat16, True, "rms", True, False, None),
    "qwen25_gqa7_rope_rms_bias": (2, 7, 64, jnp.bfloat16, True, "rms", True, False, None),
    "opt_mha_layernorm_bias": (4, 1, 64, jnp.float32, False, "layer", True, False, None),
    "opt_mha_plain": (4, 1, 64, jnp.bfloat16, False, None, False, False, None),
    "mha_rms_norope": (4, 1, 64, jnp.bfloat16, False, "rms", False, False, None),
    "gqa2_bias_qknorm_norope": (2, 2, 64, jnp.bfloat16, False, None, True, True, None),
    "gqa3_layernorm_bias_qknorm": (2, 3, 64, jnp.float32, False, "layer", True, True, None),
    "gqa1_rope_only": (4, 1, 64, jnp.bfloat16, True, None, False, False, None),
    "llama_gqa2_rope_rms_tp2": (4, 2, 64, jnp.bfloat16, True, "rms", False, False, (1, 2)),
    "llama_gqa2_rope_rms_bias_data2_tp2": (4, 2, 64, jnp.bfloat16, True, "rms", True, False, (2, 2)),
    "opt_layernorm_bias_tp2": (4, 1, 64, jnp.float32, False, "layer", True, False, (1, 2)),
}
# name: (H, Hkv, K, num_splits, use_dot, mask_loads, mesh)
ATTENTIONS = {
    "attention_mha_k64": (32, 32, 64, 1, True, True, None),
    "attention_gqa4_k128_split4": (32, 8, 128, 4, True, True, None),
    "attention_gqa6_k128": (12, 2, 128, 1, True, True, None),
    "attention_gqa7_k64_whole_blocks": (14, 2, 64, 1, True, False, None),
    "attention_mha_elementwise": (8, 8, 64, 1, False, True, None),
    "attention_gqa4_tp2_split2": (16, 4, 64, 2, True, True, (1, 2)),
}
# name: (M, K, N, layer_norm, bias, relu, mesh)
MATMULS = {
    "matmul_fc1_layernorm_bias_relu": (64, 2048, 8192, True, True, True, None),
    "matmul_bias_only": (32, 1024, 1024, False, True, False, None),
    "matmul_fc2_split": (64, 8192, 2048, False, False, False, None),
    "matmul_fc1_tp2": (64, 2048, 8192, True, True, True, (1, 2)),
}


def _mesh(shape):
    if shape is None:
        return AbstractMesh((1,), ("x",), abstract_device=H200), None
    auto = (jax.sharding.AxisType.Auto,) * 2  # as make_mesh's: shard_map reads the operands' specs from in_specs
    mesh = AbstractMesh(shape, ("data", "model"), axis_types=auto, abstract_device=H200)
    return mesh, mesh


def _step_call(Hkv, G, K, dtype, rope, norm, bias, qk_norm, mesh):
    """(function, argument shapes) of one decode_step configuration."""
    config = DecodeAttentionConfig("auto", interpret=False)
    f32, bf16 = (lambda *shape, t=t: jax.ShapeDtypeStruct(shape, t) for t in (jnp.float32, jnp.bfloat16))
    G2 = G + 2

    def fn(qkv, k, v, start, cos, sin, x, sums, squares, colsum, b, scales):
        return decode_step(
            qkv,
            k,
            v,
            start,
            300,
            1,
            rope=(cos, sin) if rope else None,
            rms=(x, 1e-5) if norm == "rms" else None,
            layer_norm=(sums, squares, 2048, 1e-5, colsum) if norm == "layer" else None,
            bias=b if bias else None,
            qk_norm=(scales, 1e-6) if qk_norm else None,
            config=config,
            mesh=mesh,
        )

    cache = bf16(L, B, Hkv, S, K)
    shapes = (jax.ShapeDtypeStruct((B, Hkv, G2, K), dtype), cache, cache, jax.ShapeDtypeStruct((B,), jnp.int32))
    shapes += (f32(B, K // 2), f32(B, K // 2), bf16(B, 5120), f32(B), f32(B), f32(Hkv, G2, K), bf16(Hkv, G2, K))
    return fn, (*shapes, bf16(2, K))


def _attention_call(H, Hkv, K, splits, use_dot, mask_loads, mesh):
    config = DecodeAttentionConfig("auto", interpret=False, num_splits=splits, use_dot=use_dot, mask_loads=mask_loads)
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((B,), jnp.int32)
    fn = lambda q, k, v, start, end: decode_attention(q, k, v, start, end, 1, config=config, mesh=mesh)
    return fn, (bf16(B, H, K), bf16(L, B, Hkv, 2048, K), bf16(L, B, Hkv, 2048, K), rows, rows)


def _matmul_call(M, K, N, layer_norm, bias, relu, mesh):
    f32, bf16 = (lambda *shape, t=t: jax.ShapeDtypeStruct(shape, t) for t in (jnp.float32, jnp.bfloat16))

    def fn(x, w, sums, squares, colsum, b):
        norm = (sums, squares, colsum, 1e-5) if layer_norm else None
        return decode_matmul(x, w, bias=b if bias else None, layer_norm=norm, relu=relu, mesh=mesh)

    return fn, (bf16(M, K), bf16(K, N), f32(M), f32(M), f32(N), bf16(N))


def _custom_calls(op, found):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == "stablehlo.custom_call":
                    found.append(inner)
                _custom_calls(inner.operation, found)
    return found


def lower(fn, shapes, mesh) -> str:
    """The text of every Triton module in fn's program for an abstract H200 (no locations), then the StableHLO."""
    with jax.sharding.use_abstract_mesh(mesh):
        module = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    parts = []
    for call in _custom_calls(module.operation, []):
        config = call.attributes["mhlo.backend_config"]
        knobs = {n.name: str(n.attr) for n in config if n.name != "ir"}
        with triton_lowering._new_ir_context():
            triton = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            parts.append(f"// triton call {knobs}\n" + triton.operation.get_asm(enable_debug_info=False))
    hlo = module.operation.get_asm(enable_debug_info=False)
    hlo = re.sub(r'ir = "(?:[^"\\]|\\.)*"', "ir = <the Triton module above>", hlo)  # its bytecode holds locations
    return "\n".join(parts) + "\n// ---- stablehlo\n" + hlo


def save(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    calls = {name: (*_step_call(*c[:-1], _mesh(c[-1])[1]), c[-1]) for name, c in STEPS.items()}
    calls |= {name: (*_attention_call(*c[:-1], _mesh(c[-1])[1]), c[-1]) for name, c in ATTENTIONS.items()}
    calls |= {name: (*_matmul_call(*c[:-1], _mesh(c[-1])[1]), c[-1]) for name, c in MATMULS.items()}
    for name, (fn, shapes, mesh) in calls.items():
        (folder / f"{name}.mlir").write_text(lower(fn, shapes, _mesh(mesh)[0]))
        print(name, "saved")


def canonical(triton: str) -> str:
    """The Triton modules of `triton` (lower's text) as Triton's first passes leave them (canonicalize, CSE: the
    address arithmetic of an operand never read is dead), without the kernel's unused arguments and with the used
    ones renumbered in order: two texts equal here are one program, up to pointers the kernel never reads."""
    out = []
    for text in triton.split("// triton call ")[1:]:
        knobs, module = text.split("\n", 1)
        with triton_lowering._new_ir_context():
            parsed = ir.Module.parse(module)
            passmanager.PassManager.parse("builtin.module(canonicalize,cse)").run(parsed.operation)
            module = parsed.operation.get_asm(enable_debug_info=False)
        start, rest = module.split("tt.func ", 1)
        head, body = rest.split("{\n", 1)  # the kernel's signature, then its body
        args = re.findall(r"(%arg(\d+): [^,)]*?\{[^}]*\})", head)
        used = [(arg, n) for arg, n in args if re.search(rf"%arg{n}\b", body)]
        # the used arguments renumbered in order; the loops' block arguments (numbered on) shifted to follow them
        number = {int(n): i for i, (_, n) in enumerate(used)}
        name = lambda m: f"%arg{number.get(int(m.group(1)), int(m.group(1)) - len(args) + len(used))}"
        signature = ", ".join(re.sub(r"%arg(\d+)", name, arg) for arg, _ in used)
        body = re.sub(r"%arg(\d+)\b", name, body)
        head = f"{start}tt.func {head.split('(', 1)[0]}({signature}) {{"
        out.append(f"// triton call {knobs}\n{head}\n{body}")
    return "\n".join(out)


def compare(a: Path, b: Path, verbose: bool = False) -> int:
    """Prints each configuration's verdict (see the module docstring); returns how many run another program."""
    differ = 0
    for path in sorted(a.glob("*.mlir")):
        old, new = path.read_text(), (b / path.name).read_text()
        (old_triton, old_hlo), (new_triton, new_hlo) = (t.split("// ---- stablehlo\n") for t in (old, new))
        hlo = "StableHLO same" if old_hlo == new_hlo else "StableHLO differs"
        if old_triton == new_triton:
            print(f"{path.stem}: Triton same, {hlo}")
        elif canonical(old_triton) == canonical(new_triton):
            print(f"{path.stem}: Triton the same program (canonicalized, without unused arguments), {hlo}")
        else:
            differ += 1
            print(f"{path.stem}: Triton DIFFERS, {hlo}")
            old_c, new_c = canonical(old_triton).splitlines(True), canonical(new_triton).splitlines(True)
            sys.stdout.writelines(difflib.unified_diff(old_c, new_c, "before", "after", n=1))
        if old_hlo != new_hlo and verbose:
            sys.stdout.writelines(difflib.unified_diff(old_hlo.splitlines(True), new_hlo.splitlines(True), n=0))
    return differ


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("save").add_argument("folder", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    cmp.add_argument("--hlo", action="store_true", help="print the StableHLO's differences too")
    args = parser.parse_args(argv)
    if args.command == "save":
        save(args.folder)
    else:
        sys.exit(1 if compare(args.before, args.after, args.hlo) else 0)


if __name__ == "__main__":
    main()
