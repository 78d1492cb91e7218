"""`llama-jax-demo`: the toolkit's main job on a laptop-class machine, end to end.

Builds a small Llama checkpoint locally (seeded random weights, a tokenizer trained here), converts it
with convert-llama, runs the JAX port and transformers side by side, and prints their parity.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llama-jax-demo", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="demo-output", help="where the HF and converted checkpoints go")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the small model")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per row in the parity check")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens to generate greedily")
    args = parser.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from converter import convert
    from converter.tiny import build_tiny_llama
    from jaxmodel.checkpoint import load_pretrained
    from jaxmodel.generate import generate

    out = Path(args.out)
    hf_dir, jax_dir = out / "hf-llama", out / "jax-llama"
    start = time.perf_counter()
    print(f"[1/4] building a small Llama 3.1-style checkpoint in {hf_dir} (seed {args.seed})")
    build_tiny_llama(hf_dir, {"num_hidden_layers": args.layers, "hidden_size": 128, "intermediate_size": 320,
                              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16}, seed=args.seed)
    print(f"[2/4] convert-llama --src {hf_dir} --out {jax_dir} --verify")
    print(f"      {convert(hf_dir, jax_dir, overwrite=True, verify=True)}")

    print("[3/4] float32 logits of both models on random tokens")
    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model = load_pretrained(jax_dir)
    ids = np.random.default_rng(args.seed).integers(0, hf.config.vocab_size, (2, args.seq_len))
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    got = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    diff = float(np.abs(got - expected).max())

    print(f"[4/4] greedy generation, {args.new_tokens} tokens, with the KV cache")
    tokenizer = AutoTokenizer.from_pretrained(jax_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "add 12 + 30"}], add_generation_prompt=True,
                                           return_tensors="np", return_dict=True)["input_ids"]
    ours = generate(model, prompt, args.new_tokens, eos_token_id=())
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(prompt), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id).numpy()
    same = bool(np.array_equal(ours, theirs))

    rows = [("logits max |JAX - transformers| (float32)", f"{diff:.2e}  ({'OK' if diff < 1e-4 else 'MISMATCH'})"),
            ("logits shape", str(tuple(got.shape))),
            ("greedy tokens equal transformers'", str(same)),
            ("JAX continuation (random weights)", repr(tokenizer.decode(ours[0, prompt.shape[1]:]))[:60]),
            ("converted checkpoint", str(jax_dir)),
            ("time", f"{time.perf_counter() - start:.1f} s")]
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    return 0 if diff < 1e-4 and same else 1


if __name__ == "__main__":
    sys.exit(main())
