"""`--plan` of an online RL run's rollouts: beside the training step, the sampler (a prefill of the prompts, then
every decode step reading the KV cache) and the log-prob passes, compiled from abstract shapes on the run's mesh,
with their temporaries a device and their predicted time on the device model.

A generation batch serves `--num-iterations` training steps and costs one draw of `--batch-size` x G completions
(`jaxmodel.generation.sample_arrays`) and the forward passes its objective needs
(`finetune.step.policy.PolicyObjective.scored_logps`: the policy's old log-probabilities, the reference's). The
sampler is planned at its most: prompts of `--seq-len` - `--max-completion-length` tokens and every completion
`--max-completion-length` tokens long (a real draw ends when every row has stopped). On a CPU a 16-bit rollout is
compiled in float32 and its temporaries, traffic and collectives scaled by the dtype's size (the training step's
own estimate, `planning.plan`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from finetune.config import ConfigFileError, TrainConfig
from finetune.planning.devices import DeviceModel
from finetune.planning.hlo_cost import StepCost, step_cost
from finetune.planning.timing import Prediction, predict
from finetune.step.flops import forward_flops_per_token
from finetune.step.policy import PolicyObjective
from finetune.step.train_step import FLOAT_BATCH_KEYS, ROLLOUT_BATCH_KEYS, TrainState, jit_policy_logps
from jaxmodel.config import ModelConfig
from jaxmodel.generation import Sampling, sample_arrays
from jaxmodel.sharding import DEFAULT_RULES, batch_sharding

GB = 1e9


@dataclasses.dataclass
class Phase:
    """One part of a rollout, as planned: its temporaries a device, how often it runs a training step, its time."""

    name: str
    temp: float
    runs: float
    prediction: Prediction | None
    cost: StepCost | None = None

    @property
    def seconds(self) -> float:
        """Its time a run, predicted (0 when not predicted)."""
        return self.prediction.step_seconds if self.prediction is not None else 0.0

    def as_json(self) -> dict:
        out = {"name": self.name, "temp_bytes": self.temp, "runs_per_step": self.runs}
        if self.prediction is not None:
            out["predicted"] = self.prediction.as_json()
            out["collectives"] = self.prediction.collectives
        return out


def prompt_tokens(config: TrainConfig) -> int:
    """The prompt length a plan samples from: --seq-len less --max-completion-length."""
    prompt = config.seq_len - config.max_completion_length
    if prompt < 1:
        raise ConfigFileError(f"--plan --objective {config.objective} plans rows of --seq-len {config.seq_len} tokens, "
                              f"a prompt and its --max-completion-length {config.max_completion_length} completion: "
                              "give --seq-len above --max-completion-length")
    return prompt


def plan_rollout(config: TrainConfig, llama: ModelConfig, mesh, trees, device: DeviceModel | None, scale: float,
                 sampler_shares: dict[str, float], pass_shares: dict[str, float]) -> list[Phase]:
    """The sampler and the log-prob pass of `config`'s run on `mesh`; `trees` = (graphdef, lora, base) abstract on
    it, in the dtype the plan compiles; `scale`: what multiplies a float32 compile's bytes (1 otherwise); no
    prediction without a `device`; the shares of a mixture of experts' blocks of each (`plan.expert_block_shares`:
    the sampler's decode steps, one position of every row; a pass, a training micro-batch's rows)."""
    graphdef, lora, base = trees
    rows, completion = config.rows_per_step, config.max_completion_length
    prompt = prompt_tokens(config)
    on_rows = batch_sharding(mesh, DEFAULT_RULES)
    ids = jax.ShapeDtypeStruct((rows, prompt), jnp.int32, sharding=on_rows)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    sampling = Sampling(completion, config.temperature, config.top_p, config.top_k, config.min_p, eos=(0,))
    with jax.set_mesh(mesh):
        sampler = sample_arrays.lower(graphdef, (lora, base), ids, ids, key, sampling).compile()
    iterations = config.num_iterations
    # generated tokens, each a forward over its context: the prefill's at the prompt's length, the decode steps' at
    # the middle of the completion (on average)
    flops = rows * (prompt * forward_flops_per_token(llama, prompt)
                    + completion * forward_flops_per_token(llama, prompt + completion // 2))
    phases = [_phase(f"sampler (prefill and {completion - 1} decode steps)", sampler, mesh, device, config, scale,
                     sampler_shares, 1 / iterations, rows * completion, flops, unknown_trips=completion - 1)]
    names = PolicyObjective.of(config).scored_logps
    if names:
        batch = {k: jax.ShapeDtypeStruct((rows, config.seq_len), jnp.float32 if k in FLOAT_BATCH_KEYS else jnp.int32,
                                         sharding=on_rows) for k in ROLLOUT_BATCH_KEYS}
        reference = lora if config.reference_model() == "init" else None
        fn = jit_policy_logps(graphdef, config, TrainState(None, lora, None, None), base, reference, mesh,
                              DEFAULT_RULES)
        with jax.set_mesh(mesh):
            passes = fn.lower(lora, base, reference, batch).compile()
        flops = rows * config.seq_len * forward_flops_per_token(llama, config.seq_len) * len(names)
        label = " and ".join(n.removesuffix("_logps") for n in names)
        phases.append(_phase(f"log-prob passes ({label}: {len(names)} forward)", passes, mesh, device, config, scale,
                             pass_shares, 1 / iterations, rows * config.seq_len, flops))
    return phases


def _phase(name: str, compiled, mesh, device: DeviceModel | None, config: TrainConfig, scale: float,
           shares: dict[str, float], runs: float, tokens: int, model_flops: float,
           unknown_trips: int | None = None) -> Phase:
    temp = float(compiled.memory_analysis().temp_size_in_bytes) * scale
    cost = step_cost(compiled.as_text(), mesh.size, shares=shares, unknown_trips=unknown_trips)
    if scale != 1.0:  # a float32 stand-in: its collectives carry the 16-bit run's bytes at this scale
        cost = dataclasses.replace(cost, collectives=[dataclasses.replace(c, bytes=c.bytes * scale)
                                                      for c in cost.collectives])
    prediction = None if device is None else predict(cost, device, config.dtype, tokens, model_flops, mesh.size,
                                                     bytes_scale=scale)
    return Phase(name, temp, runs, prediction, cost)


def rollout_lines(config: TrainConfig, phases: list[Phase], train_seconds: float | None) -> list[str]:
    """The plan's lines on the rollout: each phase's temporaries and predicted time, and a step with its share."""
    prompt = prompt_tokens(config)
    out = [f"rollout: {config.batch_size} prompts x {config.value('num_generations')} completions, prompts of "
           f"{prompt} tokens, completions of at most {config.max_completion_length} (planned at their most), once "
           f"every {config.num_iterations} step{'s' * (config.num_iterations > 1)}:"]
    for phase in phases:
        line = f"  {phase.name}: {phase.temp / GB:.2f} GB of temporaries a device"
        if phase.prediction is not None:
            p = phase.prediction
            line += (f"; predicted {_time(phase.seconds)} ({p.tokens_per_s:,.0f} tokens/s, bound by {p.bound}; "
                     f"compute {_time(p.compute_seconds)}, memory {_time(p.memory_seconds)}, communication "
                     f"{_time(p.communication_seconds)})")
            collectives = ", ".join(f"{kind} {entry['bytes'] / GB:,.1f} GB" for kind, entry in
                                    sorted(p.collectives.items()))
            line += f"; a device's collectives: {collectives or 'none'}"
        out.append(line)
    if train_seconds is not None and all(p.prediction is not None for p in phases):
        share = sum(p.seconds * p.runs for p in phases)
        out.append(f"  a step with its share of the rollout: {_time(train_seconds)} training + {_time(share)} "
                   f"rollout = {_time(train_seconds + share)}")
    return out


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"
