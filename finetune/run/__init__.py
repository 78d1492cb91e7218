"""The run directory: the names of its files (`files`), reading a run (`reading`), claiming and writing one
(`directory`), its lock (`lock`), what a resume may change (`policy`), the record of its tokens
(`data_record`), its Orbax checkpoints (`checkpoints`) and its errors (`errors`).

May import: `finetune.config`, `finetune.step` (the train state a checkpoint holds), `jaxmodel`; never data or
training code, so `export-peft` reads runs without them.
"""
