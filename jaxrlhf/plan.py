"""The memory plan of Step 3: bytes per device of every item in every phase, from the config and the mesh
alone, before anything is loaded or compiled. `python -m jaxrlhf.plan CONFIG [key=value ...]` prints it.

    item                  lives                            what
    actor/critic weights  always (FSDP)                    master dtype (fp32; pure_bf16: bf16) + LoRA adapters fp32
                                                           (critic-free algorithms: no critic, its optim, gradients
                                                           or step; the reward model holds all its leaves)
    actor/critic optim    always; offload: its step only   Adam moments of the leaves that train
    reference / reward    always; offload: scoring only    compute dtype, only the leaves not shared (engine.py)
    ema                   always                           float32, the fused actor
    gradients             the model's step                 the whole trainable tree, twice (the sum accumulated)
    fused LoRA kernels    scoring and the model's step     one layer's adapted kernels fused (lora.attach), fp32
    FSDP -> TP switch     reshard                          compute dtype, both layouts at once
    TP copy + KV cache    generation                       compute dtype; cache [L, B/data, Hkv/tp, S, K]
    activations           every program                    see `activations` (with and without remat)

Shapes and sharding are exact (the trainer state is traced with `jax.eval_shape` and laid out with the
FSDP/TP tables of jaxrlhf.sharding on an abstract mesh, so any device count can be planned); activations
are an estimate (see `activations`). The phase peak is the resident items plus that phase's transients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from jaxrlhf import hooks
from jaxrlhf.checkpoint import read_config
from jaxrlhf.config import ConfigError, parse_cli
from jaxrlhf.generate import DECODE_SLOTS, decode_slots
from jaxrlhf.lora import adapted_mask
from jaxrlhf.models import param_shapes, preset
from jaxrlhf.optim import init_state, make_optimizer
from jaxrlhf.rl import packing
from jaxrlhf.rl.config import ModelSide, PPOConfig
from jaxrlhf.sharding import AXES, make_mesh, partition_spec, path_str

GiB = 2**30


def abstract_mesh(devices: int, tp: int) -> AbstractMesh:
    if tp < 1 or devices % tp:
        raise ConfigError(f"inference_tp_size {tp} must divide the number of devices ({devices})")
    return AbstractMesh((devices // tp, tp), AXES)


def _leaf_bytes(path: str, x, layout: str, mesh) -> int:
    spec = partition_spec(path, x.shape, layout, mesh)
    split = math.prod(
        mesh.shape[a] for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))
    )
    return math.prod(x.shape) // split * np.dtype(x.dtype).itemsize


def shard_bytes(tree, layout: str, mesh) -> int:
    """Bytes per device of `tree` (arrays or ShapeDtypeStructs) laid out in `layout` on `mesh`."""
    return sum(_leaf_bytes(path_str(p), x, layout, mesh) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0])


def _cast(tree, dtype):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), tree)


def activations(
    config,
    rows: int,
    T: int,
    *,
    train: bool,
    remat: bool,
    value_head: bool,
    backend: str,
    head_len: int | None = None,
    chunk: int = 0,
    segments: bool = False,
) -> int:
    """Bytes per device of one forward (and backward with `train`) over `rows` sequences of T tokens (with
    `segments`, rows of T tokens packed with several sequences each: Step 3's micro-batches, jaxrlhf.rl.packing).

    An estimate from the layer's tensors, per token of compute dtype c: a layer keeps for its backward its
    input, the two LayerNorm outputs, q, k, v, the attention output and the residual (7 D) and the FFN's
    hidden before and after the activation (2 F; Llama's gated MLP 3 F); with XLA's attention (the CPU, fp32,
    attention dropout) also the [H, T, T] scores and probabilities in fp32; packed rows add their [T, T] segment mask
    (bool, and as cuDNN's bias in the compute dtype). Remat keeps only each layer's
    input and recomputes one layer at a time. The head's fp32 output ([T, V] logits, [head_len, V] when the
    LM head runs on the last head_len positions only, or [T] values) exists
    with its log-softmax and, training, their gradient; a forward alone holds a few [T, D] hidden states and
    either one layer's tensors or the head's. With `chunk` > 0 tokens per device (the log-probs in chunks,
    models.head_logprobs) the head holds one chunk's [chunk, V] logits (at least one position per row), not the
    whole [T, V] per row. Calibrated against XLA's own figures on the CPU
    (tests/test_plan.py); the GPU figures are tools/bench_memory.py's.
    """
    c = np.dtype(config.compute_dtype).itemsize
    D, L, H = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    F = getattr(config, "ffn_dim", None) or config.intermediate_size
    gated = 2 if config.model_type == "opt" else 3
    xla_scores = backend != "gpu" or c == 4 or (train and config.attention_dropout > 0)
    scores = H * T * T * 4 if xla_scores else 0  # one [H, T, T] fp32 array per sequence
    mask = T * T * (1 + (0 if xla_scores else c)) if segments else 0  # a packed row's [T, T] segment mask (and bias)
    layer = (
        T * (7 * D + gated * F) * c + 3.5 * scores
    )  # one layer's saved tensors per sequence: scores, probs (2 dtypes)
    head = T * 4 if value_head else (head_len or T) * config.vocab_size * 4
    if chunk and not value_head:  # one chunk of all the rows' tokens: spread over the rows below
        head = min(head, max(chunk // rows, 1) * config.vocab_size * 4)
    if not train:  # one layer at a time (fewer of its tensors live at once than a backward keeps), then the head;
        a = 4 if backend == "cpu" else c  # XLA's CPU backend computes bf16 in fp32
        return int(rows * (4 * T * D * a + mask + max(T * (5 * D + (gated - 1) * F) * a + scores, 2 * head)))
    # remat: each layer's input and the recomputed layer's scores; the rest of that layer is `backward`'s
    kept = L * T * D * c + 2 * scores if remat else L * layer
    backward = T * (2 * D + gated * F) * c + 2 * scores  # one layer's gradients in flight
    return int(rows * (kept + backward + 2 * head + mask))


@dataclasses.dataclass
class Plan:
    """Bytes per device: `items` (name -> bytes), `phases` (phase -> the items it holds), and the capacity."""

    items: dict[str, int]
    phases: dict[str, list[str]]
    capacity: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    host: int = 0  # bytes per device offloaded to pinned host memory

    def phase_bytes(self, phase: str) -> int:
        return sum(self.items[i] for i in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_bytes)

    @property
    def peak(self) -> int:
        return self.phase_bytes(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.peak <= self.capacity

    def table(self) -> str:
        """Items as rows, phases as columns (GiB, or MiB for small plans, per device), the peak marked."""
        unit, name = (GiB, "GiB") if self.peak >= GiB else (2**20, "MiB")
        width = max(len(i) for i in self.items) + 2
        head = f"item ({name} per device)".ljust(width) + "".join(p.rjust(12) for p in self.phases)
        lines = [head, "-" * len(head)]
        for item, b in self.items.items():
            cells = "".join((f"{b / unit:12.3f}" if item in held else " " * 11 + "-") for held in self.phases.values())
            lines.append(item.ljust(width) + cells)
        lines.append("-" * len(head))
        lines.append("total".ljust(width) + "".join(f"{self.phase_bytes(p) / unit:12.3f}" for p in self.phases))
        cap = "no limit given" if self.capacity is None else f"{self.capacity / GiB:.2f} GiB"
        lines.append(
            f"peak {self.peak / GiB:.3f} GiB per device in {self.peak_phase}; capacity {cap}"
            + ("" if self.fits else " -- DOES NOT FIT")
        )
        return "\n".join(lines + self.notes)


@functools.lru_cache(maxsize=64)  # the options of a refusal plan the same model many times
def _model(config, side, precision: str, mesh, value_head: bool) -> dict[str, int]:
    """Bytes per device of one trainable model's state, its gradients, its fused LoRA kernels and the leaves
    its frozen twin (reference or reward model) holds itself."""
    master = jnp.bfloat16 if precision == "pure_bf16" else jnp.float32
    params = _cast(param_shapes(config, value_head=value_head), master)
    tx = make_optimizer(side.optim, 1, side.lora)
    state = jax.eval_shape(lambda p: init_state(p, side.lora, tx, jax.random.key(0)), params)
    adapted = adapted_mask(params, side.lora) if side.lora.dim else jax.tree.map(lambda _: False, params)
    shared = jax.tree.map(lambda _: True, params) if side.lora.only_optimize_lora else adapted  # engine.never_moves
    leaves = list(
        zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(adapted), jax.tree.leaves(shared))
    )
    compute = jax.ShapeDtypeStruct
    # one layer's float32 copy of each adapted kernel
    layer_fp32 = [
        _leaf_bytes(path_str(p), compute(x.shape, jnp.float32), "fsdp", mesh) // (x.shape[0] if x.ndim == 3 else 1)
        for (p, x), a, _ in leaves
        if a
    ]
    return {
        "weights": shard_bytes({k: state[k] for k in ("trainable", "frozen")}, "fsdp", mesh),
        "optimizer": shard_bytes(state["opt"], "fsdp", mesh),
        "gradients": shard_bytes(state["trainable"], "fsdp", mesh),
        "twin": sum(
            _leaf_bytes(path_str(p), compute(x.shape, config.compute_dtype), "fsdp", mesh)
            for (p, x), _, s in leaves
            if not s
        ),
        "fused": sum(layer_fp32),  # the steps and scoring fuse one layer at a time (lora.attach)
        # the generation copy is built one layer at a time (generate.decode_params)
        "delta": max(layer_fp32, default=0),
        "master": shard_bytes(params, "fsdp", mesh),
        "tp_compute": shard_bytes(_cast(params, config.compute_dtype), "tp", mesh),
    }


def plan(
    cfg,
    actor_config,
    critic_config,
    mesh,
    *,
    batch: int,
    prompt_len: int,
    capacity: int | None = None,
    backend: str | None = None,
    experiences: int = 1,
    unsup_rows: int = 0,
    unsup_len: int = 0,
) -> Plan:
    """The memory plan of Step 3 (`cfg`: an EngineConfig, e.g. a PPOConfig) on `mesh` (a Mesh or AbstractMesh)
    for generation batches of `batch` rows (answers: prompts x num_samples_per_prompt) of `prompt_len` + answer tokens,
    `experiences` of them kept per iteration (generation_batches), and a mixture LM batch of `unsup_rows` x `unsup_len`
    tokens in the actor step. A critic-free algorithm plans no critic: its rows are 0 and its step is no phase."""
    backend = backend or jax.default_backend()
    G, N, tp = cfg.max_answer_len, mesh.size, mesh.shape["model"]
    T = prompt_len + G
    critic_free = cfg.critic_free
    a = _model(actor_config, cfg.actor, cfg.precision, mesh, value_head=False)
    # critic-free: the reward model alone, every leaf its own (a side without LoRA shares nothing)
    c = _model(critic_config, ModelSide() if critic_free else cfg.critic, cfg.precision, mesh, value_head=True)
    rows = -(-batch // N)
    cache, decoding = _generation_bytes(cfg, actor_config, mesh, batch, prompt_len, backend)
    # FSDP gathers each layer's weights as the scan reaches it: two layers in flight (none on one device)
    gather_a = 0 if N == 1 else 2 * a["master"] // actor_config.num_hidden_layers
    gather_c = 0 if N == 1 else 2 * c["master"] // critic_config.num_hidden_layers
    # the generation copy is built one layer at a time (generate.decode_params): one layer's FSDP shards gathered
    switch = 0 if N == 1 else a["master"] * N // actor_config.num_hidden_layers
    budget = cfg.max_tokens_per_micro_batch
    packed = _packed(cfg, actor_config, critic_config, N, batch, T, backend, unsup_rows, unsup_len)
    items = {
        "actor weights": a["weights"],
        "actor optimizer": a["optimizer"],
        "critic weights": c["weights"],
        "critic optimizer": c["optimizer"],
        "reference (own leaves)": a["twin"],
        "reward (own leaves)": c["twin"] if cfg.reward.model_scale else 0,
        "ema": a["master"] * (2 if cfg.precision == "pure_bf16" else 1) if cfg.enable_ema else 0,  # float32
        "switch: one layer gathered": switch,
        "TP generation copy": a["tp_compute"],
        "switch: fp32 LoRA delta": a["delta"],
        "KV cache": cache,
        "generation activations": decoding,
        "fused LoRA kernels": a["fused"] + c["fused"],
        "scoring activations": packed["scoring"] + max(gather_a, gather_c),
        "actor gradients": 2 * a["gradients"],
        "actor fused LoRA": a["fused"],
        "actor step activations": packed["actor_step"] + gather_a,
        "critic gradients": 2 * c["gradients"],
        "critic fused LoRA": c["fused"],
        "critic step activations": packed["critic_step"] + gather_c,
        "experience": experiences * rows * T * 4 * 12,
        "packed micro-batch": packed["micro-batch"],
    }
    if critic_free:  # no critic: its items count nothing (kept as rows, so a table shows what is saved)
        items.update({k: 0 for k in items if k.startswith("critic")})
    phases, offloaded = _phases(cfg)
    notes = [
        f"{N} device(s), inference_tp_size {tp}, batch {batch}, {prompt_len} + {G} tokens, precision "
        f"{cfg.precision}, backend {backend}, micro-batches of {budget} tokens per device; offloaded to host: "
        + (", ".join(i for i, (on, _) in offloaded.items() if on) or "nothing")
    ]
    return Plan(items, phases, capacity, notes, host=sum(items[i] for i, (on, _) in offloaded.items() if on))


def _packed(cfg, actor_config, critic_config, N: int, batch: int, T: int, backend, unsup_rows: int, unsup_len: int):
    """Scoring's and the steps' activations per device, and the packed micro-batch's own arrays ("micro-batch").

    They run one packed micro-batch at a time (the steps summing into a second gradient tree): at most budget // T
    rows of the widest width T per device, several sequences to a row (segments); the actor's log-probs take the LM
    head on a row's A answer slots only (experience.answer_logprobs; A: the longest answer rounded up to a power of
    two, packing.plan). The micro-batch holds packing.Micro's index arrays, the packed seq, mask, positions and
    segments [n, W], head_at, slot, answer and the slot results [n, A], and the losses' answer-space arrays [B, G]
    it fills. The actor's mixture batch (unsup_rows x unsup_len, not packed) adds its own step's activations."""
    G, budget = cfg.max_answer_len, cfg.max_tokens_per_micro_batch
    slots = min(max(packing.MIN_SLOTS, 2 ** math.ceil(math.log2(max(G, 1)))), T)

    def act(config, side, value_head, train, n=batch, length=T, head_len=slots, segments=True):
        rows = min(max(budget // T, 1), 2 ** math.ceil(math.log2(-(-n // N))))
        chunk = -(-side.logits_chunk // N)  # the chunk's tokens per device (rows split over all devices)
        kw = dict(train=train, remat=side.remat, value_head=value_head, backend=backend, head_len=head_len, chunk=chunk)
        return activations(config, rows, length, segments=segments, **kw)

    rows = min(max(budget // T, 1), 2 ** math.ceil(math.log2(-(-batch // N))))
    return {
        "scoring": max(act(actor_config, cfg.actor, False, False), act(critic_config, cfg.critic, True, False)),
        "actor_step": act(actor_config, cfg.actor, False, True)
        + (unsup_rows and act(actor_config, cfg.actor, False, True, unsup_rows, unsup_len, unsup_len, False)),
        "critic_step": act(critic_config, cfg.critic, True, True),
        "micro-batch": rows * (T * 4 * 8 + slots * 4 * 8) + -(-batch // N) * G * 4 * 8,
    }


def _generation_bytes(cfg, actor_config, mesh, batch: int, prompt_len: int, backend: str) -> tuple[int, int]:
    """Generation's bytes per device: (the KV cache, its transients).

    The cache holds a row per decode slot (continuous batching: decode_slots < batch; whole groups of a prompt's
    answers, as generate.decode_slots rounds them), the slots split over the "data" groups of devices. The
    transients are the larger of: the prefill over the prompt's tokens alone (one row per prompt: a group's answers
    copy its cache), its LM head on the last position; a decode step's float32 logits [slots, V / tp], their
    log-softmax and the sampling's draw. Plus the tokens, log-probs and mask [batch, G] it returns (all rows: an
    upper bound). The answer's length counts in the KV cache only."""
    G, N, tp, group = cfg.max_answer_len, mesh.size, mesh.shape["model"], cfg.num_samples_per_prompt
    gen_rows = -(-decode_slots(cfg.decode_slots or DECODE_SLOTS, batch, group) // (N // tp))
    cache = init_cache_bytes(actor_config, gen_rows, prompt_len + G, tp)
    prefill = activations(
        actor_config, -(-gen_rows // group), prompt_len, train=False, remat=False, value_head=False, backend=backend,
        head_len=1,
    )  # fmt: skip
    return cache, max(prefill, 3 * gen_rows * -(-actor_config.vocab_size // tp) * 4) + batch * G * 12


def _phases(cfg) -> tuple[dict[str, list[str]], dict[str, tuple[bool, str]]]:
    """The items each phase holds ({phase: [item]}: the resident ones, the offloaded ones its program copies to the
    device, its own) and the offloadable items ({item: (offloaded, the phase that uses it)})."""
    offloaded = {
        "actor optimizer": (cfg.actor.offload, "actor_step"),
        "critic optimizer": (cfg.critic.offload, "critic_step"),
        "reference (own leaves)": (cfg.offload_reference_model, "score"),
        "reward (own leaves)": (cfg.offload_reward_model, "score"),
    }
    resident = ["actor weights", "critic weights", "ema"] + [i for i, (on, _) in offloaded.items() if not on]
    micro = ["experience", "packed micro-batch"]  # what scoring and the steps hold beside their activations
    phases = {
        "reshard": ["switch: one layer gathered", "switch: fp32 LoRA delta", "TP generation copy"],
        "generate": ["TP generation copy", "KV cache", "generation activations"],
        "score": ["fused LoRA kernels", "scoring activations", *micro],
        "actor_step": ["actor gradients", "actor fused LoRA", "actor step activations", *micro],
        "critic_step": ["critic gradients", "critic fused LoRA", "critic step activations", *micro],
    }
    if cfg.critic_free:
        del phases["critic_step"]
    for phase, held in phases.items():
        held[:0] = resident + [i for i, (on, use) in offloaded.items() if on and use == phase]
    return phases, offloaded


def init_cache_bytes(config, rows: int, T: int, tp: int) -> int:
    """Bytes per device of the KV cache (models.common.init_cache): k and v [L, rows, Hkv / tp, S, K], S = T up to
    x64."""
    S = -(-T // 64) * 64
    heads = -(-config.num_key_value_heads // tp)
    return 2 * config.num_hidden_layers * rows * heads * S * config.head_dim * np.dtype(config.compute_dtype).itemsize


# ------------------------------------------------------------------------------------------- the check


def model_config(cfg, side):
    """The architecture of one side of a Step 3 config, as trainer.load_model sets it up, from its folder's
    config.json (or a random:NAME preset) alone."""
    if side is cfg.critic and not side.model and cfg.critic_free and not cfg.reward.model_scale:
        side = cfg.actor  # neither critic nor reward model: nothing of this side counts; the actor's shape stands in
    if not side.model:
        raise ConfigError("actor.model and critic.model: required, Hugging Face folders (or random:NAME)")
    config = preset(side.model.removeprefix("random:")) if side.model.startswith("random:") else read_config(side.model)
    overrides = {"dtype": "float32" if cfg.precision == "fp32" else "bfloat16", "remat": side.remat}
    if side.dropout is not None:
        overrides.update(dropout=side.dropout, attention_dropout=side.dropout)
    return dataclasses.replace(config, **overrides)


def capacity(gib: float = 0.0) -> int | None:
    """Bytes per device to plan against: `gib` if > 0, else the device's bytes_limit (None where unknown: the CPU)."""
    if gib > 0:
        return int(gib * GiB)
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def ppo_plan(cfg, mesh, actor_config=None, critic_config=None, backend=None) -> Plan:
    """The plan of a PPOConfig on `mesh`: its batch (x num_samples_per_prompt answers), prompt length and capacity
    (device_memory_gib); a critic-free one notes what PPO with the same batch would need (what dropping the critic
    saves)."""
    unsup = bool(cfg.data.unsupervised_data_path) and cfg.unsup_coef > 0
    actor_config, critic_config = (
        actor_config or model_config(cfg, cfg.actor),
        critic_config or model_config(cfg, cfg.critic),
    )
    p = plan(
        cfg,
        actor_config,
        critic_config,
        mesh,
        batch=cfg.batch_size * cfg.num_samples_per_prompt,
        prompt_len=cfg.data.max_prompt_len,
        capacity=capacity(cfg.device_memory_gib),
        backend=backend,
        experiences=cfg.generation_batches,
        unsup_rows=(cfg.unsup_batch_size or cfg.batch_size) if unsup else 0,
        unsup_len=cfg.data.max_seq_len,
    )
    if cfg.critic_free:
        as_ppo = dataclasses.replace(cfg, algorithm="ppo", dynamic_sampling=False)  # (PPO has no groups to drop)
        ppo = ppo_plan(as_ppo, mesh, actor_config, critic_config, backend)
        unit, name = (GiB, "GiB") if ppo.peak >= GiB else (2**20, "MiB")
        p.notes.append(
            f"{cfg.algorithm} trains no critic: peak {p.peak / unit:.3f} {name} per device, PPO's with this batch "
            f"{ppo.peak / unit:.3f} {name} (saves {(ppo.peak - p.peak) / unit:.3f} {name}: no critic weights, "
            "optimizer, gradients or step; "
            + (
                "the reward model holds all its leaves)"
                if cfg.reward.model_scale
                else "no reward model: functions score)"
            )
        )
    return p


def alternatives(cfg, mesh, actor_config, critic_config, backend=None) -> list[tuple[str, str, Plan]]:
    """The options that change the memory, each alone: LoRA, remat, offload, fewer decode slots, a smaller batch,
    more devices, a larger inference_tp_size; as (kind, what to set, its plan)."""
    replace = dataclasses.replace
    names = ("actor",) if cfg.critic_free else ("actor", "critic")  # the trained sides
    keys = lambda key: " ".join(f"{n}.{key}" for n in names)  # noqa: E731
    sides = lambda **kw: {n: replace(getattr(cfg, n), **kw) for n in names}  # noqa: E731
    lora = {
        n: replace(getattr(cfg, n).lora, dim=getattr(cfg, n).lora.dim or 128, only_optimize_lora=True) for n in names
    }
    options = [  # each where it changes the config
        (name, option, mesh)
        for name, option in (
            (
                f"LoRA only ({keys('lora.dim')} 128, lora.only_optimize_lora=true)",
                replace(cfg, **{n: replace(getattr(cfg, n), lora=lora[n]) for n in names}),
            ),
            ("precision=pure_bf16 (bf16 master weights and optimizer state)", replace(cfg, precision="pure_bf16")),
            (f"remat ({keys('remat')} =true)", replace(cfg, **sides(remat=True))),
            (
                f"offload ({keys('offload')} offload_reference_model offload_reward_model =true)",
                replace(cfg, **sides(offload=True), offload_reference_model=True, offload_reward_model=True),
            ),
        )
        if option != cfg
    ]
    N, tp = mesh.size, mesh.shape["model"]
    budget, T = cfg.max_tokens_per_micro_batch, cfg.data.max_prompt_len + cfg.max_answer_len
    while budget // 2 >= T:
        budget //= 2
        options.append((f"max_tokens_per_micro_batch={budget}", replace(cfg, max_tokens_per_micro_batch=budget), mesh))
    # fewer decode slots: a smaller KV cache (long answers: the largest item), the same batch
    group = cfg.num_samples_per_prompt
    slots = decode_slots(cfg.decode_slots or DECODE_SLOTS, cfg.batch_size * group, group)
    while slots // 2 >= max(group, N // tp):
        slots //= 2
        options.append((f"decode_slots={slots}", replace(cfg, decode_slots=slots), mesh))
    batch = cfg.batch_size // 2
    while batch >= N and batch % N == 0:
        options.append((f"batch_size={batch}", replace(cfg, batch_size=batch), mesh))
        batch //= 2
    options += [(f"{N * k} devices", cfg, abstract_mesh(N * k, tp)) for k in (2, 4, 8)]
    heads = actor_config.num_attention_heads
    options += [
        (f"inference_tp_size={t}", replace(cfg, inference_tp_size=t), abstract_mesh(N, t))
        for t in (2 * tp, 4 * tp, 8 * tp)
        if N % t == 0 and heads % t == 0
    ]
    kind = lambda name: "devices" if name[0].isdigit() else name.split("=")[0]
    return [(kind(name), name, ppo_plan(c, m, actor_config, critic_config, backend)) for name, c, m in options]


def check(cfg, mesh, actor_config=None, critic_config=None, backend=None) -> Plan:
    """Refuse a Step 3 config whose plan does not fit the device, before anything is loaded or compiled: the
    message names the phase, the largest item and what each option would need."""
    T = cfg.data.max_prompt_len + cfg.max_answer_len
    if cfg.max_tokens_per_micro_batch < T:
        raise ConfigError(
            f"max_tokens_per_micro_batch {cfg.max_tokens_per_micro_batch} is below one sequence's "
            f"data.max_prompt_len + max_answer_len = {T} tokens: set it to at least {T}"
        )
    actor_config = actor_config or model_config(cfg, cfg.actor)
    critic_config = critic_config or model_config(cfg, cfg.critic)
    p = ppo_plan(cfg, mesh, actor_config, critic_config, backend)
    local = mesh.size if isinstance(mesh, AbstractMesh) else len(mesh.local_devices)
    limit = float(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", 64)) * 1e9  # XLA's pinned-host pool per process
    if (backend or jax.default_backend()) == "gpu" and p.host * local > limit:
        raise ConfigError(
            f"out of host memory before starting: offload puts {p.host * local / 1e9:.1f} GB in pinned host memory "
            f"({local} device(s) x {p.host / GiB:.2f} GiB), above XLA's pinned-host pool of {limit / 1e9:.0f} GB. "
            f"Start with XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={math.ceil(p.host * local / 1e9 * 1.1)} (if the host has "
            "that much memory) or offload less (actor/critic.offload, offload_reference_model, offload_reward_model)"
        )
    if p.fits:
        return p
    item = max(p.phases[p.peak_phase], key=p.items.get)
    lines = [
        f"out of memory before starting: Step 3 needs {p.peak / GiB:.2f} GiB per device in {p.peak_phase}, the "
        f"device has {p.capacity / GiB:.2f} GiB (device_memory_gib or the device's bytes_limit); the largest item "
        f"there is {item} ({p.items[item] / GiB:.2f} GiB). Options (peak per device with each alone):"
    ]
    shown = {}  # per kind of option: the first that fits (the largest batch, the fewest devices), else the last tried
    for kind, name, q in alternatives(cfg, mesh, actor_config, critic_config, backend):
        if kind not in shown or not shown[kind][1].fits:
            shown[kind] = (name, q)
    for name, q in shown.values():
        lines.append(f"  {name}: {q.peak / GiB:.2f} GiB in {q.peak_phase} -- {'fits' if q.fits else 'does not fit'}")
    lines.append("(python -m jaxrlhf.plan CONFIG [key=value ...] prints the whole plan)")
    raise ConfigError("\n".join(lines))


# ------------------------------------------------------------------------------------------- measuring


def device_bytes(device) -> int:
    """Bytes of the live arrays in `device`'s own memory (host-memory arrays not counted)."""
    total = 0
    for x in jax.live_arrays():
        if device in x.sharding.device_set and x.sharding.memory_kind in (None, "device"):
            total += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    return total


def measure(engine, prompt_batch: dict) -> dict[str, int]:
    """One iteration of `engine` (generate_experience + train_rlhf) and the peak bytes of device 0 in each phase.

    Where the device reports memory (GPU: memory_stats' peak_bytes_in_use, which cannot be reset) the figure
    is the running peak after each phase. Where it does not (the CPU), it is computed from what JAX offers
    there: the live arrays on the device when each compiled program starts, plus the program's own
    temporaries and outputs from its `memory_analysis()` (temp + output - aliased), maximised over the
    phase's programs. The engine's observer sees each phase; jaxrlhf.hooks each program in it.
    """
    device = jax.local_devices()[0]
    peaks: dict[str, int] = {}
    gpu = "peak_bytes_in_use" in (device.memory_stats() or {})

    def probe(phase, fn, args, kwargs):
        stats = fn.lower(*args, **kwargs).compile().memory_analysis()
        program = stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
        peaks[phase] = max(peaks.get(phase, 0), device_bytes(device) + program)

    def observe(phase, run):
        with contextlib.nullcontext() if gpu else hooks.watching(functools.partial(probe, phase)):
            out = run()
        if gpu:
            peaks[phase] = device.memory_stats()["peak_bytes_in_use"]
        return out

    observer, engine.observer = engine.observer, observe
    try:
        engine.train_rlhf(engine.generate_experience(prompt_batch))
    finally:
        engine.observer = observer
    return peaks


def main(argv=None):
    """python -m jaxrlhf.plan CONFIG [key=value ...] [--devices N]: print the plan of a Step 3 config."""

    def flags(parser):
        parser.add_argument(
            "--devices", type=int, default=0, help="plan for this many devices (default: the ones here)"
        )
        parser.add_argument("--backend", default=None, help="gpu, tpu or cpu (default: this machine's)")

    try:
        cfg, ns = parse_cli(PPOConfig, __doc__.split("\n\n")[0], argv, "python -m jaxrlhf.plan", flags, processes=False)
        mesh = abstract_mesh(ns.devices, cfg.inference_tp_size) if ns.devices else make_mesh(cfg.inference_tp_size)
        actor, critic = model_config(cfg, cfg.actor), model_config(cfg, cfg.critic)
        p = ppo_plan(cfg, mesh, actor, critic, ns.backend)
        print(p.table())
        if not p.fits:
            check(cfg, mesh, actor, critic, ns.backend)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
