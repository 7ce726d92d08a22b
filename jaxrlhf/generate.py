"""KV-cached generation: one jitted program that prefills the prompts and decodes in a `lax.while_loop`.

    prompts [N, P] left-padded, taken in order of length ──_first_state: B (`slots`) empty slots, a zero cache──►
        ──while _unfinished, _chunk: _refill while _refill_due (free slots take the next `refill` waiting prompts:
          prefilled apart at the narrowest of `prefill_widths` that holds them, their K/V copied into those slots'
          cache rows; the first chunk fills every slot), then `check_every` × _decode_step (each slot one token, K/V
          written in place at its own slot P + g) ──► tokens [N, G], back in the caller's order

When no row can end early (no stop id a token can be, no limits of their own) and every prompt has its own slot, every
prompt is prefilled at once (_first_state) and the loop is G - 1 _decode_steps with no condition read on the way (a
scan: nothing to exit early from, nothing to refill).

Two things keep a decode step's work to the live rows. Prompts go to the slots in order of length, so a refill's
prompts are alike and its prefill computes the narrowest width that holds them, not the batch's widest prompt (at
HH-RLHF lengths about half the positions a full-width prefill computes). A slot whose row has ended attends to its
own new slot only until it is refilled, so the decode attention reads no cache of a finished row (at 768 rows over
256 slots, 70 % of the cache a decode step read belonged to finished rows).

The loop carries a typed `_DecodeState` (the cache; each slot's row, answer position, last token and whether it is
done; the answers so far), as Tunix's sampler does. What the step functions know when tracing (the model's config,
`generate`'s options, the shapes, and the two sentinels `no_prompt` and `no_slot`) is a `_Static` passed beside it,
the arrays they only read an `_Inputs`: each step is a plain function, state in, state out.

A prompt's n answers (GRPO's groups, `group`) prefill it once: its K/V and first logits are copied into the n slots
(and groups, not rows, are ordered by length).

Every model family runs through it (models/__init__.py picks the family from the config's type). The cache
[L, slots, Hkv, P + G, K] (Hkv < H for grouped-query models such as Llama) is allocated once and carried through the
loop (written with one dynamic_update_slice or scatter per layer and step, so XLA updates it in place, several times
faster than passing per-layer caches through a scan). A row ends at its first stop token (any of `eos_id`'s: a model
may end on any of several) or at its own limit (`limits`); later tokens are pad and the answer mask is 0 there (1 up
to and including the end). The loop exits once every row has ended: real answers are short and uneven, so a batch
rarely needs its full `max_new_tokens` steps, and with fewer slots than prompts (continuous batching) no slot idles
while one long answer runs on. Sampling: greedy (temperature 0), temperature, top-k and top-p, from an explicit PRNG
key: answer token g of prompt i draws with fold_in(fold_in(key, i), g), so the same key gives the same tokens
whatever slot a prompt decodes in. Prompts are left-aligned first (any padding pattern works), so each row's valid
slots are one range and a decode step's attention (our Pallas kernel on a GPU, `kernels/decode_attention.py`) reads
only that range of the cache.

`generate` runs the model's own parameters, or, faster, the decode layout that `decode_params` builds from
them once (each layer its own arrays, shared-input products stacked; models/common.py says why): the Step 3
engine generates with it, and so should any caller that generates more than once with the same weights. The
model runs "prefill" and "decode" calls (models.generation_modes: the layout, the mesh, the decode kernels chosen once)
with the config's backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf import hooks
from jaxrlhf.kernels import rows_axis
from jaxrlhf.lora import fuse_attached
from jaxrlhf.models import (
    Mode,
    cache_length,
    decode_layer,
    generation_modes,
    in_decode_layout,
    init_cache,
    logits_with_cache,
    positions_from_mask,
)
from jaxrlhf.sharding import shardings_for


@hooks.program  # seen by jaxrlhf.plan.measure
@partial(jax.jit, static_argnames=("config", "mesh"))
def _to_decode_layout(config, tree, mesh, i=None):
    """`tree` (all but the layers; or, given `i`, layer i of the stacked layers) fused, cast and laid out for
    generation."""
    dtype = config.compute_dtype
    layer = i is not None
    if layer:
        tree = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree)
    tree = fuse_attached(tree)
    if layer:  # stacked (and the query scale folded in) before the cast: one rounding
        tree = decode_layer(config, tree)
    # a folded LayerNorm's column sums stay float32 (models.common.fold_norm): they cancel the product's mean part
    cast = lambda path, x: (
        x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and getattr(path[-1], "key", None) != "colsum" else x
    )
    tree = jax.tree_util.tree_map_with_path(cast, tree)
    if mesh is not None:
        wrapped = {"layers": (tree,)} if layer else tree  # per-layer paths read layers/0/... (sharding.logical_axes)
        specs = shardings_for(wrapped, "tp", mesh)
        tree = jax.lax.with_sharding_constraint(tree, specs["layers"][0] if layer else specs)
    return tree


def decode_params(config, params: Any, mesh=None) -> Any:
    """`params` (the model's tree, LoRA adapters attached or not: lora.attach) as generation runs them fastest:
    LoRA fused, in the compute dtype, each layer its own arrays (the "layers" entry becomes a tuple of L
    per-layer trees, with `decode_layer`'s stacked kernels), in the generation ("tp") layout of `mesh` if given.

    Built by one compiled program per layer, so besides the result only one layer's temporaries (its fp32
    LoRA products, its gathered FSDP shards) exist at a time. The result is a new copy of the weights in the
    compute dtype; leaves that need no change may be `params`' own arrays. Pass it to `generate`.
    """
    if in_decode_layout(params):
        return params
    # the decoder's key (OPT: decoder, Llama: model)
    key = next((k for k, v in params.items() if isinstance(v, dict) and "layers" in v), None)
    if key is None:
        raise ValueError(f"no 'layers' in the parameter tree (top level: {sorted(params)})")
    # host (NumPy) leaves go to the device once, not once per layer's program
    layers = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), params[key]["layers"])
    per_layer = tuple(
        _to_decode_layout(config, layers, mesh, jnp.int32(i)) for i in range(jax.tree.leaves(layers)[0].shape[0])
    )
    rest = {k: v for k, v in params[key].items() if k != "layers"}
    out = _to_decode_layout(config, {**params, key: rest}, mesh)
    out[key]["layers"] = per_layer  # out's dicts are new (jit builds them)
    return out


# The decode slots Step 3 generates with unless told (EngineConfig.decode_slots): measured at HH-RLHF lengths
# (docs/benchmarks.md, Step 3 at real lengths), a batch of 768 over 256 refilled slots against a batch of 256.
DECODE_SLOTS = 256


def decode_slots(slots: int, rows: int, group: int = 1) -> int:
    """The slots `generate` decodes `rows` rows in, given `slots` (0: one per row): at most one per row, in whole
    groups of `group` rows (a prompt's answers; the memory plan counts the same)."""
    return max(min(slots or rows, rows) // group, 1) * group


def prefill_widths(P: int) -> tuple[int, ...]:
    """The widths a refill prefills its prompts at, for prompts P wide: 64, 96, 128, 192, 256, ... (each step 4/3
    or 3/2) below P, then P. A refill takes the narrowest that holds its longest prompt: one compiled prefill each."""
    widths, w = [], 64
    while w < P:
        widths.append(w)
        w += w // 2 if w & (w - 1) == 0 else w // 3
    return (*widths, P)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling: expected temperature >= 0, top_k >= 0, 0 < top_p <= 1; got {self}")


def sample(logits, key, s: Sampling):
    """Next tokens [B] from logits [B, V] (float32)."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1:
        # Keep the smallest set of most likely tokens whose probability reaches top_p (always the first).
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each one
        cutoff = jnp.min(jnp.where(before < s.top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: jax.Array  # [B, G] int32, pad after each row's end
    mask: jax.Array  # [B, G] int32: 1 for generated tokens up to and including the first EOS (or the row's limit)
    logprobs: jax.Array  # [B, G] float32: log p(token) under softmax(logits / temperature) (greedy: 1), no filtering
    steps: jax.Array  # int32: decode steps run (each advances every slot by one token)


def stop_tuple(eos_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """`generate`'s eos_id as a tuple of distinct ints, in order (None: empty)."""
    ids = () if eos_id is None else (eos_id,) if isinstance(eos_id, int | np.integer) else tuple(eos_id)
    if not all(isinstance(i, int | np.integer) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_id: expected an int, a sequence of ints or None, got {eos_id!r}")
    return tuple(dict.fromkeys(int(i) for i in ids))


def _row_keys(key, rows, g):
    """The sampling key of answer token g of prompt `rows` ([R] each): a prompt's stream depends on its index in
    the batch and the token's place in its answer only, never on the slot it was decoded in."""
    return jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(key, r), t))(rows, g)


@dataclasses.dataclass(frozen=True)
class _Loop:
    """`generate`'s options that shape the compiled program (see its docstring)."""

    max_new_tokens: int
    sampling: Sampling
    stops: tuple[int, ...]  # the stop ids (static: one compilation per set); the first is the one force_length forces
    pad_id: int
    force_length: bool
    slots: int
    refill: int
    check_every: int
    mesh: Any
    group: int
    # a row may end before max_new_tokens (a stop id a token can be, not barred by force_length; or a limit of its
    # own below max_new_tokens). False with a slot per row: every row runs all its tokens, the decode loop has a
    # known trip count
    ends_early: bool = True


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the decode loop's step functions know when tracing: the model, `generate`'s options, the batch's shape.

    Two sentinels, `no_prompt` and `no_slot`, are each one past the last real index: what is written there is dropped.
    """

    config: Any  # the model's (hashable) config
    loop: _Loop
    N: int  # prompts
    P: int  # prompt width
    prefill: Mode  # the model's prefill and decode calls: the parameters' layout, the mesh
    decode: Mode

    @property
    def widths(self) -> tuple[int, ...]:
        return prefill_widths(self.P)

    @property
    def no_prompt(self) -> int:
        """N: the row of an empty slot. It counts as done (it never keeps the loop going), and what its slot decodes
        goes to the scratch output row N, cut off at the end."""
        return self.N

    @property
    def no_slot(self) -> int:
        """B: the slot of a refill's place that has no prompt left; the refill's scatters (mode="drop") skip it."""
        return self.loop.slots

    @property
    def lockstep(self) -> bool:
        """Every row has a slot and runs all G tokens: each decode step writes every row at the same cache slot."""
        return not self.loop.ends_early and self.loop.slots == self.N


class _Inputs(NamedTuple):
    """The arrays every step reads and none changes."""

    params: Any  # the model's parameters (either layout)
    ids: jax.Array  # [N, P] int32 prompts, left-aligned (padding first), in order of length
    mask: jax.Array  # [N, P] int32
    real: jax.Array  # [N + 1] int32: prompt lengths (no_prompt's: 1)
    limits: jax.Array  # [N + 1] int32: each row's answer limit (no_prompt's: 1)
    key: jax.Array  # the sampling key
    origin: jax.Array  # [N + 1] int32: each row's index in the caller's batch (no_prompt's: N), which its draws key on


@flax.struct.dataclass
class _DecodeState:
    """The decode loop's carry (Tunix's _SamplingState): B slots decoding N prompts' rows. Every field is an array
    (the static description is _Static, passed beside it)."""

    cache: dict  # k, v [L, B, Hkv, S, K] (S >= P + G), start [B] int32: each slot's first valid position
    row: jax.Array  # [B] int32: the prompt each slot decodes (no_prompt: none)
    g: jax.Array  # [B] int32: answer tokens its row has drawn (at most G)
    token: jax.Array  # [B] int32: its last token, the next step's input (pad once done)
    done: jax.Array  # [B] bool: its row has ended (or it has none)
    tokens: jax.Array  # [N + 1, G] int32: the answers, pad after each row's end (row N: scratch)
    logprobs: jax.Array  # [N + 1, G] float32: their log-probs
    mask: jax.Array  # [N + 1, G] int32: 1 up to and including each row's last token
    next: jax.Array  # int32: the first prompt still waiting for a slot
    steps: jax.Array  # int32: decode steps run


def _laid_out(s: _Static, cache):
    """`cache` in the tensor-parallel layout: heads over "model", rows over "data" (if they split)."""
    mesh = s.loop.mesh
    if mesh is None:
        return cache
    spec = NamedSharding(mesh, P(None, rows_axis(mesh, cache["k"].shape[1]), "model", None, None))
    return {**cache, **{c: jax.lax.with_sharding_constraint(cache[c], spec) for c in ("k", "v")}}


def _pick(s: _Static, x: _Inputs, logits, rows, g):
    """Answer token g of prompts `rows` ([R] each) from logits [R, V]: (token, its log-prob, whether the row ends)."""
    stops, force, sampling = s.loop.stops, s.loop.force_length, s.loop.sampling
    lim = x.limits[rows]
    drawn = logits
    for stop in stops if force else ():  # benchmarks: every stop barred before the row's limit
        drawn = drawn.at[:, stop].set(jnp.where(g < lim - 1, -jnp.inf, drawn[:, stop]))
    token = jax.vmap(lambda z, k: sample(z[None], k, sampling)[0])(drawn, _row_keys(x.key, x.origin[rows], g))
    if force and stops:  # and the first forced at it
        token = jnp.where(g == lim - 1, stops[0], token)
    token = token.astype(jnp.int32)
    # the distribution sampled from (before top-k / top-p), as Step 3 scores the answers (greedy: temperature 1)
    logp = jax.nn.log_softmax(logits / (sampling.temperature or 1.0))
    logprob = jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
    ends = g + 1 >= lim
    for stop in stops:  # a few static ids: a compare each
        ends = ends | (token == stop)
    return token, logprob, ends


def _record(state: _DecodeState, rows, g, token, logprob) -> _DecodeState:
    """`token` and `logprob` ([R]) written as answer token g of output rows `rows` (no_prompt: the scratch row)."""
    at = (rows, jnp.minimum(g, state.tokens.shape[1] - 1))
    return state.replace(
        tokens=state.tokens.at[at].set(token),
        logprobs=state.logprobs.at[at].set(logprob),
        mask=state.mask.at[at].set(1),
    )


def _prefill(s: _Static, x: _Inputs, prompts, S: int, width: int):
    """Prompts `prompts` [R] (no_prompt: none) prefilled into a new cache of S slots: (logits [R, V], cache). Their
    last `width` columns are computed (padding first, a prompt's real tokens end at column P - 1: a width at least
    its length holds them all), their K/V written at slots P - width .. P - 1. With groups (n > 1; `prompts` whole
    groups), each group's prompt is prefilled once and its logits and cache rows repeated n times."""
    N, P, n = s.N, s.P, s.loop.group
    once = jnp.minimum(prompts[::n], N - 1)  # the first row of each group
    ids, mask = x.ids[once], x.mask[once]
    valid = jnp.concatenate([mask.astype(bool), jnp.ones((len(once), S - P), bool)], axis=1)
    cache = _laid_out(s, init_cache(s.config, valid, multiple=64 if P < S else 1))
    cut = lambda z: z[:, P - width :]
    positions = jnp.maximum(positions_from_mask(mask), 0)
    # the LM head on the last position only
    logits, cache = logits_with_cache(
        s.config, x.params, cut(ids), cut(positions), {**cache, "slot": P - width}, s.prefill, last=1
    )
    repeat = lambda z, axis: z if n == 1 else jnp.repeat(z, n, axis=axis)
    cache = {"k": repeat(cache["k"], 1), "v": repeat(cache["v"], 1), "start": repeat(cache["start"], 0)}
    return repeat(logits[:, -1], 0), _laid_out(s, cache)  # decode steps bring their own slots


def _start_rows(s: _Static, x: _Inputs, state: _DecodeState, slots_at, prompts, logits) -> _DecodeState:
    """Slots `slots_at` take prompts `prompts` ([R]; no_slot: none): their first answer token from the prefill's
    logits [R, V]."""
    first = jnp.zeros_like(prompts)
    token, logprob, ends = _pick(s, x, logits, prompts, first)
    state = _record(state, jnp.where(slots_at < s.no_slot, prompts, s.no_prompt), first, token, logprob)
    put = lambda field, v: field.at[slots_at].set(v, mode="drop")
    return state.replace(
        row=put(state.row, prompts),
        g=put(state.g, jnp.ones_like(prompts)),
        token=put(state.token, token),
        done=put(state.done, ends),
    )


def _first_state(s: _Static, x: _Inputs) -> _DecodeState:
    """B empty slots (their rows no_prompt, done) and a zero cache with room for a whole prompt and answer in each;
    the loop's first refills fill them. In lockstep every prompt has a slot and is prefilled here, at full width,
    its first token drawn."""
    B, G = s.loop.slots, s.loop.max_new_tokens
    state = _DecodeState(
        cache=None,
        row=jnp.full((B,), s.no_prompt, jnp.int32),
        g=jnp.zeros((B,), jnp.int32),
        token=jnp.zeros((B,), jnp.int32),
        done=jnp.ones((B,), bool),
        tokens=jnp.full((s.N + 1, G), s.loop.pad_id, jnp.int32),
        logprobs=jnp.zeros((s.N + 1, G), jnp.float32),
        mask=jnp.zeros((s.N + 1, G), jnp.int32),
        next=jnp.int32(0),
        steps=jnp.int32(0),
    )
    if not s.lockstep:
        cache = init_cache(s.config, jnp.ones((B, s.P + G), bool))
        return state.replace(cache=_laid_out(s, {c: cache[c] for c in ("k", "v", "start")}))
    first = jnp.arange(B)
    logits, cache = _prefill(s, x, first, s.P + G, s.P)
    return _start_rows(s, x, state.replace(cache=cache, next=jnp.int32(B)), first, first, logits)


def _decode_step(s: _Static, x: _Inputs, state: _DecodeState) -> _DecodeState:
    """Every slot advances one token: its last token goes in at its own cache slot, the next one comes out. A slot
    whose row has ended attends to that slot only (its start moved there for this step): none of its cache is read."""
    row, g, done = state.row, state.g, state.done
    slot = s.P + g - 1  # each row's own slot: prompt width + answer so far
    # in lockstep one slot for all: the cache write is one dynamic_update_slice per layer, not a scatter of B rows
    start = state.cache["start"] if s.lockstep else jnp.where(done, slot, state.cache["start"])
    cache = {**state.cache, "slot": slot[0] if s.lockstep else slot, "start": start}
    positions = (x.real[row] + g - 1)[:, None]
    logits, cache = logits_with_cache(s.config, x.params, state.token[:, None], positions, cache, s.decode)
    token, logprob, ends = _pick(s, x, logits[:, 0], row, g)
    state = _record(state, jnp.where(done, s.no_prompt, row), g, token, logprob)
    live = ~done
    return state.replace(
        cache={"k": cache["k"], "v": cache["v"], "start": state.cache["start"]},
        token=jnp.where(live, token, s.loop.pad_id),
        g=jnp.where(live, jnp.minimum(g + 1, s.loop.max_new_tokens), g),
        done=done | ends,
        steps=state.steps + 1,
    )


def _refill_due(s: _Static, state: _DecodeState):
    """Enough slots are free for a refill's R prompts (or for all that still wait)."""
    waiting = s.N - state.next
    return (waiting > 0) & (jnp.sum(state.done) >= jnp.minimum(s.loop.refill, waiting))


def _refill(s: _Static, x: _Inputs, state: _DecodeState) -> _DecodeState:
    """The next R waiting prompts (fewer at the end) prefilled into the first free slots' cache rows, at the
    narrowest of the widths that holds the longest of them (one compiled prefill per width, `lax.switch`)."""
    R = s.loop.refill
    prompts = state.next + jnp.arange(R)
    real_prompt = prompts < s.N
    prompts = jnp.where(real_prompt, prompts, s.no_prompt)
    slots_at = jnp.where(real_prompt, jnp.argsort(~state.done, stable=True)[:R], s.no_slot)  # free slots first
    at_width = [partial(_prefill, s, x, prompts, s.P, width=w) for w in s.widths]
    if len(at_width) == 1:
        logits, small = at_width[0]()
    else:
        which = jnp.searchsorted(jnp.asarray(s.widths), jnp.max(x.real[prompts]))  # no_prompt's length: 1
        logits, small = jax.lax.switch(jnp.minimum(which, len(at_width) - 1), at_width)
    big = state.cache
    cache = {
        **{c: big[c].at[:, slots_at, :, : s.P].set(small[c], mode="drop") for c in ("k", "v")},
        "start": big["start"].at[slots_at].set(small["start"], mode="drop"),
    }
    state = _start_rows(s, x, state.replace(cache=_laid_out(s, cache)), slots_at, prompts, logits)
    return state.replace(next=jnp.minimum(state.next + R, s.N))


def _chunk(s: _Static, x: _Inputs, state: _DecodeState) -> _DecodeState:
    """Refills while due (the first chunk's refills fill every slot), then `check_every` decode steps: the loop's
    condition is read once a chunk."""
    state = jax.lax.while_loop(partial(_refill_due, s), partial(_refill, s, x), state)
    return jax.lax.fori_loop(0, s.loop.check_every, lambda _, st: _decode_step(s, x, st), state)


def _unfinished(s: _Static, state: _DecodeState):
    return ~jnp.all(state.done) | (state.next < s.N)


@hooks.program  # seen by jaxrlhf.plan.measure
@partial(jax.jit, static_argnames=("config", "loop"))
def _generate(config, loop: _Loop, params, input_ids, attention_mask, key, limits):
    """generate's program: (tokens [N, G], mask [N, G], log-probs [N, G], decode steps run)."""
    order = jnp.argsort(attention_mask.astype(bool), axis=1, stable=True)  # padding first, real tokens in order
    input_ids, attention_mask = (jnp.take_along_axis(z, order, 1) for z in (input_ids, attention_mask))
    N, P = input_ids.shape  # the decode steps' cache: a whole prompt and answer per slot (_first_state)
    real = jnp.sum(attention_mask, axis=1).astype(jnp.int32)  # [N] prompt lengths
    # rows in order of prompt length (a prompt's group together): a refill's prompts are alike (_refill)
    n = loop.group
    rows = (jnp.argsort(real[::n], stable=True)[:, None] * n + jnp.arange(n)).reshape(N)
    input_ids, attention_mask, real, limits = (z[rows] for z in (input_ids, attention_mask, real, limits))
    tail = lambda z, v: jnp.concatenate([z, jnp.full((1,), v, jnp.int32)])  # no_prompt's
    real, limits, origin = tail(real, 1), tail(limits, 1), tail(rows, N)
    modes = generation_modes(
        config, params, mesh=loop.mesh, batch=loop.slots, slots=cache_length(P + loop.max_new_tokens)
    )
    s = _Static(config, loop, N, P, *modes)
    x = _Inputs(params, input_ids, attention_mask, real, limits, key, origin)
    state = _first_state(s, x)
    if not s.lockstep:
        state = jax.lax.while_loop(partial(_unfinished, s), partial(_chunk, s, x), state)
    else:  # every row runs all G tokens in its own slot: G - 1 steps, no condition read on the way (a scan)
        state = jax.lax.fori_loop(0, loop.max_new_tokens - 1, lambda _, st: _decode_step(s, x, st), state)
    back = jnp.argsort(rows)  # the caller's order
    tokens, logprobs, mask = (z[back] for z in (state.tokens, state.logprobs, state.mask))
    return tokens, mask, logprobs * mask, state.steps


def _checked_limits(limits, B: int, max_new_tokens: int) -> tuple[jax.Array, bool]:
    """generate's `limits` as [B] int32 (None: max_new_tokens for every row), checked where this process sees them,
    and whether one may end a row early: one below max_new_tokens (or one this process cannot see)."""
    if limits is None:
        return jnp.full((B,), max_new_tokens, jnp.int32), False
    host = np.asarray(limits) if not isinstance(limits, jax.Array) or limits.is_fully_addressable else None
    if host is not None and (host.shape != (B,) or host.min() < 1 or host.max() > max_new_tokens):
        raise ValueError(
            f"limits: expected {B} integers in 1 .. {max_new_tokens} (max_new_tokens), got shape "
            f"{host.shape}, range {host.min()} .. {host.max()}"
        )
    return jnp.asarray(limits, jnp.int32), host is None or host.min() < max_new_tokens


def generate(
    config,
    params: Any,
    input_ids,
    attention_mask,
    key,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int | None = None,
    limits=None,
    force_length: bool = False,
    slots: int = 0,
    refill: int = 0,
    check_every: int = 8,
    mesh=None,
    group: int = 1,
) -> Generation:
    """Continue left-padded prompts [B, P] by up to `max_new_tokens` tokens (see the module docstring).

    eos_id: the stop token, or several (tokenizer.stop_ids: a chat model's end-of-turn, its EOS, its
    generation_config.json's list), or None. limits: optional [B] ints, each row's own maximum (1 .. max_new_tokens).
    A row ends at its first token in eos_id or at its limit; the loop stops once every row has ended (looked at every
    `check_every` steps, on the device; not at all where no row can end early and every row has a slot: ids outside
    the vocabulary, such as benchmarks' -1, never stop a row, nor does a limit of max_new_tokens). `force_length`
    (benchmarks: every system does the same work) bars every stop id before each row's limit and forces the first
    there (with eos_id None, rows simply run to their limits).
    slots: decode slots (0: one per prompt). Fewer slots than prompts is continuous batching: a slot whose row
    ended takes the next waiting prompt, `refill` prompts (default slots / 8) prefilled at a time into the free
    slots' cache rows. A prompt's answer does not depend on the slot it gets: its random stream is keyed by its
    index in the batch. With `mesh`, the KV cache is laid out for the generation ("tp") layout; pass params
    resharded to it. Compiled once per shape and set of options.
    group: rows come in groups of `group` answers to one prompt (GRPO's samples per prompt: rows i n .. i n + n - 1
    hold the same prompt, as rl.engine.repeat_rows lays them out): each prompt is prefilled once and its cache
    copied into its answers' slots. Slots are then rounded down, and refills up, to whole groups. Each answer still
    draws with its own row's key.
    """
    B = input_ids.shape[0]
    if group < 1 or B % group:
        raise ValueError(f"group: expected a divisor of the batch ({B} rows), got {group}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    if input_ids.shape[1] + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"{config.max_position_embeddings} positions"
        )
    if slots < 0 or refill < 0 or check_every < 1:
        raise ValueError(f"expected slots >= 0, refill >= 0, check_every >= 1; got {slots}, {refill}, {check_every}")
    slots = decode_slots(slots, B, group)
    refill = min(-(-(refill or max(slots // 8, 1)) // group) * group, slots)
    stops = stop_tuple(eos_id)
    limits, limited = _checked_limits(limits, B, max_new_tokens)
    # benchmarks' "never stop" id (-1) is no token: only a limit below max_new_tokens ends those rows
    ends_early = limited or (not force_length and any(0 <= i < config.vocab_size for i in stops))
    pad_id, sampling = config.pad_token_id if pad_id is None else pad_id, Sampling(temperature, top_k, top_p)
    options = (slots, refill, check_every, mesh, group, ends_early)
    loop = _Loop(max_new_tokens, sampling, stops, pad_id, force_length, *options)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):  # the program's arrays live on this mesh
        return Generation(*_generate(config, loop, params, input_ids, attention_mask, key, limits))
