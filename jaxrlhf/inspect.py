"""`python -m jaxrlhf.inspect`: put a checkpoint on the mesh, show both layouts, time the switch, generate.

The first thing to run on a new machine: it shows the devices JAX sees, the parameter table of the
training (FSDP) and generation (tensor-parallel) layouts with bytes per device, how long `reshard`
takes each way, and a greedy continuation of a prompt. Without a checkpoint it uses random weights of
a released model's shape (no model hub needed); `save_to=DIR` writes that model as a Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.checkpoint import CheckpointError, load_hf, save_hf
from jaxrlhf.config import ConfigError, run_cli
from jaxrlhf.generate import generate
from jaxrlhf.models import Backend, init_params, param_shapes, preset
from jaxrlhf.sharding import check_tp, describe, make_mesh, reshard, shardings_for
from jaxrlhf.tokenizer import load_tokenizer


@dataclasses.dataclass(frozen=True)
class InspectConfig:
    #: a Hugging Face OPT, Llama, Qwen2 or Qwen3 checkpoint folder, or random:NAME for random weights of a released
    #: shape (NAME: opt-125m, ..., opt-66b, llama-2-7b, llama-7b-gqa, tinyllama-1.1b, qwen2.5-0.5b, qwen2.5-1.5b,
    #: qwen2.5-7b, qwen3-0.6b, qwen3-1.7b, qwen3-8b)
    model: str = "random:opt-125m"
    #: tokenizer folder (default: the model's own folder; without one, token ids are shown)
    tokenizer: str | None = None
    #: tensor-parallel size of the generation layout; must divide the device count and the heads
    tp: int = 1
    #: parameter and compute dtype
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    #: text to continue (needs a tokenizer; otherwise a fixed list of token ids is used)
    prompt: str = "\n\nHuman: What is reinforcement learning from human feedback?\n\nAssistant:"
    #: how many tokens to continue it by, greedily
    max_new_tokens: int = 16
    #: write the model (and tokenizer) as a Hugging Face folder here
    save_to: str | None = None
    #: seed of the random weights
    seed: int = 0


def _timed(fn, repeats=5):
    jax.block_until_ready(fn())  # compile outside the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _load(cfg: InspectConfig, mesh):
    dtype = jnp.dtype(cfg.dtype)
    if cfg.model.startswith("random:"):
        try:
            config = preset(cfg.model.removeprefix("random:"), dtype=cfg.dtype, backend=Backend.detect())
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None
        check_tp(config.num_attention_heads, mesh, config.num_key_value_heads)
        # Initialise directly in the training layout: no device ever holds the whole model.
        out = shardings_for(param_shapes(config), "fsdp", mesh)
        params = jax.jit(partial(init_params, config, dtype=dtype), out_shardings=out)(jax.random.key(cfg.seed))
        return config, params, load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    config, host = load_hf(cfg.model, dtype=dtype)
    check_tp(config.num_attention_heads, mesh, config.num_key_value_heads)
    try:
        tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    except CheckpointError:
        if cfg.tokenizer:
            raise
        tokenizer = None
    return config, reshard(host, "fsdp", mesh), tokenizer


def run(cfg: InspectConfig) -> dict:
    mesh = make_mesh(cfg.tp)
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}; mesh {dict(mesh.shape)}")
    config, params, tokenizer = _load(cfg, mesh)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"model: {cfg.model} ({n_params / 1e6:.1f}M parameters, {cfg.dtype})\n")

    print("training layout (fsdp):")
    describe(params)
    to_tp = _timed(lambda: reshard(params, "tp", mesh))
    tp_params = reshard(params, "tp", mesh)
    back = _timed(lambda: reshard(tp_params, "fsdp", mesh))
    print("\ngeneration layout (tp):")
    describe(tp_params)
    print(f"\nreshard fsdp -> tp: {to_tp * 1e3:.2f} ms, tp -> fsdp: {back * 1e3:.2f} ms (median of 5)")

    if tokenizer is not None:
        prompt = np.asarray(tokenizer(cfg.prompt)["input_ids"], np.int32)[None]
    else:
        prompt = np.array([[config.bos_token_id, 100, 200, 300, 400]], np.int32)
    ids, mask = jax.device_put((prompt, np.ones_like(prompt)), NamedSharding(mesh, P()))  # replicated
    greedy = partial(generate, max_new_tokens=cfg.max_new_tokens, temperature=0.0, force_length=True)
    gen = lambda: greedy(config, tp_params, ids, mask, jax.random.key(0)).tokens
    seconds = _timed(gen, repeats=3)
    new = np.asarray(gen())[0]
    shown = tokenizer.decode(new) if tokenizer is not None else new.tolist()
    print(f"\nprompt: {cfg.prompt if tokenizer is not None else prompt[0].tolist()!r}")
    print(
        f"greedy continuation ({cfg.max_new_tokens} tokens, KV-cached, generation layout, "
        f"{cfg.max_new_tokens / seconds:.0f} tokens/s at batch 1): {shown!r}"
    )

    if cfg.save_to:
        save_hf(cfg.save_to, config, jax.device_get(params), tokenizer)
        print(f"saved the model as a Hugging Face folder: {cfg.save_to}")
    return {
        "reshard_to_tp_s": to_tp,
        "reshard_to_fsdp_s": back,
        "tokens": new,
        "params": n_params,
        "generate_s": seconds,
    }


def main(argv=None):
    run_cli(InspectConfig, __doc__, "python -m jaxrlhf.inspect", run, argv)


if __name__ == "__main__":
    main()
