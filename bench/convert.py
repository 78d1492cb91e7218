"""Converter throughput and memory, measured side by side with a plain copy of the same files.

Builds a synthetic multi-shard bf16 safetensors checkpoint with Llama 3.1 8B tensor shapes (vocab
128256, hidden 4096, intermediate 14336, 32 heads, 8 kv heads) and a few layers, then alternates:
  copy     shutil.copyfile of every file (sendfile; the floor of the work),
  convert  `convert-llama` in a fresh process (its peak RSS read from the process itself).
Both read from the page cache (a warm-up pass reads the source first). Medians over --repeats.
Then the same at a second, larger size, to show that peak RSS does not grow with the model.

    python bench/convert.py [--sizes 2,9] [--repeats 3] [--workdir /tmp/bench-convert]

Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HIDDEN, INTER, VOCAB, HEADS, KV, HEAD_DIM = 4096, 14336, 128256, 32, 8, 128
SHARD_BYTES = 1 << 30

# Peak RSS is the process's VmHWM (ru_maxrss would carry the parent's peak across fork + exec).
CHILD = r"""
import sys, time, json
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
from converter import convert
start_rss = status("VmHWM")
t = time.perf_counter()
summary = convert(sys.argv[1], sys.argv[2], overwrite=True, progress=False)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "bytes": summary.bytes, "start_rss": start_rss, "peak_rss": status("VmHWM")}))
"""


def tensor_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
        })
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def build_checkpoint(directory: Path, layers: int) -> int:
    """Sharded bf16 safetensors + index + config; returns the bytes of tensor data."""
    import ml_dtypes
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, shape in tensor_shapes(layers).items():
        if shards[-1] and size >= SHARD_BYTES:
            shards.append({})
            size = 0
        # Random bf16 values in [-0.1, 0.1): realistic bytes, cheap to make.
        bits = (rng.integers(0, 1 << 16, shape, dtype=np.uint16) & 0x3DFF) | ((rng.integers(0, 2, shape, dtype=np.uint16)) << 15)
        shards[-1][name] = bits.view(ml_dtypes.bfloat16)
        size += bits.nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        total += sum(t.nbytes for t in shard.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config))
    return total


def plain_copy(src: Path, dst: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    start = time.perf_counter()
    for file in sorted(src.iterdir()):
        shutil.copyfile(file, dst / file.name)
    return time.perf_counter() - start


def run_convert(src: Path, dst: Path) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm(src: Path) -> None:
    for file in src.iterdir():
        with open(file, "rb") as f:
            while f.read(64 << 20):
                pass


def measure(workdir: Path, layers: int, repeats: int) -> dict:
    src = workdir / f"hf-{layers}l"
    if not (src / "config.json").is_file():
        print(f"building a {layers}-layer synthetic checkpoint in {src} ...", flush=True)
        build_checkpoint(src, layers)
    data_bytes = sum(np.prod(s) * 2 for s in tensor_shapes(layers).values())
    file_bytes = sum(f.stat().st_size for f in src.iterdir())
    largest = max(np.prod(s) * 2 for s in tensor_shapes(layers).values())
    warm(src)
    copies, converts = [], []
    for _ in range(repeats):  # alternate the two sides so drift hits both
        copies.append(plain_copy(src, workdir / "copy"))
        shutil.rmtree(workdir / "copy")
        converts.append(run_convert(src, workdir / "jax"))
        shutil.rmtree(workdir / "jax")
    copy_s = statistics.median(copies)
    conv_s = statistics.median(c["seconds"] for c in converts)
    peak = max(c["peak_rss"] for c in converts)
    start_rss = min(c["start_rss"] for c in converts)
    return {"layers": layers, "files": len(list(src.glob("*.safetensors"))), "gb": data_bytes / 1e9,
            "largest_gb": largest / 1e9, "copy_gbps": file_bytes / copy_s / 1e9, "convert_gbps": data_bytes / conv_s / 1e9,
            "ratio": (data_bytes / conv_s) / (file_bytes / copy_s), "peak_rss_gb": peak / 1e9,
            "rss_over_largest": peak / largest, "rss_after_imports_gb": start_rss / 1e9,
            "copies": copies, "converts": [c["seconds"] for c in converts]}


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,9", help="layer counts of the two synthetic checkpoints")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/bench-convert")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints for another run")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    workdir = Path(args.workdir)
    rows = [measure(workdir, int(n), args.repeats) for n in args.sizes.split(",")]
    print()
    print("| layers | shards | GB | largest tensor GB | copy GB/s | convert GB/s | convert/copy | "
          "peak RSS GB | RSS / largest | RSS after imports GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['files']} | {r['gb']:.2f} | {r['largest_gb']:.2f} | {r['copy_gbps']:.2f} | "
              f"{r['convert_gbps']:.2f} | {r['ratio']:.2f}x | {r['peak_rss_gb']:.2f} | {r['rss_over_largest']:.2f}x | "
              f"{r['rss_after_imports_gb']:.2f} |")
    for r in rows:
        print(f"raw seconds, {r['layers']} layers: copy {['%.2f' % s for s in r['copies']]}, "
              f"convert {['%.2f' % s for s in r['converts']]}")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
