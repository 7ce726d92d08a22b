"""DPO, `python -m jaxrlhf.dpo`: preference optimisation straight from the pairs, instead of Steps 2 + 3
(DeepSpeed-Chat's step2_dpo).

    python -m jaxrlhf.dpo model=runs/sft/model output_dir=runs/dpo [beta=0.1] [loss_type=ipo] [key=value ...]

The policy starts from `model` (a Step 1 output) and trains on Step 2's pairs (its share of data_split) to raise
the log-ratio of the chosen answer over the rejected one against a frozen reference, the starting model itself:

    per micro-batch   ref_c, ref_r = log π_ref(answer | prompt)      the frozen starting weights, no gradient
                      π_c, π_r     = log π(answer | prompt)          the policy (LoRA attached; dropout if set)
                      loss         = losses.dpo_loss(π_c, π_r, ref_c, ref_r)

log π(answer | prompt) sums the answer's token log-probs (its EOS included, the prompt masked); IPO divides
each by its answer's token count (the per-token mean, as IPO's authors and TRL). With LoRA and
only_optimize_lora the reference is the frozen base with the adapters off: no second copy of the model; otherwise
the state holds a frozen copy of the starting weights (trainer.with_reference). Evaluation on the held-out
pairs: the loss, the implicit rewards β (π - π_ref) of chosen and rejected, their margin, and the accuracy
(chosen's reward above rejected's; 0.5 for the reference itself). Writes output_dir/model (an HF causal LM, LoRA
fused), resumes and skips like Steps 1 and 2 (jaxrlhf.trainer.train).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Literal

import jax.numpy as jnp

from jaxrlhf.config import ConfigError, check_fields, run_cli
from jaxrlhf.losses import answer_mask, dpo_loss, lm_targets, sequence_logprobs
from jaxrlhf.models import LOGITS_CHUNK, next_token_logprobs
from jaxrlhf.trainer import RunConfig, train


@dataclasses.dataclass(frozen=True)
class DPOConfig(RunConfig):
    output_dir: str = "runs/dpo"
    #: strength of the pull toward the reference (DPO's β; DeepSpeed-Chat's default)
    beta: float = 0.1
    #: conservative DPO: the share ε of pairs taken as mislabelled, in [0, 0.5) (0: plain DPO; sigmoid loss only)
    label_smoothing: float = 0.0
    #: sigmoid: DPO's -log σ(β h); ipo: IPO's squared loss (h - 1/(2β))², h from per-token mean log-ratios
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    #: no dropout by default: with it the policy differs from the reference before any step
    dropout: float | None = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_fields(self, beta="> 0", label_smoothing=">= 0")
        if self.label_smoothing >= 0.5:  # ε of the pairs flipped: at 0.5 no preference is left, above it the reverse
            raise ConfigError(
                f"label_smoothing: expected [0, 0.5) (the share of pairs taken as mislabelled; 0.5 learns no "
                f"preference and more trains toward the rejected answers), got {self.label_smoothing}"
            )
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ConfigError(f"label_smoothing: only with loss_type=sigmoid, not {self.loss_type}")


def answer_logprobs(config, params, batch, key=None, *, chunk: int = LOGITS_CHUNK):
    """(log π(chosen | prompt), log π(rejected | prompt)), [B] each: one forward over both halves of the pairs (the
    LM head `chunk` tokens at a time: RunConfig.logits_chunk)."""
    n = batch["chosen_ids"].shape[0]
    ids = jnp.concatenate([batch["chosen_ids"], batch["rejected_ids"]])  # [2B, T]
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    prompt_len = jnp.concatenate([batch["prompt_len"], batch["prompt_len"]])
    lp = next_token_logprobs(config, params, ids, mask, chunk=chunk, dropout_rng=key)  # [2B, T - 1]
    lp = sequence_logprobs(lp, answer_mask(mask, prompt_len))
    return lp[:n], lp[n:]


def answer_lengths(batch):
    """(chosen, rejected) answer token counts [B] (EOS included, the prompt not): what IPO averages over."""
    count = lambda m: jnp.sum(lm_targets(answer_mask(m, batch["prompt_len"])), axis=1)  # noqa: E731
    return count(batch["chosen_mask"]), count(batch["rejected_mask"])


def reference_logprobs(config, params, batch, *, chunk: int = LOGITS_CHUNK):
    """trainer.train's `reference`: the batch plus the frozen reference's answer log-probs."""
    ref_c, ref_r = answer_logprobs(config, params, batch, chunk=chunk)
    return {**batch, "ref_chosen": ref_c, "ref_rejected": ref_r}


def dpo_loss_fn(config, cfg: DPOConfig):
    def loss_fn(params, batch, key):
        c, r = answer_logprobs(config, params, batch, key, chunk=cfg.logits_chunk)
        ref_c, ref_r = batch["ref_chosen"], batch["ref_rejected"]
        lengths = answer_lengths(batch) if cfg.loss_type == "ipo" else None
        kw = dict(beta=cfg.beta, label_smoothing=cfg.label_smoothing, kind=cfg.loss_type, lengths=lengths)
        return dpo_loss(c, r, ref_c, ref_r, **kw)

    return loss_fn


def summarise(sums) -> dict:
    pairs = max(float(sums["pairs"]), 1.0)
    means = {k: float(sums[k]) / pairs for k in ("loss", "accuracy", "chosen_reward", "rejected_reward", "margin")}
    return means | {"pairs": int(sums["pairs"])}


def run(cfg: DPOConfig, log=print, mesh=None) -> dict:
    """DPO (see trainer.train); returns the final state, the logged records and the model folder."""
    reference = partial(reference_logprobs, chunk=cfg.logits_chunk)
    loss = partial(dpo_loss_fn, cfg=cfg)  # on Step 2's preference data
    return train(cfg, 2, loss, summarise, log=log, mesh=mesh, reference=reference, name="DPO")


def main(argv=None):
    run_cli(DPOConfig, __doc__, "python -m jaxrlhf.dpo", run, argv)


if __name__ == "__main__":
    main()
