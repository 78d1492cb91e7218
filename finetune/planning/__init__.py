"""`finetune-lora --plan` and `--plan --fit`: the train step compiled from abstract shapes on the mesh, its
per-device memory with the measured margin and its predicted time (`plan`), what the compiled step costs
(`hlo_cost`), the accelerators it is predicted on (`devices`), the prediction (`timing`), the plan as JSON
(`plan_json`), every layout that fits ranked by predicted time (`fit`), and how much of a GPU JAX's allocator lets
a run use (`allocator`).

May import: `finetune.config`, `finetune.step`, `jaxmodel`; never data code (a plan needs no data).
"""
