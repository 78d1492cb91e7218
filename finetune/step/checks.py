"""Checks of a run's settings against its mesh and model, made before anything is compiled: by training
(`finetune.train.build`) and by `--plan` alike."""

from __future__ import annotations

import math

from jax.sharding import Mesh

from finetune.config import ConfigFileError, TrainConfig
from jaxmodel.config import ModelConfig
from jaxmodel.sharding import Rules, batch_mesh_axes, batch_ways


def check_batch_split(config: TrainConfig, mesh: Mesh, rules: Rules) -> None:
    """Each device holds whole rows of every micro-batch."""
    ways = batch_ways(mesh, rules)
    if (config.rows_per_step // config.grad_accum) % ways:
        names = " x ".join(batch_mesh_axes(mesh, rules))
        rows = (f"--batch-size {config.batch_size} x --num-generations {config.value('num_generations')}"
                if config.policy else f"--batch-size {config.batch_size}")
        raise ConfigFileError(f"{rows} / --grad-accum {config.grad_accum} must be a multiple of {names} = {ways} "
                              "(each device holds whole rows)")


def check_policy_mesh(config: TrainConfig, mesh: Mesh) -> None:
    """An online RL run's mesh has no cp axis: its sampler holds whole sequences on a device."""
    if config.policy and mesh.shape.get("cp", 1) > 1:
        raise ConfigFileError(f"--objective {config.objective} runs on meshes without cp (its sampler holds whole "
                              f"sequences); got --mesh {config.mesh}")


def check_seq_len(config: TrainConfig, llama: ModelConfig, mesh: Mesh) -> None:
    if config.seq_len > llama.max_position_embeddings:
        raise ConfigFileError(f"--seq-len {config.seq_len} exceeds the model's max_position_embeddings "
                              f"({llama.max_position_embeddings})")
    cp = mesh.shape.get("cp", 1)
    if cp > 1 and config.seq_len % (2 * cp):
        raise ConfigFileError(f"--seq-len {config.seq_len} must be a multiple of 2 x cp = {2 * cp} (each device of "
                              "the cp axis holds two equal chunks of every sequence)")


def check_experts_split(llama: ModelConfig, mesh: Mesh, rules: Rules) -> None:
    """The devices the rules split the experts over (fsdp's: jaxmodel/moe.py, `Experts`) each hold an equal share
    of every sparse layer's experts."""
    found = dict(rules).get("experts")
    axes = [a for a in ((found,) if isinstance(found, str) else found or ()) if mesh.shape.get(a, 1) > 1]
    ways = math.prod(mesh.shape[a] for a in axes)
    if llama.num_experts and llama.num_experts % ways:
        names = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
        raise ConfigFileError(f"--mesh {names} does not divide the model's {llama.num_experts} experts "
                              f"(num_experts): {' x '.join(axes)}'s devices each hold an equal share of every sparse "
                              "layer's experts; choose a mesh whose split divides them (dp, cp or mp for the other "
                              "devices)")


def layer_shapes(llama: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer LoRA can adapt, by HF module name: the attention's
    (`jaxmodel.lora.attention_targets`: multi-head latent attention's own), the dense MLP's and the LM head."""
    hidden, mlp = llama.hidden_size, llama.intermediate_size
    mlps = {"gate_proj": (hidden, mlp), "up_proj": (hidden, mlp), "down_proj": (mlp, hidden),
            "lm_head": (hidden, llama.vocab_size)}
    n = llama.num_attention_heads
    if llama.kv_lora_rank:
        rank, qk, v = llama.q_lora_rank, llama.qk_head_dim, llama.v_head_dim
        queries = {"q_a_proj": (hidden, rank), "q_b_proj": (rank, n * qk)} if rank else {"q_proj": (hidden, n * qk)}
        return {**queries, "kv_a_proj_with_mqa": (hidden, llama.kv_lora_rank + llama.head_dim),
                "kv_b_proj": (llama.kv_lora_rank, n * (llama.qk_nope_head_dim + v)), "o_proj": (n * v, hidden), **mlps}
    q, kv = n * llama.head_dim, llama.num_key_value_heads * llama.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden), **mlps}


def check_rank(config: TrainConfig, llama: ModelConfig) -> None:
    """A LoRA rank no larger than the smallest dimension of any adapted layer (a larger one adds parameters
    that cannot raise the update's rank, and can make the adapters larger than the model)."""
    shapes = layer_shapes(llama)
    lora = config.lora_config(llama)
    own = dict(lora.rank_pattern)
    for name in sorted((t for t in lora.targets if t in shapes), key=lambda t: min(shapes[t])):
        (n_in, n_out), most = shapes[name], min(shapes[name])
        if name in own and own[name] > most:
            raise ConfigFileError(f"--rank-pattern gives {name} rank {own[name]}, larger than its layer ({n_in} -> "
                                  f"{n_out}) allows: at most {most}")
        if name not in own and lora.rank > most:
            raise ConfigFileError(f"--rank {lora.rank} is larger than the smallest adapted layer: {name} ({n_in} -> "
                                  f"{n_out}) allows a rank of at most {most}")
