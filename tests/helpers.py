"""Tiny OPT checkpoints written by transformers itself, the reference for our parity tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Two variants that together cover every OPT code path:
#   pre-LN with a final LayerNorm (opt-125m, 1.3b and up);
#   post-LN without final LayerNorm, with project_in/out (opt-350m).
# vocab 64 and 4 heads divide over 8 devices and over tp = 2 and 4.
PRE_LN = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    ffn_dim=64,
    max_position_embeddings=40,
    word_embed_proj_dim=32,
    do_layer_norm_before=True,
)
POST_LN_PROJ = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    ffn_dim=48,
    max_position_embeddings=40,
    word_embed_proj_dim=16,
    do_layer_norm_before=False,
)


def make_hf_opt(folder: Path, seed: int = 0, **kwargs) -> Path:
    """Save a randomly initialised `OPTForCausalLM` (non-trivial biases and LayerNorms) to `folder`."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    config = OPTConfig(pad_token_id=1, bos_token_id=2, eos_token_id=2, **kwargs)
    model = OPTForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises biases to 0 and LayerNorms to 1: randomise them so they are tested,
        for name, p in model.named_parameters():  # and use larger weights so that logits are O(1), not O(0.01)
            if name.endswith("bias") or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    return folder


def hf_logits(folder: Path, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(input_ids), attention_mask=torch.tensor(attention_mask))
    return out.logits.float().numpy()


def left_padded_batch(vocab: int, lengths: list[int], T: int, seed: int = 0):
    """Random token ids [B, T], left-padded (pad id 1) to T, and the matching attention mask."""
    rng = np.random.default_rng(seed)
    ids = np.full((len(lengths), T), 1, np.int32)
    mask = np.zeros((len(lengths), T), np.int32)
    for b, n in enumerate(lengths):
        ids[b, T - n :] = rng.integers(3, vocab, n)
        ids[b, T - n] = 2  # BOS
        mask[b, T - n :] = 1
    return ids, mask


def jit_logits(config, params, input_ids, attention_mask, **kw):
    """`jaxrlhf.logits` compiled whole (once per config and shape) instead of run op by op: eager Flax is slow."""
    import jax

    from jaxrlhf import logits

    global _JIT_LOGITS
    if _JIT_LOGITS is None:
        _JIT_LOGITS = jax.jit(logits, static_argnums=0, static_argnames="last")
    return _JIT_LOGITS(config, params, input_ids, attention_mask, **kw)


def jit_values(config, params, input_ids, attention_mask):
    """`jaxrlhf.values` compiled whole (see jit_logits)."""
    import jax

    from jaxrlhf import values

    global _JIT_VALUES
    if _JIT_VALUES is None:
        _JIT_VALUES = jax.jit(values, static_argnums=0)
    return _JIT_VALUES(config, params, input_ids, attention_mask)


def greedy_reference(config, params, input_ids, attention_mask, max_new_tokens: int):
    """Greedy continuation by recomputing the whole sequence per token: slow, cache-free, obviously right.

    input_ids / attention_mask [B, P] are left-padded; returns the new tokens [B, max_new_tokens].
    """
    import jax
    import jax.numpy as jnp

    from jaxrlhf import logits

    global _NEXT_TOKEN
    if _NEXT_TOKEN is None:
        _NEXT_TOKEN = jax.jit(
            lambda config, params, ids, mask, t: jnp.argmax(
                logits(config, params, ids, mask)[:, t - 1], axis=-1
            ).astype(ids.dtype),
            static_argnums=0,
        )
    B, Pn = input_ids.shape
    ids = jnp.concatenate([input_ids, jnp.full((B, max_new_tokens), config.pad_token_id, input_ids.dtype)], 1)
    mask = jnp.concatenate([attention_mask, jnp.zeros((B, max_new_tokens), attention_mask.dtype)], 1)
    for t in range(Pn, Pn + max_new_tokens):  # slots after t are masked and causally invisible
        ids = ids.at[:, t].set(_NEXT_TOKEN(config, params, ids, mask, t))
        mask = mask.at[:, t].set(1)
    return ids[:, Pn:]


_JIT_LOGITS = _JIT_VALUES = _NEXT_TOKEN = None


def all_eqns(jaxpr):
    """Every equation of a closed `jaxpr` and of the programs inside it (scan bodies, jits, shard_maps)."""
    import jax.extend

    todo = [jaxpr.jaxpr]
    while todo:
        for eqn in todo.pop().eqns:
            yield eqn
            todo += [
                sub.jaxpr if hasattr(sub, "jaxpr") else sub for sub in jax.extend.core.jaxprs_in_params(eqn.params)
            ]


def kernel_calls(jaxpr, name: str) -> int:
    """How many places in `jaxpr` (and the programs inside it) call the Pallas kernel `name`."""
    return sum(eqn.primitive.name == "pallas_call" and str(eqn.params["name"]) == name for eqn in all_eqns(jaxpr))


def pairs_config(cls, model, tmp_path: Path, data_path, data: dict, **fields):
    """A Step 2 config (`cls`: RewardConfig or DPOConfig) from `model`, fp32, on the pairs of `data_path` alone
    (data_split 0,1,0; `data`: more DataConfig fields), its output (run/) and data cache under `tmp_path`."""
    from jaxrlhf.data import DataConfig

    data = DataConfig(data_path=(str(data_path),), data_split="0,1,0", cache_dir=str(tmp_path / "cache"), **data)
    return cls(model=str(model), output_dir=str(tmp_path / "run"), precision="fp32", data=data, **fields)


def run_on_one_device(run, cfg) -> tuple[dict, dict]:
    """`run(cfg)` (a Step 1 or 2 entry point) quietly on one device (on a 2-core CPU the 8 fake devices only add
    collectives to a step this small): (its result, its last eval record)."""
    import jax

    from jaxrlhf.sharding import make_mesh

    out = run(cfg, log=lambda _: None, mesh=make_mesh(1, jax.devices()[:1]))
    return out, [r for r in out["records"] if r["split"] == "eval"][-1]


# Reward functions for the tests of eval and Step 3 (`reward.functions=[helpers:NAME]`: tests/ is on sys.path).
def shares_a_digit(prompts, answers, metadata) -> list[float]:
    """0/1: whether the answer holds a digit of the row's reference (a verifier that random answers sometimes pass)."""
    return [float(bool(set(m["reference"]) & set(a))) for a, m in zip(answers, metadata)]


def graded(prompts, answers, metadata, *, token_ids, truncated) -> list[float]:
    """A score that every input moves: answer tokens / 10 + answer characters / 100 + prompt characters / 1000,
    minus 1 where the answer was truncated."""
    rows = zip(prompts, answers, token_ids, truncated)
    return [len(t) / 10 + len(a) / 100 + len(p) / 1000 - float(cut) for p, a, t, cut in rows]
