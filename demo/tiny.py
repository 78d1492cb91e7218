"""Build small HuggingFace checkpoints (Llama and the other families the port runs) locally: random weights from
a seed, and a tokenizer trained on the spot with `tokenizers`, so the directory looks exactly like a hub model,
with nothing downloaded. For the demo, tests and benchmarks. Needs the `[torch]` extra.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|pad|>"]
# Llama 3's chat format, reduced to what a small model needs.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

TINY_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "tie_word_embeddings": False,
    # 10x transformers' default: a frozen random LM head with std 0.02 cannot express a peaked next-token
    # distribution (logits stay within about +-1.3 at hidden 64), so LoRA could not learn anything checkable.
    "initializer_range": 0.2,
    "bos_token_id": 0,
    "eos_token_id": [1, 4],
    "pad_token_id": 5,
}


def build_tiny_model(out_dir: str | Path, config: Mapping[str, Any] | None = None, *, seed: int = 0,
                     dtype: str = "float32", weights: str = "safetensors", max_shard_size: str | int | None = None,
                     tokenizer: bool = True) -> Path:
    """Write a causal LM with seeded random weights to `out_dir` as `save_pretrained` does: TINY_CONFIG updated
    by `config`, of the family its `model_type` names (transformers' own class: LlamaForCausalLM,
    Qwen3ForCausalLM, ...).

    `weights`: "safetensors" (transformers' own writer, sharded when `max_shard_size` is given) or "bin"
    (torch pickles, as older hub repos ship them). Returns `out_dir`.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    fields = {**TINY_CONFIG, **(config or {})}
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(hf_config).to(getattr(torch, dtype)).eval()
    if weights == "safetensors":
        model.save_pretrained(out, max_shard_size=max_shard_size or "50GB")
    elif weights == "bin":
        model.config.save_pretrained(out)
        _save_bin(model, out, max_shard_size)
    else:
        raise ValueError(f"weights must be 'safetensors' or 'bin', got {weights!r}")
    if tokenizer:
        save_tokenizer(out, vocab_size=hf_config.vocab_size)
    return out


def _save_bin(model, out: Path, max_shard_size: str | int | None) -> None:
    import torch

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if max_shard_size is None:
        torch.save(state, out / "pytorch_model.bin")
        return
    limit = int(max_shard_size)
    shards: list[dict] = [{}]
    for name, tensor in state.items():
        if shards[-1] and sum(t.numel() * t.element_size() for t in shards[-1].values()) >= limit:
            shards.append({})
        shards[-1][name] = tensor
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, out / file)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


# The tokenizer's training words: each is frequent enough in the corpus to become one token (with its leading
# space), which the demo's task relies on (demo/reverse_words.py picks its words from here).
CORPUS_WORDS = tuple(("the quick brown fox jumps over lazy dog reverse these words add numbers answer question user "
                      "assistant system llama model train token sum of and is what please a an to in on with").split())


def training_corpus() -> list[str]:
    """A small deterministic English-like corpus with numbers, for training the tokenizer."""
    words = CORPUS_WORDS
    lines = []
    for i in range(400):
        picked = [words[(i * 7 + j * 13) % len(words)] for j in range(8)]
        lines.append(" ".join(picked) + f" {i % 97} + {(i * 3) % 89} = {(i % 97) + (i * 3) % 89}")
    return lines


def save_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> None:
    """Train a byte-level BPE tokenizer on the corpus and save it as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
