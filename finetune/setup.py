"""`setup(config)`: everything a run needs before its first step, as one frozen `Run`."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from finetune.config import ConfigFileError, TrainConfig
from finetune.data import DataError, TruncationReport
from finetune.data_cache import CachedData, load_tokenized, loaded_tokenizer_digest
from finetune.data_sources import DataSource, names_files, open_source
from finetune.layouts import Detection, detect
from finetune.memory import sharding_table
from finetune.mesh import initialize_distributed, make_mesh
from finetune.packing import PackedRows, truncation_report_from_store
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
    train_rows: PackedRows
    eval_rows: PackedRows | None
    tokenizer: Any
    data_record: dict[str, dict]  # RunData.record: the tokens the run trains and evaluates on


def load_data(config: TrainConfig, tokenizer, tokenizer_from_model: bool = False
              ) -> tuple[PackedRows, PackedRows | None]:
    """Training rows and held-out rows (--eval-data, or --eval-fraction of --data), packed from the data tokenized
    once and cached (finetune.data_cache). Examples cut to --seq-len are counted in one warning line on stderr;
    data left with no training target is an error. Process 0 shows the tokenizing progress and ends with one
    summary line on stderr. `tokenizer_from_model`: see `tokenize_data`."""
    return pack_data(config, tokenize_data(config, tokenizer, tokenizer_from_model))


@dataclasses.dataclass(frozen=True)
class RunData:
    """--data (and --eval-data) tokenized, and which of their examples train and which are held out."""

    data: _Tokenized
    examples: np.ndarray  # int64: the examples of `data` that train
    held_out: _Tokenized | None  # `data` itself for --eval-fraction
    eval_examples: np.ndarray | None
    eval_name: str
    started: float  # perf_counter() when loading began

    def record(self, config: TrainConfig) -> dict[str, dict]:
        """What the run trains (`data`) and evaluates (`eval_data`, with --eval-data) on, as tokens: for each its
        path, the digest of its whole tokenized store (before --eval-fraction splits it), its counts, and
        what the tokens were made from (the data's fingerprint, the tokenizer's digest)."""
        record = {"data": self.data.record(config.data)}
        if config.eval_data:
            record["eval_data"] = self.held_out.record(config.eval_data)
        return record


def tokenize_data(config: TrainConfig, tokenizer, tokenizer_from_model: bool = False) -> RunData:
    """--data and --eval-data tokenized (from the cache, or now) and --eval-fraction's split of --data.
    `tokenizer_from_model`: `tokenizer` is `AutoTokenizer.from_pretrained(config.model)`, unchanged, so the
    cache is keyed on --model's files (`loaded_tokenizer_digest`) rather than on the serialized tokenizer."""
    main, started = jax.process_index() == 0, time.perf_counter()
    key = loaded_tokenizer_digest(config.model, tokenizer) if tokenizer_from_model else None
    data = _tokenized(config, open_source(config.data, split=config.data_split, subset=config.data_subset),
                      tokenizer, main, key)
    examples, held_out, eval_examples, eval_name = np.arange(len(data.source)), None, None, config.data
    if config.eval_data:
        subset = None if names_files(config.eval_data) else config.data_subset  # a subset is a dataset id's
        eval_source = open_source(config.eval_data, split=config.eval_split, subset=subset)
        held_out, eval_name = _tokenized(config, eval_source, tokenizer, main, key), config.eval_data
        eval_examples = np.arange(len(held_out.source))
    elif config.eval_fraction > 0:
        order = np.random.default_rng(config.seed).permutation(len(data.source))
        n_eval = max(1, int(len(data.source) * config.eval_fraction))
        eval_examples, examples = np.sort(order[:n_eval]), np.sort(order[n_eval:])
        held_out, eval_name = data, f"{config.data} (the rows held out by --eval-fraction)"
        if not len(examples):
            raise DataError(f"{config.data}: no training rows left after --eval-fraction {config.eval_fraction}")
    return RunData(data, examples, held_out, eval_examples, eval_name, started)


def pack_data(config: TrainConfig, run_data: RunData) -> tuple[PackedRows, PackedRows | None]:
    """`run_data`'s training and held-out rows packed (see `load_data`), with its warning and summary lines."""
    main = jax.process_index() == 0
    data, examples, held_out, eval_examples = (run_data.data, run_data.examples, run_data.held_out,
                                               run_data.eval_examples)
    report = data.report(examples, config.seq_len)
    report.require_targets(config.data)
    if held_out is not None:
        eval_report = held_out.report(eval_examples, config.seq_len)
        eval_report.require_targets(run_data.eval_name)
        report = _both(report, eval_report)
    warning = report.warning()
    if warning and main:
        print(f"finetune-lora: warning: {warning}", file=sys.stderr)
    train_rows = PackedRows.build(data.cached.data, examples, config.seq_len, config.pack)
    eval_rows = None if held_out is None else PackedRows.build(held_out.cached.data, eval_examples, config.seq_len,
                                                              config.pack)
    if main:
        kind = "packed" if config.pack else "padded"
        line = (f"{data.layout.report(len(data.source))}; {_amount(data.cached.data.meta['tokens'])} tokens -> "
                f"{len(train_rows):,} {kind} rows of {config.seq_len}")
        if eval_rows is not None:
            line += f" (+ {len(eval_rows):,} held out, from {len(eval_examples):,} rows)"
        line += (f"; {report.truncated:,} truncated, {report.examples - report.with_targets:,} with no targets; "
                 f"{data.cache_status()}")
        if config.eval_data:
            line += f"; --eval-data {held_out.cache_status()}"
        line += f"; prepared in {time.perf_counter() - run_data.started:.1f} s"
        print(f"finetune-lora: data: {line}", file=sys.stderr)
    return train_rows, None if eval_rows is None else eval_rows.padded_to_multiple(config.batch_size)


@dataclasses.dataclass(frozen=True)
class _Tokenized:
    source: DataSource
    layout: Detection
    cached: CachedData

    def report(self, examples: np.ndarray, seq_len: int) -> TruncationReport:
        return truncation_report_from_store(self.cached.data, examples, seq_len, self.source.where)

    def cache_status(self) -> str:
        return f"cache {'hit' if self.cached.hit else 'miss'} ({self.cached.directory})"

    def record(self, path: str) -> dict[str, Any]:
        store = self.cached.data
        return {"path": path, "digest": self.cached.digest, "examples": len(store), "tokens": int(store.starts[-1]),
                "source": self.cached.key["data"], "tokenizer": self.cached.key["tokenizer"]}


def _tokenized(config: TrainConfig, source: DataSource, tokenizer, main: bool,
               tokenizer_key: str | None = None) -> _Tokenized:
    """`source` tokenized by --data-format: from the cache, or now (with a progress bar on process 0)."""
    layout = detect(source.dataset.column_names, source.description, config.data_format)
    cached = load_tokenized(source, tokenizer, config.seq_len, layout.layout, cache=config.data_cache,
                            workers=config.data_workers, progress=config.progress and main, tokenizer_key=tokenizer_key)
    return _Tokenized(source, layout, cached)


def _both(a: TruncationReport, b: TruncationReport) -> TruncationReport:
    """One report of the examples of `a` followed by those of `b`."""
    return TruncationReport(seq_len=a.seq_len, examples=a.examples + b.examples, truncated=a.truncated + b.truncated,
                            first_truncated=a.first_truncated or b.first_truncated, lost=a.lost + b.lost,
                            first_lost=a.first_lost or b.first_lost, with_targets=a.with_targets + b.with_targets)


def _amount(n: int) -> str:
    """A count for people: 1234567 -> 1.2M."""
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


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


def setup(config: TrainConfig, devices=None, check_data: Callable[[dict[str, dict]], None] | None = None) -> Run:
    """Mesh (over `devices`, default all), model with LoRA, data, optimizer and jitted steps. `check_data` is
    given the data's record (`RunData.record`) as soon as the data is tokenized, before the model is loaded."""
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
    run_data = tokenize_data(config, tokenizer, tokenizer_from_model=True)
    data_record = run_data.record(config)
    if check_data is not None:
        check_data(data_record)
    train_rows, eval_rows = pack_data(config, run_data)

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
               train_rows=train_rows, eval_rows=eval_rows, tokenizer=tokenizer, data_record=data_record)
