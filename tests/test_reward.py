"""Step 2's entry point (jaxrlhf.reward.run): each step's logged loss against the pairwise loss computed in NumPy."""

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import pairs_config
from jaxrlhf import OPTConfig, init_params, save_hf
from jaxrlhf.data import Batches, prepare
from jaxrlhf.loop import checkpoint_manager
from jaxrlhf.models import values
from jaxrlhf.optim import OptimConfig, effective_params
from jaxrlhf.reward import RewardConfig, run
from jaxrlhf.sharding import make_mesh
from jaxrlhf.train import BUILTIN_MODEL, builtin_tokenizer
from jaxrlhf.trainer import load_model


def span_loss(vc, vr, c_ids, r_ids, c_mask, r_mask) -> float:
    """DeepSpeed-Chat's loss, pair by pair: the mean of -log sigmoid(chosen - rejected value) from the first token
    where the pair differs up to the later of their ends, averaged over the pairs with such a span."""
    per_pair = []
    for b in range(len(vc)):
        differ = np.flatnonzero((c_ids[b] != r_ids[b]) & ((c_mask[b] + r_mask[b]) > 0))
        start, end = (differ[0] if len(differ) else len(c_ids[b])), max(c_mask[b].sum(), r_mask[b].sum())
        if start < end:
            d = np.float64(vc[b, start:end]) - vr[b, start:end]
            per_pair.append(np.mean(np.log1p(np.exp(-d))))
    return float(np.mean(per_pair))


def test_each_steps_logged_loss_is_the_pairwise_loss_of_its_batch(tmp_path):
    """Three steps of 8 pairs in 2 micro-batches, saving the state after each: step k's logged loss is the NumPy loss
    of batch k under the weights saved after step k - 1. The same loss with chosen and rejected swapped is far off."""
    config = OPTConfig(**BUILTIN_MODEL)
    params = jax.device_get(init_params(config, jax.random.key(0), value_head=True, std=0.1))
    model = save_hf(tmp_path / "base", config, params, builtin_tokenizer())
    optim = OptimConfig(learning_rate=1e-2, gradient_accumulation_steps=2)
    fields = dict(batch_size=8, max_steps=3, log_every=1, save_every=1, keep_checkpoints=3, dropout=0.0, optim=optim)
    cfg = pairs_config(RewardConfig, model, tmp_path, "synthetic:200", dict(max_seq_len=32), **fields)
    out = run(cfg, log=lambda _: None, mesh=make_mesh(1, jax.devices()[:1]))
    config, params, tok = load_model(cfg, value_head=True)
    batches = iter(Batches(prepare(cfg.data, 2, tok, log=lambda _: None)["train"], 2, 8, cfg.data, tok.pad_token_id))
    manager = checkpoint_manager(Path(cfg.output_dir), 3)
    score = jax.jit(lambda p, ids, mask: values(config, p, ids, mask))
    for k in (1, 2, 3):
        (logged,) = [r["loss"] for r in out["records"] if r["split"] == "train" and r["step"] == k]
        b = next(batches)
        vc, vr = (np.asarray(score(params, b[f"{s}_ids"], b[f"{s}_mask"])) for s in ("chosen", "rejected"))
        ids_and_masks = (b["chosen_ids"], b["rejected_ids"], b["chosen_mask"], b["rejected_mask"])
        assert logged == pytest.approx(span_loss(vc, vr, *ids_and_masks), rel=1e-5), k
        assert logged != pytest.approx(span_loss(vr, vc, *ids_and_masks), rel=1e-3), k
        saved = manager.restore(k, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
        params = effective_params(saved, cfg.lora)
