"""A training run: building it (`build`: mesh, model with LoRA, data, jitted steps), the batches of each step
(`batches`), building them ahead (`prefetch`), the step loop with resume, SIGTERM and evaluation (`loop`), and
metrics.jsonl / TensorBoard / MFU (`metrics`).

May import: every other part of `finetune` except `planning.plan` / `planning.fit` and the CLI.
"""
