"""TrainConfig: every option of a fine-tuning run, its default and its meaning, in one place.

The CLI's flags, the YAML config file and docs/config.md are all generated from this dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from jaxmodel.errors import UsageError


class ConfigFileError(ValueError, UsageError):
    """A bad option value or YAML file; the message names the file/option and what was expected."""


# `--attention auto` takes the blockwise path from this sequence length on: one attention forward+backward
# (b=1, 16 heads, 4 kv heads, head_dim 64, float32, 2 CPU cores) took 1.25 s plain vs 1.05 s blockwise at
# 2048 positions, 3.1-6.9 s vs 3.7 s at 4096, 49 s vs 17 s at 8192; below 2048 the plain path is as fast.
BLOCKWISE_FROM = 2048

# Section titles for --help and docs/config.md, keyed by the first option of each section (in field order).
SECTIONS = {
    "model": "Data and run directory",
    "mesh": "Mesh and hosts",
    "rank": "LoRA",
    "steps": "Optimisation",
    "dtype": "Numerics and memory",
    "checkpoint_every": "Checkpoints and logging",
    "plan": "Planning without hardware",
}


def option(default: Any, help: str, **kw) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # what to train on, and where the run goes
    model: str | None = option(None, "converted checkpoint directory (convert-llama --out)")
    data: str | None = option(None, "training data: a .jsonl file (rows with 'text', 'prompt'+'completion', "
                                     "or chat 'messages'), or a .json/.parquet/.csv file read with `datasets`")
    out: str | None = option(None, "run directory: checkpoints, metrics.jsonl, TensorBoard events")
    eval_data: str | None = option(None, "evaluation data file (same formats as --data)")
    eval_fraction: float = option(0.0, "hold out this fraction of --data rows for evaluation (when no --eval-data)")
    eval_every: int = option(0, "evaluate every N steps (0: only at the end, if there is eval data)")
    # mesh and hosts
    mesh: str = option("dp=1,fsdp=-1,mp=1", "device mesh sizes; one size may be -1 (all remaining devices)")
    coordinator: str | None = option(None, "HOST:PORT of process 0, for multi-host runs (or JAX_COORDINATOR_ADDRESS)")
    num_processes: int | None = option(None, "number of processes in a multi-host run (or JAX_NUM_PROCESSES)")
    process_id: int | None = option(None, "this process's index in a multi-host run (or JAX_PROCESS_ID)")
    # LoRA
    rank: int = option(8, "LoRA rank r")
    alpha: float = option(16.0, "LoRA alpha; scale = alpha / r (alpha / sqrt(r) with --rslora)")
    targets: str = option("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                          "comma-separated HF module names to adapt (lm_head is possible, never default)")
    rslora: bool = option(False, "rank-stabilised LoRA scaling alpha / sqrt(r)")
    lora_dropout: float = option(0.0, "dropout on the LoRA branch's input, as PEFT's lora_dropout")
    init_adapter: str | None = option(None, "start from this PEFT LoRA adapter directory; its r, alpha, rsLoRA and "
                                            "targets replace --rank/--alpha/--rslora/--targets")
    # optimisation
    steps: int = option(100, "optimizer steps")
    batch_size: int = option(8, "global batch size in sequences per optimizer step (across all devices)")
    grad_accum: int = option(1, "micro-batches per step; each micro-batch holds batch_size / grad_accum rows")
    seq_len: int = option(512, "tokens per sequence")
    pack: bool = option(True, "pack several examples per sequence (attention stays within each); "
                              "--no-pack pads each example to --seq-len")
    lr: float = option(1e-4, "peak learning rate")
    schedule: Literal["cosine", "linear", "constant"] = option("cosine", "decay after warm-up")
    warmup_steps: int = option(0, "linear warm-up steps from 0 to --lr")
    min_lr_ratio: float = option(0.0, "final learning rate as a fraction of --lr (cosine/linear)")
    weight_decay: float = option(0.0, "AdamW weight decay on the LoRA parameters")
    adam_b1: float = option(0.9, "AdamW beta1")
    adam_b2: float = option(0.999, "AdamW beta2")
    adam_eps: float = option(1e-8, "AdamW epsilon")
    clip_norm: float = option(1.0, "clip gradients to this global norm (0: no clipping)")
    seed: int = option(0, "seed of LoRA initialisation, data order and dropout")
    # numerics and memory
    dtype: Literal["bfloat16", "float32"] = option("bfloat16", "compute dtype of the forward/backward pass")
    param_dtype: Literal["keep", "bfloat16", "float32"] = option("keep", "dtype of the frozen base weights in "
                                                                          "device memory (keep: as stored)")
    remat: Literal["none", "full", "dots", "dots_no_batch", "projections", "offload"] = option(
        "dots", "rematerialisation policy of the scanned layer: dots keeps matmul outputs and recomputes the "
                "elementwise work (faster than none on CPU, and less memory); full keeps only layer inputs (least "
                "memory); projections keeps the attention projections but no attention internals (for long "
                "sequences with --attention xla); offload keeps layer inputs in host memory where the backend "
                "supports it")
    attention: Literal["auto", "xla", "blockwise"] = option(
        "auto", "attention without a cache: xla materialises [seq, seq] scores; blockwise (flash-style, memory "
                "linear in seq) computes them block by block; auto: blockwise from --seq-len 2048 on or with cp > 1")
    loss_chunk: int = option(2048, "positions per chunk of the LM head + cross-entropy, so [seq, vocab] logits are "
                                   "never held at once; a sequence (per cp device) of at most this many positions "
                                   "takes the plain loss, which needs less memory then (0: always plain)")
    mlp_chunk: int = option(4096, "positions per chunk of the MLP (per device of the cp axis) when a sequence is "
                                  "longer (0: never chunk)")
    # checkpoints and logging
    checkpoint_every: int = option(100, "save a checkpoint every N steps (and at the end)")
    keep_checkpoints: int = option(3, "keep the newest N checkpoints")
    resume: bool = option(False, "continue from the newest checkpoint in --out")
    stop_after: int = option(0, "end this invocation after N more steps, with a checkpoint (e.g. to fit a job's "
                                "time limit); --resume continues the same schedule (0: run to --steps)")
    log_every: int = option(1, "write metrics every N steps")
    progress: bool = option(True, "show a progress bar (--no-progress to hide it)")
    # planning without hardware
    plan: bool = option(False, "compile the train step from abstract shapes on the current devices and print "
                               "the per-device memory plan; loads no weights and trains nothing")
    model_config: str | None = option(None, "with --plan: a HF config.json instead of --model")
    hbm_gb: float = option(192.0, "with --plan: memory of one device in GB (MI300X: 192); the plan is judged against "
                                  "the part JAX's allocator lets a run use (XLA_CLIENT_MEM_FRACTION, default 0.75)")
    fit: bool = option(False, "with --plan: try --remat, --grad-accum and --mesh settings, fastest first, and print "
                              "the first that fits as a command line")
    show_sharding: bool = option(False, "print each parameter's sharding and per-device bytes, then continue")

    def attention_impl(self, cp: int = 1) -> str:
        """The attention implementation `--attention` names; `auto` resolved for this run's shape."""
        if self.attention != "auto":
            return self.attention
        return "blockwise" if cp > 1 or self.seq_len >= BLOCKWISE_FROM else "xla"

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    def lora_config(self):
        from jaxmodel.lora import LoraConfig

        return LoraConfig(rank=self.rank, alpha=self.alpha, targets=self.target_modules, rslora=self.rslora,
                          dropout=self.lora_dropout)

    def validate(self) -> "TrainConfig":
        """Raise ConfigFileError for values that cannot work, naming the option."""
        positive = ("rank", "steps", "batch_size", "grad_accum", "seq_len", "log_every", "checkpoint_every",
                    "keep_checkpoints")
        for name in ("loss_chunk", "mlp_chunk"):
            if getattr(self, name) < 0:
                raise ConfigFileError(f"--{flag_of(name)} must be 0 or a positive integer, got {getattr(self, name)}")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigFileError(f"--{flag_of(name)} must be a positive integer, got {getattr(self, name)}")
        if self.batch_size % self.grad_accum:
            raise ConfigFileError(f"--batch-size {self.batch_size} must be a multiple of --grad-accum {self.grad_accum}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigFileError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.lr <= 0:
            raise ConfigFileError(f"--lr must be positive, got {self.lr}")
        try:
            self.lora_config()
        except ValueError as e:
            raise ConfigFileError(f"--rank/--alpha/--targets/--lora-dropout: {e}") from None
        if self.fit and not self.plan:
            raise ConfigFileError("--fit goes with --plan")
        if self.plan:
            if not (self.model or self.model_config):
                raise ConfigFileError("--plan needs --model-config CONFIG.json (or --model DIR)")
        else:
            for name in ("model", "data", "out"):
                if not getattr(self, name):
                    raise ConfigFileError(f"--{name} is required")
        return self


def flag_of(name: str) -> str:
    return name.replace("_", "-")


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """Flags for every TrainConfig field, with defaults suppressed so that only given flags override YAML."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of options (keys as the flags, with - or _); "
                                                               "flags given on the command line override it")
    hints = get_type_hints(TrainConfig)
    group = parser
    for f in dataclasses.fields(TrainConfig):
        if f.name in SECTIONS:
            group = parser.add_argument_group(SECTIONS[f.name])
        kind = hints[f.name]
        text = f"{f.metadata['help']} (default: {f.default})"
        if kind is bool:
            group.add_argument(f"--{flag_of(f.name)}", dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=text)
            continue
        choices = list(get_args(kind)) if get_origin(kind) is Literal else None
        group.add_argument(f"--{flag_of(f.name)}", dest=f.name, type=scalar_type(kind), choices=choices,
                           default=argparse.SUPPRESS, metavar=None if choices else f.name.upper(), help=text)
    return parser


def scalar_type(kind) -> type:
    """The Python type of an option's values (str for a Literal, T for `T | None`)."""
    if get_origin(kind) is Literal:
        return str
    args = [a for a in get_args(kind) if a is not type(None)]
    return args[0] if args else kind


def load_config(argv: list[str] | None, prog: str, description: str, validate: bool = True) -> TrainConfig:
    """TrainConfig from YAML (if `--config`) overridden by flags."""
    args = vars(build_parser(prog, description).parse_args(argv))
    values: dict[str, Any] = {}
    config_file = args.pop("config", None)
    if config_file:
        values.update(read_yaml(Path(config_file)))
    values.update(args)
    config = TrainConfig(**values)
    return config.validate() if validate else config


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigFileError(f"{path}: not found") from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigFileError(f"{path}: expected a mapping of option: value")
    hints = get_type_hints(TrainConfig)
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in hints:
            raise ConfigFileError(f"{path}: unknown option '{key}'")
        values[name] = _coerce(path, key, value, hints[name])
    return values


def _coerce(path: Path, key: str, value: Any, kind) -> Any:
    if value is None:
        return None
    if get_origin(kind) is Literal:
        if value not in get_args(kind):
            raise ConfigFileError(f"{path}: option '{key}' must be one of {', '.join(get_args(kind))}, got {value!r}")
        return value
    if key == "targets" and isinstance(value, list):
        return ",".join(map(str, value))
    target = scalar_type(kind)
    if target is bool and not isinstance(value, bool):
        raise ConfigFileError(f"{path}: option '{key}' must be true or false, got {value!r}")
    if target is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, target) or (target is int and isinstance(value, bool)):
        raise ConfigFileError(f"{path}: option '{key}' must be {target.__name__}, got {value!r}")
    return value
