"""The memory plan (jaxrlhf.plan): within 15 % of the measured peak of each phase on tiny models, an
impossible config refused before anything is loaded or compiled, and offloaded runs equal to device-resident ones.

On the CPU `memory_stats()` is None, so the measured figure is what JAX offers there (plan.measure): the live
arrays on device 0 when each compiled program starts plus the program's temporaries and outputs from its
`memory_analysis()`. One device: on 8 virtual CPU devices XLA's SPMD partitioner replicates the attention's
backward ("involuntary full rematerialization"), which a GPU run does not do.
"""

import math
import re

import jax
import numpy as np
import pytest

from jaxrlhf import OPTConfig, init_params, make_mesh
from jaxrlhf import plan as memory_plan
from jaxrlhf.config import ConfigError, load
from jaxrlhf.lora import LoRAConfig
from jaxrlhf.optim import OptimConfig
from jaxrlhf.rl import EngineConfig, HybridEngine, ModelSide
from jaxrlhf.rl.engine import tree_bytes

ARCH = dict(vocab_size=512, max_position_embeddings=128, dropout=0.0)
ACTOR = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, ffn_dim=256, word_embed_proj_dim=64)
CRITIC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=32)
B, PROMPT, G = 16, 32, 32


def build(precision="bf16", remat=False, lora=0, mesh=None, offload=False, **kw):
    dtype = "float32" if precision == "fp32" else "bfloat16"
    actor = OPTConfig(**ARCH, **ACTOR, dtype=dtype, remat=remat)
    critic = OPTConfig(**ARCH, **CRITIC, dtype=dtype, remat=remat)
    side = ModelSide(
        optim=OptimConfig(learning_rate=1e-3, warmup_steps=0), lora=LoRAConfig(dim=lora), remat=remat, offload=offload
    )
    cfg = EngineConfig(actor=side, critic=side, precision=precision, max_answer_len=G, enable_ema=True, seed=7, **kw)
    mesh = mesh or make_mesh(1, jax.devices()[:1])
    params = (
        jax.device_get(init_params(actor, jax.random.key(0), std=0.2)),
        jax.device_get(init_params(critic, jax.random.key(1), value_head=True, std=0.2)),
    )
    engine = HybridEngine(cfg, mesh, (actor, params[0]), (critic, params[1]), total_steps=10, eos_id=-1, pad_id=1)
    return engine, cfg, actor, critic, mesh


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    mask = (np.arange(PROMPT)[None] >= rng.integers(0, PROMPT // 2, B)[:, None]).astype(np.int32)  # left padding
    return {"prompt_ids": np.where(mask, rng.integers(3, 512, (B, PROMPT)), 1).astype(np.int32), "prompt_mask": mask}


@pytest.mark.slow
@pytest.mark.parametrize("precision,remat,lora", [("bf16", False, 0), ("fp32", True, 8)])
def test_plan_within_15_percent_of_the_measured_peak_of_every_phase(precision, remat, lora):
    """The plan counts the widest width a packed micro-batch may have, so it may be above what a batch of shorter rows
    takes (by up to 30 %), never below by more than 15 %."""
    engine, cfg, actor, critic, mesh = build(precision, remat, lora)
    measured = memory_plan.measure(engine, prompts())
    p = memory_plan.plan(cfg, actor, critic, mesh, batch=B, prompt_len=PROMPT)
    errors = {ph: p.phase_bytes(ph) / measured[ph] - 1 for ph in p.phases}
    print({ph: f"{e:+.1%}" for ph, e in errors.items()})
    assert all(-0.15 <= e <= 0.3 for e in errors.values()), errors
    assert -0.15 <= p.peak / max(measured.values()) - 1 <= 0.3


@pytest.mark.slow
def test_plan_counts_the_state_exactly_and_offload_moves_items_out_of_other_phases():
    engine, cfg, actor, critic, mesh = build("fp32", True, 8)  # as above and below: compiled once
    p = memory_plan.plan(cfg, actor, critic, mesh, batch=B, prompt_len=PROMPT)
    state = engine.state
    live = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # one device: global bytes are per-device bytes
    assert p.items["actor weights"] == live({k: state["actor"][k] for k in ("trainable", "frozen")})
    assert p.items["actor optimizer"] == live(state["actor"]["opt"])
    assert p.items["reference (own leaves)"] == live(engine.ref_own)
    assert p.items["reward (own leaves)"] == live(engine.reward_own)
    assert p.items["ema"] == live(state["ema"])
    # KV cache: 2 x L x B x H x (P + G up to 64) x K x 4 bytes
    assert p.items["KV cache"] == 2 * 4 * B * 4 * 64 * 16 * 4
    off = memory_plan.plan(
        EngineConfig(
            **{
                **cfg.__dict__,
                "offload_reference_model": True,
                "actor": ModelSide(**{**cfg.actor.__dict__, "offload": True}),
            }
        ),
        actor,
        critic,
        mesh,
        batch=B,
        prompt_len=PROMPT,
    )
    assert off.phase_bytes("actor_step") == p.phase_bytes("actor_step") - p.items["reference (own leaves)"]
    assert off.phase_bytes("generate") == (
        p.phase_bytes("generate") - p.items["actor optimizer"] - p.items["reference (own leaves)"]
    )


def test_an_impossible_config_is_refused_before_loading_or_compiling(tmp_path, monkeypatch):
    from jaxrlhf import ppo

    cfg = load(
        ppo.PPOConfig,
        None,
        [
            "actor.model=random:opt-30b",
            "critic.model=random:opt-350m",
            "batch_size=8",
            "device_memory_gib=80",
            f"output_dir={tmp_path}",
            "tokenizer=nowhere",
        ],
    )
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(kw.get("fun_name")) if "backend_compile" in event else None
    )
    monkeypatch.setattr(ppo, "load_model", lambda *a, **k: pytest.fail("loaded a model before refusing"))
    with pytest.raises(ConfigError) as e:
        ppo.run(cfg, mesh=make_mesh(1, jax.devices()[:1]), log=lambda *_: None)
    # nothing but the two one-primitive programs of a jnp.zeros (param_shapes' dummy input); no model program
    assert set(compiles) <= {"jit(convert_element_type)", "jit(broadcast_in_dim)"}, compiles
    message = str(e.value)
    # 30B parameters x (4 + 4) bytes of fp32 Adam moments = 223.5 GiB, the largest item
    assert "in actor_step, the device has 80.00 GiB" in message, message
    assert "largest item there is actor optimizer (223.33 GiB)" in message, message
    # every kind of option with its peak, each below the config's own; none fits alone on one 80 GiB device
    peak = float(message.split("needs ")[1].split(" GiB")[0])
    for option in ("LoRA only", "precision=pure_bf16", "remat", "offload", "batch_size=1:", "8 devices:"):
        line = next(row for row in message.splitlines() if row.strip().startswith(option))
        assert float(line.split(": ")[-1].split(" GiB")[0]) < peak and line.endswith("does not fit"), line


@pytest.mark.slow
def test_offloaded_runs_give_the_same_losses_as_device_resident_ones_and_phases_release_their_memory():
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert "pinned_host" in kinds  # the CPU backend of jax 0.11 has it too, so the code path runs here
    runs = {}
    for offload in (False, True):
        engine = build("fp32", True, 8, offload=offload, offload_reference_model=offload, offload_reward_model=offload)[
            0
        ]
        if offload:  # the offloaded Adam moments are made in host memory, never moved there from the device
            assert {x.sharding.memory_kind for x in jax.tree.leaves(engine.state["actor"]["opt"])} == {"pinned_host"}
            assert "offload" not in engine.timings
        runs[offload] = []
        for i in range(2):  # release between phases: only the experience outlives generation, nothing the steps
            device, start = jax.devices()[0], memory_plan.device_bytes(jax.devices()[0])
            exp = engine.generate_experience(prompts(i))
            own = tree_bytes({k: v for k, v in exp.items() if k != "kl_coef"})  # kl_coef: the state's own scalar
            assert 0 <= memory_plan.device_bytes(device) - start - own <= 64  # a scalar or two at most
            runs[offload].append(engine.train_rlhf(exp))
            own = tree_bytes({k: v for k, v in exp.items() if k != "kl_coef"})  # now with the step's old log-probs
            assert 0 <= memory_plan.device_bytes(device) - start - own <= 64  # a scalar or two at most
            del exp
        if offload:  # between uses everything offloaded is in host memory
            trees = (engine.ref_own, engine.reward_own, engine.state["actor"]["opt"], engine.state["critic"]["opt"])
            assert {x.sharding.memory_kind for x in jax.tree.leaves(trees)} == {"pinned_host"}
            assert engine.timings["offload"] > 0
    for a, b in zip(runs[False], runs[True]):
        for k in ("actor_loss", "critic_loss", "kl", "reward", "actor_grad_norm"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, err_msg=k)
        assert a["actor_loss"] != 0


def test_offload_beyond_the_pinned_host_pool_is_refused_with_the_variable_to_set(monkeypatch):
    """XLA's pinned-host pool on a GPU is 64 GB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says more: a plan that
    offloads more is refused before loading, naming the variable and the value that fits."""
    from jaxrlhf import ppo

    cfg = load(
        ppo.PPOConfig,
        None,
        [
            "actor.model=random:opt-6.7b",
            "critic.model=random:opt-350m",
            "batch_size=8",
            "actor.offload=true",
            "critic.offload=true",
            "offload_reference_model=true",
            "device_memory_gib=1000",
            "tokenizer=nowhere",
        ],
    )
    mesh = memory_plan.abstract_mesh(1, 1)
    p = memory_plan.ppo_plan(cfg, mesh, backend="gpu")
    # 6.7B fp32 Adam moments (8 bytes a weight) + critic's + the reference's own bf16 leaves: past 64 GB
    assert p.host > 64e9
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    with pytest.raises(ConfigError, match=rf"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={math.ceil(p.host / 1e9 * 1.1)}"):
        memory_plan.check(cfg, mesh, backend="gpu")
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(math.ceil(p.host / 1e9 * 1.1)))
    assert memory_plan.check(cfg, mesh, backend="gpu").host == p.host
    assert memory_plan.check(cfg, mesh, backend="cpu").host == p.host  # no pinned pool on the CPU


def test_the_eight_gpu_configurations_of_the_node_benchmark():
    """The plans behind the eight-GPU commands (docs/benchmarks.md), on an abstract 8-device mesh (nothing
    allocated): OPT-13B full fine-tuning at batch 512 with tp 2 and OPT-66B with LoRA at batch 128 with tp 8 fit
    JAX's default pool on an H200 (104.9 GiB); OPT-13B does not fit one. The KV cache and the weights by hand."""
    from jaxrlhf import ppo
    from jaxrlhf.models import param_shapes, preset

    def plan(devices, tp, *extra):
        cfg = load(
            ppo.PPOConfig,
            None,
            [
                "critic.model=random:opt-350m",
                "precision=pure_bf16",
                "data.max_prompt_len=256",
                "max_answer_len=256",
                "device_memory_gib=104.9",
                *extra,
            ],
        )
        return memory_plan.ppo_plan(cfg, memory_plan.abstract_mesh(devices, tp), backend="gpu")

    # 8 sequences of 512 tokens per device in each micro-batch, as the node benchmark's --micro-batch
    steps = ["max_tokens_per_micro_batch=4096"]
    p = plan(8, 2, "actor.model=random:opt-13b", "batch_size=512", "inference_tp_size=2", *steps)
    assert p.fits, p.table()
    # 40 layers x 64 rows per data group (256 decode slots over 4 groups) x 20 of 40 heads x 512 slots x 128 x (K, V)
    # x 2 bytes
    assert p.items["KV cache"] == 40 * 64 * 20 * 512 * 128 * 2 * 2
    n = sum(x.size for x in jax.tree.leaves(param_shapes(preset("opt-13b"))))
    assert abs(p.items["actor weights"] - 2 * n / 8) < 2 * n / 8 * 0.01  # bf16, split over 8 (up to rounding)
    assert 35 * 2**30 < p.peak < 70 * 2**30
    assert plan(
        8,
        8,
        "actor.model=random:opt-66b",
        "batch_size=128",
        "inference_tp_size=8",
        "actor.lora.dim=128",
        "actor.lora.only_optimize_lora=true",
        *steps,
    ).fits
    assert not plan(1, 1, "actor.model=random:opt-13b", "batch_size=64", "inference_tp_size=1", *steps).fits


def test_a_token_budget_below_one_sequence_is_refused_and_a_smaller_one_is_an_option(tmp_path):
    from jaxrlhf import ppo

    args = [
        "actor.model=random:opt-1.3b",
        "critic.model=random:opt-350m",
        "batch_size=8",
        f"output_dir={tmp_path}",
        "tokenizer=nowhere",
        "data.max_prompt_len=256",
        "max_answer_len=256",
    ]
    cfg = load(ppo.PPOConfig, None, args + ["max_tokens_per_micro_batch=500"])
    with pytest.raises(
        ConfigError,
        match="max_tokens_per_micro_batch 500 is below one sequence's data.max_prompt_len "
        r"\+ max_answer_len = 512 tokens: set it to at least 512",
    ):
        memory_plan.check(cfg, make_mesh(1, jax.devices()[:1]))
    # A budget that does not fit: the plan offers smaller ones (their activations scale with the rows per micro-batch)
    cfg = load(
        ppo.PPOConfig,
        None,
        args + ["max_tokens_per_micro_batch=65536", "batch_size=256", "device_memory_gib=80", "precision=pure_bf16"],
    )
    with pytest.raises(ConfigError) as e:
        memory_plan.check(cfg, make_mesh(1, jax.devices()[:1]), backend="gpu")
    assert "in actor_step" in str(e.value)
    line = next(row for row in str(e.value).splitlines() if row.startswith("  max_tokens_per_micro_batch="))
    assert line.endswith("-- fits"), line


def test_chunked_head_saving_at_qwen_vocabulary():
    """At V = 151,936 (Qwen2.5-1.5B's shape) the plan counts one 1,024-token chunk of float32 logits, not [T, V] per
    row: 16 rows of 1,024 tokens, the actor's step, bf16 on a GPU."""
    from jaxrlhf.models import preset
    from jaxrlhf.plan import activations

    config = preset("qwen2.5-1.5b", dtype="bfloat16")
    kw = dict(train=True, remat=True, value_head=False, backend="gpu")
    plain, chunked = (activations(config, 16, 1024, **kw, chunk=c) for c in (0, 1024))
    V = 151936
    assert plain - chunked == 16 * 2 * (1024 * V * 4 - 64 * V * 4)  # [T, V] per row -> 64 positions per row
    assert plain > 20 * 2**30 and chunked < 3.5 * 2**30  # 20.8 and 3.4 GiB, (plain / 2**30, chunked / 2**30)


@pytest.mark.parametrize("name, layers, kv_heads, V", [("qwen2.5-1.5b", 28, 2, 151936), ("qwen3-1.7b", 28, 8, 151936)])
def test_long_answers_kv_cache_decode_slots_and_log_prob_chunks_by_hand(name, layers, kv_heads, V):
    """GRPO at 256 + 4,096 tokens, 32 prompts x 8 answers: the KV cache is L x 2 x slots x Hkv x S x K x 2 bytes,
    slots in whole groups (100 asked: 96), S = 4,352. Generation's transients do not grow with the answer (only its
    [batch, G] outputs do), and the actor's step holds one 1,024-token chunk of float32 logits, not 4,096 answer slots.
    Too little memory is met with fewer decode slots."""
    from jaxrlhf import ppo

    def config(tp=1, slots="decode_slots=100", *extra):
        return load(
            ppo.PPOConfig,
            None,
            [
                f"actor.model=random:{name}",
                f"critic.model=random:{name}",  # the reward model
                "algorithm=grpo",
                "num_samples_per_prompt=8",
                "batch_size=32",
                "data.max_prompt_len=256",
                "max_answer_len=4096",
                "max_tokens_per_micro_batch=8192",
                f"inference_tp_size={tp}",
                slots,
                *extra,
            ],
        )

    plan = lambda devices=1, tp=1, *extra: memory_plan.ppo_plan(  # noqa: E731
        config(tp, *extra), memory_plan.abstract_mesh(devices, tp), backend="gpu"
    )
    full_mesh = memory_plan.abstract_mesh(1, 1)
    p = plan()
    assert p.items["KV cache"] == layers * 2 * 96 * kv_heads * 4352 * 128 * 2
    # 8 devices, tp 2: 4 "data" groups of 24 slots, half the KV heads each
    assert plan(8, 2).items["KV cache"] == layers * 2 * 24 * (kv_heads // 2) * 4352 * 128 * 2
    short = plan(1, 1, "decode_slots=100", "max_answer_len=1024")
    assert p.items["generation activations"] - short.items["generation activations"] == 256 * (4096 - 1024) * 12
    # one row of 4,352 tokens per micro-batch: [4096, V] logits at its answer slots (the longest answer rounded up
    # to a power of two), twice (forward and backward)
    whole = plan(1, 1, "decode_slots=100", "actor.logits_chunk=0")
    assert whole.items["actor step activations"] - p.items["actor step activations"] == 2 * (4096 - 1024) * V * 4
    # at 256 slots (the default), a device too small for generation by less than half the cache: 128 slots fit
    full = plan(1, 1, "decode_slots=256")
    rest = max(full.phase_bytes(phase) for phase in full.phases if phase != "generate")
    gib = max(rest, full.phase_bytes("generate") - full.items["KV cache"] / 2) / 2**30 + 0.01
    with pytest.raises(ConfigError, match=r"in generate, .* the largest item there is KV cache") as e:
        memory_plan.check(config(1, "decode_slots=256", f"device_memory_gib={gib}"), full_mesh, backend="gpu")
    assert re.search(r"\n  decode_slots=128: [\d.]+ GiB in \w+ -- fits", str(e.value)), str(e.value)
