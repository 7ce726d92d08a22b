"""Two whole PPO iterations of the engine against an independent computation (NumPy loops, plain jax.grad).

The engine runs as Step 3 does (jaxrlhf.ppo): per iteration two generation batches, then two PPO epochs over
them, the actor's and critic's steps accumulated over two micro-batches, the mixture LM loss on (in the actor's
one optimizer step with PPO's, not a second step as in DeepSpeed-Chat: README, where we differ), whitened
advantages, the adaptive KL controller, gamma != lam, clip_value != clip_ratio, the EMA. The reference takes
only the engine's sampled tokens; it scores them with its own copies of the four models, then computes
rewards, GAE, whitening and the KL coefficient in NumPy loops, the losses (their formulas in losses.py) over the
whole batch in one piece, their gradients with jax.grad, and clipping, Adam and the EMA in NumPy. Its
models move by its own steps only, so a difference in any step shows in the figures of the steps after it
and in the weights after each iteration. Single-step checks cannot tell old log-probs or values from current
ones (equal before the first step), nor an adaptive coefficient from a fixed one (the first iteration's KL
is 0): two iterations of four steps can.
"""

import jax
import jax.numpy as jnp
import numpy as np
from test_engine import ACTOR, CRITIC, G, engine, host, models, prompts  # noqa: F401  (fixtures)

from helpers import jit_values
from jaxrlhf import logits, make_mesh, values
from jaxrlhf.optim import OptimConfig
from jaxrlhf.rl import ModelSide

P = 6  # prompt length of the `prompts` fixture
ITERATIONS, BATCHES, EPOCHS, MICRO = 2, 2, 2, 2
OPTIM = dict(learning_rate=1e-2, warmup_steps=0, schedule="constant", betas=(0.9, 0.95), eps=1e-4, clip_grad_norm=1.0)
PPO = dict(
    kl_coef=0.1,
    kl_target=0.05,
    kl_horizon=20,
    clip_score=1.0,
    clip_ratio=0.2,
    clip_value=0.05,
    gamma=0.9,
    lam=0.7,
    whiten_advantages=True,
    unsup_coef=0.5,
    ema_decay=0.9,
)


# ------------------------------------------------------------------------------- the reference, in NumPy


def ref_rewards(logprobs, ref_logprobs, scores, mask, beta, clip):
    r = -beta * (logprobs - ref_logprobs) * mask
    for b, n in enumerate(mask.sum(1).astype(int)):
        r[b, n - 1] += min(max(scores[b], -clip), clip)
    return r


def ref_gae(v, r, mask, gamma, lam):
    adv = np.zeros_like(v)
    for b, n in enumerate(mask.sum(1).astype(int)):
        running = 0.0
        for t in reversed(range(n)):
            delta = r[b, t] + gamma * (v[b, t + 1] if t + 1 < n else 0.0) - v[b, t]
            running = delta + gamma * lam * running
            adv[b, t] = running
    return adv, (adv + v) * mask


def ref_whiten(x, mask):
    real = x[mask > 0]
    return (x - real.mean()) / np.sqrt(real.var() + 1e-8) * mask


def ref_next_beta(beta, kl, target, horizon, samples):
    return beta * (1 + min(max(kl / target - 1, -0.2), 0.2) * samples / horizon)


class Adam:
    """optax.chain(clip_by_global_norm, adamw) without weight decay, in float64."""

    def __init__(self, params):
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]
        self.t = 0

    def step(self, params, grads):
        o = OPTIM
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        grads = [g * o["clip_grad_norm"] / max(norm, o["clip_grad_norm"]) for g in grads]
        self.t += 1
        b1, b2 = o["betas"]
        out = []
        for i, (p, g) in enumerate(zip(params, grads)):
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g**2
            m_hat, v_hat = self.m[i] / (1 - b1**self.t), self.v[i] / (1 - b2**self.t)
            out.append(p - o["learning_rate"] * m_hat / (np.sqrt(v_hat) + o["eps"]))
        return out, norm


@jax.jit
def answer_logprobs(params, seq, seq_mask):
    lp = jax.nn.log_softmax(logits(ACTOR, params, seq, seq_mask))
    return jnp.take_along_axis(lp[:, P - 1 : -1], seq[:, P:, None], -1)[..., 0]


@jax.jit
def answer_values(params, seq, seq_mask):
    return values(CRITIC, params, seq, seq_mask)[:, P - 1 : -1]


def actor_objective(params, seq, seq_mask, mask, old, adv, unsup):
    """PPO's clipped surrogate over all the batch's answer tokens + unsup_coef * the LM loss over all its targets."""
    ratio = jnp.exp(answer_logprobs(params, seq, seq_mask) - old)
    c = PPO["clip_ratio"]
    ppo = jnp.sum(jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - c, 1 + c)) * mask) / jnp.sum(mask)
    ids, targets = unsup["input_ids"], unsup["loss_mask"][:, 1:]
    lp = jax.nn.log_softmax(logits(ACTOR, params, ids, unsup["attention_mask"]))[:, :-1]
    lm = -jnp.sum(jnp.take_along_axis(lp, ids[:, 1:, None], -1)[..., 0] * targets) / jnp.sum(targets)
    return ppo + PPO["unsup_coef"] * lm, (ppo, lm)


def critic_objective(params, seq, seq_mask, mask, old, returns):
    v = answer_values(params, seq, seq_mask)
    v_clip = old + jnp.clip(v - old, -PPO["clip_value"], PPO["clip_value"])
    return 0.5 * jnp.sum(jnp.maximum((v - returns) ** 2, (v_clip - returns) ** 2) * mask) / jnp.sum(mask)


actor_grad = jax.jit(jax.value_and_grad(actor_objective, has_aux=True))
critic_grad = jax.jit(jax.value_and_grad(critic_objective))


class Reference:
    """The four models and both optimizers of Step 3, stepped by the functions above."""

    def __init__(self, actor, critic):
        f64 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float64), tree)
        self.actor, self.critic, self.ref, self.reward = f64(actor), f64(critic), f64(actor), f64(critic)
        self.ema = f64(actor)
        self.opt = {"actor": Adam(jax.tree.leaves(actor)), "critic": Adam(jax.tree.leaves(critic))}
        self.beta = PPO["kl_coef"]

    @staticmethod
    def f32(tree):
        return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)

    def score(self, seq, seq_mask, mask):
        """The experience of one batch, with the KL coefficient of its rewards; the controller then steps."""
        f = lambda fn, p: np.asarray(fn(self.f32(p), seq, seq_mask), np.float64) * mask
        exp = {
            "seq": seq,
            "seq_mask": seq_mask,
            "mask": mask,
            "logprobs": f(answer_logprobs, self.actor),
            "ref_logprobs": f(answer_logprobs, self.ref),
            "values": f(answer_values, self.critic),
        }
        reward = np.asarray(jit_values(CRITIC, self.f32(self.reward), seq, seq_mask), np.float64)
        exp["scores"] = reward[np.arange(len(mask)), P + mask.sum(1).astype(int) - 1]
        exp["kl"] = np.sum((exp["logprobs"] - exp["ref_logprobs"]) * mask) / len(mask)
        exp["beta"] = self.beta
        self.beta = ref_next_beta(self.beta, exp["kl"], PPO["kl_target"], PPO["kl_horizon"], len(mask))
        return exp

    def train(self, exp, unsup):
        """One actor step, the EMA, one critic step; the figures the engine reports."""
        mask = exp["mask"]
        rewards = ref_rewards(exp["logprobs"], exp["ref_logprobs"], exp["scores"], mask, exp["beta"], PPO["clip_score"])
        adv, ret = ref_gae(exp["values"], rewards, mask, PPO["gamma"], PPO["lam"])
        adv = ref_whiten(adv, mask)
        batch = [jnp.asarray(exp[k], jnp.float32) for k in ("mask", "logprobs")] + [jnp.asarray(adv, jnp.float32)]
        (_, (ppo, lm)), grads = actor_grad(self.f32(self.actor), exp["seq"], exp["seq_mask"], *batch, unsup)
        leaves, norm_a = self.opt["actor"].step(
            jax.tree.leaves(self.actor), [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
        )
        self.actor = jax.tree.unflatten(jax.tree.structure(self.actor), leaves)
        d = PPO["ema_decay"]
        self.ema = jax.tree.map(lambda e, a: d * e + (1 - d) * a, self.ema, self.actor)
        critic_loss, grads = critic_grad(
            self.f32(self.critic),
            exp["seq"],
            exp["seq_mask"],
            jnp.asarray(mask, jnp.float32),
            jnp.asarray(exp["values"], jnp.float32),
            jnp.asarray(ret, jnp.float32),
        )
        leaves, norm_c = self.opt["critic"].step(
            jax.tree.leaves(self.critic), [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
        )
        self.critic = jax.tree.unflatten(jax.tree.structure(self.critic), leaves)
        real = mask > 0
        return {
            "kl": exp["kl"],
            "kl_coef": exp["beta"],
            "advantage": adv[real].mean(),
            "return": ret[real].mean(),
            "actor_loss": float(ppo),
            "unsup_loss": float(lm),
            "critic_loss": float(critic_loss),
            "actor_grad_norm": norm_a,
            "critic_grad_norm": norm_c,
        }


# ----------------------------------------------------------------------------------------------- the test


def unsup_batches(n):
    """Mixture LM batches of 4 right-padded rows with different numbers of targets, so that micro-batch means
    weighted by anything but their LM targets differ from the whole batch's mean."""
    rng = np.random.default_rng(10)
    mask = (np.arange(10)[None, :] < np.array([10, 3, 7, 5])[:, None]).astype(np.int32)
    return [
        {"input_ids": rng.integers(3, 64, (4, 10)).astype(np.int32), "attention_mask": mask, "loss_mask": mask}
        for _ in range(n)
    ]


def test_two_ppo_iterations_equal_an_independent_numpy_computation(models, prompts):
    batch, eos = prompts
    side = ModelSide(optim=OptimConfig(**OPTIM, gradient_accumulation_steps=MICRO))
    e = engine(models, make_mesh(1, jax.devices()[:1]), eos, actor=side, critic=side, **PPO)
    ref = Reference(*models)
    unsup = iter(unsup_batches(ITERATIONS * BATCHES * EPOCHS))
    clipped, kls = [], []
    for it in range(ITERATIONS):
        prompts_it = [{k: np.roll(v, it + k_, axis=0) for k, v in batch.items()} for k_ in range(BATCHES)]
        exps = [e.generate_experience(p) for p in prompts_it]
        refs = []
        for exp in exps:
            got = host(exp)
            want = ref.score(got["seq"], got["seq_mask"], got["mask"].astype(np.float64))
            for k in ("logprobs", "ref_logprobs", "values", "scores"):
                np.testing.assert_allclose(got[k], want[k], atol=2e-5, err_msg=f"iteration {it}: {k}")
            np.testing.assert_allclose(got["kl_coef"], want["beta"], rtol=1e-6, err_msg=f"iteration {it}: kl_coef")
            refs.append(want)
            kls.append(want["kl"])
        np.testing.assert_allclose(float(e.state["kl_coef"]), ref.beta, rtol=1e-6)  # stepped once per batch
        for epoch in range(EPOCHS):
            for exp, want_exp in zip(exps, refs):
                u = next(unsup)
                before = host(e.actor_params())
                lp_now = np.asarray(answer_logprobs(before, want_exp["seq"], want_exp["seq_mask"]))
                clipped.append(np.abs(np.exp(lp_now - want_exp["logprobs"]) - 1)[want_exp["mask"] > 0].max())
                stats = e.train_rlhf(exp, u)
                want = ref.train(want_exp, u)
                for k, v in want.items():
                    np.testing.assert_allclose(
                        stats[k], v, rtol=2e-4, atol=2e-5, err_msg=f"iteration {it}, epoch {epoch}: {k}"
                    )
        for name, got, want in (
            ("actor", e.actor_params(), ref.actor),
            ("critic", e.critic_params(), ref.critic),
            ("ema", e.state["ema"], ref.ema),
        ):
            for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(host(got))[0], jax.tree.leaves(want)):
                np.testing.assert_allclose(
                    a, b, atol=2e-5, err_msg=f"iteration {it}: {name} {jax.tree_util.keystr(path)}"
                )
    # The case is one where every term matters: ratios beyond the clip, a KL the controller steers by.
    assert max(clipped) > PPO["clip_ratio"], clipped
    assert kls[:BATCHES] == [0.0] * BATCHES and min(kls[BATCHES:]) > 1e-3, kls
