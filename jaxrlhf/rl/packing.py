"""Step 3's experience without padding: whole sequences (prompt + answer) joined into the rows of micro-batches of a
token budget, each a segment of its row.

The experience is a padded block: prompts left-padded to P, answers right-padded to G. At real lengths (HH-RLHF:
~95 + 39 tokens in 256 + 256) three quarters of it is padding. Scoring and both training steps instead run on
micro-batches laid out by `plan` on the host and gathered by `pack` on the device:

    experience [B, P + G]  ──plan (host: each row's real tokens)──►  micro-batches (Micro: index arrays) of n rows of
        W columns (one W for the batch), n x W <= the token budget per device x devices (a whole number of rows per
        device); the sequences placed first-fit decreasing, several to a row, each one's real tokens side by side (a
        segment), at most A answer tokens to a row
    ──pack (on the device)──►  seq, seq_mask, positions (restarting at 0 in each segment), segment_ids [n, W];
        answer slots [n, A]: head_at (the column whose output scores the slot's answer token: the one before it) and
        answer (that token); slot (b G + g: where the slot's result goes in the answer space [B, G])

        row 0:  | b=5: prompt.......answer.. | b=2: prompt....answer | b=9: prompt..answer | pad |
        row 1:  | b=0: prompt..........answer........ | b=7: prompt...answer...... | pad ......... |

The model attends within a segment only and counts each segment's positions from 0, so a sequence's log-probs,
entropies, values and reward score (at its segment's last column: segment_ends) are those of the sequence alone,
whatever shares its row. `to_answers` scatters the slots' results back to the answer space [B, G]: the losses read
the whole batch's [B, G] arrays with the mask of the micro-batch's answers (`members`), so a sequence-level quantity
(GSPO's ratio, the per-answer means) is the answer's own, and the losses, sums over answer tokens divided once by the
whole batch's count, give the same totals and gradients however the batch is cut (tests/test_packing.py). W is a
multiple of `multiple`, A a power of two and the rows per device `rounded`, the same in every micro-batch of a batch:
one shape a batch (one program each for scoring and both training steps), a handful over a run, each compiled once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

#: the fewest answer slots per row (A): smaller powers of two would add shapes and save nothing
MIN_SLOTS = 8


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["segment", "column", "position", "head_at", "slot"],
    meta_fields=["joined"],
)
@dataclasses.dataclass(frozen=True)
class Micro:
    """One packed micro-batch's layout (host int32 arrays: a pytree jit takes as arguments; row r's sequences b)."""

    segment: np.ndarray  # [n, W] the experience row b whose token sits at each column; B: padding
    column: np.ndarray  # [n, W] that token's column in the padded block [B, P + G] (0: padding)
    position: np.ndarray  # [n, W] its position in its sequence: real tokens counted from 0 (0: padding)
    head_at: np.ndarray  # [n, A] the column whose output scores answer slot a (the column before its token)
    slot: np.ndarray  # [n, A] slot a's answer token as b G + g in the answer space [B, G]; B G: an empty slot
    # static (part of the program's key): some row holds several sequences, so the model attends within segments
    # (a segment mask, cuDNN's attention with a bias); else each sequence is alone from its row's column 0 and plain
    # causal attention is exact (the fixed-length workloads: no mask read in any layer)
    joined: bool = True

    @property
    def width(self) -> int:
        return self.segment.shape[1]


def _rows(lengths, answers, order, W: int, A: int) -> list[list[int]]:
    """First fit decreasing: the sequences `order` (longest first; `lengths` tokens of which `answers` answer tokens)
    into rows of W tokens and A answer tokens, each into the first row with room, a new row where none has."""
    free, slots, rows = np.zeros(0, np.int64), np.zeros(0, np.int64), []
    for b in order:
        fits = np.flatnonzero((free >= lengths[b]) & (slots >= answers[b]))
        if len(fits):
            rows[fits[0]].append(b)
            free[fits[0]] -= lengths[b]
            slots[fits[0]] -= answers[b]
        else:
            rows.append([b])
            free, slots = np.append(free, W - lengths[b]), np.append(slots, A - answers[b])
    return rows


def _layout(rows: list[list[int]], real, targets, B: int, P: int, G: int, W: int, A: int, joined: bool) -> Micro:
    """The Micro of rows of sequences (lists of experience rows b; [] an empty row): each sequence's real columns
    `real[b]` side by side from column 0, its target tokens (targets [B, T]) in the row's first slots; `joined`: the
    batch's (Micro.joined), one for all its micro-batches."""
    n = len(rows)
    segment, column, position = np.full((n, W), B), np.zeros((n, W), np.int64), np.zeros((n, W), np.int64)
    head_at, slot = np.zeros((n, A), np.int64), np.full((n, A), B * G)
    for r, row in enumerate(rows):
        at, k = 0, 0  # the row's next free column and answer slot
        for b in row:
            cols = real[b]
            segment[r, at : at + len(cols)], column[r, at : at + len(cols)] = b, cols
            position[r, at : at + len(cols)] = np.arange(len(cols))
            answer = np.flatnonzero(targets[b, cols])  # the answer's tokens; the head one column earlier scores each
            head_at[r, k : k + len(answer)] = np.maximum(at + answer - 1, 0)
            slot[r, k : k + len(answer)] = b * G + cols[answer] - P
            at, k = at + len(cols), k + len(answer)
    arrays = (x.astype(np.int32) for x in (segment, column, position, head_at, slot))
    return Micro(*arrays, joined=joined)


def rounded(rows: int) -> int:
    """rows rounded up to m 2^e with m in 16 .. 31 (five significant bits: 1 .. 32, 34, 36, ..., 64, 68, ...): a
    micro-batch's rows per device, at most a sixteenth more than it needs, sixteen shapes an octave."""
    e = max(rows.bit_length() - 5, 0)
    return -(-rows // (1 << e)) * (1 << e)


def plan(
    seq_mask,
    prompt_len: int,
    budget: int,
    devices: int,
    multiple: int = 64,
    max_width: int | None = None,
    targets=None,
) -> list[Micro]:
    """Micro-batches over the rows of a padded experience's seq_mask [B, P + G] (host; P = prompt_len). One width W
    for all, the longest sequence rounded up to `multiple` (at most `max_width` and the budget), then to an even width;
    the sequences packed first-fit decreasing into rows of W tokens and A answer tokens (A: the longest answer rounded
    up to a power of two, at least MIN_SLOTS, at most W: the LM head runs on A positions of a row); the fewest
    micro-batches of at most (budget // W) x devices rows (a whole number per device), all of the same rows, the rows
    shared evenly and `rounded` per device (the last one's empty rows fill it). Every sequence is in exactly one
    micro-batch, whole. `targets` [B, T] (default: the answers' real tokens, columns P on) are the tokens that get a
    slot: the mixture batch's LM targets (P = 0, G = T)."""
    mask = np.asarray(seq_mask) != 0
    B, T = mask.shape
    lengths = mask.sum(1)
    max_width = max_width or int(lengths.max(initial=1))
    if lengths.max(initial=0) > budget:
        raise ValueError(f"a sequence of {lengths.max()} tokens is longer than max_tokens_per_micro_batch {budget}")
    W = min(-(-max(int(lengths.max(initial=1)), 1) // multiple) * multiple, max_width, budget)
    W += W % 2  # even: cuDNN's attention with a bias (the segment mask) takes even widths only
    targets = mask & (np.arange(T) >= prompt_len) if targets is None else np.asarray(targets) != 0
    answers = targets.sum(1)
    A = min(max(MIN_SLOTS, 1 << int(np.ceil(np.log2(max(answers.max(initial=1), 1))))), W)
    rows = _rows(lengths, answers, np.argsort(-lengths, kind="stable"), W, A)
    n = max(budget // W, 1) * devices  # the most rows a micro-batch holds
    parts = max(-(-len(rows) // n), 1)  # the fewest micro-batches, the rows shared evenly: one shape for all of them
    size = min(n, devices * rounded(-(-len(rows) // (parts * devices))))
    real, joined = [np.flatnonzero(m) for m in mask], any(len(row) > 1 for row in rows)
    return [
        _layout(part + [[]] * (size - len(part)), real, targets, B, prompt_len, T - prompt_len, W, A, joined)
        for part in (rows[i : i + size] for i in range(0, len(rows), size))
    ]


def real_share(micro: list[Micro], B: int) -> float:
    """The share of the micro-batches' token positions that hold a real token (a sequence of the B rows), not
    padding: what scoring and training compute for something."""
    return sum(int((m.segment < B).sum()) for m in micro) / max(sum(m.segment.size for m in micro), 1)


def mixture_plan(attention_mask, loss_mask, parts: int, devices: int, multiple: int = 64) -> list[Micro]:
    """The mixture batch's (a Step 1 batch: attention_mask, loss_mask [N, T], host) `parts` parts, rows i, i + parts,
    ... (gradient_accumulation_steps), each one micro-batch with its sequences packed as the experience's (plan); a
    slot per LM target (a loss_mask token after its sequence's first real token), b T + t."""
    mask, loss = np.asarray(attention_mask) != 0, np.asarray(loss_mask) != 0
    N, T = mask.shape
    targets = mask & loss
    targets[np.arange(N), np.argmax(mask, axis=1)] = False  # a sequence's first token is no target
    out = []
    for i in range(parts):
        part = np.zeros_like(mask)
        part[i::parts] = mask[i::parts]  # the other rows empty: in no row, no slot
        out += plan(part, 0, N * (T + 1), devices, multiple, T, targets & part)  # (room for all N at an even W)
    return out


def pack(exp: dict, m: Micro) -> dict:
    """Micro-batch `m` of a padded experience (seq, seq_mask [B, P + G]; mask [B, G]) on the device: seq, seq_mask,
    positions, segment [n, W] (padding: segment B, mask 0), the model's segment_ids (segment, or None where no row
    joins sequences: Micro.joined), and per answer slot [n, A] head_at, slot (Micro's) and
    answer (the token the slot scores)."""
    B, T = exp["seq"].shape
    G = exp["mask"].shape[1]
    segment = jnp.asarray(m.segment)
    b, slot = jnp.minimum(segment, B - 1), jnp.asarray(m.slot)
    seq_mask = jnp.where(segment < B, exp["seq_mask"][b, m.column], 0).astype(exp["seq_mask"].dtype)
    answer = exp["seq"][jnp.minimum(slot // G, B - 1), T - G + slot % G]
    return {
        "seq": exp["seq"][b, m.column],
        "seq_mask": seq_mask,
        "positions": jnp.asarray(m.position),
        "segment": segment,
        "segment_ids": segment if m.joined else None,  # the model's: None where every sequence is alone in its row
        "head_at": jnp.asarray(m.head_at),
        "answer": answer,
        "slot": slot,
    }


def unpack(out: dict, part: dict, packed: dict) -> dict:
    """The batch's `out` ([B, G] answer-space and [B] leaves) plus a micro-batch's results `part`: slot values
    [n, A] scattered to the answer space (to_answers), per-sequence values [B] (segment_ends) as they are."""
    return {
        k: v + (to_answers(part[k], packed, v.shape) if part[k].ndim == 2 else part[k]) if k in part else v
        for k, v in out.items()
    }


def to_answers(x, packed: dict, shape: tuple[int, int]):
    """Slot values x [n, A] in the answer space [B, G] (shape), zero where no slot of this micro-batch writes."""
    B, G = shape
    return jnp.zeros(B * G, x.dtype).at[packed["slot"].reshape(-1)].set(x.reshape(-1), mode="drop").reshape(B, G)


def members(packed: dict, B: int):
    """[B] float32: 1 for the experience rows whose sequence is in this micro-batch."""
    return jnp.zeros(B, jnp.float32).at[packed["segment"].reshape(-1)].set(1.0, mode="drop")


def segment_ends(x, packed: dict, B: int):
    """[B]: x [n, W] at each sequence's last real token (its segment's last column), 0 for rows not in this
    micro-batch: where the reward model scores a sequence."""
    segment = packed["segment"]
    after = jnp.concatenate([segment[:, 1:], jnp.full_like(segment[:, :1], B)], axis=1)
    at = jnp.where(after != segment, segment, B)  # the last column of each segment (padding's index B is dropped)
    return jnp.zeros(B, x.dtype).at[at.reshape(-1)].set(x.reshape(-1), mode="drop")
