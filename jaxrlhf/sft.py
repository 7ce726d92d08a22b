"""Step 1, `python -m jaxrlhf.sft`: supervised fine-tuning of an OPT model on prompt + chosen answers.

    python -m jaxrlhf.sft model=/data/opt-1.3b output_dir=runs/sft [data.data_path=[...]] [key=value ...]

Writes output_dir/model (an HF folder, LoRA fused: what Step 3 and transformers load), output_dir/state
(Orbax), run_config.json, metrics.jsonl and TensorBoard events. The same command started again continues an
interrupted run and skips a finished one (loop.start_run). Evaluation: perplexity on the held-out
set, and greedy answers to a few held-out prompts before and after training (DeepSpeed-Chat's prompt_eval).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import numpy as np

from jaxrlhf.config import run_cli
from jaxrlhf.data.batches import pad_rows
from jaxrlhf.data.pipeline import check_positions
from jaxrlhf.generate import generate
from jaxrlhf.losses import lm_loss
from jaxrlhf.models import LOGITS_CHUNK, next_token_logprobs
from jaxrlhf.optim import effective_params
from jaxrlhf.tokenizer import decode_rows, stop_ids
from jaxrlhf.trainer import RunConfig, train


@dataclasses.dataclass(frozen=True)
class SFTConfig(RunConfig):
    output_dir: str = "runs/sft"
    #: held-out prompts answered greedily at each evaluation, before and after training
    sample_prompts: int = 3
    #: tokens per sample answer
    sample_tokens: int = 32


def sft_loss(config, chunk: int = LOGITS_CHUNK):
    """Step 1's loss function: lm_loss, its log-probs computed `chunk` tokens at a time (RunConfig.logits_chunk)."""

    def loss_fn(params, batch, key):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        lp = next_token_logprobs(config, params, ids, mask, chunk=chunk, dropout_rng=key)
        return lm_loss(lp, batch["loss_mask"])

    return loss_fn


def summarise(sums) -> dict:
    loss = float(sums["loss"]) / max(float(sums["count"]), 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def sample_answers(
    config, params, tokenizer, prompts: list[np.ndarray], n_tokens: int, chat_template: str = "auto", model_dir=None
) -> list[str]:
    """Greedy answers (KV-cached generation, stopping at stop_ids: EOS, the chat template's end-of-turn, the model
    folder's generation_config.json ids) to tokenized prompts, as text."""
    ids, mask = pad_rows(prompts, max(len(p) for p in prompts), tokenizer.pad_token_id, left=True)
    greedy = dict(max_new_tokens=n_tokens, temperature=0.0, eos_id=stop_ids(tokenizer, chat_template, model_dir))
    out = generate(config, params, ids, mask, jax.random.key(0), **greedy)
    return decode_rows(tokenizer, out.tokens, out.mask, stops=greedy["eos_id"])


def prompt_eval(cfg: SFTConfig, config, tokenizer, data, state):
    """DeepSpeed-Chat's prompt_eval (train's make_on_eval, `cfg` bound): greedy answers to held-out prompts, before
    training and at each eval."""
    arrays = data["eval"]
    n = min(cfg.sample_prompts, len(arrays["offsets"]) - 1)
    if n == 0:
        return None
    starts = arrays["offsets"][:n]
    prompts = [arrays["tokens"][a : a + length] for a, length in zip(starts, arrays["prompt_len"][:n])]
    need, what = max(len(p) for p in prompts) + cfg.sample_tokens, f"sample_tokens ({cfg.sample_tokens}) after a prompt"
    check_positions(config.max_position_embeddings, need, what, "lower sample_tokens, or sample_prompts=0 for none")
    answers = lambda st: sample_answers(
        config, effective_params(st, cfg.lora), tokenizer, prompts, cfg.sample_tokens, cfg.data.chat_template, cfg.model
    )
    before = answers(state)
    texts = [decode_rows(tokenizer, p[None], np.ones((1, len(p))), skip_first=True)[0] for p in prompts]  # no BOS
    return lambda st: {
        "samples": [{"prompt": t, "before": b, "after": a} for t, b, a in zip(texts, before, answers(st))]
    }


def run(cfg: SFTConfig, log=print, mesh=None) -> dict:
    """Step 1 (see trainer.train); returns the final state, the logged records and the model folder."""
    loss = partial(sft_loss, chunk=cfg.logits_chunk)
    return train(cfg, 1, loss, summarise, log=log, mesh=mesh, make_on_eval=partial(prompt_eval, cfg))


def main(argv=None):
    run_cli(SFTConfig, __doc__, "python -m jaxrlhf.sft", run, argv)


if __name__ == "__main__":
    main()
