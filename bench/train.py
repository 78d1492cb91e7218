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

Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
BATCH, SEQ, RANK, ALPHA = 8, 256, 8, 16.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def jax_side(layers: int = 8, remat: str = "none"):
    """A compiled JAX LoRA step and its inputs; returns (run_one_step, compile_seconds)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from finetune.config import TrainConfig
    from finetune.step import TrainState, build_steps, make_optimizer, split_model
    from jaxmodel import LlamaConfig, LlamaForCausalLM
    from jaxmodel.lora import LoraConfig, apply_lora

    config = LlamaConfig(**{**CONFIG, "num_hidden_layers": layers}, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config, remat=remat, rngs=nnx.Rngs(0))
    apply_lora(model, LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS), rngs=nnx.Rngs(1))
    graphdef, lora, base = split_model(model)
    train_config = TrainConfig(lr=1e-4, steps=10**6, schedule="constant", clip_norm=0.0)
    tx, schedule = make_optimizer(train_config)
    state = TrainState(jnp.int32(0), lora, tx.init(lora), jax.random.key(0))
    train_fn, _ = build_steps(graphdef, schedule, tx, grad_accum=1)
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


def torch_side():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, rms_norm_eps=1e-5, attn_implementation="sdpa"))
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
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
    from finetune.metrics import measure_peak_flops
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


def main() -> None:
    from finetune.config import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of both sides")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side per round")
    parser.add_argument("--remat", default=TrainConfig.remat, help="JAX remat policy (default: finetune-lora's)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    from finetune.metrics import flops_per_token
    from jaxmodel import LlamaConfig

    flops = flops_per_token(LlamaConfig(**CONFIG), SEQ)
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
    main()
