"""Benchmark one Step 3 iteration (BENCHMARKS.md items 3 and 5) against a plain PyTorch + HF implementation.

    PYTHONPATH=. python tools/bench_ppo.py --actor opt-1.3b --critic opt-350m --batch 64 128 256 \\
        [--precision pure_bf16 bf16] [--lora 0 128] [--algorithm ppo grpo] [--samples-per-prompt 4 8] \\
        [--no-torch] [--find-max]

Ours: `HybridEngine` with random weights of the real shapes, random prompts of --prompt tokens, answers
forced to --new tokens (EOS off), one generation batch and one PPO epoch, the generation batch = the
training batch. One warm-up iteration (compilation), then the median of --repeats iterations. Figures:
samples/s, seconds per phase (reshard, generate, score, advantages, actor step, critic step), peak device
memory, effective TFLOP/s per GPU by DeepSpeed-Chat's count (BENCHMARKS.md: 2·N per token for every
forward, 6·N for every forward + backward, over the whole iteration's wall time) and its fraction of the
bf16 matmul rate measured in the run.

Theirs (same run, same GPU): transformers' own models of the same shapes (OPT or Llama) in pure bf16: actor, critic
(OPTModel + a value head), a frozen reference copy and a frozen reward copy; HF `generate` with its static cache
(compiled by transformers); scoring and both updates micro-batched; torch AdamW (fused); the same PPO losses.
`--lengths FILE` (real lengths, BENCHMARKS.md): each row draws a (prompt, answer) token-length pair from FILE
(`{"pairs": [[prompt, answer], ...]}`, e.g. ../shared/assets/data/hh-rlhf/hh_lengths.json; prompts over --prompt
dropped, answers capped at --new), the same draws for both sides; the prompt is left-padded to --prompt and the
answer forced to end at its drawn length (ours: the engine's per-row answer_limits; theirs: a logits processor
that bars EOS before the drawn length and forces it there, HF stopping once every row has ended, then padded
scoring and training as DeepSpeed-Chat does). Reported beside samples/s: real tokens/s (prompt + answer tokens
that are not padding) and ours' micro_batch_real_share (of the positions its packed scoring and training compute,
the share holding a real token). `--slots` sets ours' decode slots (continuous batching; 0: the engine's 256).
`--algorithm ppo grpo` (rloo, reinforce_pp) benchmarks each algorithm, the critic-free ones at every
`--samples-per-prompt` n (PPO: n = 1). --batch counts ANSWERS in every case: a critic-free run at batch B answers
B / n prompts n times each (the engine's num_samples_per_prompt; theirs: HF `generate` with num_return_sequences=n),
so samples/s (answers/s) and real tokens/s compare with PPO's on the same number of answers. With --lengths each
answer draws its own length (the first of a group's n draws sets the prompt's length), the same answer lengths as
PPO at that batch. Critic-free: no critic is made, scored or trained (ours: EngineConfig.algorithm; theirs: the
reward model scores, group-normalised advantages (r - mean) / (std + 1e-6) of the sequence reward score - KL, one
actor step). One result file per algorithm and n: ppo-ACTOR[-lengths], grpo-nN-ACTOR[-lengths], ...
`--find-max` instead tries growing actor sizes at batch 1 and reports the largest whose iteration runs.
`--profile` adds, per run, the device time of one more iteration by kernel, on a line per phase (generate, score,
actor step, ...: common.kernel_totals splits them by the engine's marks).
`--compile-cache DIR` keeps the compiled programs in DIR (jaxrlhf.compile_cache; off by default, so iteration
figures never depend on an earlier run): the first invocation with a new DIR is a cold start, the same command again
a warm one. Every run records time_to_first_iteration_s (the imports, its weights, the engine, compilation and one
iteration: what a user's start pays; the first run of the process is the one to read) beside first_iteration_s, and
first_iteration_compiles: the programs XLA compiled to there, their seconds and the costliest functions (a warm start
compiles none of the cached ones); later_compiles counts the programs the timed iterations still compiled (0: none).
On several GPUs the mesh spans every visible device (pick them with CUDA_VISIBLE_DEVICES for a scaling curve);
the JSON holds samples/s per GPU and the hours DeepSpeed-Chat's 264,292-sample Step 3 benchmark would take.

PyTorch runs first, in a child process that keeps JAX off the GPU, so that neither side's allocator holds
memory the other needs (JAX preallocates 75% of the GPU when it starts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
STARTED = time.perf_counter()  # the process's start, near enough: JAX and the package load after it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrlhf import compile_cache  # noqa: E402
from jaxrlhf.checkpoint import config_to_hf  # noqa: E402
from jaxrlhf.lora import LoRAConfig  # noqa: E402
from jaxrlhf.models import FAMILIES, Backend, init_params, llama, opt, param_shapes, preset  # noqa: E402
from jaxrlhf.optim import OptimConfig  # noqa: E402
from jaxrlhf.plan import capacity, plan  # noqa: E402
from jaxrlhf.rewards import HostScores, RewardConfig  # noqa: E402
from jaxrlhf.rl import EngineConfig, HybridEngine, ModelSide, packing  # noqa: E402
from jaxrlhf.rl import engine as rl_engine  # noqa: E402
from jaxrlhf.sharding import make_mesh, shardings_for  # noqa: E402
from tools import common  # noqa: E402

IMPORT_S = time.perf_counter() - STARTED  # what every start pays before its first weight is made
PRESETS = {name: c for fam in FAMILIES.values() for name, c in fam.PRESETS.items()}  # any family's shape
NO_CRITIC = "none"  # --critic none: no critic and no reward model; the reward is a rule on the host (rule_scores)
PHASES = ("reshard", "generate", "score", "advantages", "actor_step", "critic_step")
CRITIC_FREE = ("grpo", "rloo", "reinforce_pp")


def n_params(name: str, value_head: bool = False) -> int:
    if name == NO_CRITIC:
        return 0
    return sum(x.size for x in jax.tree.leaves(param_shapes(preset(name), value_head=value_head)))


def vocab(*names: str) -> int:
    """Token ids every model of `names` knows (random prompts draw below it)."""
    return min(preset(n).vocab_size for n in names if n != NO_CRITIC)


def effective_flops(actor: str, critic: str, B: int, L: int, ppo_epochs: int = 1, critic_free: bool = False) -> float:
    """DeepSpeed-Chat's count for one iteration (BENCHMARKS.md); critic-free: no critic values, no critic update."""
    na, nc = n_params(actor), n_params(critic, True)
    if critic_free:  # nc = 0 without a reward model (--critic none)
        return B * L * (2 * na * 3 + 2 * nc + ppo_epochs * 6 * na)
    return B * L * (2 * na * 3 + 2 * nc * 2 + ppo_epochs * 6 * (na + nc))


def draw_lengths(file: str | None, B: int, max_prompt: int, max_answer: int, seed: int = 0):
    """[B] prompt and answer lengths drawn from a lengths file (None: every row max_prompt + max_answer)."""
    if file is None:
        return np.full(B, max_prompt), np.full(B, max_answer)
    pairs = np.asarray(json.loads(Path(file).read_text())["pairs"])
    pairs = pairs[pairs[:, 0] <= max_prompt]
    rows = np.random.default_rng(seed).integers(0, len(pairs), B)
    return pairs[rows, 0], np.minimum(pairs[rows, 1], max_answer)


def prompt_batch(B: int, P: int, prompt_lens, answer_lens, vocab: int = 50272, n: int = 1) -> dict:
    """Random left-padded prompts (BOS first) for B answers, n to a prompt: B / n prompts whose lengths are every n-th
    of the B drawn prompt lengths, and every answer's own limit [B] (answers i n .. i n + n - 1 are prompt i's)."""
    if B % n:
        raise ValueError(f"batch {B} is not a whole number of groups of {n} answers")
    rows, prompt_lens = B // n, np.asarray(prompt_lens)[::n]
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, (rows, P), dtype=np.int32)
    mask = (np.arange(P)[None, :] >= P - prompt_lens[:, None]).astype(np.int32)
    ids = np.where(mask == 1, ids, 1)
    ids[np.arange(rows), P - prompt_lens] = 2
    return {"prompt_ids": ids, "prompt_mask": mask, "answer_limits": np.asarray(answer_lens, np.int32)}


def rule_scores(tokens, mask) -> np.ndarray:
    """The host rule that stands for a verifier (--critic none): 1 where an answer's token ids sum to an even number,
    else 0 (random weights answer at random, so groups have spread). tokens, mask [B, G] (host arrays)."""
    return (np.sum(np.asarray(tokens) * np.asarray(mask), axis=1) % 2 == 0).astype(np.float32)


def rule_host_scores(tokens, mask) -> HostScores:
    """rule_scores as the engine waits for reward functions' scores: every answer scored."""
    scores = rule_scores(tokens, mask)
    return HostScores(scores, np.ones_like(scores), scores[:, None])


def real_tokens(batch: dict) -> int:
    """Prompt + answer tokens that are not padding, over every answer (each answer row holds its prompt)."""
    n = len(batch["answer_limits"]) // len(batch["prompt_ids"])
    return int(n * batch["prompt_mask"].sum() + batch["answer_limits"].sum())


@contextlib.contextmanager
def per_answer_limits():
    """The engine repeats each prompt row n times (rl.engine.repeat_rows), answer_limits with it, so the n answers to a
    prompt would share one drawn length; a benchmark batch (prompt_batch) holds every answer's own limit already, and
    inside this block the repeat leaves a limits array of B rows as it is."""
    repeat = rl_engine.repeat_rows

    def rows(batch, n):
        limits = batch.get("answer_limits")
        if limits is None or len(limits) != n * len(batch["prompt_ids"]) or n == 1:
            return repeat(batch, n)
        return {**repeat({k: v for k, v in batch.items() if k != "answer_limits"}, n), "answer_limits": limits}

    rl_engine.repeat_rows = rows
    try:
        yield
    finally:
        rl_engine.repeat_rows = repeat


def ours(args, actor: str, critic: str, B: int, precision: str, lora: int, algorithm: str = "ppo", n: int = 1) -> dict:
    """One Step 3 iteration of the engine on B answers (B / n prompts, n answers each)."""
    entered = time.perf_counter()  # time to the first iteration: IMPORT_S, the weights, the engine, one iteration
    compiled = len(common.COMPILES)
    mesh = make_mesh(args.tp)
    dtype = jnp.float32 if precision in ("bf16", "fp32") else jnp.bfloat16
    compute = "float32" if precision == "fp32" else "bfloat16"
    configs, params = [], []
    for name, head in ((actor, False), (critic, True)):
        if name == NO_CRITIC:  # no critic, no reward model: the actor's config stands in (the engine reads no weights)
            configs.append(configs[0])
            params.append(None)
            continue
        config = preset(name, dtype=compute, dropout=0.0, backend=Backend.detect())
        configs.append(config)
        # made sharded over the mesh (an OPT-66B would not fit one device), then gathered to the host as a checkpoint is
        shardings = shardings_for(param_shapes(config, value_head=head), "fsdp", mesh)
        params.append(
            jax.device_get(
                jax.jit(
                    lambda k, c=config, h=head: init_params(c, k, value_head=h, dtype=dtype), out_shardings=shardings
                )(jax.random.key(len(params)))
            )
        )
    accumulation = max(1, B // args.micro_batch)
    side = lambda lr: ModelSide(
        optim=OptimConfig(learning_rate=lr, warmup_steps=0, gradient_accumulation_steps=accumulation),
        lora=LoRAConfig(dim=lora, only_optimize_lora=bool(lora) and args.only_optimize_lora),
        remat=args.remat,
        dropout=0.0,
    )
    critic_side = ModelSide() if algorithm in CRITIC_FREE else side(5e-6)  # critic-free: the reward model only
    rule = critic == NO_CRITIC  # the long-answer workload: a rule's reward, GRPO's KL as a k3 loss term (as the peer)
    extra = dict(reward=RewardConfig(functions=("tools.bench_ppo:rule_scores",), model_weight=0.0)) if rule else {}
    cfg = EngineConfig(
        **extra,
        **(dict(kl_loss="k3", kl_loss_coef=0.001) if rule else {}),
        actor=side(9.65e-6),
        critic=critic_side,
        precision=precision,
        max_answer_len=args.new,
        algorithm=algorithm,
        num_samples_per_prompt=n,
        inference_tp_size=args.tp,
        enable_ema=False,
        old_logprobs="generation" if args.old_from_generation else args.old_logprobs,
        decode_slots=args.slots,
        refill_size=args.refill,
        max_tokens_per_micro_batch=args.tokens,
        packed_width_multiple=args.width_multiple,
    )
    need = plan(cfg, configs[0], configs[1], mesh, batch=B, prompt_len=args.prompt, capacity=capacity())
    if not need.fits:  # what `python -m jaxrlhf.ppo` refuses before loading anything; no device time spent on it
        return {
            "error": f"does not fit (jaxrlhf.plan): {need.peak / 2**30:.1f} GiB in {need.peak_phase}, "
            f"the device has {need.capacity / 2**30:.1f} GiB",
            "plan_peak_bytes": need.peak,
        }
    started = time.perf_counter()  # time to the first iteration: the engine's start, compilation, one iteration
    engine = HybridEngine(
        cfg, mesh, (configs[0], params[0]), (configs[1], params[1]), total_steps=1000, eos_id=-1, pad_id=1
    )  # EOS never matches: every answer has its full length
    del params
    batch = prompt_batch(B, args.prompt, *draw_lengths(args.lengths, B, args.prompt, args.new), vocab(actor, critic), n)
    pool = ThreadPoolExecutor(1)
    start_rewards = None
    if rule:  # the rule runs on the host while the device scores, as reward functions do (jaxrlhf.ppo)
        start_rewards = lambda _, tokens, mask: pool.submit(rule_host_scores, *jax.device_get((tokens, mask)))
    times, phases = [], []
    with per_answer_limits():
        for i in range(args.repeats + 1):  # the first iteration compiles
            engine.timings.clear()
            start = time.perf_counter()
            exp = engine.generate_experience(batch, start_rewards)
            stats = engine.train_rlhf(exp)
            elapsed = time.perf_counter() - start
            if i:
                times.append(elapsed)
                phases.append(dict(engine.timings))
            else:
                first = time.perf_counter() - started
                to_first = IMPORT_S + time.perf_counter() - entered
                first_compiles = common.compiles_since(compiled)
        t = statistics.median(times)
        profile = {}
        if args.profile:  # the kernels of one more iteration by device time, per phase (HybridEngine marks them)
            trace = Path(args.out or common.RESULTS / "ppo") / f"trace-{algorithm}-n{n}-{actor}-{B}-{precision}"
            profile = {
                "profile": common.kernel_profile(
                    lambda: engine.train_rlhf(engine.generate_experience(batch, start_rewards)), trace, top=25
                )
            }
    real = real_tokens(batch)
    return {
        **profile,
        "algorithm": algorithm,
        "samples_per_prompt": n,
        "prompts": B // n,
        "answers": B,
        "iteration_s": t,
        "first_iteration_s": first,
        # a process's start to its first iteration (a user's start: the imports, weights, engine, compilation)
        "time_to_first_iteration_s": to_first,
        "first_iteration_compiles": first_compiles,  # XLA's compiles to there (none for programs the cache held)
        "later_compiles": common.compiles_since(compiled)["programs"] - first_compiles["programs"],  # new shapes
        "samples_per_s": B / t,
        "samples_per_s_per_gpu": B / t / mesh.size,
        "real_tokens_per_s": real / t,
        "real_tokens": real,
        # of the positions scoring and both training steps compute, the share that holds a real token (packing)
        "micro_batch_real_share": packing.real_share(engine.micro_batches(exp), B),
        "answer_tokens": round(stats.get("answer_len", 0) * B),
        # DeepSpeed-Chat's Step 3 benchmark: 264,292 samples (9 hours for OPT-13B on 8 A100-80G)
        "deepspeed_chat_benchmark_hours": 264292 / (B / t) / 3600,
        "phases_s": {p: statistics.median(x.get(p, 0.0) for x in phases) for p in PHASES},
        "reshard_bytes": engine.reshard_bytes,
        "peak_bytes": common.peak_bytes(),
        "plan_peak_bytes": need.peak,
        "last_stats": stats,
    }


def length_forcer(P: int, limits, eos: int):
    """An HF logits processor: row b's answer ends at its limits[b]-th token (EOS barred before it, forced there)."""

    def force(input_ids, scores):
        t = input_ids.shape[1] - P  # the answer token being chosen
        scores[t < limits - 1, eos] = -float("inf")
        at = t == limits - 1
        scores[at] = -float("inf")
        scores[at, eos] = 0.0
        return scores

    return force


def theirs(args, actor: str, critic: str, B: int, algorithm: str = "ppo", n: int = 1) -> dict:
    """The same iteration in plain PyTorch + transformers, pure bf16: PPO (actor, critic, reference, reward; GAE; an
    actor and a critic step) or GRPO's simplest (n answers to each of B / n prompts by num_return_sequences; reference
    and reward; group-normalised advantages of the sequence reward; one actor step; no critic)."""
    if algorithm not in ("ppo", "grpo"):
        raise ValueError(f"the PyTorch peer runs ppo and grpo, not {algorithm}")
    critic_free = algorithm == "grpo"
    started = time.perf_counter()
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = torch.bfloat16

    def mk(name: str, head: str):  # transformers' own model of a preset's shape: "ForCausalLM" or "Model"
        if name not in opt.PRESETS and name not in llama.PRESETS:  # other families: the config.json save_hf writes
            hf = {k: v for k, v in config_to_hf(preset(name), "bfloat16").items() if k not in ("architectures",)}
            config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf, attn_implementation="sdpa")
            auto = transformers.AutoModelForCausalLM if head == "ForCausalLM" else transformers.AutoModel
            return auto.from_config(config).to(dev, bf16)
        family = "Llama" if name in llama.PRESETS else "OPT"
        config = getattr(transformers, f"{family}Config")(
            **PRESETS[name], attn_implementation="sdpa", **({"dropout": 0.0} if family == "OPT" else {})
        )
        return getattr(transformers, f"{family}{head}")(config).to(dev, bf16)

    rule = critic == NO_CRITIC  # TRL's GRPO: a rule's reward, the KL as a k3 loss term, old log-probs = the actor's own
    actor_m = mk(actor, "ForCausalLM")
    ref_m = mk(actor, "ForCausalLM").eval().requires_grad_(False)
    if not rule:
        reward_m = mk(critic, "Model").eval().requires_grad_(False)
        proj = PRESETS[critic].get("word_embed_proj_dim", PRESETS[critic]["hidden_size"])
        r_head = torch.nn.Linear(proj, 1, bias=False).to(dev, bf16).requires_grad_(False)
    opt_a = torch.optim.AdamW(actor_m.parameters(), lr=9.65e-6, betas=(0.9, 0.95), fused=dev == "cuda")
    if not critic_free:
        critic_m, v_head = mk(critic, "Model"), torch.nn.Linear(proj, 1, bias=False).to(dev, bf16)
        critic_params = [*critic_m.parameters(), *v_head.parameters()]
        opt_c = torch.optim.AdamW(critic_params, lr=5e-6, betas=(0.9, 0.95), fused=dev == "cuda")
    mb = args.torch_micro_batch
    P, G = args.prompt, args.new
    batch = prompt_batch(B, P, *draw_lengths(args.lengths, B, P, G), vocab(actor, critic), n)
    prompts, prompt_mask = (torch.tensor(batch[k], device=dev, dtype=torch.long) for k in ("prompt_ids", "prompt_mask"))
    limits = torch.tensor(batch["answer_limits"], device=dev)  # [B]: every answer's own length
    EOS = 2
    force_lengths = length_forcer(P, limits, EOS)

    def logprobs(model, seq, mask):
        logits = model(seq, attention_mask=mask).logits[:, P - 1 : -1].float()
        return logits.gather(-1, seq[:, P:, None])[..., 0] - torch.logsumexp(logits, -1)

    def vals(model, head, seq, mask):
        return head(model(seq, attention_mask=mask).last_hidden_state[:, P - 1 : -1]).float()[..., 0]

    def iteration():
        with torch.no_grad():
            actor_m.eval()
            lengths = dict(min_new_tokens=G) if args.lengths is None else dict(logits_processor=[force_lengths])
            # num_return_sequences repeats each prompt n times side by side (rows i n .. i n + n - 1: prompt i's)
            seq = actor_m.generate(
                prompts,
                attention_mask=prompt_mask,
                max_new_tokens=G,
                do_sample=True,
                top_k=0,
                eos_token_id=EOS,
                pad_token_id=1,
                cache_implementation="static",
                num_return_sequences=n,
                **lengths,
            )
            Gb = seq.shape[1] - P  # HF stops once every row has ended: the batch's longest answer
            answer = (
                (torch.arange(Gb, device=dev)[None, :] < limits[:, None]).long()
                if args.lengths
                else torch.ones(B, Gb, device=dev, dtype=torch.long)
            )
            mask = torch.cat([prompt_mask.repeat_interleave(n, 0), answer], 1)
            last = P + answer.sum(1) - 1
            old, ref, v, score = [], [], [], []
            for i in range(0, B, mb):
                s, m = seq[i : i + mb], mask[i : i + mb]
                ref.append(logprobs(ref_m, s, m))
                if rule:  # the rule scores on the host; old log-probs come from the training pass itself
                    continue
                old.append(logprobs(actor_m, s, m))
                if not critic_free:
                    v.append(vals(critic_m, v_head, s, m))
                h = reward_m(s, attention_mask=m).last_hidden_state
                score.append(r_head(h[torch.arange(len(s), device=dev), last[i : i + mb]]).float()[:, 0])
            am = answer.float()
            ref = torch.cat(ref) * am
            if rule:
                host = rule_scores(seq[:, P:].cpu().numpy(), answer.cpu().numpy())
                score, old = torch.tensor(host, device=dev), torch.zeros_like(ref)
            else:
                old, score = torch.cat(old) * am, torch.cat(score)
            rewards = -0.1 * (old - ref) * (not rule)
            rewards[torch.arange(B, device=dev), answer.sum(1) - 1] += score.clamp(-5, 5)
            if critic_free:  # GRPO: each answer's sequence reward against its group's mean, over the group's std
                r = rewards.sum(1).view(-1, n)
                adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1, 1) * am
            else:  # PPO: GAE on the critic's values
                v = torch.cat(v) * am
                adv, running = torch.zeros_like(rewards), torch.zeros(B, device=dev)
                for t in reversed(range(Gb)):
                    nxt = v[:, t + 1] if t + 1 < Gb else torch.zeros(B, device=dev)
                    running = (rewards[:, t] + nxt - v[:, t] + 0.95 * running) * am[:, t]
                    adv[:, t] = running
                returns = adv + v
            tokens = am.sum()
        actor_m.train()
        for i in range(0, B, mb):
            s, m, w = seq[i : i + mb], mask[i : i + mb], am[i : i + mb]
            lp = logprobs(actor_m, s, m)
            ratio = torch.exp(lp - (lp.detach() if rule else old[i : i + mb]))
            a = adv[i : i + mb]
            per_token = torch.max(-a * ratio, -a * ratio.clamp(0.8, 1.2))
            if rule:  # GRPO's k3 KL to the reference, weight 0.001 (veRL's default; ours passes the same)
                d = ref[i : i + mb] - lp
                per_token = per_token + 0.001 * (torch.exp(d) - d - 1)
            loss = (per_token * w).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(actor_m.parameters(), 1.0)
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        if critic_free:
            return
        for i in range(0, B, mb):
            s, m, w = seq[i : i + mb], mask[i : i + mb], am[i : i + mb]
            nv, ov, r = vals(critic_m, v_head, s, m), v[i : i + mb], returns[i : i + mb]
            vc = ov + (nv - ov).clamp(-0.2, 0.2)
            loss = 0.5 * (torch.max((nv - r) ** 2, (vc - r) ** 2) * w).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(critic_params, 1.0)
        opt_c.step()
        opt_c.zero_grad(set_to_none=True)

    sync = (lambda _: torch.cuda.synchronize()) if dev == "cuda" else (lambda _: None)
    iteration()
    sync(None)
    first = time.perf_counter() - started  # the models made, the first iteration (HF compiles the static-cache forward)
    t = common.timeit(iteration, args.repeats, warmup=0, block=sync)
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
    real = real_tokens(batch)
    return {
        "algorithm": algorithm,
        "samples_per_prompt": n,
        "prompts": B // n,
        "answers": B,
        "iteration_s": t["median_s"],
        "first_iteration_s": first,
        "samples_per_s": B / t["median_s"],
        "spread_s": [t["min_s"], t["max_s"]],
        "real_tokens_per_s": real / t["median_s"],
        "real_tokens": real,
        "peak_bytes": peak,
        "micro_batch": mb,
    }


def find_max(args) -> dict:
    """The largest actor (critic opt-350m) whose iteration runs at batch 1, full fine-tuning and with LoRA."""
    sizes = ["opt-1.3b", "opt-6.7b", "opt-13b", "opt-30b", "opt-66b"]
    found = {}
    for lora in (0, 128):
        found[f"lora{lora}"] = None
        for actor in sizes:
            try:
                ours(argparse.Namespace(**{**vars(args), "repeats": 1}), actor, "opt-350m", 1, "bf16", lora)
                found[f"lora{lora}"] = actor
                print(f"find-max lora={lora}: {actor} runs", flush=True)
            except Exception as e:  # noqa: BLE001 - out of memory: the previous size is the answer
                print(f"find-max lora={lora}: {actor} fails: {str(e).splitlines()[0][:200]}", flush=True)
                break
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actor", default="opt-1.3b", choices=sorted(PRESETS))
    ap.add_argument(
        "--critic",
        default="opt-350m",
        choices=[*sorted(PRESETS), NO_CRITIC],
        help="critic and reward model; none: neither (critic-free algorithms), the reward a rule on the host "
        "(rule_scores), GRPO's KL a k3 loss term of weight 0.001 on both sides (the long-answer workload)",
    )
    ap.add_argument(
        "--batch", type=int, nargs="+", default=[64, 128, 256], help="answers per iteration (all algorithms)"
    )
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--precision", nargs="+", default=["pure_bf16", "bf16"], choices=["pure_bf16", "bf16", "fp32"])
    ap.add_argument("--lora", type=int, nargs="+", default=[0], help="actor and critic LoRA dims to compare (0: off)")
    ap.add_argument(
        "--algorithm",
        nargs="+",
        default=["ppo"],
        choices=["ppo", *CRITIC_FREE],
        help="Step 3 algorithms to compare (the PyTorch peer runs ppo and grpo)",
    )
    ap.add_argument(
        "--samples-per-prompt",
        type=int,
        nargs="+",
        default=[4, 8],
        metavar="N",
        help="critic-free algorithms: answers per prompt n (each a run; --batch counts answers, B / n prompts)",
    )
    ap.add_argument(
        "--only-optimize-lora",
        action="store_true",
        help="with --lora: train the adapters only (the base "
        "weights frozen, no Adam state for them: how OPT-66B fits a node)",
    )
    ap.add_argument("--remat", action="store_true", help="recompute layers in the backward passes")
    ap.add_argument("--tp", type=int, default=1, help="inference_tp_size (the mesh spans every device)")
    ap.add_argument(
        "--lengths",
        default=None,
        help="real lengths: a JSON file of [prompt, answer] token-length pairs "
        "(e.g. ../shared/assets/data/hh-rlhf/hh_lengths.json); default: every row --prompt + --new",
    )
    ap.add_argument(
        "--slots",
        type=int,
        default=0,
        help="ours: decode slots (0: the engine's default, 256, or one per prompt in a smaller batch; the batch: one "
        "per prompt; fewer: continuous batching, and answers that all run to --new decode in waves)",
    )
    ap.add_argument(
        "--refill", type=int, default=0, help="ours: prompts prefilled at a time into freed slots (0: slots / 8)"
    )
    ap.add_argument(
        "--tokens",
        type=int,
        default=16384,
        help="ours: max_tokens_per_micro_batch (tokens per device in a packed micro-batch of scoring and training; "
        "at least --prompt + --new)",
    )
    ap.add_argument("--width-multiple", type=int, default=64, help="ours: packed_width_multiple")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-ours", action="store_true", help="the PyTorch peer only (its runs in the result files alone)")
    ap.add_argument("--torch-micro-batch", type=int, default=16)
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=64,
        help="ours: sets gradient_accumulation_steps = batch / this, which cuts only a mixture batch (none here): "
        "the experience is cut by --tokens",
    )
    ap.add_argument(
        "--old-logprobs",
        choices=["auto", "scoring", "step", "generation"],
        default="auto",
        help="ours: EngineConfig.old_logprobs, where the old log-probs come from (auto: the default a user gets, the "
        "actor step's own forward where that is exact)",
    )
    ap.add_argument("--old-from-generation", action="store_true", help="--old-logprobs generation (older trees' flag)")
    ap.add_argument("--only-torch", action="store_true", help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--find-max", action="store_true")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also profile one iteration: device time per kernel and phase (the trace stays in OUT/trace-ppo-*)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="keep compiled programs in DIR (jaxrlhf.compile_cache; default off): the first run with a new DIR is "
        "cold, the next one warm (time_to_first_iteration_s)",
    )
    args = ap.parse_args()
    cache = compile_cache.enable({"JAXRLHF_COMPILE_CACHE": args.compile_cache or "off"})  # before any compile
    programs = len(list(cache.glob("*-cache"))) if cache and cache.is_dir() else 0  # 0: a cold start
    if args.only_torch:
        print(
            json.dumps(
                {
                    torch_key(a, n, B): common.safely(theirs, args, args.actor, args.critic, B, a, n)
                    for a, n in algorithms(args)
                    for B in args.batch
                }
            )
        )
        return
    argv = [
        __file__,
        "--only-torch",
        "--actor",
        args.actor,
        "--critic",
        args.critic,
        "--batch",
        *map(str, args.batch),
        "--prompt",
        str(args.prompt),
        "--new",
        str(args.new),
        "--repeats",
        str(args.repeats),
        "--torch-micro-batch",
        str(args.torch_micro_batch),
        *(["--lengths", args.lengths] if args.lengths else []),
        "--algorithm",
        *args.algorithm,
        "--samples-per-prompt",
        *map(str, args.samples_per_prompt),
    ]
    keys = [torch_key(a, n, B) for a, n in algorithms(args) for B in args.batch]
    torch_runs = {} if args.no_torch or args.find_max else common.torch_child(argv, keys)
    if args.find_max:
        result = {"benchmark": "ppo_step", **common.environment(), "args": vars(args), "largest_actor": find_max(args)}
        common.write("ppo", "ppo-find-max", result, args.out)
        return
    from tools.bench_forward import matmul_ceiling

    ceiling = matmul_ceiling() if jax.default_backend() == "gpu" else None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # one result file per algorithm and n (bench_summary compares the ours_* and torch_* runs of one file)
    results = {
        (a, n): {
            "benchmark": "ppo_step",
            **common.environment(),
            "args": vars(args),
            "algorithm": a,
            "samples_per_prompt": n,
            "matmul_ceiling_flops": ceiling,
            "compile_cache": {"dir": str(cache) if cache else None, "programs_before": programs},
            "runs": [],
        }
        for a, n in algorithms(args)
    }
    for B in args.batch:
        draws = draw_lengths(args.lengths, B, args.prompt, args.new)  # the same answer lengths for every algorithm
        for (algorithm, n), result in results.items():
            if B % n:
                print(f"B={B:4d} {algorithm} n={n}: skipped, {B} answers do not split into groups of {n}", flush=True)
                continue
            L = real_tokens(prompt_batch(B, args.prompt, *draws, n=n)) / B  # real tokens per answer
            flops = effective_flops(args.actor, args.critic, B, L, critic_free=algorithm in CRITIC_FREE)
            runs = (
                {}
                if args.no_ours
                else {f"ours_{p}" + (f"_lora{r}" if r else ""): (p, r) for p in args.precision for r in args.lora}
            )
            row = {
                "batch": B,
                "algorithm": algorithm,
                "samples_per_prompt": n,
                "prompts": B // n,
                "effective_flops": flops,
            }
            for key, (precision, lora) in runs.items():
                row[key] = common.safely(ours, args, args.actor, args.critic, B, precision, lora, algorithm, n)
            if torch_key(algorithm, n, B) in torch_runs:
                row["torch_hf_pure_bf16"] = torch_runs[torch_key(algorithm, n, B)]
            for key, r in row.items():
                label = f"{algorithm}{f' n={n}' if n > 1 else ''} {key}"
                if isinstance(r, dict) and "iteration_s" in r:
                    r["tflops_per_gpu"] = flops / r["iteration_s"] / jax.device_count() / 1e12
                    if ceiling:
                        r["matmul_fraction"] = flops / r["iteration_s"] / jax.device_count() / ceiling
                    phases = " ".join(f"{p} {s:.2f}" for p, s in r.get("phases_s", {}).items())
                    print(
                        f"B={B:4d} {label:32s} {r['iteration_s']:7.2f} s  {r['samples_per_s']:6.1f} samples/s  "
                        f"{r['real_tokens_per_s']:8.0f} real tok/s  {r['tflops_per_gpu']:6.1f} TFLOP/s  {phases}",
                        flush=True,
                    )
                elif isinstance(r, dict):
                    print(f"B={B:4d} {label:32s} {r['error']}", flush=True)
            result["runs"].append(row)
            common.write("ppo", result_name(args, algorithm, n), result, args.out, stamp)


def algorithms(args) -> list[tuple[str, int]]:
    """(algorithm, answers per prompt) of every run: PPO once with n = 1, the critic-free ones at each n."""
    return [(a, n) for a in args.algorithm for n in ([1] if a == "ppo" else args.samples_per_prompt)]


def torch_key(algorithm: str, n: int, B: int) -> str:
    return f"{algorithm}-n{n}-{B}"


def result_name(args, algorithm: str, n: int) -> str:
    """ppo-ACTOR[-lengths], or ALGORITHM-nN-ACTOR[-lengths] for the critic-free ones."""
    return f"{algorithm}{f'-n{n}' if algorithm != 'ppo' else ''}-{args.actor}" + ("-lengths" if args.lengths else "")


if __name__ == "__main__":
    main()
