"""Step 1, `python -m jaxrlhf.sft`: supervised fine-tuning of an OPT model on prompt + chosen answers.

    python -m jaxrlhf.sft model=/data/opt-1.3b output_dir=runs/sft [data.data_path=[...]] [key=value ...]

Writes output_dir/model (an HF folder, LoRA fused: what Step 3 and transformers load), output_dir/state
(Orbax, for resume=true), metrics.jsonl and TensorBoard events. Evaluation: perplexity on the held-out
set, and greedy answers to a few held-out prompts before and after training (DeepSpeed-Chat's prompt_eval).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np

from jaxrlhf.config import ConfigError, parse_cli
from jaxrlhf.data import Batches, DataError, prepare
from jaxrlhf.losses import lm_loss
from jaxrlhf.models.opt import logits
from jaxrlhf.trainer import RunConfig, check_run, create_state, effective_params, eval_batches, fit, load_model, make_optimizer, perplexity, total_steps


@dataclasses.dataclass(frozen=True)
class SFTConfig(RunConfig):
    output_dir: str = "runs/sft"
    #: held-out prompts answered greedily at each evaluation, before and after training
    sample_prompts: int = 3
    #: tokens per sample answer
    sample_tokens: int = 32


def sft_loss(config):
    def loss_fn(params, batch, key):
        out = logits(config, params, batch["input_ids"], batch["attention_mask"], dropout_rng=key)
        return lm_loss(out, batch["input_ids"], batch["loss_mask"])

    return loss_fn


def summarise(sums) -> dict:
    loss = float(sums["loss"]) / max(float(sums["count"]), 1.0)
    return {"loss": loss, "perplexity": perplexity(loss)}


def sample_answers(config, params, tokenizer, prompts: list[np.ndarray], n_tokens: int) -> list[str]:
    """Greedy answers (no KV cache yet: the generation engine replaces this) to tokenized prompts."""
    from jaxrlhf.inspect import greedy_reference

    answers = []
    for ids in prompts:
        new = np.asarray(greedy_reference(config, params, ids[None], np.ones_like(ids)[None], n_tokens))[0]
        eos = np.flatnonzero(new == tokenizer.eos_token_id)
        answers.append(tokenizer.decode(new[: eos[0] if len(eos) else len(new)]))
    return answers


def run(cfg: SFTConfig, log=print, mesh=None) -> dict:
    """Step 1 on `mesh` (default: all devices, "model" axis of size cfg.tp); returns the state and records."""
    from jaxrlhf.checkpoint import save_hf
    from jaxrlhf.sharding import make_mesh

    mesh = mesh or make_mesh(cfg.tp)
    check_run(cfg, mesh.size)
    config, params, tokenizer = load_model(cfg, value_head=False)
    data = prepare(cfg.data, 1, tokenizer, log=log)
    pad = tokenizer.pad_token_id
    batches = Batches(data["train"], 1, cfg.batch_size, cfg.data, pad,
                      process_index=jax.process_index(), process_count=jax.process_count())
    steps = total_steps(cfg, len(batches))
    tx = make_optimizer(cfg.optim, steps, cfg.lora)
    state = create_state(params, cfg.lora, tx, jax.random.key(cfg.seed), mesh)

    eval_arrays = data["eval"]
    offsets, tokens = eval_arrays["offsets"], eval_arrays["tokens"]
    prompt_len = eval_arrays["prompt_len"]
    prompts = [tokens[offsets[i] : offsets[i] + prompt_len[i]] for i in range(min(cfg.sample_prompts, len(offsets) - 1))]
    samples = lambda st: sample_answers(config, effective_params(st, cfg.lora), tokenizer, prompts, cfg.sample_tokens)
    baseline = samples(state) if prompts else []

    def on_eval(st):
        return {"samples": [{"prompt": tokenizer.decode(p[1:]), "before": b, "after": a} for p, b, a in zip(prompts, baseline, samples(st))]}

    state, records = fit(cfg, state, sft_loss(config), tx, batches, eval_batches(eval_arrays, 1, cfg, pad), summarise, mesh,
                         total_steps=steps, on_eval=on_eval if prompts else None, log=log)
    final = jax.device_get(effective_params(state, cfg.lora))
    saved = dataclasses.replace(config, dtype="float32", remat=False)
    out = save_hf(Path(cfg.output_dir) / "model", saved, final, tokenizer) if jax.process_index() == 0 else None
    log(f"Step 1 done: HF model in {out}")
    return {"state": state, "records": records, "config": config, "model_dir": out}


def main(argv=None):
    cfg = parse_cli(SFTConfig, __doc__.split("\n\n")[0], argv, prog="python -m jaxrlhf.sft")
    try:
        run(cfg)
    except (ConfigError, DataError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
