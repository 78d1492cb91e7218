"""Rollouts for online RL: the reward functions a run scores its sampled completions with (`rewards`: a user's
TRL-style functions loaded from their file, and built-ins) and the sampled completions laid out as the rows a
policy-gradient step trains on, with the prompt lengths the sampler compiles for (`batch`).

May import: `finetune.config`, `finetune.step`, `jaxmodel`; never the training loop.
"""
