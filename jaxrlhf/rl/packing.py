"""Step 3's experience without padding: rows sorted by length into micro-batches of a token budget.

The experience is a padded block: prompts left-padded to P, answers right-padded to G. At real lengths (HH-RLHF:
~126 + 43 tokens in 256 + 256) three quarters of it is padding. Scoring and both training steps instead run on
micro-batches cut by `plan`, each its rows moved to the front of a narrower block by `pack`:

    experience [B, P + G]  ──plan (host: each row's real length)──►  micro-batches (W, rows [n]), longest first,
                                                                      n x W <= the token budget per device x devices
    ──pack (on the device)──►  seq, seq_mask [n, W]: each row's prompt then answer from column 0, padding after
                               answer-space leaves [n, A], A = min(G, W); head_at [n, A]: the column whose output
                               scores answer token g (the prompt's last token for g = 0)

W is a multiple of `multiple` (a handful of shapes, each compiled once: rows of one width share a program). A
row's numbers do not depend on the rows beside it or on W (every model lays out its real tokens first, whatever
the padding), so packed and padded give the same log-probs, values and scores, and the losses, which are sums
over answer tokens divided once by the whole batch's count, the same losses and gradients (tests/test_packing.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def plan(
    lengths, budget: int, devices: int, multiple: int = 64, max_width: int | None = None
) -> list[tuple[int, np.ndarray]]:
    """Micro-batches [(W, rows)] over rows of real `lengths` [B] (prompt + answer tokens): longest first, each of
    width W (its longest row rounded up to `multiple`, at most `max_width` and the budget) and n = (budget // W) x
    devices rows (a whole number per device), or, for the rows left at the end, a power of two per device; the last
    one filled up with index B, an empty row. Every row is in exactly one."""
    lengths = np.asarray(lengths)
    B = len(lengths)
    max_width = max_width or int(lengths.max(initial=1))
    if lengths.max(initial=0) > budget:
        raise ValueError(f"a sequence of {lengths.max()} tokens is longer than max_tokens_per_micro_batch {budget}")
    order = np.argsort(-lengths, kind="stable")
    out, i = [], 0
    while i < B:
        W = min(-(-max(int(lengths[order[i]]), 1) // multiple) * multiple, max_width, budget)
        n = max(budget // W, 1) * devices
        # Fewer rows left than that: a power of two per device (a handful of shapes, not one per batch's remainder).
        n = min(n, devices * 2 ** int(np.ceil(np.log2(-(-(B - i) // devices)))))
        rows = order[i : i + n]
        out.append((W, np.concatenate([rows, np.full(n - len(rows), B)]).astype(np.int32)))
        i += n
    return out


def pack(exp: dict, rows, W: int) -> dict:
    """Rows `rows` [n] (index B: an empty row) of a padded experience (seq, seq_mask [B, P + G]; every other leaf
    answer-space [B, G, ...] or per row [B]) as one packed micro-batch (see the module docstring): seq, seq_mask
    [n, W] (the prompt's real tokens, then the answer, from column 0), answer-space leaves cut to [n, A], per-row
    leaves [n], plus head_at [n, A] and answer [n, A] (the answer's tokens). An empty row has masks of 0."""
    B, T = exp["seq"].shape
    G = exp["mask"].shape[1]
    P, A = T - G, min(G, W)
    real = rows < B
    r = jnp.minimum(rows, B - 1)
    seq, seq_mask = exp["seq"][r], exp["seq_mask"][r] * real[:, None].astype(exp["seq_mask"].dtype)
    # The prompt's real tokens to its end (any padding pattern), then the whole row from its first real token on.
    order = jnp.argsort(seq_mask[:, :P] != 0, axis=1, stable=True)
    seq = jnp.concatenate([jnp.take_along_axis(seq[:, :P], order, 1), seq[:, P:]], 1)
    seq_mask = jnp.concatenate([jnp.take_along_axis(seq_mask[:, :P], order, 1), seq_mask[:, P:]], 1)
    prompt = jnp.sum(seq_mask[:, :P] != 0, axis=1)
    cols = (P - prompt)[:, None] + jnp.arange(W)[None, :]
    inside = cols < T
    cols = jnp.minimum(cols, T - 1)
    out = {
        "seq": jnp.take_along_axis(seq, cols, 1),
        "seq_mask": jnp.take_along_axis(seq_mask, cols, 1) * inside.astype(seq_mask.dtype),
        "head_at": jnp.minimum(jnp.maximum(prompt[:, None] - 1 + jnp.arange(A)[None, :], 0), W - 1),
        "answer": seq[:, P : P + A],
    }
    for k, x in exp.items():
        if k in ("seq", "seq_mask") or not hasattr(x, "shape") or x.ndim == 0 or x.shape[0] != B:
            continue
        x = x[r] * real.reshape(-1, *(1,) * (x.ndim - 1)).astype(x.dtype)
        out[k] = x[:, :A] if x.ndim > 1 and x.shape[1] == G else x
    return out


def unpack(full: dict, part: dict, rows) -> dict:
    """`full`'s leaves ([B, G] answer-space or [B]) with packed `part`'s ([n, A] or [n]) written back at `rows`
    (empty rows dropped)."""
    out = dict(full)
    for k, x in part.items():
        out[k] = (
            full[k].at[rows, : x.shape[1]].set(x, mode="drop") if x.ndim > 1 else full[k].at[rows].set(x, mode="drop")
        )
    return out
