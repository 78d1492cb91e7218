"""docs/config.md from TrainConfig: every finetune-lora option, its YAML key, type, default, what a `--resume` may
do with it, and its meaning.

    python -m finetune.config_doc > docs/config.md
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args, get_origin, get_type_hints

from finetune.config import (OBJECTIVE_DEFAULTS, SECTIONS, Allowed, NotCompared, Refused, TrainConfig, flag_of,
                             is_list, objective_defaults, scalar_type)

HEADER = """# finetune-lora options

<!-- Generated from finetune/config.py (TrainConfig) by `python -m finetune.config_doc > docs/config.md`;
     tests/test_config_doc.py fails when this file is stale. -->

Every option is a command-line flag and a key of the YAML file given with `--config FILE.yaml` (keys as
the flags, with `-` or `_`); flags given on the command line override the file. Booleans are switched
with `--name` / `--no-name` on the command line and `true` / `false` in YAML; `targets` may be a YAML
list. `finetune-lora --help` lists the same options in the same sections.

The "on --resume" column says whether `--resume` accepts the option with a value other than the run's:
*refused* for what the stored checkpoints and data position depend on (the resume stops and names each
such change), *allowed* for the rest (each change is recorded in `RUN/resumes.jsonl`), and — where it is not
compared: the options that say where the run is and how this invocation treats it.

```yaml
# run.yaml: finetune-lora --config run.yaml [--steps 1000 ...]
model: /data/llama-8b-jax
data: train.jsonl
out: runs/r1
mesh: dp=1,fsdp=8,mp=1
steps: 500
batch_size: 16
seq_len: 512
lr: 2.0e-4
targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]
```
"""


def _type_name(kind) -> str:
    if is_list(kind):
        return f"{scalar_type(kind).__name__}, repeated (a YAML list)"
    if get_origin(kind) is Literal:
        return " \\| ".join(f"`{v}`" for v in get_args(kind))
    return scalar_type(kind).__name__ + (" (optional)" if type(None) in get_args(kind) else "")


def _flags(name: str, kind) -> str:
    flag = f"--{flag_of(name)}"
    return f"`{flag}` / `--no-{flag_of(name)}`" if kind is bool else f"`{flag}`"


ON_RESUME = {Refused: "refused", Allowed: "allowed", NotCompared: "—"}


def config_markdown() -> str:
    hints = get_type_hints(TrainConfig)
    out = [HEADER]
    for f in dataclasses.fields(TrainConfig):
        if f.name in SECTIONS:
            out.append(f"\n## {SECTIONS[f.name]}\n\n| option | YAML key | type | default | on --resume | meaning |\n"
                       "|---|---|---|---|---|---|")
        if f.name in OBJECTIVE_DEFAULTS:
            default = objective_defaults(f.name)
        else:
            default = "—" if f.default is None or f.default == () else f"`{f.default}`"
        on_resume = ON_RESUME[type(f.metadata["resume"])]
        meaning = f.metadata["help"].replace("|", "\\|")
        out.append(f"| {_flags(f.name, hints[f.name])} | `{f.name}` | {_type_name(hints[f.name])} | {default} | "
                   f"{on_resume} | {meaning} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(config_markdown(), end="")
