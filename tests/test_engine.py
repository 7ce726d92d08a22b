"""The hybrid engine on tiny models: one iteration on 8 devices (tp 2) equals one device, the experience is
what the models say, generation's log-probs equal the training forward's, LoRA shares the base weights
(counted in bytes), EMA, the mixture loss and the adaptive KL controller."""

import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import POST_LN_PROJ, PRE_LN, jit_logits, jit_values, left_padded_batch
from jaxrlhf import OPTConfig, init_params, make_mesh
from jaxrlhf.generate import decode_params, generate
from jaxrlhf.lora import LoRAConfig
from jaxrlhf.losses import lm_loss, token_logprobs
from jaxrlhf.optim import OptimConfig
from jaxrlhf.rl import EngineConfig, HybridEngine, ModelSide
from jaxrlhf.rl.engine import tree_bytes
from jaxrlhf.sharding import path_str

ACTOR = OPTConfig(**PRE_LN, dropout=0.0)
CRITIC = OPTConfig(**POST_LN_PROJ, dropout=0.0)
G = 5
LENGTHS = [6, 3, 5, 1, 4, 6, 2, 5]


@pytest.fixture(scope="module")
def models():
    actor = jax.device_get(init_params(ACTOR, jax.random.key(0), std=0.3))
    critic = jax.device_get(init_params(CRITIC, jax.random.key(1), value_head=True, std=0.3))
    return actor, critic


@pytest.fixture(scope="module")
def prompts(models):
    ids, mask = left_padded_batch(64, LENGTHS, T=6, seed=5)
    # An EOS that the actor really draws: the second token of the first row's answer in the engines' first
    # generation (config's seed 3, iteration 0), so some answers end early (different lengths) and others fill
    # all G positions.
    first = generate(ACTOR, models[0], ids, mask, jax.random.fold_in(jax.random.key(3), 0), max_new_tokens=G)
    return {"prompt_ids": ids, "prompt_mask": mask}, int(np.asarray(first.tokens)[0, 1])


def config(**kw):
    # eps 1e-4: Adam would normalise a gradient of pure float noise (a dead ReLU's, ~1e-8) into a full 1e-2 step,
    # different on 1 and 8 devices; real gradients here are 1e-3 and larger.
    side = ModelSide(optim=OptimConfig(learning_rate=1e-2, warmup_steps=0, schedule="constant", eps=1e-4))
    base = dict(actor=side, critic=side, precision="fp32", max_answer_len=G, enable_ema=True, kl_coef=0.1, seed=3)
    return EngineConfig(**{**base, **kw})


def engine(models, mesh, eos, **kw):
    return HybridEngine(
        config(**kw), mesh, (ACTOR, models[0]), (CRITIC, models[1]), total_steps=10, eos_id=eos, pad_id=1
    )


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.mark.slow
def test_one_iteration_on_8_devices_with_tp_2_equals_one_device(models, prompts):
    batch, eos = prompts
    runs = {}
    for name, mesh in (("one", make_mesh(1, jax.devices()[:1])), ("eight", make_mesh(2))):
        e = engine(models, mesh, eos)
        exp = e.generate_experience(batch)
        stats = e.train_rlhf(exp)
        runs[name] = host(exp), stats, host(e.state)
        if name == "eight":  # scored and trained with the rows split over all devices
            assert exp["seq"].sharding.spec == jax.sharding.PartitionSpec(("data", "model"))
    (exp1, stats1, state1), (exp8, stats8, state8) = runs["one"], runs["eight"]
    np.testing.assert_array_equal(exp1["seq"], exp8["seq"])
    lengths = exp1["mask"].sum(1)
    assert lengths.max() == G and lengths.min() < G, lengths  # both kinds of answer are in the batch
    for k in ("logprobs", "ref_logprobs", "values", "scores"):
        np.testing.assert_allclose(exp1[k], exp8[k], atol=2e-5, err_msg=k)
    for k in stats1:
        np.testing.assert_allclose(stats1[k], stats8[k], rtol=1e-4, atol=1e-5, err_msg=k)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state1)[0], jax.tree.leaves(state8)):
        # The key bias has a zero gradient in exact arithmetic (softmax ignores a constant added to every
        # key); Adam normalises its float noise into a full-size step, different on 1 and 8 devices.
        if "k_proj/bias" not in path_str(path):
            np.testing.assert_allclose(a, b, atol=1e-4, err_msg=path_str(path))
    moved = np.abs(
        state1["actor"]["trainable"]["params"]["decoder"]["layers"]["fc1"]["kernel"]
        - models[0]["decoder"]["layers"]["fc1"]["kernel"]
    )
    assert moved.max() > 1e-3  # the step did something


def test_experience_is_what_the_models_say(models, prompts):
    """Old (old_logprobs scoring) and reference log-probs, values and scores against direct forwards; generation's
    own log-probs equal the training forward's old log-probs, so old_logprobs generation may skip that forward."""
    batch, eos = prompts
    e = engine(models, make_mesh(1, jax.devices()[:1]), eos, old_logprobs="scoring")
    exp = host(e.generate_experience(batch))
    seq, seq_mask, mask = exp["seq"], exp["seq_mask"], exp["mask"]
    np.testing.assert_array_equal(seq[:, :6], batch["prompt_ids"])
    n = mask.sum(1)
    for b in range(len(n)):  # mask: 1 up to and including the first EOS
        hits = np.flatnonzero(seq[b, 6:] == eos)
        assert n[b] == (hits[0] + 1 if len(hits) else G)
    lp = np.asarray(jax.nn.log_softmax(jit_logits(ACTOR, models[0], seq, seq_mask)))
    want = np.take_along_axis(lp[:, 5:-1], seq[:, 6:, None], -1)[..., 0] * mask  # token 6 + g from logits at 5 + g
    np.testing.assert_allclose(exp["logprobs"], want, atol=1e-5)
    np.testing.assert_array_equal(exp["ref_logprobs"], exp["logprobs"])  # before any step the actor is the reference
    np.testing.assert_allclose(exp["generation_logprobs"] * mask, exp["logprobs"], atol=2e-5)
    v = np.asarray(jit_values(CRITIC, models[1], seq, seq_mask))
    np.testing.assert_allclose(exp["values"], v[:, 5:-1] * mask, atol=1e-5)
    np.testing.assert_allclose(exp["scores"], v[np.arange(len(n)), 5 + n], atol=1e-5)  # critic = reward model at first
    reuse = engine(models, make_mesh(1, jax.devices()[:1]), eos, old_logprobs="generation")
    exp2 = host(reuse.generate_experience(batch))
    np.testing.assert_array_equal(exp2["seq"], seq)
    np.testing.assert_allclose(exp2["logprobs"], exp["logprobs"], atol=2e-5)


def live_bytes():
    """Bytes of every array alive on the mesh (per-device views of shards, SingleDeviceSharding, share the
    buffers of their global array and are not counted twice)."""
    gc.collect()  # what earlier tests left in reference cycles
    return sum(
        x.nbytes for x in jax.live_arrays() if not x.is_deleted() and isinstance(x.sharding, jax.sharding.NamedSharding)
    )


def adapted_bytes(params):
    layers = params["decoder"]["layers"]
    return sum(layers[m]["kernel"].nbytes for m in ("fc1", "fc2")) + sum(
        layers["self_attn"][m]["kernel"].nbytes for m in ("q_proj", "k_proj", "v_proj", "out_proj")
    )


@pytest.mark.slow
def test_lora_shares_the_base_weights_ema_mixture_and_adaptive_kl(models, prompts):
    """Count bytes. Critic with only_optimize_lora: the reward model holds no weights of its own. Actor with
    LoRA on every layer's Linears and the rest trained: the reference holds a copy of exactly that rest and
    stays the Step 1 model. Nothing else is alive: the generation-layout copy is gone after
    generate_experience. The EMA, the mixture LM loss and the adaptive KL coefficient follow their formulas."""
    batch, eos = prompts
    mesh = make_mesh(1, jax.devices()[:1])  # bytes are bytes on any mesh; one device compiles faster
    optim = OptimConfig(learning_rate=1e-2, warmup_steps=0)
    only = ModelSide(optim=optim, lora=LoRAConfig(dim=4, only_optimize_lora=True))
    lora = ModelSide(optim=optim, lora=LoRAConfig(dim=4))
    before = live_bytes()
    e = engine(models, mesh, eos, actor=lora, critic=only, kl_target=0.5, kl_horizon=100, unsup_coef=0.5, ema_decay=0.9)
    assert tree_bytes(e.reward_own) == 0
    assert tree_bytes(e.state["critic"]["frozen"]) == tree_bytes(models[1])  # its one copy, in the critic's state
    for a, b in zip(jax.tree.leaves(e.reward_params()), jax.tree.leaves(e.state["critic"]["frozen"]["params"])):
        assert a is b
    assert tree_bytes(e.ref_own) == tree_bytes(models[0]) - adapted_bytes(models[0])
    assert live_bytes() - before == tree_bytes(e.state) + tree_bytes(e.ref_own)

    ema0 = host(e.state["ema"])
    unsup_ids = np.random.default_rng(0).integers(3, 64, (8, 12)).astype(np.int32)
    unsup = {"input_ids": unsup_ids, "attention_mask": np.ones_like(unsup_ids), "loss_mask": np.ones_like(unsup_ids)}
    exp = e.generate_experience(batch)
    # the fused copy existed in the generation layout (decode_params: pre-LN, the attention's LayerNorms folded) ...
    copy = jax.eval_shape(lambda p: decode_params(ACTOR, p), models[0])
    assert e.reshard_bytes == sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(copy))
    assert live_bytes() - before == tree_bytes(e.state) + tree_bytes(e.ref_own) + tree_bytes(exp)  # ... and is gone
    total, count, _ = lm_loss(
        token_logprobs(jit_logits(ACTOR, models[0], unsup_ids, unsup["attention_mask"]), unsup_ids), unsup["loss_mask"]
    )
    stats = e.train_rlhf(exp, unsup)
    np.testing.assert_allclose(stats["unsup_loss"], float(total / count), rtol=1e-5)  # LM loss before the step
    actor = host(e.actor_params())
    for a, b, ema in zip(jax.tree.leaves(ema0), jax.tree.leaves(actor), jax.tree.leaves(host(e.state["ema"]))):
        np.testing.assert_allclose(ema, 0.9 * a + 0.1 * b, rtol=1e-5, atol=1e-7)
    assert stats["kl"] == 0.0  # the first batch is scored by an actor equal to the reference
    np.testing.assert_allclose(float(e.state["kl_coef"]), 0.1 * (1 - 0.2 * 8 / 100), rtol=1e-6)  # error clipped to -0.2
    for a, b in zip(jax.tree.leaves(host(e.reference_params())), jax.tree.leaves(models[0])):
        np.testing.assert_array_equal(a, b)  # the reference is still exactly the Step 1 model ...
    layers = models[0]["decoder"]["layers"]  # ... while the actor moved, through its adapters and directly
    assert np.abs(actor["decoder"]["layers"]["fc1"]["kernel"] - layers["fc1"]["kernel"]).max() > 1e-4
    assert (
        np.abs(actor["decoder"]["layers"]["final_layer_norm"]["bias"] - layers["final_layer_norm"]["bias"]).max() > 1e-4
    )
    for a, b in zip(jax.tree.leaves(host(e.reward_params())), jax.tree.leaves(models[1])):
        np.testing.assert_array_equal(a, b)  # and the reward model is still the Step 2 model

    # Actor with only_optimize_lora: the reference shares every leaf; without LoRA it is a whole copy.
    shared = engine(models, mesh, eos, actor=only, enable_ema=False)
    assert tree_bytes(shared.ref_own) == 0
    assert all(
        a is b
        for a, b in zip(
            jax.tree.leaves(shared.reference_params()), jax.tree.leaves(shared.state["actor"]["frozen"]["params"])
        )
    )
    full = engine(models, mesh, eos, enable_ema=False)
    assert tree_bytes(full.ref_own) == tree_bytes(models[0]) and tree_bytes(full.reward_own) == tree_bytes(models[1])


@pytest.mark.slow
def test_ema_is_float32_under_pure_bf16_and_stays_when_the_actor_step_is_skipped(models, prompts):
    """In bf16, ema + 0.008 * (actor - ema) rounds most of each step away (about 27 % survived): the EMA is kept in
    float32 and moves by exactly its formula; exported, it takes the actor's bf16. A step that the non-finite guard
    skips leaves the actor and the EMA as they were."""
    batch, eos = prompts
    bf16 = lambda tree: jax.tree.map(lambda x: np.asarray(x, jnp.bfloat16), tree)
    e = HybridEngine(
        config(precision="pure_bf16", ema_decay=0.992),
        make_mesh(1, jax.devices()[:1]),
        (ACTOR, bf16(models[0])),
        (CRITIC, bf16(models[1])),
        total_steps=10,
        eos_id=eos,
        pad_id=1,
    )
    ema0 = host(e.state["ema"])
    assert {x.dtype for x in jax.tree.leaves(ema0)} == {np.dtype(np.float32)}
    exp = e.generate_experience(batch)
    assert e.train_rlhf(exp)["actor_skipped"] == 0
    actor, ema1 = host(e.actor_params()), host(e.state["ema"])
    moved = exact = 0.0
    for a, before, after in zip(jax.tree.leaves(actor), jax.tree.leaves(ema0), jax.tree.leaves(ema1)):
        want = 0.992 * before + 0.008 * a.astype(np.float32)
        np.testing.assert_allclose(after, want, rtol=1e-6, atol=1e-7)
        moved, exact = moved + np.abs(after - before).sum(), exact + np.abs(want - before).sum()
    assert exact > 0 and moved / exact == pytest.approx(1.0, abs=1e-3)
    assert {x.dtype for x in jax.tree.leaves(host(e.ema_params()))} == {np.dtype(jnp.bfloat16)}

    exp["scores"] = exp["scores"] * np.nan  # a non-finite loss: the guard skips both steps
    stats = e.train_rlhf(exp)
    assert stats["actor_skipped"] == 1 and stats["critic_skipped"] == 1
    for a, b in zip(jax.tree.leaves(host(e.actor_params())), jax.tree.leaves(actor)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(host(e.state["ema"])), jax.tree.leaves(ema1)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_one_row_per_micro_batch_gives_the_whole_batch_step(models, prompts):
    """Packed micro-batches of one row each (max_tokens_per_micro_batch = one sequence, 11 tokens) and all 8 rows in
    one give the same experience (scored row by row) and the same steps (token-weighted sums: the whole-batch step)."""
    batch, eos = prompts
    one = make_mesh(1, jax.devices()[:1])
    runs, exps = [], []
    for budget in (11, 1024):
        e = engine(models, one, eos, enable_ema=False, max_tokens_per_micro_batch=budget)
        exp = e.generate_experience(batch)
        assert len(e.micro_batches(exp)) == (8 if budget == 11 else 1)
        runs.append((e.train_rlhf(exp), host(e.state)))
        exps.append(host(exp))  # its old log-probs the actor step's own (old_logprobs auto: step)
    for k in ("seq", "mask", "logprobs", "ref_logprobs", "values", "scores"):
        np.testing.assert_allclose(
            exps[0][k], exps[1][k], rtol=1e-5, atol=1e-5, err_msg=k
        )  # fp32 sums in another order
    assert np.abs(exps[0]["scores"]).max() > 0.1 and np.abs(exps[0]["ref_logprobs"]).max() > 0.1  # not all zeros
    (stats1, state1), (stats8, state8) = runs
    for k in stats1:
        np.testing.assert_allclose(stats1[k], stats8[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state1)[0], jax.tree.leaves(state8)):
        if "k_proj/bias" not in path_str(path):  # float noise through Adam (see the test above)
            np.testing.assert_allclose(a, b, atol=1e-4, err_msg=path_str(path))


@pytest.mark.slow
def test_each_phase_is_marked_in_a_profile_with_its_measured_time(models, prompts, tmp_path, monkeypatch):
    """HybridEngine marks every phase in a jax.profiler trace (what splits tools/bench_ppo.py --profile by phase),
    each mark as long as the phase's own timing. The packing plan (on the host, from the seq_mask it fetches) is made
    once an iteration: scoring's is the one the training steps take."""
    import gzip
    import json

    from jaxrlhf.rl import packing

    batch, eos = prompts
    e = engine(models, make_mesh(1, jax.devices()[:1]), eos)
    plans, plan = [], packing.plan
    monkeypatch.setattr(packing, "plan", lambda *a, **kw: plans.append(1) or plan(*a, **kw))
    e.train_rlhf(e.generate_experience(batch))  # compiled outside the trace
    assert len(plans) == 1
    e.timings.clear()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        e.train_rlhf(e.generate_experience(batch))
    with gzip.open(next(tmp_path.rglob("perfetto_trace.json.gz"))) as f:
        events = json.load(f)["traceEvents"]
    marks = sorted(
        (ev["ts"], ev["name"].removeprefix("jaxrlhf."), ev["dur"] / 1e6)
        for ev in events
        if ev.get("ph") == "X" and ev.get("name", "").startswith("jaxrlhf.")
    )
    # every phase in the order it first ran ("advantages" twice: again after the actor step gave the old log-probs)
    assert list(dict.fromkeys(name for _, name, _ in marks)) == list(e.timings)
    assert list(e.timings)[:3] == ["reshard", "generate", "score"]
    for phase, total in e.timings.items():
        assert sum(seconds for _, name, seconds in marks if name == phase) == pytest.approx(total, rel=0.2, abs=0.01)


def test_a_setting_no_program_reads_compiles_nothing_again(models, prompts):
    """The scoring, advantage and step programs are keyed by what they read (experience.Scoring, Returns, the mesh,
    steps.programs), not the whole EngineConfig: a second engine that differs in settings none of them reads (the
    seed, dynamic sampling's cap, the decode slots, the initial KL coefficient) runs one iteration of the same shapes
    without compiling any of them again; one that scoring reads (the temperature) compiles scoring again."""
    from jaxrlhf.rl import experience, steps

    batch, _ = prompts
    one = make_mesh(1, jax.devices()[:1])
    programs = {
        "score": experience.score,
        "advantages": experience.advantages,
        "padded_experience": experience.padded_experience,
        "truncated_rows": experience.truncated_rows,
        "accumulate": steps.accumulate,
        "zero_accumulator": steps.zero_accumulator,
        "apply": steps.apply,
    }
    compiled = lambda: {k: f._cache_size() for k, f in programs.items()}  # noqa: E731

    def iteration(**kw):  # eos -1: every answer G tokens, the same shapes whatever the seed
        e = engine(models, one, -1, **kw)
        e.train_rlhf(e.generate_experience(batch))

    iteration()
    before = compiled()
    iteration(seed=9, max_draws=7, decode_slots=4, kl_coef=0.3)
    assert compiled() == before
    iteration(temperature=0.7)
    assert compiled()["score"] == before["score"] + 1


@pytest.mark.parametrize("algorithm", ["ppo", pytest.param("grpo", marks=pytest.mark.slow)])
def test_old_logprobs_from_the_step_equal_scored_ones(models, prompts, algorithm):
    """old_logprobs step (the actor step's own forward, detached) against scoring (a forward in scoring) on 4 devices,
    packed micro-batches of one row a device accumulated, two iterations, the second batch trained twice (two PPO
    epochs: the second reads the old log-probs the first left in the experience): the same old log-probs, figures
    and weights. PPO takes its advantages in the step from them (the KL in the reward); GRPO's KL is a loss term."""
    batch, eos = prompts
    mesh = make_mesh(1, jax.devices()[:4])
    kw = dict(algorithm=algorithm, max_tokens_per_micro_batch=11, enable_ema=False)
    if algorithm == "grpo":
        kw.update(num_samples_per_prompt=2, kl_loss_coef=0.5)
        batch = {k: v[:4] for k, v in batch.items()}
    runs = {}
    for source in ("scoring", "step"):
        e = engine(models, mesh, eos, old_logprobs=source, **kw)
        assert e.static.scoring.old == (source == "scoring")
        records, olds = [], []
        for epochs in (1, 2):
            exp = e.generate_experience(batch)
            assert ("logprobs" in exp) == (source == "scoring")
            assert len(e.micro_batches(exp)) > 1
            records += [e.train_rlhf(exp) for _ in range(epochs)]
            olds.append(np.asarray(exp["logprobs"]))  # the step's: left in the experience
        held_out = host(e.held_out(batch)[1])  # no step there: scored, as with scoring
        runs[source] = records, olds, host(e.state), held_out
    (rec_s, old_s, state_s, held_s), (rec_t, old_t, state_t, held_t) = runs["scoring"], runs["step"]
    assert held_s.keys() == held_t.keys() and abs(held_s["kl"]) > 1e-3
    for k in held_s:
        np.testing.assert_allclose(held_t[k], held_s[k], rtol=1e-4, atol=2e-5, err_msg=k)
    for a, b in zip(old_s, old_t):
        assert np.abs(a).max() > 0.1
        np.testing.assert_allclose(b, a, atol=2e-5)
    for r_s, r_t in zip(rec_s, rec_t):
        assert r_s.keys() == r_t.keys()
        for k in r_s:
            np.testing.assert_allclose(r_t[k], r_s[k], rtol=1e-4, atol=2e-5, err_msg=k)
    # the first step moved the actor off the reference; the second batch's second epoch moved its ratio off 1
    assert abs(rec_s[1]["kl"]) > 1e-3 and rec_s[2]["ratio_max"] > 1.001
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state_s)[0], jax.tree.leaves(state_t)):
        if "k_proj/bias" not in path_str(path):  # float noise through Adam (see the 8-device test)
            np.testing.assert_allclose(b, a, atol=1e-4, err_msg=path_str(path))


def test_old_logprobs_from_the_step_refuse_a_batch_the_actor_has_moved_past(models, prompts):
    """A batch answered before another batch's actor step cannot take its old log-probs from the step (the weights
    that answered are gone): a clear error, not a silently wrong ratio. The default resolves to scoring wherever
    something reads the old log-probs before the step."""
    from jaxrlhf.config import ConfigError
    from jaxrlhf.rl import PPOConfig

    batch, eos = prompts
    e = engine(models, make_mesh(1, jax.devices()[:1]), eos, old_logprobs="step")
    first, second = e.generate_experience(batch), e.generate_experience(batch)
    e.train_rlhf(first)
    with pytest.raises(RuntimeError, match="stepped 1 time"):
        e.train_rlhf(second)
    assert config().old_logprobs_source == "step"
    assert config(algorithm="grpo", num_samples_per_prompt=2).old_logprobs_source == "step"
    for refused in (
        dict(whiten_advantages=True),
        dict(kl_target=6.0),
        dict(algorithm="rloo", num_samples_per_prompt=2),
        dict(algorithm="grpo", num_samples_per_prompt=2, kl_loss="none"),
    ):
        assert config(**refused).old_logprobs_source == "scoring", refused
        with pytest.raises(ConfigError, match="old_logprobs: step"):
            config(old_logprobs="step", **refused)
    assert PPOConfig(generation_batches=2).old_logprobs_source == "scoring"
    assert PPOConfig(ppo_epochs=2).old_logprobs_source == "step"
