"""The compiled train step and what it runs on, shared by training, `--plan` and reading runs: the mesh
(`mesh`), the checks of a run's settings against mesh and model (`checks`), the LM head's loss per token
(`lm_head`), the preference objectives (`preference`) and the policy-gradient ones (`policy`), the model FLOPs
MFU counts (`flops`), the loss, optimizer and jit wiring (`train_step`: the one builder both training and `--plan`
compile), and per-device bytes (`memory`).

May import: `finetune.config`, `jaxmodel`, JAX, optax.
"""
