"""TrainConfig: every option of a fine-tuning run, its default and its meaning, in one place.

The CLI's flags, the YAML config file and docs/config.md are all generated from this dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, get_args, get_origin, get_type_hints

from jaxmodel.errors import UsageError

if TYPE_CHECKING:
    from jaxmodel.quantization import Quantization


class ConfigFileError(ValueError, UsageError):
    """A bad option value or YAML file; the message names the file/option and what was expected."""


# `--attention auto` takes the blockwise path from this sequence length on: the whole train step through
# finetune-lora (bench/long_context.py, 4 layers, hidden 1024, float32, 2 CPU cores) took 8.08 s xla vs 7.38 s
# blockwise at 2048 positions and 24.7 s vs 19.2 s at 4096; at 1024 the two were within 5%.
BLOCKWISE_FROM = 2048

# Section titles for --help and docs/config.md, keyed by the first option of each section (in field order).
SECTIONS = {
    "model": "Data and run directory",
    "mesh": "Mesh and hosts",
    "rank": "LoRA",
    "steps": "Optimisation",
    "objective": "Preference tuning",
    "num_generations": "Online RL",
    "dtype": "Numerics and memory",
    "checkpoint_every": "Checkpoints and logging",
    "plan": "Planning without hardware",
}


# `--targets` by default; on a model with experts the default adapts attention and the experts instead
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
MOE_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")


# Options whose default depends on --objective: {option: {objective: default}}, "*" for the objectives not named. The
# online RL objectives take TRL 1.16's defaults for its GRPOTrainer and RLOOTrainer where they differ from the others'.
# Such an option is declared with None (not given) and read through `TrainConfig.value`.
OBJECTIVE_DEFAULTS: dict[str, dict[str, Any]] = {
    "lr": {"*": 1e-4, "grpo": 1e-6, "rloo": 1e-6},
    "beta": {"*": 0.1, "grpo": 0.0, "rloo": 0.05},
    "num_generations": {"*": None, "grpo": 8, "rloo": 2},
}
PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
POLICY_OBJECTIVES = ("grpo", "rloo")


def objective_defaults(name: str) -> str:
    """An objective-dependent default as the help and docs show it: `1e-4; grpo, rloo: 1e-6`."""
    by_objective = OBJECTIVE_DEFAULTS[name]
    named: dict[Any, list[str]] = {}
    for objective, value in by_objective.items():
        if objective != "*":
            named.setdefault(value, []).append(objective)
    parts = [] if by_objective["*"] is None else [f"{by_objective['*']:g}"]
    return "; ".join(parts + [f"{', '.join(objectives)}: {value:g}" for value, objectives in named.items()])


# What a `--resume` may do with each option, declared beside the option so that a new option cannot be added
# without deciding it (finetune/run/policy.py reads these; docs/config.md shows them). `why` is the reason a
# user sees: what the stored run depends on (Refused), why changing it is harmless (Allowed), or why comparing
# it means nothing (NotCompared).
@dataclasses.dataclass(frozen=True)
class Refused:
    why: str


@dataclasses.dataclass(frozen=True)
class Allowed:
    why: str


@dataclasses.dataclass(frozen=True)
class NotCompared:
    why: str


ResumePolicy = Refused | Allowed | NotCompared


def option(default: Any, help: str, *, resume: ResumePolicy, plan_only: bool = False) -> Any:
    """A TrainConfig field. `plan_only`: the option describes a plan, not a run, so the command line
    `--plan --fit` prints leaves it out."""
    if not isinstance(resume, ResumePolicy) or not resume.why:
        raise TypeError(f"option {help!r}: resume= must be Refused, Allowed or NotCompared with a reason, "
                        f"got {resume!r}")
    return dataclasses.field(default=default, metadata={"help": help, "resume": resume, "plan_only": plan_only})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # what to train on, and where the run goes
    model: str | None = option(None, "converted checkpoint directory (convert-llama --out)",
                               resume=Refused("the base weights the adapters belong to (export-peft reads it from "
                                              "run_config.json)"))
    data: str | None = option(None, "training data: a .jsonl/.json/.parquet/.csv file, a directory or glob of such "
                                     "files (read in sorted name order), or a dataset id in the HF datasets cache",
                              resume=Refused("the rows the stored data position counts through"))
    data_format: Literal["auto", "text", "prompt-completion", "messages", "alpaca", "sharegpt", "preference",
                         "preference-chat", "preference-conversations", "preference-sharegpt",
                         "preference-alpaca", "prompt-only"] = option(
        "auto", "row layout of --data and --eval-data: text, prompt-completion, messages (OpenAI chat), alpaca "
                "(instruction/input/output/system) or sharegpt (conversations of from/value, system); for a "
                "preference objective preference (prompt/chosen/rejected strings), preference-chat (prompt messages, "
                "chosen/rejected replies), preference-conversations (chosen/rejected conversations sharing their "
                "prompt turns), preference-sharegpt (LLaMA-Factory's: conversations, chosen/rejected one from/value "
                "message each, system) or preference-alpaca (LLaMA-Factory's: instruction/input, chosen/rejected "
                "strings, system); for an online RL objective prompt-only (a prompt string or messages, the other "
                "columns passed to the rewards); auto detects it and reports what it found",
        resume=Refused("how each row becomes tokens and training targets"))
    data_split: str = option("train", "split of a dataset id given as --data",
                             resume=Refused("which rows --data names"))
    data_subset: str | None = option(None, "subset (configuration) of a dataset id given as --data",
                                     resume=Refused("which rows --data names"))
    data_cache: str | None = option(None, "directory of tokenized-data caches, reused by reruns, resumes and other "
                                          "runs (default: $XDG_CACHE_HOME/llama-jax/data or ~/.cache/llama-jax/data)",
                                    resume=Allowed("where tokenized data is kept: the same rows either way"))
    data_workers: int = option(0, "processes that tokenize the data (0: one per CPU core, at most one per 20,000 rows)",
                               resume=Allowed("speed only: the same tokens either way"))
    out: str | None = option(None, "run directory: checkpoints, metrics.jsonl, TensorBoard events",
                             resume=NotCompared("where the run is: the same directory, however spelled"))
    eval_data: str | None = option(None, "evaluation data file (same formats as --data)",
                                   resume=Refused("the held-out set every eval_loss in metrics.jsonl is measured on"))
    eval_split: str = option("test", "split of a dataset id given as --eval-data (its subset: --data-subset)",
                             resume=Refused("the held-out set every eval_loss in metrics.jsonl is measured on"))
    eval_fraction: float = option(0.0, "hold out this fraction of --data rows for evaluation (when no --eval-data)",
                                  resume=Refused("which rows of --data are held out, so which rows train"))
    eval_every: int = option(0, "evaluate every N steps (0: only at the end, if there is eval data)",
                             resume=Allowed("when to evaluate, not what"))
    eval_generate: int = option(0, "at each evaluation, also complete the first N held-out prompts (greedily, at most "
                                   "--max-completion-length tokens; an online RL objective as it samples) and write "
                                   "them with the step's metrics (metrics.jsonl, TensorBoard text), beside each "
                                   "prompt's own reply or reward", resume=Allowed("what an evaluation also writes"))
    # mesh and hosts
    mesh: str = option("dp=1,fsdp=-1,mp=1", "device mesh sizes; one size may be -1 (all remaining devices)",
                       resume=Allowed("the layout only: restore reshards, and losses agree across meshes to 1e-5"))
    coordinator: str | None = option(None, "HOST:PORT of process 0, for multi-host runs (or JAX_COORDINATOR_ADDRESS)",
                                     resume=Allowed("the hosts only"))
    num_processes: int | None = option(None, "number of processes in a multi-host run (or JAX_NUM_PROCESSES)",
                                       resume=Allowed("the hosts only"))
    process_id: int | None = option(None, "this process's index in a multi-host run (or JAX_PROCESS_ID)",
                                    resume=Allowed("the hosts only"))
    # LoRA
    rank: int = option(8, "LoRA rank r", resume=Refused("the shape of the stored adapters"))
    alpha: float = option(16.0, "LoRA alpha; scale = alpha / r (alpha / sqrt(r) with --rslora)",
                          resume=Refused("the adapters' scale (export writes it from run_config.json)"))
    targets: str = option(DEFAULT_TARGETS,
                          "comma-separated HF module names to adapt (lm_head is possible, never default); the "
                          "routed experts are experts.gate_up_proj and experts.down_proj, the router gate (which adds "
                          "the load-balancing loss). The default on a model with experts: the attention projections "
                          "and the experts",
                          resume=Refused("which modules have stored adapters"))
    rank_pattern: str | None = option(None, "ranks of their own for some targets, TARGET=R[,TARGET=R...], the "
                                            "others --rank (PEFT's rank_pattern: one rank a target in every layer)",
                                      resume=Refused("the shape of the stored adapters"))
    alpha_pattern: str | None = option(None, "alphas of their own for some targets, TARGET=ALPHA[,...], the others "
                                             "--alpha (PEFT's alpha_pattern)",
                                       resume=Refused("the adapters' scale (export writes it from run_config.json)"))
    rslora: bool = option(False, "rank-stabilised LoRA scaling alpha / sqrt(r)",
                          resume=Refused("the adapters' scale (export writes it from run_config.json)"))
    lora_dropout: float = option(0.0, "dropout on the LoRA branch's input, as PEFT's lora_dropout",
                                 resume=Refused("the function being trained"))
    init_adapter: str | None = option(None, "start from this PEFT LoRA adapter directory; its r, alpha, patterns, "
                                            "rsLoRA and targets replace --rank/--alpha/--rank-pattern/"
                                            "--alpha-pattern/--rslora/--targets",
                                      resume=Refused("the starting point and shape of the adapters"))
    # optimisation
    steps: int = option(100, "optimizer steps",
                        resume=Allowed("the schedule's length: a run can be extended or shortened"))
    batch_size: int = option(8, "global batch size in sequences per optimizer step (across all devices)",
                             resume=Refused("the rows per step the stored data position counts in"))
    grad_accum: int = option(1, "micro-batches per step; each micro-batch holds batch_size / grad_accum rows (grpo/"
                                "rloo: batch_size x num_generations / grad_accum completions; their sampler draws all "
                                "of them at once)",
                             resume=Refused("the micro-batches each step's dropout keys are split over"))
    seq_len: int = option(512, "tokens per sequence; a longer example is cut to it, with one warning counting "
                               "the examples cut and those left with no training target",
                          resume=Refused("the rows themselves (packing and truncation)"))
    max_prompt_len: int = option(
        0, "bound each prompt (of prompt-completion, alpaca and chat rows and of preference pairs) to N tokens, "
           "keeping its end next to the reply: a chat keeps BOS, its system turn and the template's headers whole, "
           "dropping whole old turns first, then the start of the oldest kept content; the data line counts the "
           "prompts cut (0: prompts kept whole, a long one cut with its example by --seq-len)",
        resume=Refused("the rows themselves (which prompt tokens each example keeps)"))
    pack: bool = option(True, "pack several examples per sequence (attention stays within each); "
                              "--no-pack pads each example to --seq-len",
                        resume=Refused("the rows themselves"))
    lr: float | None = option(None, "peak learning rate",
                       resume=Refused("the optimisation the stored Adam moments belong to (and the model card's "
                                      "learning rate)"))
    schedule: Literal["cosine", "linear", "constant"] = option(
        "cosine", "decay after warm-up", resume=Refused("the optimisation the stored Adam moments belong to"))
    warmup_steps: int = option(0, "linear warm-up steps from 0 to --lr",
                               resume=Refused("the optimisation the stored Adam moments belong to"))
    min_lr_ratio: float = option(0.0, "final learning rate as a fraction of --lr (cosine/linear)",
                                 resume=Refused("the optimisation the stored Adam moments belong to"))
    weight_decay: float = option(0.0, "AdamW weight decay on the LoRA parameters",
                                 resume=Refused("the optimisation the stored Adam moments belong to"))
    adam_b1: float = option(0.9, "AdamW beta1", resume=Refused("the meaning of the stored first moments"))
    adam_b2: float = option(0.999, "AdamW beta2", resume=Refused("the meaning of the stored second moments"))
    adam_eps: float = option(1e-8, "AdamW epsilon",
                             resume=Refused("the optimisation the stored Adam moments belong to"))
    clip_norm: float = option(1.0, "clip gradients to this global norm (0: no clipping)",
                              resume=Refused("the optimisation (and 0 <-> non-zero changes the stored optimizer "
                                             "state's structure)"))
    seed: int = option(0, "seed of LoRA initialisation, data order and dropout",
                       resume=Refused("the data order and dropout keys"))
    # preference tuning
    objective: Literal["sft", "dpo", "ipo", "simpo", "orpo", "grpo", "rloo"] = option(
        "sft", "what the step minimises: sft (next-token loss on the trained tokens), a preference objective on "
               "chosen/rejected pairs (dpo, ipo, simpo, orpo; docs/preference-tuning.md; --batch-size counts pairs) "
               "or an online RL objective on completions sampled from the policy and scored by --reward (grpo, rloo: "
               "TRL's GRPOTrainer and RLOOTrainer; docs/rl.md; --batch-size counts prompts)",
        resume=Refused("the function being optimised"))
    beta: float | None = option(None, "dpo/ipo/simpo: the inverse temperature b of the preference loss; grpo: the "
                                      "weight of the k3 KL to --reference in the loss; rloo: the weight of the KL to "
                                      "--reference in the rewards; 0: no reference pass",
                                resume=Refused("the function being optimised"))
    label_smoothing: float = option(0.0, "dpo only: the conservative DPO's assumed label noise e, "
                                         "-(1-e) log s(b D) - e log s(-b D)",
                                    resume=Refused("the function being optimised"))
    simpo_gamma: float = option(0.5, "simpo only: the target reward margin gamma",
                                resume=Refused("the function being optimised"))
    orpo_lambda: float = option(0.1, "orpo only: the weight lambda of the odds-ratio term",
                                resume=Refused("the function being optimised"))
    reference: Literal["auto", "base", "init"] = option(
        "auto", "dpo/ipo, and grpo/rloo with --beta > 0: the reference model: base (the base model with every LoRA "
                "branch off), init (the --init-adapter as loaded, frozen); auto: init with --init-adapter, else base",
        resume=Refused("the reference the losses are measured against"))
    precompute_reference: bool = option(
        False, "dpo/ipo only: compute the reference's log-probability of every pair once, before training, and "
               "store it with the tokenized data (reused by later runs and resumes on the same data, model, "
               "adapter and dtypes), so that a step runs no reference forward",
        resume=Allowed("the same values as the reference computed in the step"))
    # online RL (TRL's option names)
    num_generations: int | None = option(
        None, "grpo/rloo: completions sampled for each prompt, G (each step trains --batch-size x G completions)",
        resume=Refused("the completions each step trains on"))
    max_completion_length: int = option(512, "grpo/rloo: the most tokens a sampled completion has (and, with "
                                             "--eval-generate, an evaluation's completions under any objective)",
                                        resume=Refused("the completions each step trains on"))
    temperature: float = option(1.0, "grpo/rloo: the sampling temperature (log-probabilities are taken at it, as TRL "
                                     "takes them)", resume=Refused("the completions and the function being optimised"))
    top_p: float = option(1.0, "grpo/rloo: sample from the smallest set of tokens whose probability reaches top_p",
                          resume=Refused("the completions each step trains on"))
    top_k: int = option(0, "grpo/rloo: sample from the top_k most likely tokens (0: all)",
                        resume=Refused("the completions each step trains on"))
    min_p: float = option(0.0, "grpo/rloo: sample only tokens at least min_p times as likely as the most likely one "
                               "(0: all)", resume=Refused("the completions each step trains on"))
    reward: tuple[str, ...] = option(
        (), "grpo/rloo: a reward function, path/to/file.py:function (called as TRL calls one) or a built-in: "
            "equals:COLUMN, regex:PATTERN, last-number:COLUMN; repeat the flag (a YAML list) for several, summed with "
            "--reward-weights", resume=Refused("the function being optimised"))
    reward_weights: str | None = option(None, "grpo/rloo: the weight of each --reward, comma-separated (default: 1 "
                                              "each)", resume=Refused("the function being optimised"))
    loss_type: Literal["dapo", "grpo", "bnpo", "dr_grpo"] = option(
        "dapo", "grpo only: how the per-token losses are averaged (TRL's loss_type: dapo over the batch's tokens, grpo "
                "each completion's mean, bnpo each micro-batch's tokens, dr_grpo over completions x "
                "max_completion_length)", resume=Refused("the function being optimised"))
    scale_rewards: Literal["group", "batch", "none"] = option(
        "group", "grpo only: divide each advantage by the reward spread of its prompt's group, of the batch, or not",
        resume=Refused("the function being optimised"))
    importance_sampling_level: Literal["token", "sequence"] = option(
        "token", "grpo only: each token's ratio to the sampling policy, or each completion's (GSPO)",
        resume=Refused("the function being optimised"))
    epsilon: float = option(0.2, "grpo/rloo: ratios are clipped to [1 - epsilon, 1 + epsilon_high]",
                            resume=Refused("the function being optimised"))
    epsilon_high: float | None = option(None, "grpo/rloo: the upper clip (default: epsilon)",
                                        resume=Refused("the function being optimised"))
    num_iterations: int = option(1, "grpo/rloo: optimizer steps on each batch of completions (their log-probabilities "
                                    "when sampled come from one forward pass, as TRL's)",
                                 resume=Refused("which steps sample new completions"))
    mask_truncated_completions: bool = option(False, "grpo/rloo: completions cut at max_completion_length train "
                                                     "nothing (grpo's and dr_grpo's averages over completions still "
                                                     "count them, as TRL's do)",
                                              resume=Refused("the function being optimised"))
    normalize_advantages: bool = option(False, "rloo only: standardise the advantages over the batch",
                                        resume=Refused("the function being optimised"))
    # numerics and memory
    dtype: Literal["bfloat16", "float32"] = option("bfloat16", "compute dtype of the forward/backward pass",
                                                   resume=Refused("the numerics of the function being trained"))
    param_dtype: Literal["keep", "bfloat16", "float32"] = option(
        "keep", "dtype of the frozen base weights in device memory (keep: as stored)",
        resume=Refused("the frozen weights the adapters are trained against"))
    remat: Literal["none", "full", "dots", "dots_no_batch", "projections", "offload"] = option(
        "dots", "rematerialisation policy of the scanned layer: dots keeps matmul outputs and recomputes the "
                "elementwise work (faster than none on CPU, and less memory); full keeps only layer inputs (least "
                "memory); projections keeps the attention projections but no attention internals (for long "
                "sequences with --attention xla); offload keeps layer inputs in host memory where the backend "
                "supports it",
        resume=Allowed("memory/speed only, same function"))
    attention: Literal["auto", "xla", "blockwise", "cudnn", "pallas-triton", "pallas-flash", "aiter"] = option(
        "auto", "attention without a cache: xla materialises [seq, seq] scores; blockwise (flash-style, memory "
                "linear in seq) computes them block by block; cudnn (NVIDIA, --no-pack rows), pallas-triton "
                "(NVIDIA sm80+), pallas-flash (this package's Pallas kernel, Triton: also cp > 1 and sliding "
                "windows) and aiter (AMD, --no-pack rows; untested) are fused kernels, each checked against "
                "blockwise before the run takes it, the portable path serving what a kernel cannot take; auto: on "
                "an NVIDIA GPU the first of cudnn, pallas-triton, pallas-flash that takes the run and agrees (on an "
                "AMD GPU aiter, pallas-flash), else blockwise from --seq-len 2048 on or with cp > 1, else xla",
        resume=Allowed("memory/speed only, same function"))
    loss_chunk: int = option(2048, "positions per chunk of the LM head + cross-entropy, so [seq, vocab] logits are "
                                   "never held at once: a frozen head computes each chunk's logits once (its chunks "
                                   "also hold at most a few hundred rows per device); with LoRA on lm_head they "
                                   "are computed again in the backward pass, and a sequence (per cp device) of at "
                                   "most this many positions takes the plain loss (0: always plain)",
                             resume=Allowed("memory/speed only, same function"))
    fp8_matmul: Literal["off", "e4m3fn", "e4m3fnuz"] = option(
        "off", "with an fp8 base: multiply the frozen projections in this FP8 against their codes as stored (e4m3fn: "
               "H100, H200; e4m3fnuz: MI300X), the activations quantized per 1 x block tile, instead of dequantizing "
               "each weight to --dtype first (docs/deepseek-on-mi300x.md: the bound on the difference); gradients "
               "through the dequantized weight",
        resume=Allowed("how the frozen weights are multiplied: the same adapter and optimizer state, the step's values "
                       "within the documented bound of each other"))
    mlp_chunk: int = option(4096, "positions per chunk of the MLP (per device of the cp axis) when a sequence is "
                                  "longer (0: never chunk)",
                            resume=Allowed("memory/speed only, same function"))
    # checkpoints and logging
    checkpoint_every: int = option(100, "save a checkpoint every N steps (and at the end)",
                                   resume=Allowed("when to save"))
    keep_checkpoints: int = option(3, "keep the newest N checkpoints", resume=Allowed("how many to keep"))
    resume: bool = option(False, "continue from the newest checkpoint in --out",
                          resume=NotCompared("how this invocation treats the run directory"))
    overwrite: bool = option(False, "start a new run in a non-empty --out, deleting the run it holds",
                             resume=NotCompared("how this invocation treats the run directory"))
    stop_after: int = option(0, "end this invocation after N more steps, with a checkpoint (e.g. to fit a job's "
                                "time limit); --resume continues the same schedule (0: run to --steps)",
                             resume=Allowed("this invocation's length"))
    log_every: int = option(1, "write metrics every N steps", resume=Allowed("how often to log"))
    progress: bool = option(True, "show a progress bar (--no-progress to hide it)", resume=Allowed("display only"))
    # planning without hardware
    plan: bool = option(False, "compile the train step from abstract shapes on the current devices and print "
                               "the per-device memory plan; loads no weights and trains nothing",
                        resume=Allowed("planning only"), plan_only=True)
    model_config: str | None = option(None, "with --plan: a HF config.json instead of --model",
                                      resume=Allowed("planning only"), plan_only=True)
    hbm_gb: float = option(192.0, "with --plan: memory of one device in GB of 1e9 bytes (MI300X: 206.1, its 192 GiB; "
                                  "205.8 on an MI300X VF; 192 is conservative); the plan is judged against the part "
                                  "JAX's allocator lets a run use (XLA_CLIENT_MEM_FRACTION, default 0.75)",
                           resume=Allowed("planning only"), plan_only=True)
    fit: bool = option(False, "with --plan: try --remat, --grad-accum and --mesh settings, fastest first, and print "
                              "the first that fits as a command line",
                       resume=Allowed("planning only"), plan_only=True)
    fit_minutes: float = option(20.0, "with --plan --fit: plan no new setting after this many minutes, and say which "
                                      "meshes were left unplanned (0: no limit)",
                                resume=Allowed("planning only"), plan_only=True)
    device_model: str | None = option(None, "with --plan: the accelerator the predicted step time is for: mi300x, "
                                            "mi325x, h100, h200, or a JSON file of bench/device_report.py --json "
                                            "(default: the accelerator the plan runs on; mi300x on a CPU)",
                                      resume=Allowed("planning only"), plan_only=True)
    plan_json: str | None = option(None, "with --plan: also write the plan (memory, predicted time, collectives) "
                                         "to this JSON file",
                                   resume=Allowed("planning only"), plan_only=True)
    # plan-only: a quantized base is a property of the converted checkpoint a run trains on, never an option of the run
    quantize: Literal["none", "nf4", "int8", "fp8"] = option("none", "with --plan --model-config: plan a base quantized "
                                                              "this way (convert-llama --quantize); a quantized "
                                                              "--model says so itself",
                                                      resume=Allowed("planning only"), plan_only=True)
    quant_block: int | None = option(None, "with --plan --quantize: values per scale, or fp8's square blocks' side "
                                           "(convert-llama --quant-block; default 64, fp8 128)",
                                     resume=Allowed("planning only"), plan_only=True)
    show_sharding: bool = option(False, "print each parameter's sharding and per-device bytes, then continue",
                                 resume=Allowed("display only"), plan_only=True)

    def __post_init__(self):
        if isinstance(self.reward, str):  # one reward, as YAML or Python may give it
            object.__setattr__(self, "reward", (self.reward,))
        elif isinstance(self.reward, list):  # several, as argparse and run_config.json give them
            object.__setattr__(self, "reward", tuple(self.reward))

    def portable_attention(self, cp: int = 1) -> str:
        """The portable attention path of this run: xla or blockwise as `--attention` names it; otherwise (auto, and
        a fused kernel's fallback) resolved for this run's shape."""
        if self.attention in ("xla", "blockwise"):
            return self.attention
        return "blockwise" if cp > 1 or self.seq_len >= BLOCKWISE_FROM else "xla"

    def attention_impl(self, cp: int = 1) -> str:
        """The attention `--plan` compiles: the portable path, and blockwise for a fused kernel (a CPU compiles
        none; both hold O(seq) per row: the output and its log-sum-exp). The run resolves its own
        (`finetune.step.attention_choice`)."""
        fused = self.attention not in ("auto", "xla", "blockwise")
        return "blockwise" if fused else self.portable_attention(cp)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    def lora_config(self, model=None):
        """The adapters' LoraConfig; `model` (the base's `ModelConfig`) decides what the default targets mean."""
        from jaxmodel.lora import LoraConfig

        return LoraConfig(rank=self.rank, alpha=self.alpha, targets=self.adapted(model), rslora=self.rslora,
                          dropout=self.lora_dropout, rank_pattern=_pattern(self.rank_pattern, "rank", int),
                          alpha_pattern=_pattern(self.alpha_pattern, "alpha", float))

    def adapted(self, model=None) -> tuple[str, ...]:
        """The targets for the base `model`: `--targets` as given, or, when left at the default, the model's
        attention projections (multi-head latent attention's own) and its MLP's, on a model with experts its routed
        experts instead (a dense MLP's adapter on such a class is one PEFT cannot serve:
        `jaxmodel.families.Family.unservable_targets`)."""
        if self.targets != DEFAULT_TARGETS or model is None:
            return self.target_modules
        from jaxmodel.lora import EXPERT_TARGETS, MLP_TARGETS, attention_targets

        return attention_targets(model) + (EXPERT_TARGETS if model.num_experts else MLP_TARGETS)

    def validate(self) -> "TrainConfig":
        """Raise ConfigFileError for values that cannot work, naming the option and what it accepts."""
        hints = get_type_hints(TrainConfig)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            choices = get_args(hints[f.name]) if get_origin(hints[f.name]) is Literal else None
            if choices and value not in choices:
                raise ConfigFileError(f"--{flag_of(f.name)} must be one of {', '.join(choices)}, got {value!r}")
            if f.name in OPTION_RANGES and value is not None:
                accepts, expected = OPTION_RANGES[f.name]
                if not accepts(value):
                    raise ConfigFileError(f"--{flag_of(f.name)} must be {expected}, got {value}")
        if self.max_prompt_len >= self.seq_len and not self.policy:
            raise ConfigFileError(f"--max-prompt-len {self.max_prompt_len} must be below --seq-len {self.seq_len}: "
                                  "the reply needs room after the prompt")
        if self.rows_per_step % self.grad_accum:
            counted = (f"--batch-size {self.batch_size} x --num-generations {self.value('num_generations')}"
                       if self.policy else f"--batch-size {self.batch_size}")
            raise ConfigFileError(f"{counted} must be a multiple of --grad-accum {self.grad_accum}")
        try:
            self.lora_config()
        except ConfigFileError:
            raise
        except ValueError as e:
            raise ConfigFileError(f"--rank/--alpha/--targets/--lora-dropout/--rank-pattern/--alpha-pattern: {e}") \
                from None
        self._validate_objective()
        if self.eval_generate and not (self.eval_data or self.eval_fraction):
            raise ConfigFileError("--eval-generate needs held-out prompts: --eval-data or --eval-fraction")
        for name in ("fit", "device_model", "plan_json"):
            if getattr(self, name) and not self.plan:
                raise ConfigFileError(f"--{flag_of(name)} goes with --plan")
        if self.plan:
            if not (self.model or self.model_config):
                raise ConfigFileError("--plan needs --model-config CONFIG.json (or --model DIR)")
        else:
            for name in ("model", "data", "out"):
                if not getattr(self, name):
                    raise ConfigFileError(f"--{name} is required")
        return self


    def value(self, name: str) -> Any:
        """Option `name` as the run uses it: as given, or, for an option whose default depends on the objective
        (`OBJECTIVE_DEFAULTS`) and that was not given, this objective's default."""
        given = getattr(self, name)
        if given is not None or name not in OBJECTIVE_DEFAULTS:
            return given
        by_objective = OBJECTIVE_DEFAULTS[name]
        return by_objective.get(self.objective, by_objective["*"])

    @property
    def preference(self) -> bool:
        """Whether the run trains a preference objective on chosen/rejected pairs."""
        return self.objective in PREFERENCE_OBJECTIVES

    @property
    def policy(self) -> bool:
        """Whether the run trains an online RL objective on completions it samples (grpo, rloo)."""
        return self.objective in POLICY_OBJECTIVES

    @property
    def rows_per_step(self) -> int:
        """The sequences one optimizer step trains on before packing: --batch-size, or with an online RL objective
        --batch-size prompts x --num-generations completions (preference pairs count as --batch-size here)."""
        return self.batch_size * self.value("num_generations") if self.policy else self.batch_size

    @property
    def step_rows(self) -> int:
        """The most rows of --seq-len tokens one step computes: `rows_per_step`, and two a pair for a preference
        objective (unpacked: packing never needs more)."""
        return 2 * self.batch_size if self.preference else self.rows_per_step

    def reference_model(self) -> str | None:
        """The reference a dpo/ipo run (or a grpo/rloo run with --beta > 0) measures against (`--reference` with
        `auto` resolved); None for the objectives that have none."""
        if self.objective not in ("dpo", "ipo") and not (self.policy and self.value("beta") > 0):
            return None
        if self.reference == "auto":
            return "init" if self.init_adapter else "base"
        return self.reference

    @property
    def reference_forward(self) -> bool:
        """Whether each step runs the reference model's forward (dpo/ipo without --precompute-reference)."""
        return self.preference and self.reference_model() is not None and not self.precompute_reference

    def _validate_objective(self) -> None:
        """An option that belongs to another objective is refused rather than silently ignored."""
        rl = POLICY_OBJECTIVES
        owners = {"beta": ("dpo", "ipo", "simpo", *rl), "label_smoothing": ("dpo",), "simpo_gamma": ("simpo",),
                  "orpo_lambda": ("orpo",), "reference": ("dpo", "ipo", *rl), "precompute_reference": ("dpo", "ipo"),
                  **{name: rl for name in ("num_generations", "max_completion_length", "temperature", "top_p",
                                           "top_k", "min_p", "reward", "reward_weights", "epsilon", "epsilon_high",
                                           "num_iterations", "mask_truncated_completions")},
                  "loss_type": ("grpo",), "scale_rewards": ("grpo",), "importance_sampling_level": ("grpo",),
                  "normalize_advantages": ("rloo",)}
        if self.eval_generate:  # the length of the completions it writes, whatever the objective
            owners.pop("max_completion_length")
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        for name, objectives in owners.items():
            if getattr(self, name) != defaults[name] and self.objective not in objectives:
                goes_with = "--objective " + (objectives[0] if len(objectives) == 1 else
                                              f"{', '.join(objectives[:-1])} or {objectives[-1]}")
                raise ConfigFileError(f"--{flag_of(name)} goes with {goes_with}, not --objective {self.objective}")
        if self.preference and self.value("beta") <= 0 and self.objective != "orpo":
            raise ConfigFileError(f"--beta must be a finite number > 0, got {self.value('beta')}")
        if self.reference == "init" and not self.init_adapter:
            raise ConfigFileError("--reference init needs --init-adapter (the adapter the reference is)")
        if self.policy:
            self._validate_policy()
        self.check_router_objective()

    def _validate_policy(self) -> None:
        if not self.reward and not self.plan:
            raise ConfigFileError(f"--objective {self.objective} needs --reward (path/to/file.py:function, or a "
                                  "built-in: equals:COLUMN, regex:PATTERN, last-number:COLUMN)")
        weights = self.reward_weight_values()
        if len(weights) != len(self.reward) and not self.plan:
            raise ConfigFileError(f"--reward-weights gives {len(weights)} weights for {len(self.reward)} --reward "
                                  "functions: give one each")
        if self.reference != "auto" and self.value("beta") == 0:
            raise ConfigFileError(f"--reference goes with --beta > 0 for --objective {self.objective} (with --beta 0 "
                                  "no reference runs)")

    def reward_weight_values(self) -> tuple[float, ...]:
        """--reward-weights as numbers (1 for each --reward when not given)."""
        if self.reward_weights is None:
            return (1.0,) * len(self.reward)
        try:
            weights = tuple(float(w) for w in self.reward_weights.split(","))
        except ValueError:
            raise ConfigFileError(f"--reward-weights {self.reward_weights!r}: expected numbers separated by "
                                  "commas") from None
        if not all(math.isfinite(w) for w in weights):
            raise ConfigFileError(f"--reward-weights {self.reward_weights!r}: expected finite numbers")
        return weights

    def multiplied(self, quantization: Quantization | None) -> Quantization | None:
        """The base's quantization as the run multiplies it: with --fp8-matmul, an fp8 base's codes in that FP8."""
        if self.fp8_matmul == "off":
            return quantization
        if quantization is None or quantization.scheme != "fp8":
            held = "not quantized" if quantization is None else f"quantized {quantization.scheme}"
            raise ConfigFileError(f"--fp8-matmul {self.fp8_matmul}: the base is {held}; FP8 matmuls take an fp8 base "
                                  "(an FP8 checkpoint, or convert-llama --quantize fp8)")
        return dataclasses.replace(quantization, matmul=self.fp8_matmul)

    def check_router_objective(self) -> None:
        """Training the router (target `gate`) adds the load-balancing loss to the SFT objective; the preference
        and online RL objectives do not add it, so they refuse the router rather than train it unbalanced."""
        if self.objective != "sft" and "gate" in self.target_modules:
            raise ConfigFileError(f"--targets gate (the router) goes with --objective sft, not --objective "
                                  f"{self.objective}: its load-balancing loss is added to the SFT loss only")


def _pattern(text: str | None, what: str, kind: type) -> dict[str, Any]:
    """`--rank-pattern`/`--alpha-pattern` TARGET=VALUE,... as {target: value}."""
    pattern = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        target, _, value = item.partition("=")
        try:
            pattern[target.strip()] = kind(value)
        except ValueError:
            raise ConfigFileError(f"--{what}-pattern {text!r}: expected TARGET={what.upper()} pairs separated by "
                                  "commas") from None
    return pattern


# (accepts(value), what is expected) for each numeric option; comparisons with NaN are false, so NaN is refused.
_POSITIVE_INT = (lambda v: v > 0, "a positive integer")
_COUNT = (lambda v: v >= 0, "0 or a positive integer")
_POSITIVE = (lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
_NON_NEGATIVE = (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
_UNIT_CLOSED = (lambda v: 0 <= v <= 1, "in [0, 1]")
_UNIT_OPEN = (lambda v: 0 <= v < 1, "in [0, 1)")

# What every int/float option accepts (tests/test_config.py checks that each one has an entry). A rank must
# also fit the adapted layers: checked once the model's config is known (finetune/setup.py, check_rank).
OPTION_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "eval_fraction": _UNIT_OPEN,
    "eval_every": _COUNT,
    "eval_generate": _COUNT,
    "data_workers": _COUNT,
    "num_processes": _POSITIVE_INT,
    "process_id": _COUNT,  # below --num-processes: checked where the processes join (finetune/mesh.py)
    "rank": _POSITIVE_INT,
    "alpha": _POSITIVE,
    "lora_dropout": _UNIT_OPEN,
    "steps": _POSITIVE_INT,
    "batch_size": _POSITIVE_INT,
    "grad_accum": _POSITIVE_INT,
    "seq_len": (lambda v: v >= 2, "an integer >= 2 (a token's target is the next token)"),
    "max_prompt_len": _COUNT,
    "lr": _POSITIVE,
    "warmup_steps": _COUNT,
    "min_lr_ratio": _UNIT_CLOSED,
    "weight_decay": _NON_NEGATIVE,
    "adam_b1": _UNIT_OPEN,
    "adam_b2": _UNIT_OPEN,
    "adam_eps": _POSITIVE,
    "clip_norm": _NON_NEGATIVE,
    "beta": _NON_NEGATIVE,  # and > 0 for dpo/ipo/simpo: `_validate_objective`
    "label_smoothing": (lambda v: 0 <= v < 0.5, "in [0, 0.5)"),
    "simpo_gamma": (lambda v: math.isfinite(v), "a finite number"),
    "orpo_lambda": _NON_NEGATIVE,
    "num_generations": (lambda v: v >= 2, "at least 2 (a completion's advantage is measured against its prompt's "
                                          "others)"),
    "max_completion_length": _POSITIVE_INT,
    "temperature": _POSITIVE,
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": _COUNT,
    "min_p": _UNIT_CLOSED,
    "epsilon": _NON_NEGATIVE,
    "epsilon_high": _NON_NEGATIVE,
    "num_iterations": _POSITIVE_INT,
    "seed": (lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)"),  # what numpy and JAX take as a seed
    "loss_chunk": _COUNT,
    "mlp_chunk": _COUNT,
    "checkpoint_every": _POSITIVE_INT,
    "keep_checkpoints": _POSITIVE_INT,
    "stop_after": _COUNT,
    "log_every": _POSITIVE_INT,
    "hbm_gb": _POSITIVE,
    "fit_minutes": _NON_NEGATIVE,
    "quant_block": _POSITIVE_INT,
}


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
        default = "none" if is_list(kind) and not f.default else f.default
        if f.name in OBJECTIVE_DEFAULTS:
            default = objective_defaults(f.name)
        text = f"{f.metadata['help']} (default: {default})"
        if is_list(kind):
            group.add_argument(f"--{flag_of(f.name)}", dest=f.name, action="append", default=argparse.SUPPRESS,
                               metavar=f.name.upper(), help=text)
            continue
        if kind is bool:
            group.add_argument(f"--{flag_of(f.name)}", dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=text)
            continue
        choices = list(get_args(kind)) if get_origin(kind) is Literal else None
        group.add_argument(f"--{flag_of(f.name)}", dest=f.name, type=scalar_type(kind), choices=choices,
                           default=argparse.SUPPRESS, metavar=None if choices else f.name.upper(), help=text)
    return parser


def is_list(kind) -> bool:
    """Whether an option takes several values (`tuple[str, ...]`: a repeated flag, a YAML list)."""
    return get_origin(kind) is tuple


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
    if is_list(kind):
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in values):
            raise ConfigFileError(f"{path}: option '{key}' must be a string or a list of strings, got {value!r}")
        return tuple(values)
    target = scalar_type(kind)
    if target is bool and not isinstance(value, bool):
        raise ConfigFileError(f"{path}: option '{key}' must be true or false, got {value!r}")
    if target is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, target) or (target is int and isinstance(value, bool)):
        raise ConfigFileError(f"{path}: option '{key}' must be {target.__name__}, got {value!r}")
    return value
