"""The sampler's generated tokens per second against transformers' `generate`, side by side in one run: SmolLM2-135M
-Instruct (tests/pretrained.py's checkpoint, float32), a batch of 64 chat prompts left-padded, 128 new tokens each
drawn at temperature 1 (no row stops early: no EOS), rounds alternating which side runs first. Each side runs in a
child process (this one imports neither jax nor torch), which converts or loads the model, draws once to compile
or warm up (its seconds reported apart), then times `--reps` draws; a side's figure is generated tokens (64 x 128)
over the median draw, with the spread over every draw of every round and the child's peak RSS.

    python bench/sampler.py [--rounds 3] [--reps 2] [--batch 64] [--new 128] [--workdir /tmp/llama-jax-bench]

Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import GB, cpu_description  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# One side's measurement, in a child process: argv = side, checkpoint, converted dir, batch, new tokens, reps.
_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, "tests")
side, checkpoint, converted, batch, new, reps = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:])
from transformers import AutoTokenizer
from pretrained import chat_rows
tokenizer = AutoTokenizer.from_pretrained(checkpoint)
tokenizer.padding_side = "left"
topics = [row["messages"][0]["content"] for row in chat_rows([f"topic {i}" for i in range(batch)])][:batch]
texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
         for t in topics]
encoded = tokenizer(texts, return_tensors="np", padding=True)
ids, mask = encoded["input_ids"], encoded["attention_mask"]
if side == "jax":
    import jax
    from jaxmodel import load_pretrained
    from jaxmodel.generation import Sampling, sample_arrays
    from flax import nnx
    model = load_pretrained(converted)
    graphdef, state = nnx.split(model)
    sampling = Sampling(new, 1.0, pad=tokenizer.pad_token_id)
    def draw(seed):
        out = sample_arrays(graphdef, state, jax.numpy.asarray(ids), jax.numpy.asarray(mask), jax.random.key(seed),
                            sampling)
        jax.block_until_ready(out)
        assert int(out[2].min()) == new
else:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    def draw(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new,
                                 pad_token_id=tokenizer.pad_token_id)
        assert out.shape[1] == ids.shape[1] + new
start = time.perf_counter()
draw(0)
first = time.perf_counter() - start
times = []
for rep in range(reps):
    start = time.perf_counter()
    draw(rep + 1)
    times.append(time.perf_counter() - start)
print(json.dumps({"first": first, "times": times, "prompt": list(ids.shape),
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def measure(side: str, checkpoint: Path, converted: Path, batch: int, new: int, reps: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, side, str(checkpoint), str(converted), str(batch), str(new),
                           str(reps)], cwd=ROOT, capture_output=True, text=True,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        raise SystemExit(f"{side} side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/llama-jax-bench"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from pretrained import smollm2_checkpoint

    checkpoint = smollm2_checkpoint()
    converted = args.workdir / "sampler-smollm2-jax"
    if not (converted / "jax_checkpoint.json").is_file():
        subprocess.run([str(Path(sys.executable).parent / "convert-llama"), "--src", str(checkpoint), "--out",
                        str(converted), "--overwrite"], check=True, capture_output=True)
    results: dict[str, list[dict]] = {"jax": [], "transformers": []}
    for round_ in range(args.rounds):
        order = ["jax", "transformers"] if round_ % 2 == 0 else ["transformers", "jax"]
        for side in order:
            results[side].append(measure("jax" if side == "jax" else "torch", checkpoint, converted, args.batch,
                                         args.new, args.reps))
            print(f"round {round_ + 1} {side}: {results[side][-1]}", flush=True)
    tokens = args.batch * args.new
    print(f"\nSmolLM2-135M-Instruct float32, batch {args.batch} x {args.new} new tokens (prompts padded to "
          f"{results['jax'][0]['prompt'][1]}), temperature 1; {cpu_description()}; {args.rounds} rounds x "
          f"{args.reps} draws, alternating")
    print("| side | median s a draw | spread s | generated tokens/s | first draw s (compile or warm-up) | peak RSS |")
    print("|---|---|---|---|---|---|")
    medians = {}
    for side, runs in results.items():
        times = [t for run in runs for t in run["times"]]
        medians[side] = statistics.median(times)
        print(f"| {side} | {medians[side]:.2f} | {min(times):.2f}-{max(times):.2f} | {tokens / medians[side]:,.0f} | "
              f"{statistics.median(run['first'] for run in runs):.1f} | "
              f"{max(run['peak_rss'] for run in runs) / GB:.2f} GB |")
    print(f"sampler / transformers: {medians['transformers'] / medians['jax']:.2f}x the tokens a second")


if __name__ == "__main__":
    main()
