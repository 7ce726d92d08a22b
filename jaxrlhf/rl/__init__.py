"""Step 3's reinforcement learning, beside the supervised Steps 1 and 2 (jaxrlhf.trainer):

    engine.py      the hybrid engine: four models on one mesh, generate_experience and train_rlhf
    experience.py  the answers scored, the KL coefficient, rewards and advantages (compiled programs)
    steps.py       the actor's and critic's training programs
    packing.py     several sequences joined into each row (segments), in micro-batches of a token budget
    losses.py      the math: rewards, GAE, the clipped losses, the adaptive KL controller; the critic-free
                   algorithms' advantages (GRPO, RLOO, REINFORCE++), KL loss estimators, loss aggregations

    config.py      the settings: EngineConfig, ModelSide, PPOConfig

`algorithm` (config.py) picks PPO or a critic-free algorithm (grpo, rloo, reinforce_pp: no critic, n answers per
prompt). The entry point, `python -m jaxrlhf.ppo`, drives the engine through the one training loop (jaxrlhf.loop).
"""

from jaxrlhf.rl.config import EngineConfig, ModelSide, PPOConfig
from jaxrlhf.rl.engine import HybridEngine

__all__ = ["EngineConfig", "HybridEngine", "ModelSide", "PPOConfig"]
