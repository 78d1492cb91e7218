"""Rollouts for online RL: the reward functions a run scores its sampled completions with (`rewards`: a user's
TRL-style functions loaded from their file, and built-ins).

May import: `finetune.config`, `finetune.step`, `jaxmodel`; never the training loop.
"""
