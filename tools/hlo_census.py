"""The HLO op census of the models' programs: how many ops of each kind XLA compiles for a training step, a score,
a prefill and a decode step of tiny OPT, Llama and Qwen3 models, in both parameter layouts, with the decode kernels
(Pallas, interpret mode off a GPU) on and off, unsharded and under tensor parallelism. A rework of the models that
must not change what runs (issue 42: one layer API with an explicit decode) compares two censuses: identical
counts mean the same programs, op for op.

    python tools/hlo_census.py --out before.json                 # runs on 8 virtual CPU devices
    python tools/hlo_census.py --out after.json --compare before.json
    python tools/hlo_census.py --only opt --programs decode_fast_pallas

Each program's census is {op kind: count} over every computation of the compiled module (fusions' bodies included),
read from `jax.jit(f).lower(...).compile().as_text()`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrlhf import models  # noqa: E402
from jaxrlhf.generate import decode_params  # noqa: E402
from jaxrlhf.models import Backend, LlamaConfig, Mode, OPTConfig, QwenConfig  # noqa: E402
from jaxrlhf.sharding import make_mesh, reshard  # noqa: E402

B, P, G = 16, 8, 4  # rows (16: decode_matmul's smallest), prompt width, answer tokens
KERNELS = Backend(decode_attention="pallas", interpret=True)
# Tiny models where every decode kernel applies at 16 rows (decode_matmul: widths of whole 64 x 128 blocks).
MODELS = {
    "opt": OPTConfig(
        vocab_size=64,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=512,
        max_position_embeddings=64,
        word_embed_proj_dim=128,
    ),
    "opt_post_ln": OPTConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=48,
        max_position_embeddings=64,
        word_embed_proj_dim=16,
        do_layer_norm_before=False,
    ),
    "llama": LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ),
    "qwen3": QwenConfig(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        attention_bias=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
MODELS["llama_interleaved"] = dataclasses.replace(MODELS["llama"], rope_interleaved=True)

_OP = re.compile(r"([\w\-]+)\(")


def op_kind(line: str) -> str | None:
    """The op kind of one HLO instruction line (`%name = shape kind(operands), ...`), or None for other lines."""
    if " = " not in line or line.lstrip().startswith(("HloModule", "//")):
        return None
    rest = line.split(" = ", 1)[1]
    if rest.startswith("("):  # a tuple shape: skip the balanced parentheses
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rest = rest[i + 1 :]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = _OP.match(rest.strip())
    return m.group(1) if m else None


def census(fn, *args) -> dict:
    """{op kind: count} of fn(*args) compiled."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    counts = collections.Counter(k for k in map(op_kind, text.splitlines()) if k)
    return dict(sorted(counts.items()))


def generation_modes(config, params, layout: bool, mesh, slots: int) -> tuple[Mode, Mode]:
    """The Modes of a generation's prefill and decode step: at HEAD before issue 42 Mode(kind, layout, mesh); after
    it models.generation_modes (the kernel choices made once ride in the decode step's)."""
    if not hasattr(models, "generation_modes"):
        return Mode("prefill", layout, mesh), Mode("decode", layout, mesh)
    return models.generation_modes(config, params, mesh=mesh, batch=B, slots=slots)


def _inputs(config):
    key = jax.random.key(1)
    ids = jax.random.randint(key, (B, P), 3, config.vocab_size)
    mask = (jnp.arange(P)[None, :] >= (jnp.arange(B) % 4)[:, None]).astype(jnp.int32)  # left padding 0..3
    return ids, mask


def train_programs(config, params, lora_params) -> dict:
    """A training forward + backward (dropout on), with LoRA attached too, and a score (no dropout)."""
    ids, mask = _inputs(config)
    key = jax.random.key(2)

    def loss(p):
        lp = models.next_token_logprobs(config, p, ids, mask, dropout_rng=key)
        return -jnp.sum(lp * mask[:, 1:])

    grad = lambda p: jax.value_and_grad(loss)(p)
    score = lambda p: models.logits(config, p, ids, mask)
    values = lambda p: models.values(config, p, ids, mask)
    value_params = {**params, "value_head": {"kernel": jnp.zeros((config.word_embed_proj_dim, 1))}}
    return {
        "train": census(grad, params),
        "train_lora": census(grad, lora_params),
        "score": census(score, params),
        "values": census(values, value_params),
    }


def generation_programs(config, params, mesh=None, tag: str = "") -> dict:
    """A prefill (P tokens into an empty cache) and one decode step (each row at its own slot), in the training layout
    and the decode layout (decode_params), with the decode kernels on and off."""
    ids, mask = _inputs(config)
    valid = jnp.concatenate([mask.astype(bool), jnp.ones((B, G), bool)], axis=1)
    cache = models.init_cache(config, valid)
    S = cache["k"].shape[3]
    positions = jnp.maximum(models.positions_from_mask(mask), 0)
    out = {}
    for impl, backend in (("xla", Backend()), ("pallas", KERNELS)):
        cfg = dataclasses.replace(config, backend=backend)
        for layout in (False, True):
            p = decode_params(cfg, params, mesh) if layout else params
            name = f"{'fast' if layout else 'plain'}_{impl}{tag}"
            prefill_mode, step_mode = generation_modes(cfg, p, layout, mesh, S)

            def prefill(p, cache, mode=prefill_mode):
                return models.logits_with_cache(cfg, p, ids, positions, cache, mode, last=1)

            def step(p, cache, mode=step_mode):
                c = {**cache, "slot": P + jnp.arange(B, dtype=jnp.int32) % 3}
                return models.logits_with_cache(cfg, p, ids[:, :1], positions[:, -1:] + 1, c, mode)

            with jax.set_mesh(mesh) if mesh is not None else _nothing():
                if not tag:
                    out[f"prefill_{name}"] = census(prefill, p, cache)
                out[f"decode_{name}"] = census(step, p, cache)
    return out


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def model_census(name: str, config) -> dict:
    """Every program of one model: training, scoring, generation unsharded and (decode steps) at tp 2 over 2 devices."""
    params = models.init_params(config, jax.random.key(0))
    from jaxrlhf.lora import LoRAConfig, attach, init_lora

    lora_cfg = LoRAConfig(dim=4)
    lora_params = attach(params, init_lora(params, lora_cfg, jax.random.key(3)), lora_cfg)
    out = {} if name == "llama_interleaved" else train_programs(config, params, lora_params)
    out.update(generation_programs(config, params))
    mesh = make_mesh(tp=2, devices=jax.devices()[:2])
    out.update(generation_programs(config, reshard(params, "fsdp", mesh), mesh, tag="_tp2"))
    return out


def compare(before: dict, after: dict) -> list[str]:
    """The differences between two censuses, one line each (none: identical)."""
    lines = []
    for model in sorted(set(before) | set(after)):
        b, a = before.get(model, {}), after.get(model, {})
        for prog in sorted(set(b) | set(a)):
            if prog not in b or prog not in a:
                lines.append(f"{model}/{prog}: only {'after' if prog in a else 'before'}")
                continue
            for op in sorted(set(b[prog]) | set(a[prog])):
                x, y = b[prog].get(op, 0), a[prog].get(op, 0)
                if x != y:
                    lines.append(f"{model}/{prog}: {op} {x} -> {y}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the census here (JSON)")
    parser.add_argument("--compare", help="a census to compare with (JSON): prints every difference")
    parser.add_argument("--only", nargs="*", default=list(MODELS), choices=list(MODELS))
    ns = parser.parse_args(argv)
    result = {}
    for name in ns.only:
        result[name] = model_census(name, MODELS[name])
        total = {p: sum(c.values()) for p, c in result[name].items()}
        print(name, json.dumps(total), flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    if ns.compare:
        with open(ns.compare) as f:
            before = json.load(f)
        lines = compare({m: before[m] for m in result if m in before}, result)
        print("\n".join(lines) or "identical: every program, every op kind")
        return 1 if lines else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
