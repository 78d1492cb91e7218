"""The sampler's generated tokens per second against transformers' `generate` and vLLM's CPU build, side by side in
one run: SmolLM2-135M-Instruct (tests/pretrained.py's checkpoint; `--random-weights`: its shapes with random weights,
bench/smollm2.py), float32 unless `--dtype`, a batch of 64 chat prompts (left-padded where a side pads), 128 new
tokens each drawn at temperature 1 (no row stops early: no EOS), rounds alternating which side runs first. Each side
runs in a child process (this one imports neither jax nor torch), on its framework's accelerator where there is one
(a GPU for jax and torch alike), which converts or loads the model, draws once to compile or warm up (its seconds
reported apart), then times `--reps` draws; a side's figure is generated tokens (64 x 128) over the median draw,
with the spread over every draw of every round and the child's peak RSS (vLLM's: its front process and its engine
process, the larger). vLLM runs from its own environment (`--vllm-python`, default `tox -e serve`'s .tox/vllm;
left out when there is none), with `VLLM_CPU_KVCACHE_SPACE=1` (GiB) and its own defaults otherwise.

    python bench/sampler.py [--rounds 3] [--reps 2] [--batch 64] [--new 128] [--dtype float32] [--random-weights]
                            [--workdir /tmp/llama-jax-bench]

Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import GB, cpu_description, run_cli  # noqa: E402
from smollm2 import smollm2_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The end of each side's child script: a first draw (compile or warm-up), then `reps` timed draws of `draw(seed)`,
# printed as one JSON line with `prompt_shape` and the peak RSS (of the child and, for vLLM, its engine process).
_TIMED_DRAWS = r"""
start = time.perf_counter()
draw(0)
first = time.perf_counter() - start
times = []
for rep in range(reps):
    start = time.perf_counter()
    draw(rep + 1)
    times.append(time.perf_counter() - start)
rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
print(json.dumps({"first": first, "times": times, "prompt": prompt_shape, "peak_rss": rss * 1024,
                  "device": device_name}))
"""
# One side's measurement, in a child process: argv = side, checkpoint, converted dir, dtype, batch, new tokens, reps.
# Each side runs on its framework's default accelerator where it has one (torch: CUDA), else on the CPU.
_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, "tests")
side, checkpoint, converted, dtype = sys.argv[1:5]
batch, new, reps = map(int, sys.argv[5:])
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
    model = load_pretrained(converted, dtype=dtype, param_dtype=dtype)
    graphdef, state = nnx.split(model)
    device_name = jax.devices()[0].device_kind
    sampling = Sampling(new, 1.0, pad=tokenizer.pad_token_id)
    def draw(seed):
        out = sample_arrays(graphdef, state, jax.numpy.asarray(ids), jax.numpy.asarray(mask), jax.random.key(seed),
                            sampling)
        jax.block_until_ready(out)
        assert int(out[2].min()) == new
else:
    import torch
    from transformers import AutoModelForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).to(device).eval()
    def draw(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(torch.tensor(ids, device=device), attention_mask=torch.tensor(mask, device=device),
                                 do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=tokenizer.pad_token_id)
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + new
prompt_shape = list(ids.shape)
""" + _TIMED_DRAWS


# vLLM's side, run as a script by vLLM's own python (its engine process spawns: a `__main__` guard, and a file):
# argv = checkpoint, dtype, batch, new tokens, reps.
_VLLM_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, "tests")
from transformers import AutoTokenizer
from pretrained import chat_rows
if __name__ == "__main__":
    checkpoint, dtype = sys.argv[1:3]
    batch, new, reps = map(int, sys.argv[3:])
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    topics = [row["messages"][0]["content"] for row in chat_rows([f"topic {i}" for i in range(batch)])][:batch]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                           add_generation_prompt=True) for t in topics]
    prompts = [{"prompt_token_ids": ids} for ids in tokenizer(texts)["input_ids"]]
    from vllm import LLM, SamplingParams
    llm = LLM(model=checkpoint, dtype=dtype, max_model_len=512, seed=0)
    device_name = "cpu"
    def draw(seed):
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=new, min_tokens=new, ignore_eos=True,
                                seed=seed)
        out = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new for o in out)
    prompt_shape = [batch, max(len(p["prompt_token_ids"]) for p in prompts)]
""" + textwrap.indent(_TIMED_DRAWS, "    ")


def measure(side: str, checkpoint: Path, converted: Path, dtype: str, batch: int, new: int, reps: int,
            vllm_python: Path | None = None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if side == "vllm":
        script = Path(tempfile.mkdtemp(prefix="sampler-vllm-")) / "vllm_side.py"
        script.write_text(_VLLM_CHILD)
        env.pop("PYTHONPATH", None)
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        done = subprocess.run([str(vllm_python), str(script), str(checkpoint), dtype, str(batch), str(new), str(reps)],
                              cwd=ROOT, capture_output=True, text=True, env=env)
    else:
        done = subprocess.run([sys.executable, "-c", _CHILD, side, str(checkpoint), str(converted), dtype,
                               str(batch), str(new), str(reps)], cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{side} side failed:\n{done.stderr[-3000:]}")
    # vLLM logs its shutdown after the figures: the figures are the last JSON line.
    return json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and compute on every side")
    parser.add_argument("--random-weights", action="store_true",
                        help="SmolLM2-135M's shapes with random weights and a small tokenizer (bench/smollm2.py), "
                             "for a machine that cannot fetch the checkpoint")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/llama-jax-bench"))
    parser.add_argument("--vllm-python", type=Path, default=Path(os.environ.get(
        "LLAMA_JAX_VLLM_PYTHON", ROOT / ".tox" / "vllm" / "bin" / "python")),
                        help="the python of vLLM's environment (tests/vllm_env.py); no vLLM side when it is missing")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    checkpoint = smollm2_checkpoint(args.workdir, args.random_weights)
    converted = args.workdir / ("sampler-smollm2-random-jax" if args.random_weights else "sampler-smollm2-jax")
    if not (converted / "jax_checkpoint.json").is_file():
        done = run_cli(["convert-llama", "--src", checkpoint, "--out", converted, "--overwrite", "--no-progress"])
        if not done.ok:
            raise SystemExit(f"convert-llama failed: {done.error_lines()}")
    sides = ["jax", "transformers"] + (["vllm"] if args.vllm_python.is_file() else [])
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        order = sides if round_ % 2 == 0 else sides[::-1]
        for side in order:
            results[side].append(measure({"transformers": "torch"}.get(side, side), checkpoint, converted,
                                         args.dtype, args.batch, args.new, args.reps, args.vllm_python))
            print(f"round {round_ + 1} {side}: {results[side][-1]}", flush=True)
    tokens = args.batch * args.new
    model = "SmolLM2-135M's shapes, random weights" if args.random_weights else "SmolLM2-135M-Instruct"
    print(f"\n{model}, {args.dtype}, batch {args.batch} x {args.new} new tokens (prompts padded to "
          f"{results['jax'][0]['prompt'][1]}), temperature 1; {cpu_description()}; {args.rounds} rounds x "
          f"{args.reps} draws, alternating")
    print("| side | device | median s a draw | spread s | generated tokens/s | first draw s (compile or warm-up) | "
          "peak RSS |")
    print("|---|---|---|---|---|---|---|")
    medians = {}
    for side, runs in results.items():
        times = [t for run in runs for t in run["times"]]
        medians[side] = statistics.median(times)
        print(f"| {side} | {runs[0]['device']} | {medians[side]:.2f} | {min(times):.2f}-{max(times):.2f} | {tokens / medians[side]:,.0f} | "
              f"{statistics.median(run['first'] for run in runs):.1f} | "
              f"{max(run['peak_rss'] for run in runs) / GB:.2f} GB |")
    for other in sides[1:]:
        print(f"sampler / {other}: {medians[other] / medians['jax']:.2f}x the tokens a second")


if __name__ == "__main__":
    main()
