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
from finetune.data import DataError, Rows, build_rows, read_rows, tokenize, truncation_report
from finetune.memory import sharding_table
from finetune.mesh import initialize_distributed, make_mesh
from finetune.step import DTYPES, TrainState, jit_steps, make_optimizer, optimizer_shardings, split_model
from jaxmodel.config import LlamaConfig
from jaxmodel.formats.checkpoint import read_manifest
from jaxmodel.formats.peft_adapter import load_peft_adapter, read_adapter
from jaxmodel.lora import apply_lora
from jaxmodel.pretrained import load_pretrained
from jaxmodel.sharding import DEFAULT_RULES, Rules, batch_sharding, batch_mesh_axes, batch_ways, named_sharding


@dataclasses.dataclass(frozen=True)
class Run:
    """A run ready for its first step: the mesh, the model split into graph / frozen base / train state, the
    jitted steps and the data. `config` carries an `--init-adapter`'s LoRA shape."""

    config: TrainConfig
    mesh: Mesh
    llama: LlamaConfig
    model: Any  # the LlamaForCausalLM with adapters, sharing its arrays with `base` and `state.lora`
    graphdef: Any
    base: nnx.State
    state: TrainState
    train_step: Callable
    eval_step: Callable
    batch_sharding: NamedSharding
    train_rows: Rows
    eval_rows: Rows | None
    tokenizer: Any


def load_data(config: TrainConfig, tokenizer) -> tuple[Rows, Rows | None]:
    """Training rows and held-out rows (--eval-data, or --eval-fraction of --data). Examples cut to --seq-len
    are counted in one warning line on stderr; data left with no training target is an error."""
    rows = read_rows(config.data)
    eval_rows = read_rows(config.eval_data) if config.eval_data else None
    eval_source = config.eval_data
    if eval_rows is None and config.eval_fraction > 0:
        order = np.random.default_rng(config.seed).permutation(len(rows))
        n_eval = max(1, int(len(rows) * config.eval_fraction))
        eval_rows = [rows[i] for i in sorted(order[:n_eval])]
        rows = [rows[i] for i in sorted(order[n_eval:])]
        eval_source = f"{config.data} (the rows held out by --eval-fraction)"
        if not rows:
            raise DataError(f"{config.data}: no training rows left after --eval-fraction {config.eval_fraction}")
    examples = tokenize(rows, tokenizer, config.seq_len)
    eval_examples = tokenize(eval_rows, tokenizer, config.seq_len) if eval_rows else []
    del rows, eval_rows  # a long row's text is not needed past its first tokens
    truncation_report(examples, config.seq_len).require_targets(config.data)
    if eval_examples:
        truncation_report(eval_examples, config.seq_len).require_targets(eval_source)
    warning = truncation_report(examples + eval_examples, config.seq_len).warning()
    if warning and jax.process_index() == 0:
        print(f"finetune-lora: warning: {warning}", file=sys.stderr)
    train, _ = build_rows(examples, config.seq_len, pack=config.pack)
    if not eval_examples:
        return train, None
    held_out, _ = build_rows(eval_examples, config.seq_len, pack=config.pack)
    return train, held_out.padded_to_multiple(config.batch_size)


def check_batch_split(config: TrainConfig, mesh: Mesh, rules: Rules) -> None:
    """Each device holds whole rows of every micro-batch."""
    ways = batch_ways(mesh, rules)
    if (config.batch_size // config.grad_accum) % ways:
        names = " x ".join(batch_mesh_axes(mesh, rules))
        raise ConfigFileError(f"--batch-size {config.batch_size} / --grad-accum {config.grad_accum} must be a multiple "
                              f"of {names} = {ways} (each device holds whole rows)")


def check_seq_len(config: TrainConfig, llama: LlamaConfig, mesh: Mesh) -> None:
    if config.seq_len > llama.max_position_embeddings:
        raise ConfigFileError(f"--seq-len {config.seq_len} exceeds the model's max_position_embeddings "
                              f"({llama.max_position_embeddings})")
    cp = mesh.shape.get("cp", 1)
    if cp > 1 and config.seq_len % (2 * cp):
        raise ConfigFileError(f"--seq-len {config.seq_len} must be a multiple of 2 x cp = {2 * cp} (each device of "
                              "the cp axis holds two equal chunks of every sequence)")


def layer_shapes(llama: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer LoRA can adapt, by HF module name."""
    hidden, mlp = llama.hidden_size, llama.intermediate_size
    q, kv = llama.num_attention_heads * llama.head_dim, llama.num_key_value_heads * llama.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp), "down_proj": (mlp, hidden),
            "lm_head": (hidden, llama.vocab_size)}


def check_rank(config: TrainConfig, llama: LlamaConfig) -> None:
    """A LoRA rank no larger than the smallest dimension of any adapted layer (a larger one adds parameters
    that cannot raise the update's rank, and can make the adapters larger than the model)."""
    shapes = layer_shapes(llama)
    name = min((t for t in config.target_modules if t in shapes), key=lambda t: min(shapes[t]), default=None)
    if name is not None and config.rank > min(shapes[name]):
        (n_in, n_out), most = shapes[name], min(shapes[name])
        raise ConfigFileError(f"--rank {config.rank} is larger than the smallest adapted layer: {name} ({n_in} -> "
                              f"{n_out}) allows a rank of at most {most}")


def _place(tree, mesh, rules):
    """Put every LoRA variable onto the sharding its logical axes give (same values on every process)."""
    def place(var):
        value = np.asarray(var[...])
        sharding = named_sharding(var.get_metadata()["axes"], value.shape, mesh, rules)
        var.set_value(jax.make_array_from_callback(value.shape, sharding, lambda i: value[i]))
        return var
    return jax.tree.map(place, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def with_adapter_shape(config: TrainConfig) -> TrainConfig:
    """`config` with an `--init-adapter`'s r, alpha, rsLoRA and targets in place of its own (what the run trains)."""
    if not config.init_adapter:
        return config
    adapter = read_adapter(config.init_adapter)[0]
    return dataclasses.replace(config, rank=adapter.rank, alpha=adapter.alpha, rslora=adapter.rslora,
                               targets=",".join(sorted(adapter.targets)))


def setup(config: TrainConfig, devices=None) -> Run:
    """Mesh (over `devices`, default all), model with LoRA, data, optimizer and jitted steps."""
    if not jax.distributed.is_initialized():  # run_training joins first, to know which process owns the run dir
        initialize_distributed(config.coordinator, config.num_processes, config.process_id)
    mesh = make_mesh(config.mesh, devices)
    rules = DEFAULT_RULES
    check_batch_split(config, mesh, rules)
    model_dir = Path(config.model)
    read_manifest(model_dir)  # a clear error for a directory that is not a converted checkpoint
    llama = LlamaConfig.from_hf(model_dir)
    check_seq_len(config, llama, mesh)
    if not config.init_adapter:  # an adapter brings its own rank, checked against the model as it loads
        check_rank(config, llama)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_rows, eval_rows = load_data(config, tokenizer)

    config = with_adapter_shape(config)
    param_dtype = None if config.param_dtype == "keep" else DTYPES[config.param_dtype]
    with jax.set_mesh(mesh):
        model = load_pretrained(model_dir, mesh=mesh, dtype=DTYPES[config.dtype], param_dtype=param_dtype,
                                remat=config.remat, attention=config.attention_impl(mesh.shape.get("cp", 1)),
                                mlp_chunk=config.mlp_chunk, rules=rules)
        if config.init_adapter:
            load_peft_adapter(model, config.init_adapter)
        else:
            apply_lora(model, config.lora_config(), rngs=nnx.Rngs(config.seed))
        graphdef, lora, base = split_model(model)
        lora = _place(lora, mesh, rules)
        tx, schedule = make_optimizer(config)
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_state = jax.jit(tx.init, out_shardings=optimizer_shardings(tx, lora, replicated))(lora)
        state = TrainState(jax.device_put(jnp.int32(0), replicated), lora, opt_state,
                           jax.device_put(jax.random.key(config.seed), replicated))
    if config.show_sharding and jax.process_index() == 0:
        print("\n".join(sharding_table(base, lora)))
        jax.debug.visualize_array_sharding(model.embed_tokens.weight[...])
    train_step, eval_step = jit_steps(graphdef, config, tx, schedule, state, base, mesh, rules)
    return Run(config=config, mesh=mesh, llama=llama, model=model, graphdef=graphdef, base=base, state=state,
               train_step=train_step, eval_step=eval_step, batch_sharding=batch_sharding(mesh, rules),
               train_rows=train_rows, eval_rows=eval_rows, tokenizer=tokenizer)
