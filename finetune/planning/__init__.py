"""`finetune-lora --plan` and `--plan --fit`: the train step compiled from abstract shapes on the mesh, its
per-device memory with the measured margin (`plan`), the fastest settings that fit (`fit`), and how much of a
GPU JAX's allocator lets a run use (`allocator`).

May import: `finetune.config`, `finetune.step`, `jaxmodel`; never data code (a plan needs no data).
"""
