"""LoRA train-step throughput: this toolkit's jit step against transformers + PEFT (torch), same machine,
same model, same run, alternating sides.

Model: hidden 512, 8 layers, 8 heads, 2 kv heads, intermediate 1536, vocab 8192; batch 8 x seq 256;
LoRA rank 8 (alpha 16) on all seven projections; AdamW; float32; steps timed after warm-up/compile.

MFU = model FLOPs per step / (step time x matmul peak), the peak measured in the same run on a float32
2048x2048 matmul for each framework. Model FLOPs per token (finetune/metrics.py): 4N + 12·L·T·H with N
the matmul weights (q, k, v, o, gate, up, down per layer, and the LM head), L layers, T the sequence
length, H = heads x head_dim: a forward pass (2N + 4LTH) and a backward pass that needs activation
gradients only (2N + 8LTH), the base weights being frozen.

Also compiles the JAX step at 8 and 32 layers to show that compile time does not grow with depth.

    python bench/train.py [--rounds 5] [--steps 5]

`--cli` compares instead the same JAX step run in this process with the whole `finetune-lora` command on the
same model (built and converted once, bench/cli_runs.py), same batch, LoRA and optimizer settings: the
steady-state step time of each (median and range over the steps after the first two of each round; the CLI's
from its metrics.jsonl, the wall time between consecutive finished steps), rounds alternating which side
goes first. What the CLI adds per step (building and sending batches, reading metrics) shows as the ratio.

    python bench/train.py --cli [--rounds 3] [--steps 10] [--workdir /tmp/llama-jax-bench]

Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
BATCH, SEQ, RANK, ALPHA = 8, 256, 8, 16.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LR = 1e-4  # constant, no clipping: what jax_side's optimizer is


def jax_side(layers: int = 8, remat: str = "none", loss_chunk: int | None = None):
    """A compiled JAX LoRA step and its inputs; returns (run_one_step, compile_seconds). `loss_chunk`:
    finetune-lora's default when None."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from finetune.config import TrainConfig
    from finetune.step.train_step import TrainState, build_steps, make_optimizer, split_model
    from jaxmodel import ModelConfig, CausalLM
    from jaxmodel.lora import LoraConfig, apply_lora

    config = ModelConfig(**{**CONFIG, "num_hidden_layers": layers}, rms_norm_eps=1e-5)
    model = CausalLM(config, remat=remat, rngs=nnx.Rngs(0))
    apply_lora(model, LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS), rngs=nnx.Rngs(1))
    graphdef, lora, base = split_model(model)
    train_config = TrainConfig(lr=LR, steps=10**6, schedule="constant", clip_norm=0.0)
    tx, schedule = make_optimizer(train_config)
    state = TrainState(jnp.int32(0), lora, tx.init(lora), jax.random.key(0))
    loss_chunk = train_config.loss_chunk if loss_chunk is None else loss_chunk
    train_fn, _ = build_steps(graphdef, schedule, tx, grad_accum=1, loss_chunk=loss_chunk)
    step = jax.jit(train_fn, donate_argnums=0)
    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (BATCH, SEQ + 1)).astype(np.int32)
    batch = {"input_ids": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
             "loss_mask": jnp.ones((BATCH, SEQ), jnp.float32), "segment_ids": jnp.ones((BATCH, SEQ), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), (BATCH, SEQ))}
    start = time.perf_counter()
    compiled = step.lower(state, base, batch).compile()
    compile_seconds = time.perf_counter() - start
    holder = {"state": state}

    def run_one():
        holder["state"], metrics = compiled(holder["state"], base, batch)
        return float(metrics["loss"])  # blocks until done

    return run_one, compile_seconds


def torch_side(dtype=None, config: dict | None = None):
    """A transformers + PEFT LoRA step on `config` (default CONFIG; its weights cast to `dtype` first, if given;
    PEFT keeps the adapters in float32 on a 16-bit base); returns run_one_step."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = CONFIG if config is None else config
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{"rms_norm_eps": 1e-5, **config}, attn_implementation="sdpa"))
    if dtype is not None:
        model = model.to(dtype)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    ids = torch.randint(0, config["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def run_one():
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        optimizer.step()
        return float(loss)

    return run_one


def jax_peak(size=2048, repeats=10) -> float:
    from finetune.train.metrics import measure_peak_flops
    import jax.numpy as jnp

    return measure_peak_flops(jnp.float32, size, repeats)


def torch_peak(size=2048, repeats=10) -> float:
    import torch

    a = torch.ones(size, size)
    a @ a
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def timed(run_one, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        run_one()
    return BATCH * SEQ * steps / (time.perf_counter() - start)


def step_times(run_one, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `run_one` (each waits for its step's result)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run_one()
        times.append(time.perf_counter() - start)
    return times


def cli_args(model: Path, data: Path, out: Path, steps: int, remat: str) -> list[str]:
    """`finetune-lora` on the converted bench model with jax_side's batch, LoRA, optimizer and remat."""
    return ["finetune-lora", "--model", model, "--data", data, "--out", out, "--steps", steps,
            "--batch-size", BATCH, "--seq-len", SEQ, "--dtype", "float32", "--mesh", "dp=1,fsdp=1,mp=1",
            "--rank", RANK, "--alpha", ALPHA, "--targets", ",".join(TARGETS), "--lr", LR, "--schedule", "constant",
            "--clip-norm", "0", "--remat", remat, "--checkpoint-every", "100000", "--no-progress"]


def describe(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} | {min(times):.3f}-{max(times):.3f} | {len(times)}"


def cli_main(args) -> None:
    """The in-process step against `finetune-lora`, step times side by side (see the module's docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cli_runs import build_model, cpu_description, run_cli, step_seconds, write_text_data

    steps = max(args.steps, 3)
    workdir = Path(args.workdir)
    print(f"CPU: {cpu_description()}", flush=True)
    model = build_model(workdir, {**CONFIG, "rms_norm_eps": 1e-5})
    data = write_text_data(workdir / f"train-{SEQ}.jsonl", BATCH * SEQ * steps, seed=0, row_words=SEQ - 2)
    jax_step, _ = jax_side(8, args.remat)
    for _ in range(2):  # warm-up: first calls, allocator, caches
        jax_step()
    inside, cli = [], []
    for r in range(args.rounds):
        for side in ("in-process", "cli") if r % 2 == 0 else ("cli", "in-process"):
            if side == "in-process":
                times = step_times(jax_step, steps)[2:]
                inside += times
            else:
                out = workdir / "runs" / f"cli-{r}"
                shutil.rmtree(out, ignore_errors=True)
                run = run_cli(cli_args(model, data, out, steps, args.remat))
                if not run.ok:
                    raise SystemExit(f"finetune-lora failed (exit {run.returncode}): {run.error_lines()}")
                times = step_seconds(out)[1:]  # step_seconds leaves out step 1 already
                cli += times
                shutil.rmtree(out, ignore_errors=True)
            print(f"round {r + 1} {side}: {', '.join(f'{t:.3f}' for t in times)} s", flush=True)
    ratio = statistics.median(cli) / statistics.median(inside)
    print(f"CPU: {cpu_description()}; batch {BATCH} x seq {SEQ}, float32, LoRA r={RANK} on all seven projections, "
          f"remat {args.remat}; {args.rounds} rounds x steps 3..{steps}")
    print("| side | step s (median) | min-max | steps |")
    print("|---|---|---|---|")
    print(f"| jit step in this process | {describe(inside)} |")
    print(f"| finetune-lora (whole CLI) | {describe(cli)} |")
    print(f"ratio CLI / in-process (medians): {ratio:.3f} ({ratio - 1:+.1%})")


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    from finetune.config import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of both sides")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per side per round (default 5; --cli: steps per run, default 10, the "
                             "first two of each round not counted)")
    parser.add_argument("--remat", default=TrainConfig.remat, help="JAX remat policy (default: finetune-lora's)")
    parser.add_argument("--cli", action="store_true", help="the in-process step against the finetune-lora command")
    parser.add_argument("--workdir", default="/tmp/llama-jax-bench", help="--cli: model, data and run directories")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.cli:
        args.steps = args.steps or 10
        cli_main(args)
        return
    args.steps = args.steps or 5

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    from finetune.step.flops import flops_per_token
    from jaxmodel import ModelConfig

    flops = flops_per_token(ModelConfig(**CONFIG), SEQ)
    jax_step, compile_8 = jax_side(8, args.remat)
    torch_step = torch_side()
    for _ in range(2):  # warm-up: first calls, allocator, caches
        jax_step(), torch_step()
    jax_rates, torch_rates, jax_peaks, torch_peaks = [], [], [], []
    for _ in range(args.rounds):
        jax_rates.append(timed(jax_step, args.steps))
        torch_rates.append(timed(torch_step, args.steps))
        jax_peaks.append(jax_peak())
        torch_peaks.append(torch_peak())
    j, t = statistics.median(jax_rates), statistics.median(torch_rates)
    jp, tp = statistics.median(jax_peaks), statistics.median(torch_peaks)
    _, compile_32 = jax_side(32, args.remat)
    print(f"model FLOPs per token: {flops / 1e6:.1f} MFLOP (4N + 12·L·T·H)")
    print("| side | tokens/s (median) | matmul peak GFLOP/s (f32 2048²) | MFU vs own peak |")
    print("|---|---|---|---|")
    print(f"| JAX jit step (this toolkit) | {j:,.0f} | {jp / 1e9:.0f} | {flops * j / jp:.0%} |")
    print(f"| torch + PEFT | {t:,.0f} | {tp / 1e9:.0f} | {flops * t / tp:.0%} |")
    print(f"ratio JAX / torch+PEFT: {j / t:.2f}x")
    print(f"compile time of the JAX step: {compile_8:.1f} s at 8 layers, {compile_32:.1f} s at 32 layers")
    print(f"raw tokens/s: JAX {[round(r) for r in jax_rates]}, torch {[round(r) for r in torch_rates]}")


if __name__ == "__main__":
    from finetune.train.host_memory import restart_with_hugepages

    restart_with_hugepages()  # as finetune-lora does on the CPU, for both sides of this process
    main()
