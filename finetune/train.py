"""`train(config)`: a LoRA fine-tuning run on a device mesh, resumable, with metrics and checkpoints."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from finetune.checkpoints import RunCheckpoints
from finetune.config import ConfigFileError, TrainConfig
from finetune.data import DataError, Rows, build_rows, read_rows, row_indices, tokenize
from finetune.mesh import initialize_distributed, make_mesh
from finetune.metrics import MetricsWriter, flops_per_token, measure_peak_flops
from finetune.step import TrainState, build_steps, make_optimizer, optimizer_shardings, split_model
from jaxmodel.checkpoint import load_pretrained, read_manifest
from jaxmodel.config import LlamaConfig
from jaxmodel.lora import apply_lora
from jaxmodel.sharding import named_sharding

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
RUN_CONFIG = "run_config.json"


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. a non-finite loss); the message says what happened and what was kept."""


@dataclasses.dataclass
class RunSummary:
    steps: int
    first_loss: float | None
    last_loss: float | None
    tokens_per_s: float
    seconds: float
    stopped_early: bool = False

    def __str__(self) -> str:
        how = "stopped by SIGTERM after" if self.stopped_early else "trained"
        losses = f"loss {self.first_loss:.4f} -> {self.last_loss:.4f}" if self.last_loss is not None else "no steps"
        return f"{how} {self.steps} steps, {losses}, {self.tokens_per_s:,.0f} tokens/s, {self.seconds:.1f} s"


def load_data(config: TrainConfig, tokenizer) -> tuple[Rows, Rows | None]:
    rows = read_rows(config.data)
    eval_rows = read_rows(config.eval_data) if config.eval_data else None
    if eval_rows is None and config.eval_fraction > 0:
        order = np.random.default_rng(config.seed).permutation(len(rows))
        n_eval = max(1, int(len(rows) * config.eval_fraction))
        eval_rows = [rows[i] for i in sorted(order[:n_eval])]
        rows = [rows[i] for i in sorted(order[n_eval:])]
        if not rows:
            raise DataError(f"{config.data}: no training rows left after --eval-fraction {config.eval_fraction}")
    train, _ = build_rows(tokenize(rows, tokenizer), config.seq_len, pack=config.pack)
    if not eval_rows:
        return train, None
    held_out, _ = build_rows(tokenize(eval_rows, tokenizer), config.seq_len, pack=config.pack)
    return train, held_out.padded_to_multiple(config.batch_size)


def _global_batch(rows: Rows, indices_for, sharding: NamedSharding, batch_size: int) -> dict[str, jax.Array]:
    """The global batch as arrays sharded over (dp, fsdp); this process reads only its own rows."""
    seq_len = rows.input_ids.shape[1]
    index_map = sharding.addressable_devices_indices_map((batch_size, seq_len))
    starts = sorted({idx[0].start or 0 for idx in index_map.values()})
    stops = sorted({idx[0].stop if idx[0].stop is not None else batch_size for idx in index_map.values()})
    lo, hi = starts[0], stops[-1]
    local = rows.take(indices_for(lo, hi))
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, seq_len)) for k, v in local.items()}


def _place(tree, mesh, rules):
    """Put every LoRA variable onto the sharding its logical axes give (same values on every process)."""
    def place(var):
        value = np.asarray(var[...])
        sharding = named_sharding(var.get_metadata()["axes"], value.shape, mesh, rules)
        var.set_value(jax.make_array_from_callback(value.shape, sharding, lambda i: value[i]))
        return var
    return jax.tree.map(place, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def check_batch_split(config: TrainConfig, mesh) -> None:
    """Each device holds whole rows of every micro-batch."""
    batch_ways = mesh.shape["dp"] * mesh.shape["fsdp"]
    if (config.batch_size // config.grad_accum) % batch_ways:
        raise ConfigFileError(f"--batch-size {config.batch_size} / --grad-accum {config.grad_accum} must be a multiple "
                              f"of dp x fsdp = {batch_ways} (each device holds whole rows)")


def setup(config: TrainConfig, devices=None):
    """Everything a run needs before its first step: mesh (over `devices`, default all), model with LoRA,
    data, optimizer, jitted steps."""
    initialize_distributed(config.coordinator, config.num_processes, config.process_id)
    mesh = make_mesh(config.mesh, devices)
    check_batch_split(config, mesh)
    model_dir = Path(config.model)
    read_manifest(model_dir)  # a clear error for a directory that is not a converted checkpoint
    llama = LlamaConfig.from_hf(model_dir)
    if config.seq_len > llama.max_position_embeddings:
        raise ConfigFileError(f"--seq-len {config.seq_len} exceeds the model's max_position_embeddings "
                              f"({llama.max_position_embeddings})")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_rows, eval_rows = load_data(config, tokenizer)

    if config.init_adapter:
        from export.peft import read_adapter

        adapter = read_adapter(config.init_adapter)[0]
        config = dataclasses.replace(config, rank=adapter.rank, alpha=adapter.alpha, rslora=adapter.rslora,
                                     targets=",".join(sorted(adapter.targets)))
    lora_config = config.lora_config()
    param_dtype = None if config.param_dtype == "keep" else DTYPES[config.param_dtype]
    with jax.set_mesh(mesh):
        model = load_pretrained(model_dir, mesh=mesh, dtype=DTYPES[config.dtype], param_dtype=param_dtype,
                                remat=config.remat)
        if config.init_adapter:
            from export.peft import load_peft_adapter

            load_peft_adapter(model, config.init_adapter)
        else:
            apply_lora(model, lora_config, rngs=nnx.Rngs(config.seed))
        graphdef, lora, base = split_model(model)
        lora = _place(lora, mesh, model.rules)
        tx, schedule = make_optimizer(config)
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_state = jax.jit(tx.init, out_shardings=optimizer_shardings(tx, lora, replicated))(lora)
        state = TrainState(jax.device_put(jnp.int32(0), replicated), lora, opt_state,
                           jax.device_put(jax.random.key(config.seed), replicated))
    if config.show_sharding and jax.process_index() == 0:
        from finetune.plan import sharding_table

        print("\n".join(sharding_table(base, lora)))
        for name, var in (("embed_tokens.weight", model.embed_tokens.weight),):
            jax.debug.visualize_array_sharding(var[...])
    train_fn, eval_fn = build_steps(graphdef, schedule, tx, config.grad_accum, dropout=config.lora_dropout > 0)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    base_shardings = jax.tree.map(lambda x: x.sharding, base)
    batch_sharding = NamedSharding(mesh, PartitionSpec(("dp", "fsdp")))
    train_step = jax.jit(train_fn, in_shardings=(state_shardings, base_shardings, batch_sharding),
                         out_shardings=(state_shardings, replicated), donate_argnums=0)
    eval_step = jax.jit(eval_fn, in_shardings=(state_shardings.lora, base_shardings, batch_sharding),
                        out_shardings=replicated)
    return dict(config=config, mesh=mesh, llama=llama, model=model, graphdef=graphdef, base=base, state=state, tx=tx,
                train_step=train_step, eval_step=eval_step, train_rows=train_rows, eval_rows=eval_rows,
                batch_sharding=batch_sharding, tokenizer=tokenizer)


def train(config: TrainConfig) -> RunSummary:
    run = setup(config)
    config = run["config"]  # with an --init-adapter's LoRA shape
    mesh, state, base = run["mesh"], run["state"], run["base"]
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:  # what export-peft needs to rebuild the model and read the checkpoints
        (out / RUN_CONFIG).write_text(json.dumps(dataclasses.asdict(config), indent=1) + "\n")
    checkpoints = RunCheckpoints(out / "checkpoints", config.keep_checkpoints)
    position = 0  # global batches consumed
    if config.resume and checkpoints.latest_step() is not None:
        with jax.set_mesh(mesh):
            state, meta = checkpoints.restore(state)
        position = int(meta["data_position"])
    start_step = int(jax.device_get(state.step))
    is_main = jax.process_index() == 0
    metrics = MetricsWriter(out, enabled=is_main)
    stop = {"sigterm": False}
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("sigterm", True))

    train_rows, batch_sharding = run["train_rows"], run["batch_sharding"]
    flops = flops_per_token(run["llama"], config.seq_len)
    peak = measure_peak_flops(DTYPES[config.dtype]) * jax.device_count()
    first_loss = last_loss = None
    tokens_seen, started = 0.0, time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=config.steps, initial=start_step, desc="finetune", disable=not (config.progress and is_main))
    step = start_step
    last_step = min(config.steps, start_step + config.stop_after) if config.stop_after else config.steps
    try:
        with jax.set_mesh(mesh):
            while step < last_step and not stop["sigterm"]:
                batch = _global_batch(train_rows, lambda lo, hi, g=position: row_indices(
                    len(train_rows), config.seed, g, config.batch_size, lo, hi), batch_sharding, config.batch_size)
                t0 = time.perf_counter()
                new_state, m = run["train_step"](state, base, batch)
                m = jax.device_get(m)
                seconds = time.perf_counter() - t0
                if not (math.isfinite(float(m["loss"])) and math.isfinite(float(m["grad_norm"]))):
                    kept = checkpoints.latest_step()
                    raise TrainingError(f"non-finite loss or gradient at step {step + 1} (loss {float(m['loss'])}); "
                                        f"stopped; newest checkpoint kept: "
                                        f"{'step ' + str(kept) if kept is not None else 'none'}")
                state, position, step = new_state, position + 1, step + 1
                tokens = config.batch_size * config.seq_len
                tokens_seen += tokens
                loss = float(m["loss"])
                first_loss = loss if first_loss is None else first_loss
                last_loss = loss
                record = {"loss": loss, "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
                          "tokens_per_s": tokens / seconds, "mfu": flops * tokens / seconds / peak,
                          "target_tokens": int(m["tokens"])}
                if run["eval_rows"] is not None and config.eval_every and step % config.eval_every == 0:
                    record["eval_loss"] = evaluate(run, state, config)
                if step % config.log_every == 0 or step == config.steps:
                    metrics.write(step, record)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")
                if step % config.checkpoint_every == 0 or step == last_step or stop["sigterm"]:
                    checkpoints.save(state, {"data_position": position, "step": step})
            if run["eval_rows"] is not None and not config.eval_every and step == config.steps:
                metrics.write(step, {"eval_loss": evaluate(run, state, config)})
    finally:
        bar.close()
        checkpoints.close()
        metrics.close()
        signal.signal(signal.SIGTERM, previous)
    elapsed = time.perf_counter() - started
    return RunSummary(step - start_step, first_loss, last_loss, tokens_seen / max(elapsed, 1e-9), elapsed,
                      stopped_early=stop["sigterm"])


def evaluate(run, state: TrainState, config: TrainConfig) -> float:
    """Mean target-token loss over the whole eval set (padded to whole batches with loss-free rows)."""
    rows = run["eval_rows"]
    loss_sum = tokens = 0.0
    for g in range(len(rows) // config.batch_size):
        batch = _global_batch(rows, lambda lo, hi, g=g: np.arange(g * config.batch_size + lo, g * config.batch_size + hi),
                              run["batch_sharding"], config.batch_size)
        l, n = jax.device_get(run["eval_step"](state.lora, run["base"], batch))
        loss_sum, tokens = loss_sum + float(l), tokens + float(n)
    return loss_sum / max(tokens, 1.0)
