"""`python -m jaxrlhf.train`: the three steps in one command, as DeepSpeed-Chat's train.py runs them.

    python -m jaxrlhf.train                                   the built-in task end to end on a tiny model
    python -m jaxrlhf.train algorithm=grpo                    the same with GRPO (gspo, rloo, reinforce_pp,
                                                              reinforce_pp_baseline) in Step 3
    python -m jaxrlhf.train --actor-model /data/opt-1.3b --reward-model /data/opt-350m \\
        --deployment-type single_gpu --output-dir runs/opt-1.3b
    python -m jaxrlhf.train --step 3 --output-dir runs/opt-1.3b ppo.kl_coef=0.05 step3_dir=step3-kl0.05
                                                              another Step 3 on the same Steps 1 and 2
    python -m jaxrlhf.train [CONFIG.yaml] [sft.key=value reward.key=value ppo.key=value data.key=value ...]

Outputs: OUTPUT_DIR/actor-models (Step 1: model/, state/, metrics), OUTPUT_DIR/reward-models (Step 2), and
OUTPUT_DIR/step3-models (actor/, critic/ (PPO only), actor_ema/, state/, metrics; `step3_dir` names another
folder, for another Step 3 on the same Steps 1 and 2). Step 2 starts from --reward-model, Step 3 from the two earlier
outputs. Started again with the same settings, the command skips the finished steps and continues an interrupted one
(loop.start_run). `data` is shared by the three steps; the settings that train sets itself (each step's model,
output_dir and data section: SET_BY_TRAIN) are refused in the steps' own sections, never silently replaced. With no
arguments the actor and reward model are tiny random OPTs with the built-in
task's word-level tokenizer (letters sorting, jaxrlhf.data.synthetic), and the run ends by comparing the
gold reward of the Step 1 model and of the final actor on held-out prompts, with the KL between them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import string
import time
from pathlib import Path
from typing import Literal

import jax
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as token_models
from transformers import PreTrainedTokenizerFast

from jaxrlhf import ppo, reward, rewards, sft
from jaxrlhf.checkpoint import export_manifest, load_hf, save_hf
from jaxrlhf.config import ConfigError, build, parse_cli, run_cli, set_dotted
from jaxrlhf.data import DataConfig, arithmetic, make_batch, prepare
from jaxrlhf.data.synthetic import gold_reward, make_prompt, make_response
from jaxrlhf.eval import gold_and_kl, pipeline_report
from jaxrlhf.loop import ChangedRunError, settings
from jaxrlhf.models import OPTConfig, init_params
from jaxrlhf.optim import OptimConfig
from jaxrlhf.reward import RewardConfig
from jaxrlhf.rl import ModelSide, PPOConfig
from jaxrlhf.sft import SFTConfig
from jaxrlhf.tokenizer import decode_rows, load_tokenizer

BUILTIN = "builtin"
FIRST_DIRS = ("actor-models", "reward-models")  # Steps 1 and 2's folders under output_dir
STEP3_DIR = "step3-models"  # Step 3's (the default of step3_dir)
# The built-in model: small enough to train all three steps on two CPU cores in minutes.
BUILTIN_MODEL = dict(
    vocab_size=64,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    ffn_dim=256,
    max_position_embeddings=64,
    word_embed_proj_dim=64,
    dropout=0.0,
)
DEMO_DATA = DataConfig(data_path=("synthetic:6000",), data_split="2,4,4", max_seq_len=32, max_prompt_len=24)
# What the demo's Steps 1 and 2 share: their batch, precision and learning-rate schedule.
DEMO_STEP = dict(batch_size=16, precision="fp32")
demo_optim = lambda lr: OptimConfig(learning_rate=lr, schedule="constant", warmup_steps=20)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    #: the model Step 1 starts from: an HF OPT folder, or "builtin" (a tiny random OPT, built-in tokenizer)
    actor_model: str = BUILTIN
    #: the model Step 2 starts from: an HF OPT folder, or "builtin"
    reward_model: str = BUILTIN
    #: presets of DeepSpeed-Chat's training scripts (demo: the built-in task; see DEPLOYMENTS)
    deployment_type: Literal["demo", "single_gpu", "single_node", "multi_node"] = "demo"
    #: which steps to run (a later step reads the earlier ones' outputs from output_dir)
    steps: tuple[int, ...] = (1, 2, 3)
    #: Step 3's algorithm, ppo | grpo | gspo | rloo | reinforce_pp | reinforce_pp_baseline: sets ppo.algorithm and,
    #: for the group ones (all but ppo and reinforce_pp), 4 answers to each of ppo.batch_size / 4 prompts (GROUP;
    #: ppo.KEY=VALUE overrides). The Step 2 reward model scores the answers; only PPO also trains it as its critic
    algorithm: Literal["ppo", "grpo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "ppo"
    #: everything goes under here (actor-models/, reward-models/, step3-models/)
    output_dir: str = "runs/train"
    #: Step 3's folder under output_dir; another name runs another Step 3 (another algorithm or settings) on the same
    #: finished Steps 1 and 2, its evaluation (eval/, summary.json) inside it
    step3_dir: str = STEP3_DIR
    #: held-out prompts on which the Step 1 model and the final actor are compared (built-in task)
    eval_prompts: int = 256
    #: sampled answers per held-out prompt in that comparison
    eval_samples: int = 4
    #: the datasets and lengths of all three steps
    data: DataConfig = DEMO_DATA
    sft: SFTConfig = SFTConfig(**DEMO_STEP, max_steps=1500, log_every=100, sample_prompts=2, optim=demo_optim(3e-3))
    reward: RewardConfig = RewardConfig(
        **DEMO_STEP, max_steps=300, log_every=50, loss_kind="last", optim=demo_optim(1e-3)
    )
    ppo: PPOConfig = PPOConfig(
        batch_size=32,
        max_steps=300,
        max_answer_len=8,
        precision="fp32",
        kl_coef=0.1,
        log_every=10,
        enable_ema=True,
        actor=ModelSide(optim=OptimConfig(learning_rate=5e-4, warmup_steps=5)),
        critic=ModelSide(optim=OptimConfig(learning_rate=2e-3, warmup_steps=5)),
    )

    def __post_init__(self):
        if not self.steps or any(s not in (1, 2, 3) for s in self.steps) or list(self.steps) != sorted(set(self.steps)):
            raise ValueError(f"steps: expected increasing numbers among 1, 2, 3, got {list(self.steps)}")
        if Path(self.step3_dir).name != self.step3_dir or self.step3_dir in ("", ".", "..", *FIRST_DIRS, "eval"):
            raise ConfigError(
                f"step3_dir: expected a folder name for OUTPUT_DIR/NAME other than {', '.join(FIRST_DIRS)} and eval, "
                f"got {self.step3_dir!r}"
            )
        refuse_set_by_train(self)


# The steps' own settings that train sets itself (or does not use), and what to do instead: refused, never ignored.
SET_BY_TRAIN = {
    "sft.model": "give actor_model (--actor-model), which Step 1 starts from",
    "sft.output_dir": "give output_dir (--output-dir): Step 1 writes OUTPUT_DIR/actor-models",
    "reward.model": "give reward_model (--reward-model), which Step 2 starts from",
    "reward.output_dir": "give output_dir (--output-dir): Step 2 writes OUTPUT_DIR/reward-models",
    "reward.score_file": "train only trains; score with python -m jaxrlhf.reward model=OUTPUT_DIR/reward-models/model "
    "score_file=FILE",
    "ppo.output_dir": "give output_dir (--output-dir) and step3_dir: Step 3 writes OUTPUT_DIR/STEP3_DIR",
    "ppo.actor.model": "Step 3's actor is Step 1's output (OUTPUT_DIR/actor-models/model); give actor_model for Step 1",
    "ppo.critic.model": "Step 3's critic is Step 2's output (OUTPUT_DIR/reward-models/model); give reward_model for "
    "Step 2",
}


# Left out of --help and --help-all: what refuse_set_by_train refuses (the steps' data sections: train's one data
# section is theirs)
HIDDEN = (*SET_BY_TRAIN, "sft.data", "reward.data", "ppo.data")


def refuse_set_by_train(cfg: TrainConfig):
    """A ConfigError for a setting of SET_BY_TRAIN, or of a step's own data section, that differs from its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    get = lambda obj, dotted: functools.reduce(getattr, dotted.split("."), obj)
    for key, instead in SET_BY_TRAIN.items():
        section, rest = key.split(".", 1)
        if (value := get(cfg, key)) != get(defaults[section], rest):
            raise ConfigError(f"{key}: jaxrlhf.train would ignore {value!r}; {instead}")
    for section in ("sft", "reward", "ppo"):
        ours, default = getattr(cfg, section).data, defaults[section].data
        for f in dataclasses.fields(ours):
            if getattr(ours, f.name) != getattr(default, f.name):
                raise ConfigError(
                    f"{section}.data.{f.name}: jaxrlhf.train gives its three steps one data section, so this would "
                    f"be ignored; set data.{f.name}"
                )


# DeepSpeed-Chat's training scripts per deployment (OPT-1.3B / 13B / 66B actor with an OPT-350M reward model):
# dotted overrides applied before the config file and the command line. Models come from --actor-model and
# --reward-model (no hub here); data from its hub names unless data.data_path says otherwise.
_REAL = {
    "data": {"data_path": ["Dahoas/rm-static"], "max_seq_len": 512, "max_prompt_len": 256},
    "sft": {"precision": "bf16", "max_steps": 0, "epochs": 1, "sample_prompts": 3, "log_every": 10},
    "sft.optim": {"learning_rate": 9.65e-6, "weight_decay": 0.0, "schedule": "cosine", "warmup_steps": 0},
    "reward": {"precision": "bf16", "max_steps": 0, "epochs": 1, "loss_kind": "span", "log_every": 10},
    "reward.optim": {"learning_rate": 5e-5, "weight_decay": 0.1, "schedule": "cosine", "warmup_steps": 0},
    "ppo": {"precision": "bf16", "max_steps": 0, "max_answer_len": 256, "kl_coef": 0.1, "log_every": 1},
    "ppo.actor": {"optim": {"learning_rate": 9.65e-6, "warmup_steps": 100}, "remat": True},
    "ppo.critic": {"optim": {"learning_rate": 5e-6, "warmup_steps": 100}, "remat": True},
    "ppo.enable_ema": True,
}
# Answers per prompt of the group-baseline algorithms: a batch of batch_size / GROUP prompts, as many answers as PPO's.
# Their KL (ppo.kl_loss auto) is each one's published default: k3 in the loss of weight ppo.kl_loss_coef for grpo, gspo
# and reinforce_pp_baseline, in the reward for rloo (jaxrlhf.rl.config).
GROUP = {"grpo": 4, "gspo": 4, "rloo": 4, "reinforce_pp_baseline": 4}
# The demo's KL loss weight where a learned reward model scores (DeepSeekMath's 0.04; veRL's 0.001 is
# ppo.kl_loss_coef's default): over the demo's 300 steps at 0.001 its reward model was gamed or not by float noise alone
# (docs/usage.md). The arithmetic task's verifier cannot be gamed so: it keeps 0.001.
DEMO_KL_LOSS_COEF = 0.04
_batch = lambda n: {f"{step}.batch_size": n for step in ("sft", "reward", "ppo")}
DEPLOYMENTS = {
    "demo": {},
    "single_gpu": {
        **_REAL,
        **_batch(8),
        "sft.lora": {"dim": 128},
        "ppo.actor": {**_REAL["ppo.actor"], "lora": {"dim": 128}},
    },
    "single_node": {**_REAL, **_batch(32)},
    "multi_node": {**_REAL, **_batch(64)},
}


# ------------------------------------------------------------------------------------ the built-in model


# The built-in tasks (data sources "synthetic:N", "arithmetic:N"): every text each can write, for its tokenizer,
# and its gold reward (prompt, answer) -> float on held-out prompts.
TASKS = {
    "synthetic": (
        lambda: [make_prompt(list(string.ascii_lowercase)) + make_response(list(string.ascii_lowercase))],
        gold_reward,
    ),
    "arithmetic": (lambda: arithmetic.ArithmeticTask().texts(), rewards.arithmetic_gold),
}
GOLD_NAME = {"arithmetic": " (the math verifier's accuracy)"}  # what the summary line calls a task's gold reward
# What an arithmetic run sets unless the command line says otherwise: the math verifier is the reward.
# Answers cut at the length limit without EOS stay out of the loss (DAPO's over-long filter): the verifier reads the
# last \boxed{} and does not punish writing on past it, and without the filter GRPO's actor learned to drop its EOS.
ARITHMETIC = {"ppo.reward": {"functions": ["jaxrlhf.rewards:math_verify"]}, "ppo.overlong_filter": True}


def builtin_task(data: DataConfig) -> str | None:
    """The built-in task that every source of `data` is (a name in TASKS), else None."""
    tasks = {spec.partition(":")[0] for spec in data.data_path}
    return next(iter(tasks)) if len(tasks) == 1 and tasks <= TASKS.keys() else None


def builtin_tokenizer(task: str = "synthetic"):
    """A word-level tokenizer for a built-in task: the byte-level pieces of its prompts and answers (OPT's
    pre-tokenizer, so text decodes exactly), with OPT's special ids <s>=0, <pad>=1, </s>=2 (BOS and EOS), <unk>=3."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for text in TASKS[task][0]():
        for piece, _ in pre.pre_tokenize_str(text):
            vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(token_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre, decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="</s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def builtin_model(folder: Path, seed: int, value_head: bool = False, task: str = "synthetic") -> Path:
    """A tiny random OPT (BUILTIN_MODEL, its vocabulary a multiple of 64 that holds the task's) with the built-in
    tokenizer of `task`, written as an HF folder (kept if written already: a new copy's manifest id would make the
    Step 1 run that started from it look changed). `value_head` adds a random one: a stand-in for a Step 2 output
    where its training does not matter (tests)."""
    if export_manifest(folder) is not None:
        return folder
    tok = builtin_tokenizer(task)
    config = OPTConfig(**{**BUILTIN_MODEL, "vocab_size": max(BUILTIN_MODEL["vocab_size"], -(-len(tok) // 64) * 64)})
    params = init_params(config, jax.random.key(seed), value_head=value_head)
    return save_hf(folder, config, jax.device_get(params), tok)


# ------------------------------------------------------------------------------------------- evaluation


def compare(cfg: TrainConfig, sft_model: Path, actor_model: Path, log=print) -> dict:
    """Gold reward of the Step 1 model and of the final actor on held-out Step 3 prompts (sampled at the PPO
    temperature, and greedy), and the KL from the actor to the Step 1 model on the actor's sampled answers."""
    tok = load_tokenizer(actor_model)
    held = prepare(cfg.data, 3, tok, log=lambda _: None)["eval"]  # Step 3's held-out prompts: never trained on
    n = min(cfg.eval_prompts, len(held["offsets"]) - 1)
    batch = make_batch(held, range(n), 3, cfg.data, tok.pad_token_id)
    ids, mask, ppo_cfg = batch["prompt_ids"], batch["prompt_mask"], cfg.ppo
    prompts = decode_rows(tok, ids, mask, skip_first=True)
    models = {"step1": load_hf(sft_model), "actor": load_hf(actor_model)}
    gold = lambda i, answer: TASKS[builtin_task(cfg.data)][1](prompts[i], answer)
    sampling = dict(temperature=ppo_cfg.temperature, top_k=ppo_cfg.top_k, top_p=ppo_cfg.top_p)
    out, texts = gold_and_kl(
        models,
        tok,
        ids,
        mask,
        gold,
        samples=cfg.eval_samples,
        max_new_tokens=ppo_cfg.max_answer_len,
        chat_template=cfg.data.chat_template,
        model_dir=sft_model,
        **sampling,
    )
    out["examples"] = [
        {"prompt": p, "step1": texts["step1", "greedy"][i], "actor": texts["actor", "greedy"][i]}
        for i, p in enumerate(prompts[:3])
    ]
    out["eval_answers"] = n * cfg.eval_samples
    return out


# ----------------------------------------------------------------------------------------------- the run


def run(cfg: TrainConfig, log=print, mesh=None) -> dict:
    """Steps `cfg.steps` in order (on `mesh`, default all devices); returns each step's model folder and, on
    the built-in task, the comparison."""
    out = Path(cfg.output_dir)
    dirs = {1: out / FIRST_DIRS[0], 2: out / FIRST_DIRS[1], 3: out / cfg.step3_dir}
    result, clock = {}, time.perf_counter()
    task = builtin_task(cfg.data) or "synthetic"  # the built-in models' tokenizer
    lengths = lambda data: (data.max_seq_len, data.max_prompt_len)
    own = BUILTIN not in (cfg.actor_model, cfg.reward_model)
    if cfg.deployment_type == "demo" and own and lengths(cfg.data) == lengths(DEMO_DATA):
        log(
            f"note: deployment_type demo keeps the built-in task's lengths (prompts of at most "
            f"{DEMO_DATA.max_prompt_len} tokens, sequences of {DEMO_DATA.max_seq_len}, answers of "
            f"{cfg.ppo.max_answer_len}) for your models; --deployment-type single_gpu (single_node, multi_node) "
            "gives DeepSpeed-Chat's settings, or set data.* and ppo.max_answer_len"
        )

    first_steps = {
        1: ("supervised fine-tuning", sft, cfg.sft, cfg.actor_model),
        2: ("reward model", reward, cfg.reward, cfg.reward_model),
    }
    for n, (what, module, step_cfg, model) in first_steps.items():
        if n in cfg.steps:
            log(f"=== Step {n}: {what} -> {dirs[n]}")
            if model == BUILTIN:  # seed 0 for the actor, 1 for the reward model
                name = f"builtin-{n - 1}" if task == "synthetic" else f"builtin-{task}-{n - 1}"
                model = str(builtin_model(out / name, n - 1, task=task))
            step = dataclasses.replace(step_cfg, model=model, output_dir=str(dirs[n]), data=cfg.data)
            result[f"step{n}"] = str(module.run(step, log=log, mesh=mesh)["model_dir"])
    if 3 in cfg.steps:
        result |= step3(cfg, dirs, log=log, mesh=mesh)
    result["seconds"] = time.perf_counter() - clock
    log_summary(result, task, log)
    folder = report_dir(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".summary.json.tmp").write_text(json.dumps(result, indent=2) + "\n")
    os.replace(folder / ".summary.json.tmp", folder / "summary.json")  # whole or not at all: read next start
    return result


def report_dir(cfg: TrainConfig) -> Path:
    """Where summary.json and eval/ of this Step 3 go: output_dir, or the folder of another Step 3 (step3_dir)."""
    return Path(cfg.output_dir) if cfg.step3_dir == STEP3_DIR else Path(cfg.output_dir) / cfg.step3_dir


def step3(cfg: TrainConfig, dirs: dict, log=print, mesh=None) -> dict:
    """Step 3 from the models of Steps 1 and 2 (`dirs`: each step's folder), then its evaluation."""
    log(f"=== Step 3: {cfg.ppo.algorithm.upper()} -> {dirs[3]}")
    sft_model, rm_model = dirs[1] / "model", dirs[2] / "model"
    # A critic-free run rewarded by functions alone (arithmetic's verifier) needs no Step 2 model (--step 1 3);
    # without one, the evaluation report, whose judge it is, is left out
    needed = (sft_model, rm_model) if ppo.needs_critic_model(cfg.ppo) else (sft_model,)
    for path in needed:
        if not path.is_dir():
            raise ConfigError(
                f"{path}: not found; Step 3 needs the outputs of Steps 1 and 2 (run them, e.g. --step 1 2 3)"
            )
    step = dataclasses.replace(
        cfg.ppo,
        actor=dataclasses.replace(cfg.ppo.actor, model=str(sft_model)),
        critic=dataclasses.replace(cfg.ppo.critic, model=str(rm_model) if rm_model.is_dir() else ""),
        output_dir=str(dirs[3]),
        data=cfg.data,
    )
    try:
        folders = {k: str(v) for k, v in ppo.run(step, log=log, mesh=mesh)["folders"].items()}
    except ChangedRunError as e:  # e.g. algorithm=grpo where a PPO run is saved
        out = Path(cfg.output_dir)
        beside = f"give step3_dir=NAME to run this Step 3 into {out}/NAME beside it (on the same Steps 1 and 2)"
        raise ChangedRunError(e.out, e.what, beside) from None
    return {"step3": folders, **evaluate(cfg, dirs, folders, log)}


def evaluate(cfg: TrainConfig, dirs: dict, step3_folders: dict, log=print) -> dict:
    """The evaluation of a Step 3: the comparison (built-in task) and the report (judged by Step 2's model, where
    there is one), or those of summary.json where these exact models were evaluated with these settings already."""
    sft_model, rm_model = dirs[1] / "model", dirs[2] / "model"
    judged = rm_model.is_dir()
    # What the evaluation depends on: these settings and these exact exports (their manifests' ids).
    folders = (sft_model, *[rm_model] * judged, *map(Path, step3_folders.values()))
    ids = {str(p): (export_manifest(p) or {}).get("id") for p in folders}
    result = {"evaluated": {"settings": settings(cfg, ()), "models": ids}}
    summary = report_dir(cfg) / "summary.json"
    before = json.loads(summary.read_text()) if summary.is_file() else {}
    if None not in ids.values() and before.get("evaluated") == result["evaluated"]:  # its evaluation stands
        log(f"evaluation: these models were evaluated already with these settings ({summary})")
        return result | {k: before[k] for k in ("comparison", "report") if k in before}
    if builtin_task(cfg.data):
        result["comparison"] = compare(cfg, sft_model, dirs[3] / "actor", log=log)
    if not judged and not cfg.ppo.reward.functions:  # with functions, they judge the report (eval.pipeline_report)
        log(f"evaluation: no report ({rm_model} not found: the report's reward model is Step 2's)")
        return result
    metrics = dirs[3] / "metrics.jsonl"
    report = pipeline_report(
        sft_model,
        rm_model if judged else None,
        step3_folders,
        metrics,
        report_dir(cfg) / "eval",
        cfg.data,
        cfg.ppo,
        cfg.eval_prompts,
        log=log,
    )
    return result | {"report": report}


def log_summary(result: dict, task: str, log=print):
    """The run's last lines: the comparison of the Step 1 model and the final actor (built-in task), and the time."""
    if "comparison" in result:
        c = result["comparison"]
        log(
            f"gold reward{GOLD_NAME.get(task, '')} on {c['eval_answers']} answers to held-out prompts "
            "(sampled / greedy): Step 1 model "
            f"{c['step1_gold_reward_sampled']:.3f} / {c['step1_gold_reward_greedy']:.3f}, final actor "
            f"{c['actor_gold_reward_sampled']:.3f} / {c['actor_gold_reward_greedy']:.3f}; "
            f"KL(actor || Step 1) {c['kl_actor_to_step1']:.3f} nats per answer"
        )
        for e in c["examples"]:
            log(f"  {e['prompt']!r}\n     Step 1: {e['step1']!r}\n     actor:  {e['actor']!r}")
    log(
        f"done in {result['seconds']:.0f} s"
        + (f"; evaluation report: {result['report']}" if "report" in result else "")
    )


def flags(parser):
    """DeepSpeed-Chat's flags, the same as the settings of their names."""
    parser.add_argument("--actor-model", "--actor_model", dest="actor_model", metavar="DIR")
    parser.add_argument("--reward-model", "--reward_model", dest="reward_model", metavar="DIR")
    parser.add_argument(
        "--deployment-type",
        "--deployment_type",
        dest="deployment_type",
        choices=list(DEPLOYMENTS),
        metavar="NAME",
        help=", ".join(DEPLOYMENTS),
    )
    # "--step 1 2 3"; what is not a number is a key=value or CONFIG.yaml that the list took (parse_cli hands it back)
    parser.add_argument(
        "--step",
        dest="steps",
        nargs="+",
        action="extend",
        metavar="{1,2,3}",
        type=lambda s: int(s) if s.isdigit() else s,
    )
    parser.add_argument("--output-dir", "--output_dir", dest="output_dir", metavar="DIR")


def _preset(cfg: TrainConfig) -> TrainConfig | None:
    """The deployment preset's settings, which the file and the command line then override."""
    dotted, tree = copy.deepcopy(DEPLOYMENTS[cfg.deployment_type]), {}  # deep: set_dotted fills nested sections
    verifier = builtin_task(cfg.data) == "arithmetic"  # a rule's reward, no reward model to game
    if verifier:
        dotted |= copy.deepcopy(ARITHMETIC)
    if cfg.algorithm != "ppo":  # Step 3's algorithm; GROUP answers to each of a batch's prompts
        n = GROUP.get(cfg.algorithm, 1)
        dotted["ppo.batch_size"] = dotted.get("ppo.batch_size", TrainConfig.ppo.batch_size) // n
        dotted |= {"ppo.algorithm": cfg.algorithm, "ppo.num_samples_per_prompt": n}
        if cfg.deployment_type == "demo" and not verifier:  # the tiny reward model's guard (DEMO_KL_LOSS_COEF)
            dotted["ppo.kl_loss_coef"] = DEMO_KL_LOSS_COEF
    for key, value in dotted.items():
        set_dotted(tree, key, value)
    return build(TrainConfig, tree) if dotted else None


def parse(argv: list[str] | None) -> TrainConfig:
    """DeepSpeed-Chat's flags (--actor-model, --reward-model, --deployment-type, --step, --output-dir) and
    [CONFIG.yaml] [key=value ...], in any order, on top of the deployment preset."""
    return parse_cli(
        TrainConfig, __doc__.split("\n\n")[0], argv, "python -m jaxrlhf.train", flags, _preset, hidden=HIDDEN
    )[0]


def main(argv=None):
    return run_cli(
        TrainConfig, __doc__, "python -m jaxrlhf.train", run, argv, flags=flags, preset=_preset, hidden=HIDDEN
    )


if __name__ == "__main__":
    main()
