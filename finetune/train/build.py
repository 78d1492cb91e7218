"""`setup(config)`: everything a run needs before its first step, as one frozen `Run`."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from finetune.config import ConfigFileError, TrainConfig
from finetune.data.packing import PackedRows
from finetune.data.pairs import PairRows
from finetune.data.prompts import PromptRows, held_out_prompts
from finetune.data.prepare import pack_data, tokenize_data
from finetune.step.attention_choice import choose_attention
from finetune.step.checks import check_batch_split, check_experts_split, check_policy_mesh, check_rank, check_seq_len
from finetune.step.memory import adapter_summary, sharding_table
from finetune.step.mesh import initialize_distributed, make_mesh
from finetune.step.train_step import (DTYPES, TrainState, jit_policy_logps, jit_steps, make_optimizer,
                                     optimizer_shardings, split_model)
from finetune.train.reference_pass import with_precomputed_reference
from jaxmodel.config import ModelConfig
from jaxmodel.formats.checkpoint import MANIFEST, checkpoint_quantization, read_manifest
from jaxmodel.formats.peft_adapter import load_peft_adapter, read_adapter, unservable_message, unservable_targets
from jaxmodel.lora import apply_lora
from jaxmodel.pretrained import load_pretrained
from jaxmodel.sharding import DEFAULT_RULES, batch_sharding, batch_ways, variable_sharding


@dataclasses.dataclass(frozen=True)
class Run:
    """A run ready for its first step: the mesh, the model split into graph / frozen base / train state, the
    jitted steps and the data. `config` carries an `--init-adapter`'s LoRA shape."""

    config: TrainConfig
    mesh: Mesh
    llama: ModelConfig
    model: Any  # the CausalLM with adapters, sharing its arrays with `base` and `state.lora`
    graphdef: Any
    base: nnx.State
    state: TrainState
    train_step: Callable
    eval_step: Callable
    batch_sharding: NamedSharding
    train_rows: PackedRows | PairRows | PromptRows  # PairRows with a preference objective, PromptRows with grpo/rloo
    eval_rows: PackedRows | PairRows | PromptRows | None
    tokenizer: Any
    data_record: dict[str, dict]  # RunData.record: the tokens the run trains and evaluates on
    frozen: Any = None  # what the steps take beside the state: `base`, or (base, reference adapter or None)
    reference: Any = None  # the frozen initial adapter a reference runs with (None: the base itself, or none)
    eval_prompts: list | None = None  # --eval-generate's held-out (prompt, reply) tokens: prompts.held_out_prompts
    policy_logps: Callable | None = None  # grpo/rloo: the jitted pass of `train_step.jit_policy_logps`


def _place(tree, mesh, rules):
    """Put every LoRA variable onto the sharding its logical axes give (same values on every process)."""
    def place(var):
        value = np.asarray(var[...])
        sharding = variable_sharding(var, mesh, rules, value.shape)
        var.set_value(jax.make_array_from_callback(value.shape, sharding, lambda i: value[i]))
        return var
    return jax.tree.map(place, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def with_adapter_shape(config: TrainConfig) -> TrainConfig:
    """`config` with an `--init-adapter`'s r, alpha, patterns, rsLoRA and targets in place of its own (what the run
    trains)."""
    if not config.init_adapter:
        return config
    base = Path(config.model or "", "config.json")  # a per-expert adapter reads by the model's experts
    adapter = read_adapter(config.init_adapter, ModelConfig.from_hf(base.parent) if base.is_file() else None)[0]
    return dataclasses.replace(config, rank=adapter.rank, alpha=adapter.alpha, rslora=adapter.rslora,
                               targets=",".join(sorted(adapter.targets)),
                               rank_pattern=",".join(f"{t}={r}" for t, r in adapter.rank_pattern) or None,
                               alpha_pattern=",".join(f"{t}={a}" for t, a in adapter.alpha_pattern) or None)


def setup(config: TrainConfig, devices=None, check_data: Callable[[dict[str, dict]], None] | None = None) -> Run:
    """Mesh (over `devices`, default all), model with LoRA, data, optimizer and jitted steps. `check_data` is
    given the data's record (`RunData.record`) as soon as the data is tokenized, before the model is loaded."""
    if not jax.distributed.is_initialized():  # run_training joins first, to know which process owns the run dir
        initialize_distributed(config.coordinator, config.num_processes, config.process_id)
    mesh = make_mesh(config.mesh, devices)
    rules = DEFAULT_RULES
    check_batch_split(config, mesh, rules)
    check_policy_mesh(config, mesh)
    model_dir = Path(config.model)
    read_manifest(model_dir)  # a clear error for a directory that is not a converted checkpoint
    llama = ModelConfig.from_hf(model_dir)
    check_seq_len(config, llama, mesh)
    check_experts_split(llama, mesh, rules)
    if not config.init_adapter:  # an adapter brings its own rank, checked against the model as it loads
        check_rank(config, llama)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    main = jax.process_index() == 0
    run_data = tokenize_data(config, tokenizer, tokenizer_from_model=True, main=main)
    data_record = run_data.record(config)
    if check_data is not None:
        check_data(data_record)
    train_rows, eval_rows = pack_data(config, run_data, main, ways=batch_ways(mesh, rules))
    eval_prompts = None
    if config.eval_generate and not config.policy:  # an online RL run samples its held-out prompts anyway
        eval_prompts = held_out_prompts(run_data.held_out.cached.data, run_data.eval_examples, config.eval_generate)
        if not eval_prompts:
            raise ConfigFileError(f"--eval-generate: no held-out row of {run_data.eval_name} has a prompt (rows "
                                  "trained from their first token, as text rows are, have none)")
        if mesh.shape.get("cp", 1) > 1:
            raise ConfigFileError(f"--eval-generate runs on meshes without cp (the sampler holds whole sequences); "
                                  f"got --mesh {config.mesh}")

    config = with_adapter_shape(config)
    config.check_router_objective()  # an --init-adapter's targets
    param_dtype = None if config.param_dtype == "keep" else DTYPES[config.param_dtype]
    attention = choose_attention(config, llama, mesh.shape.get("cp", 1))
    if main and attention.weighed:  # on stderr beside the data line: stdout's first line is the run's result
        print(f"finetune-lora: {attention.why}", file=sys.stderr, flush=True)
    config.multiplied(checkpoint_quantization(read_manifest(model_dir), Path(model_dir) / MANIFEST))  # fp8 or refused
    with jax.set_mesh(mesh):
        model = load_pretrained(model_dir, mesh=mesh, dtype=DTYPES[config.dtype], param_dtype=param_dtype,
                                remat=config.remat, attention=attention.impl, mlp_chunk=config.mlp_chunk,
                                rules=rules, fp8_matmul=None if config.fp8_matmul == "off" else config.fp8_matmul)
        if config.init_adapter:
            load_peft_adapter(model, config.init_adapter)
        else:
            lora_config = config.lora_config(model.config)
            apply_lora(model, lora_config, rngs=nnx.Rngs(config.seed))
            unservable = unservable_targets(lora_config, model.config)
            if main and unservable:
                print(f"finetune-lora: note: {unservable_message(unservable, model.config)}; export-peft will refuse "
                      "them (export-peft --merge folds them in)", file=sys.stderr, flush=True)
        graphdef, lora, base = split_model(model)
        lora = _place(lora, mesh, rules)
        # The initial adapter as loaded, frozen: a copy of the adapter only, never donated or trained.
        reference = jax.tree.map(jnp.copy, lora) if config.reference_model() == "init" else None
        tx, schedule = make_optimizer(config)
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_state = jax.jit(tx.init, out_shardings=optimizer_shardings(tx, lora, replicated))(lora)
        state = TrainState(jax.device_put(jnp.int32(0), replicated), lora, opt_state,
                           jax.device_put(jax.random.key(config.seed), replicated))
    if main:
        print(f"finetune-lora: adapter: {adapter_summary(lora, opt_state)}", file=sys.stderr, flush=True)
    if config.show_sharding and jax.process_index() == 0:
        print("\n".join(sharding_table(base, lora)))
        jax.debug.visualize_array_sharding(model.embed_tokens.weight[...])
    if config.precompute_reference:  # computed once here; the steps then take its values from the batches
        train_rows, eval_rows = with_precomputed_reference(config, run_data, train_rows, eval_rows, graphdef, lora,
                                                           base, reference, mesh, batch_sharding(mesh, rules))
        reference = None
    frozen = (base, reference) if config.preference else base
    train_step, eval_step = jit_steps(graphdef, config, tx, schedule, state, frozen, mesh, rules)
    logps = jit_policy_logps(graphdef, config, state, base, reference, mesh, rules) if config.policy else None
    return Run(config=config, mesh=mesh, llama=llama, model=model, graphdef=graphdef, base=base, state=state,
               train_step=train_step, eval_step=eval_step, batch_sharding=batch_sharding(mesh, rules),
               train_rows=train_rows, eval_rows=eval_rows, tokenizer=tokenizer, data_record=data_record,
               frozen=frozen, reference=reference, policy_logps=logps, eval_prompts=eval_prompts)
