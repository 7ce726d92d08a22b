"""Step 3's reinforcement learning, beside the supervised Steps 1 and 2 (jaxrlhf.trainer):

    engine.py      the hybrid engine: four models on one mesh, generate_experience and train_rlhf
    experience.py  the answers scored, the KL coefficient, rewards and advantages (compiled programs)
    steps.py       the actor's and critic's training programs
    packing.py     rows sorted by length into micro-batches of a token budget
    losses.py      PPO's math: rewards, GAE, the clipped losses, the adaptive KL controller

The entry point, `python -m jaxrlhf.ppo`, drives the engine through the shared training loop (jaxrlhf.trainer.fit).
"""

from jaxrlhf.rl.engine import EngineConfig, HybridEngine, ModelSide

__all__ = ["EngineConfig", "HybridEngine", "ModelSide"]
