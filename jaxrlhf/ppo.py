"""Step 3, `python -m jaxrlhf.ppo`: PPO, GRPO, RLOO or REINFORCE++ on the Step 1 actor against the Step 2 reward
model (hybrid engine).

    python -m jaxrlhf.ppo actor.model=runs/sft/model critic.model=runs/reward/model output_dir=runs/ppo [key=value ...]
    python -m jaxrlhf.ppo algorithm=grpo num_samples_per_prompt=4 actor.model=... critic.model=... [key=value ...]

Each iteration: `generation_batches` batches of prompts are answered and scored (engine.generate_experience),
then `ppo_epochs` passes of one actor and one critic step per batch (engine.train_rlhf), with the mixture
LM loss when data.unsupervised_data_path is set. The critic-free algorithms (grpo, rloo, reinforce_pp) answer each
prompt num_samples_per_prompt times and train no critic (critic.model is the reward model only; no critic/ folder).
Writes output_dir/actor, critic and (enable_ema) actor_ema
as Hugging Face folders, output_dir/state (Orbax: the same command started again continues exactly, or skips a
finished run), run_config.json, metrics.jsonl and TensorBoard events (tb/): per iteration the reward, KL to the
reference, answer length, losses, the steps skipped by the non-finite guard, the seconds of each phase, bytes
resharded, peak device memory, samples/s and effective TFLOP/s. On the built-in task (data_path: [synthetic]) the
gold reward of the answers is logged too.

The reward can also be Python functions of the prompts, decoded answers and the data's metadata, alone or weighted
with the reward model's score (jaxrlhf.rewards); they run on the host while the device scores. Without the reward
model (reward.model_weight 0) a critic-free algorithm needs no critic.model:

    python -m jaxrlhf.ppo algorithm=grpo num_samples_per_prompt=4 actor.model=... data.data_path=[gsm8k/train.jsonl] \
        reward.functions=[jaxrlhf.rewards:gsm8k]
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from jaxrlhf import loop
from jaxrlhf import plan as memory_plan
from jaxrlhf.alarms import AlarmTracker, experience_figures, training_records
from jaxrlhf.checkpoint import save_hf
from jaxrlhf.config import ConfigError, run_cli
from jaxrlhf.data import Batches, prepare
from jaxrlhf.data.batches import make_batch, num_rows
from jaxrlhf.data.pipeline import check_positions, check_rows
from jaxrlhf.data.synthetic import gold_reward
from jaxrlhf.distributed import to_host
from jaxrlhf.loop import settings, start_run
from jaxrlhf.metrics import MetricsLog
from jaxrlhf.optim import check_microbatches, precision_warning
from jaxrlhf.rewards import HostRewards, figure_names
from jaxrlhf.rl import HybridEngine, ModelSide, PPOConfig
from jaxrlhf.rl.experience import base_params
from jaxrlhf.sharding import make_mesh
from jaxrlhf.tokenizer import decode_rows, stop_ids
from jaxrlhf.trainer import RunConfig, load_model

INPUTS = ("actor.model", "critic.model")  # the model folders a run starts from (loop.settings)
PHASES = ("reshard", "generate", "score", "rewards", "advantages", "actor_step", "critic_step", "offload")


def check(cfg: PPOConfig, mesh):
    """Refuse what cannot run on `mesh`, before anything is loaded or compiled."""
    for name in ("actor", "critic") if needs_critic_model(cfg) else ("actor",):
        if not getattr(cfg, name).model:
            raise ConfigError(
                f"{name}.model: required, a Hugging Face folder (the Step {1 if name == 'actor' else 2} model)"
            )
    if cfg.critic_free:  # settings that would change nothing are refused rather than ignored
        for key, on in (("critic.lora.dim", cfg.critic.lora.dim), ("critic.offload", cfg.critic.offload)):
            if on:
                raise ConfigError(
                    f"{key}: algorithm {cfg.algorithm} trains no critic (critic.model is its reward model "
                    "only); leave the critic's training settings unset"
                )
    n, unsup = cfg.num_samples_per_prompt, cfg.unsup_batch_size or cfg.batch_size
    answers = f"batch_size {cfg.batch_size} x num_samples_per_prompt {n} = {cfg.batch_size * n} answers"
    for what, rows in (
        (answers if n > 1 else f"batch_size {cfg.batch_size}", cfg.batch_size * n),
        (f"unsup_batch_size {unsup}", unsup),
    ):
        if rows % mesh.size:
            raise ConfigError(f"{what} does not split over the {mesh.size} devices; use a multiple of {mesh.size}")
    try:  # the actor's gradient_accumulation_steps cuts the mixture batch (the experience is cut by tokens)
        check_microbatches(
            unsup, cfg.actor.optim.gradient_accumulation_steps, mesh.size, "actor.optim.gradient_accumulation_steps"
        )
    except ValueError as e:
        raise ConfigError(f"{e} (with unsup_batch_size {unsup})") from None
    local = jax.local_device_count()
    if jax.process_count() > 1 and local % cfg.inference_tp_size:  # each process loads its own prompts
        raise ConfigError(
            f"inference_tp_size {cfg.inference_tp_size} would span processes ({local} devices each): "
            f"a generation group must sit in one process; use a divisor of {local}"
        )


def side_run(cfg: PPOConfig, side: ModelSide) -> RunConfig:
    """The Step 1/2 run settings that load one side's model (trainer.load_model)."""
    return RunConfig(
        model=side.model,
        tokenizer=cfg.tokenizer or cfg.actor.model,
        precision=cfg.precision,
        remat=side.remat,
        dropout=side.dropout,
        seed=cfg.seed,
    )


def gold_rewards(tokenizer, exp) -> list[float]:
    """The built-in task's gold reward of each answer in an experience batch (host arrays, `host_experiences`)."""
    G = exp["mask"].shape[1]
    seq, seq_mask = np.asarray(exp["seq"]), np.asarray(exp["seq_mask"])
    prompts = decode_rows(tokenizer, seq[:, :-G], seq_mask[:, :-G], skip_first=True)
    answers = decode_rows(tokenizer, seq[:, -G:], seq_mask[:, -G:])
    return [gold_reward(p, a) for p, a in zip(prompts, answers)]


def needs_critic_model(cfg: PPOConfig) -> bool:
    """critic.model is loaded for the critic (ppo) or the reward model (a reward.model_weight above 0)."""
    return not cfg.critic_free or bool(cfg.reward.model_scale)


def reward_starter(rewards: HostRewards, tokenizer, chat_template: str = "auto", model_dir=None):
    """engine.generate_experience's start_rewards: a batch's answers decoded as soon as they exist, then the reward
    functions started on the host with this process's prompts and their metadata (prompt_batch["metadata"]), each
    answer's token ids (its stop token included where it ended: EOS, the chat template's end-of-turn or another of
    the model's, see tokenizer.stop_ids) and whether it was truncated (no stop token: it hit its length limit,
    max_answer_len or its row's answer_limits)."""
    stops = stop_ids(tokenizer, chat_template, model_dir)

    def start(prompt_batch, tokens, mask):
        rows = len(prompt_batch["prompt_ids"])  # this process's: the global batch holds each process's rows in turn
        local = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
        tokens, mask = (np.asarray(to_host(x))[local] for x in (tokens, mask))
        prompts = decode_rows(tokenizer, prompt_batch["prompt_ids"], prompt_batch["prompt_mask"], skip_first=True)
        token_ids = [row[m != 0].tolist() for row, m in zip(tokens, mask)]
        truncated = [not set(stops).intersection(ids) for ids in token_ids]
        answers = decode_rows(tokenizer, tokens, mask, stops=stops)
        return rewards.start(prompts, answers, prompt_batch["metadata"], token_ids=token_ids, truncated=truncated)

    return start


def host_experiences(experiences: list[dict]) -> list[dict]:
    """The token arrays and old log-probs of experience batches, whole on every process (each process holds only
    its rows of a batch): what gold rewards, alarms and printed answers read."""
    return to_host([{k: e[k] for k in ("seq", "seq_mask", "mask", "logprobs")} for e in experiences])


def effective_tflops(engine: HybridEngine, samples: int, seq_len: int, seconds: float, ppo_epochs: int) -> float:
    """DeepSpeed-Chat's effective TFLOP/s per device (docs/benchmarks.md): 2 N L per forward, 6 N L per training
    pass; generation, old log-probs and reference forwards of the actor, critic and reward forwards, and the
    two updates per PPO epoch."""
    n_actor = sum(x.size for x in jax.tree.leaves(base_params(engine.state["actor"])))
    n_reward = sum(x.size for x in jax.tree.leaves(engine.reward_params()))  # 0 without a reward model
    critic = engine.state.get("critic")  # none: a critic-free algorithm
    n_critic = sum(x.size for x in jax.tree.leaves(base_params(critic))) if critic else 0
    flops = seq_len * samples * (6 * n_actor + 2 * n_reward + 2 * n_critic + ppo_epochs * 6 * (n_actor + n_critic))
    return flops / max(seconds, 1e-9) / engine.mesh.size / 1e12


def peak_memory() -> int | None:
    stats = [d.memory_stats() for d in jax.local_devices()]
    peaks = [s.get("peak_bytes_in_use") for s in stats if s]
    return max(peaks) if peaks and None not in peaks else None


def export(engine: HybridEngine, cfg: PPOConfig, tokenizer) -> dict[str, Path]:
    """output_dir/actor, critic, actor_ema as HF folders (LoRA fused), as DeepSpeed-Chat lays them out; each one's
    manifest carries the run's settings (what tells a finished run when it is started again)."""
    trees = {"actor": (engine.actor_config, engine.actor_params())}
    if "critic" in engine.state:
        trees["critic"] = (engine.critic_config, engine.critic_params())
    if "ema" in engine.state:
        trees["actor_ema"] = (engine.actor_config, engine.ema_params())  # float32 while training
    folders = {name: Path(cfg.output_dir) / name for name in trees}
    for name, (config, params) in trees.items():
        host = to_host(params)  # every process takes part; process 0 writes
        if jax.process_index() == 0:
            save_hf(folders[name], config, host, tokenizer, manifest={"settings": settings(cfg, INPUTS)})
    return folders


def load_models(cfg: PPOConfig, mesh, log) -> tuple[tuple, tuple, object]:
    """The actor's and the critic's (model config, host params) and the tokenizer, once the memory plan says they fit
    (critic (None, None) where no critic.model is needed); the actor's positions checked against the lengths."""
    for who, side in (("actor ", cfg.actor), *(() if cfg.critic_free else (("critic ", cfg.critic),))):
        if warning := precision_warning(cfg.precision, side.optim, side.lora, who):
            log(warning)
    log(memory_plan.check(cfg, mesh).table())  # refuses a config that cannot fit, before loading or compiling
    # The critic first: a folder without a trained value head is refused before the actor loads.
    critic_config, critic_params, _ = (
        load_model(side_run(cfg, cfg.critic), value_head=True) if needs_critic_model(cfg) else (None, None, None)
    )
    actor_config, actor_params, tokenizer = load_model(side_run(cfg, cfg.actor), value_head=False)
    check_positions(
        actor_config.max_position_embeddings,
        cfg.data.max_prompt_len + cfg.max_answer_len,
        f"data.max_prompt_len ({cfg.data.max_prompt_len}) + max_answer_len ({cfg.max_answer_len})",
        "lower either",
        "actor",
    )
    return (actor_config, actor_params), (critic_config, critic_params), tokenizer


def load_data(cfg: PPOConfig, tokenizer, positions: int, log) -> tuple[Batches, Batches | None, dict]:
    """This process's prompt batches, with data.unsupervised_data_path and unsup_coef > 0 the mixture's LM batches
    (their rows checked against the actor's `positions`), and the held-out prompts (the eval split's arrays)."""
    pad = tokenizer.pad_token_id
    proc = dict(process_index=jax.process_index(), process_count=jax.process_count())
    data = prepare(cfg.data, 3, tokenizer, log=log)
    stats = data["stats"]["train"]
    if stats["prompts"] < cfg.batch_size and stats["dropped_too_long"]:  # not "use more data": the length cut them
        raise ConfigError(
            f"data.max_prompt_len ({cfg.data.max_prompt_len}): {stats['dropped_too_long']} of the step 3 set's "
            f"{stats['prompts'] + stats['dropped_too_long']} prompts are longer and were dropped, leaving "
            f"{stats['prompts']}, fewer than one batch of {cfg.batch_size}; raise data.max_prompt_len (the longest "
            f"prompt has {stats.get('longest_prompt', '?')} tokens in its chat format) or lower batch_size"
        )
    prompts = Batches(data["train"], 3, cfg.batch_size, cfg.data, pad, **proc)
    if not (cfg.data.unsupervised_data_path and cfg.unsup_coef > 0):
        return prompts, None, data["eval"]
    blocks = prepare(cfg.data, "unsupervised", tokenizer, log=log)
    check_rows(blocks, "unsupervised", cfg.data, positions, "actor")
    rows = cfg.unsup_batch_size or cfg.batch_size
    return prompts, Batches(blocks["train"], "unsupervised", rows, cfg.data, pad, **proc), data["eval"]


#: the held-out batches' figures logged (the training batch's of the same name; not its advantages and returns)
HELD_OUT_FIGURES = ("reward", "kl", "answer_len", "truncated", "zero_spread")


def held_out_evaluation(cfg: PPOConfig, engine: HybridEngine, held_out: dict, pad_id: int, starter, log):
    """loop.fit's evaluate(state): the held-out prompts in order, in batches of batch_size (the last partial one
    dropped; eval_batches of them if set), answered and scored by engine.held_out (the training batch's shapes, so
    nothing compiles again; the state untouched): the mean of the batches' figures (reward, kl, answer_len,
    truncated, ...) and each reward function's mean score (reward/NAME). None (and a line once) without a batch."""
    B, local = cfg.batch_size, cfg.batch_size // jax.process_count()
    n = num_rows(held_out) // B
    n = min(n, cfg.eval_batches) if cfg.eval_batches else n
    if not n:
        log(f"eval: fewer held-out prompts ({num_rows(held_out)}) than one batch of {B}: no evaluation")
        return lambda state: None

    def evaluate(state):
        if state is not engine.state:  # a finished run's restored state
            engine.load_state(state)
        stats, parts = [], []
        for i in range(n):
            first = i * B + jax.process_index() * local  # this process's rows of the batch
            batch = make_batch(held_out, range(first, first + local), 3, cfg.data, pad_id)
            exp, figures = engine.held_out(batch, starter)
            stats.append(to_host(figures))
            if cfg.reward.functions:
                parts.append(to_host(exp["function_parts"]))
        out = {k: float(np.mean([s[k] for s in stats])) for k in HELD_OUT_FIGURES if k in stats[0]}
        if parts:
            out.update(function_means(cfg.reward.functions, np.concatenate(parts)))
        return {"prompts": n * B, **out}

    return evaluate


def function_means(functions, parts) -> dict[str, float]:
    """Each reward function's mean score over the answers it scored, by its metric name (rewards.figure_names);
    parts [B, F] (NaN: no score)."""
    return {
        name: float(np.nanmean(col)) for name, col in zip(figure_names(functions), parts.T) if not np.isnan(col).all()
    }


def run(cfg: PPOConfig, log=print, mesh=None) -> dict:
    """Step 3 from the Step 1 and 2 folders to the exported actor/critic; returns the engine, the logged
    records and the HF folders. The engine owns Step 3's state: the loop checkpoints `engine.state`, and a restored
    one enters through engine.load_state."""
    mesh = mesh or make_mesh(cfg.inference_tp_size)
    log(
        f"mesh {dict(mesh.shape)}: {mesh.size} devices, {jax.process_count()} process(es), this is process "
        f"{jax.process_index()}"
    )
    if jax.process_index() != 0:  # the others run silently (errors still reach their stderr)
        log = lambda _: None  # noqa: E731
    check(cfg, mesh)
    out = Path(cfg.output_dir)
    manager = loop.checkpoint_manager(out, cfg.keep_checkpoints)
    names = ("actor", *(() if cfg.critic_free else ("critic",)), *(("actor_ema",) if cfg.enable_ema else ()))
    folders = {name: out / name for name in names}  # what export writes
    if start_run(cfg, list(folders.values()), manager.latest_step(), INPUTS, log=log):
        manager.close()
        return {"engine": None, "records": [], "folders": folders, "tokenizer": None, "skipped": True}
    actor, critic, tokenizer = load_models(cfg, mesh, log)
    prompts, unsup, held_out = load_data(cfg, tokenizer, actor[0].max_position_embeddings, log)
    iterations = cfg.max_steps or cfg.epochs * (len(prompts) // cfg.generation_batches)
    if iterations <= 0:
        raise ConfigError(
            f"nothing to train: {len(prompts)} prompt batches for generation_batches {cfg.generation_batches}"
        )
    engine = HybridEngine(
        cfg,
        mesh,
        actor,
        critic,
        total_steps=iterations * cfg.generation_batches * cfg.ppo_epochs,
        eos_id=stop_ids(tokenizer, cfg.data.chat_template, cfg.actor.model),  # end-of-turn, EOS, the model's own
        pad_id=tokenizer.pad_token_id,
    )
    del actor, critic  # the host copies: the engine holds the weights now
    starter = None
    if cfg.reward.functions:
        starter = reward_starter(HostRewards(cfg.reward, log), tokenizer, cfg.data.chat_template, cfg.actor.model)
    evaluate = None
    if cfg.eval_every:
        evaluate = held_out_evaluation(cfg, engine, held_out, tokenizer.pad_token_id, starter, log)
    state, records = loop.fit(
        cfg,
        engine.state,
        ppo_iteration(cfg, engine, tokenizer, prompts, unsup, iterations, starter, log),
        lambda window: window[-1],
        {"prompts": prompts, **({"unsup": unsup} if unsup else {})},
        total=iterations,
        manager=manager,
        metrics_log=MetricsLog(out, cfg.report_to, settings(cfg, INPUTS)),
        shardings=engine.shardings(),
        counter=("iteration", cfg.generation_batches),
        evaluate=evaluate,
        eval_every=cfg.eval_every,
        desc=cfg.algorithm,
        log=log,
        shown=("reward", "gold_reward", "kl", "answer_len", "samples_per_s"),
    )
    if state is not engine.state:  # a finished run's state restored and no iteration run: what export writes
        engine.load_state(state)
    folders = export(engine, cfg, tokenizer)
    log(f"Step 3 done: Hugging Face models in {', '.join(str(f) for f in folders.values())}")
    return {"engine": engine, "records": records, "folders": folders, "tokenizer": tokenizer}


def sampled_batch(cfg: PPOConfig, engine: HybridEngine, prompt_iter, starter) -> tuple[dict, dict]:
    """One generation batch (engine.generate_experience on the next prompts) and its figures. With dynamic_sampling
    (DAPO), the groups whose rewards are all equal are dropped and more prompts drawn until batch_size groups are
    kept, at most max_draws batches; at the cap the batch is filled with dropped groups, left out of the loss (its
    shape stays, so nothing compiles again). Figures: dropped_groups (the share of the drawn groups dropped),
    draws (batches drawn)."""
    exps = [engine.generate_experience(next(prompt_iter), starter)]
    if not cfg.dynamic_sampling:
        return exps[0], {}
    n, groups, kept, dropped = cfg.num_samples_per_prompt, cfg.batch_size, [], []
    while True:
        spread, base = engine.group_spread(exps[-1]), (len(exps) - 1) * groups
        kept += [base + int(g) for g in np.flatnonzero(spread)]
        dropped += [base + int(g) for g in np.flatnonzero(~spread)]
        if len(kept) >= groups or len(exps) == cfg.max_draws:
            break
        exps.append(engine.generate_experience(next(prompt_iter), starter, draw=len(exps)))
    figures = {"dropped_groups": len(dropped) / (len(exps) * groups), "draws": float(len(exps))}
    if len(exps) == 1 and not dropped:
        return exps[0], figures
    chosen = (kept + dropped)[:groups]  # the kept groups first; dropped ones fill what the cap left empty
    rows = [g * n + j for g in chosen for j in range(n)]
    return engine.select_rows(exps, rows, left_out=range(min(len(kept), groups) * n, groups * n)), figures


def iteration_figures(cfg: PPOConfig, engine: HybridEngine, drawn, stats, seconds: float) -> dict:
    """One iteration's figures (host floats): the mean over its steps' figures, the ratio's extremes, skip counts,
    dynamic sampling's figures, each phase's seconds, throughput and peak memory."""
    samples = cfg.batch_size * cfg.num_samples_per_prompt * cfg.generation_batches  # answers
    figures = {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}
    figures.update({k: float(np.mean([d[k] for _, d in drawn])) for k in drawn[0][1]})  # dynamic sampling's
    figures.update({k: float(f([s[k] for s in stats])) for k, f in (("ratio_min", min), ("ratio_max", max))})
    figures.update({f"{k}_skipped": float(sum(s[f"{k}_skipped"] for s in stats)) for k in engine.trained})  # counts
    seq_len = drawn[0][0]["seq"].shape[1]
    figures.update(
        {f"{p}_s": engine.timings.get(p, 0.0) for p in PHASES},
        iteration_s=seconds,
        samples_per_s=samples / seconds,
        reshard_bytes=engine.reshard_bytes,
        tflops=effective_tflops(engine, samples, seq_len, seconds, cfg.ppo_epochs),
    )
    if peak_memory() is not None:
        figures["peak_memory_bytes"] = peak_memory()
    if cfg.reward.functions:  # each function's mean over the answers it scored (TRL's rewards/NAME/mean)
        figures.update(
            function_means(cfg.reward.functions, np.concatenate([to_host(e["function_parts"]) for e, _ in drawn]))
        )
    return figures


def answer_figures(cfg: PPOConfig, tokenizer, eos_id, tracker, experiences, figures: dict, it: int, logged: bool, log):
    """What the answers themselves say, added to `figures`: the built-in task's gold reward, the reward-hacking alarms
    (logged when they start), and (print_answers, at the log steps) the first answer printed."""
    synthetic = all(p.startswith("synthetic") for p in cfg.data.data_path)
    if not (synthetic or cfg.alarms.enabled or (cfg.print_answers and logged)):
        return
    host = host_experiences(experiences)
    if synthetic:
        figures["gold_reward"] = float(np.mean([g for e in host for g in gold_rewards(tokenizer, e)]))
    if cfg.alarms.enabled:  # signs of reward hacking: logged when they start, on the bar while they last
        figures.update(experience_figures(host, eos_id, cfg.alarms.ngram))
        alarms = tracker.update(figures)
        for a in alarms:
            if a.new:
                log(f"alarm at iteration {it}: {a.message}")
        if alarms:
            figures["alarms"] = ",".join(a.name for a in alarms)
    if cfg.print_answers and logged:
        e, G = host[0], host[0]["mask"].shape[1]
        prompt = decode_rows(tokenizer, e["seq"][:1, :-G], e["seq_mask"][:1, :-G], True)[0]
        answer = decode_rows(tokenizer, e["seq"][:1, -G:], e["seq_mask"][:1, -G:])[0]
        log(f"--- iteration {it}\nprompt: {prompt!r}\nanswer: {answer!r}")


def ppo_iteration(cfg: PPOConfig, engine: HybridEngine, tokenizer, prompts, unsup, iterations: int, starter, log):
    """Step 3's step for the loop (jaxrlhf.loop.fit): iteration `it` answers and scores `generation_batches` batches
    of prompts, then runs `ppo_epochs` passes of one actor and (PPO) one critic step per batch; its figures (the mean
    over the steps, skip counts, phase seconds, throughput, gold reward, alarms) are host floats. It trains the
    engine's own state and returns it; a state the loop restored enters through engine.load_state. `starter`: the
    reward functions' (reward_starter), or None."""
    prompt_iter, unsup_iter = iter(prompts), iter(unsup) if unsup else None
    tracker = None

    def step(state, it):
        nonlocal tracker
        if tracker is None:  # resume: the alarms' history replayed from the iterations before this one
            tracker = AlarmTracker(
                cfg.alarms, history=training_records(Path(cfg.output_dir) / "metrics.jsonl", upto=it - 1)
            )
        if state is not engine.state:  # restored from a checkpoint
            engine.load_state(state)
        clock, engine.timings = time.perf_counter(), {}
        drawn = [sampled_batch(cfg, engine, prompt_iter, starter) for _ in range(cfg.generation_batches)]
        experiences = [exp for exp, _ in drawn]
        stats = [
            engine.train_rlhf(exp, next(unsup_iter) if unsup_iter else None)
            for _ in range(cfg.ppo_epochs)
            for exp in experiences
        ]
        batches = cfg.generation_batches
        skips = [
            (n, s[f"{n}_skipped"], f"iteration {it}, PPO epoch {i // batches + 1}, batch {i % batches + 1}, {n}")
            for i, s in enumerate(stats)
            for n in engine.trained
        ]
        figures = iteration_figures(cfg, engine, drawn, stats, time.perf_counter() - clock)
        logged = it % cfg.log_every == 0 or it == iterations
        answer_figures(cfg, tokenizer, engine.eos_id, tracker, experiences, figures, it, logged, log)
        return engine.state, figures, skips

    return step


def main(argv=None):
    run_cli(PPOConfig, __doc__, "python -m jaxrlhf.ppo", run, argv)


if __name__ == "__main__":
    main()
