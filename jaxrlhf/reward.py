"""Step 2, `python -m jaxrlhf.reward`: train a reward model on preference pairs, or score answers with one.

    python -m jaxrlhf.reward model=runs/sft/model output_dir=runs/reward [key=value ...]      train
    python -m jaxrlhf.reward model=runs/reward/model score_file=pairs.jsonl                  score

The reward model is the OPT decoder with a value head (Linear(E, 1), no bias); a sequence's score is the
head's output at its last real token. Training minimises DeepSpeed-Chat's pairwise loss over the span
where chosen and rejected differ (loss_kind=last: Bradley-Terry on end scores). Evaluation: accuracy and
the mean chosen and rejected scores on held-out pairs. `score_file` (json/jsonl rows with prompt and
answer, or prompt, chosen and rejected) prints each score instead of training (DeepSpeed-Chat's rw_eval); its
model must hold a trained value head (value_head.safetensors: a Step 2 output).
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.config import run_cli
from jaxrlhf.data import DataConfig, DataError, Record, make_batch, tokenize
from jaxrlhf.losses import end_scores, reward_loss
from jaxrlhf.models import values
from jaxrlhf.optim import OptimConfig
from jaxrlhf.trainer import RunConfig, load_model, train


@dataclasses.dataclass(frozen=True)
class RewardConfig(RunConfig):
    output_dir: str = "runs/reward"
    #: DeepSpeed-Chat's Step 2 settings for OPT-350m
    optim: OptimConfig = OptimConfig(learning_rate=5e-5, weight_decay=0.1)
    #: "span": DeepSpeed-Chat's loss over the tokens where the pair differs; "last": Bradley-Terry on end scores
    loss_kind: Literal["span", "last"] = "span"
    #: score the (prompt, answer) rows of this json/jsonl file with `model` instead of training
    score_file: str | None = None


def reward_loss_fn(config, kind: str):
    def loss_fn(params, batch, key):
        ids = jnp.concatenate([batch["chosen_ids"], batch["rejected_ids"]])  # one forward for both halves
        mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
        v = values(config, params, ids, mask, dropout_rng=key)
        n = batch["chosen_ids"].shape[0]
        return reward_loss(
            v[:n], v[n:], *(batch[k] for k in ("chosen_ids", "rejected_ids", "chosen_mask", "rejected_mask")), kind=kind
        )

    return loss_fn


def summarise(sums) -> dict:
    pairs = max(float(sums["pairs"]), 1.0)
    means = {k: float(sums[k]) / pairs for k in ("accuracy", "chosen_score", "rejected_score")}
    return {"loss": float(sums["loss"]) / max(float(sums["count"]), 1.0), **means, "pairs": int(sums["pairs"])}


def score_texts(config, params, tokenizer, prompts: list[str], answers: list[str], max_len: int = 512, batch: int = 8):
    """The reward model's score of each (prompt, answer): BOS + prompt + answer + EOS, cut as in training
    (the prompt's start first), value at the last token."""
    data = DataConfig(max_seq_len=max_len)
    arrays, _ = tokenize([Record(p, a) for p, a in zip(prompts, answers)], tokenizer, 1, data)
    score_fn = jax.jit(lambda p, i, m: end_scores(values(config, p, i, m), m))
    scores = []
    for start in range(0, len(prompts), batch):
        b = make_batch(arrays, range(start, min(start + batch, len(prompts))), 1, data, tokenizer.pad_token_id)
        scores += np.asarray(score_fn(params, b["input_ids"], b["attention_mask"])).tolist()
    return scores


def score(cfg: RewardConfig, log=print) -> list[dict]:
    config, params, tokenizer = load_model(cfg, value_head=True)
    path = Path(cfg.score_file)
    rows = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.suffix == ".jsonl"
        else json.loads(path.read_text())
    )
    out = []
    for i, row in enumerate(rows):
        if "prompt" not in row or not ({"answer"} <= row.keys() or {"chosen", "rejected"} <= row.keys()):
            raise DataError(
                f"{path} row {i}: expected fields prompt + answer, or prompt + chosen + rejected; got {sorted(row)}"
            )
    for row in rows:
        answers = [row["answer"]] if "answer" in row else [row["chosen"], row["rejected"]]
        s = score_texts(config, params, tokenizer, [row["prompt"]] * len(answers), answers, cfg.data.max_seq_len)
        out.append({"prompt": row["prompt"], "scores": s})
        log(json.dumps({"prompt": row["prompt"][-80:], "scores": [round(x, 4) for x in s]}))
    pairs = [r["scores"] for r in out if len(r["scores"]) == 2]
    if pairs:
        log(f"accuracy (chosen > rejected) over {len(pairs)} pairs: {np.mean([c > r for c, r in pairs]):.3f}")
    return out


def run(cfg: RewardConfig, log=print, mesh=None) -> dict:
    """Step 2 (see trainer.train); returns the final state, the logged records and the model folder."""
    return train(cfg, 2, partial(reward_loss_fn, kind=cfg.loss_kind), summarise, value_head=True, log=log, mesh=mesh)


def main(argv=None):
    run_cli(
        RewardConfig, __doc__, "python -m jaxrlhf.reward", lambda cfg: score(cfg) if cfg.score_file else run(cfg), argv
    )


if __name__ == "__main__":
    main()
