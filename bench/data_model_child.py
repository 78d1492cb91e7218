"""A small Llama for the data benchmarks, saved in Hugging Face format: demo.tiny's model (config overrides
given as JSON) with its own tiny tokenizer, or with the tokenizer of `--tokenizer-json` and a vocabulary its
size. A tokenizer with no chat template gets demo.tiny's Llama-3-style one; a Llama 3 tokenizer with no BOS or
EOS set gets `<|begin_of_text|>` and `<|eot_id|>`. Run in a child process by bench/data_common.py (torch
never enters the benchmark's own process), which converts the result with `convert-llama`.

    python bench/data_model_child.py HF_DIR '{"max_position_embeddings": 8192}' [--tokenizer-json PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", help="where to save the model")
    p.add_argument("config", help="JSON overrides of demo.tiny's config")
    p.add_argument("--tokenizer-json", help="a tokenizer.json; its tokenizer_config.json beside it is used too")
    args = p.parse_args()
    from demo.tiny import CHAT_TEMPLATE, build_tiny_model

    hf_dir, config = Path(args.hf_dir), json.loads(args.config)
    if not args.tokenizer_json:
        build_tiny_model(hf_dir, config, seed=0)
        return
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    source = Path(args.tokenizer_json)
    if (source.parent / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(source.parent)
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source))
    if tokenizer.bos_token is None and "<|begin_of_text|>" in tokenizer.get_vocab():
        tokenizer.bos_token = "<|begin_of_text|>"
    if tokenizer.eos_token is None and "<|eot_id|>" in tokenizer.get_vocab():
        tokenizer.eos_token = "<|eot_id|>"
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    config.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    build_tiny_model(hf_dir, config, seed=0, tokenizer=False)
    tokenizer.save_pretrained(hf_dir)


if __name__ == "__main__":
    main()
