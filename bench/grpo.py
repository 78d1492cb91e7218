"""A GRPO run on SmolLM2-135M-Instruct through `finetune-lora` (the command a user runs), with a verifiable reward the
base model rarely meets: docs/rl.md's `brief` (a reply of at most 16 tokens), read from the docs so that the two
cannot drift. Prompts ask for short descriptions of tests/pretrained.py's topics in four phrasings; the held-out
prompts are the held-out topics'. The run evaluates the base model at step 0 and the policy every `--eval-every`
steps (one completion of each held-out prompt, the same key each time); this prints the held-out mean reward of the
base and after training, and each step's time split into sampling, the log-prob pass, the rewards and the rest
(the training step), with the run's wall time and peak RSS.

    python bench/grpo.py [--steps 40] [--lr 2e-4] [--dtype float32] [--workdir /tmp/llama-jax-bench]
    python bench/grpo.py --random-weights --steps 5 --dtype bfloat16     # on a GPU machine: the step's split alone

Done when (docs/rl.md): the held-out mean reward at least twice the base's and at least 0.15 above it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import GB, OneLineErrorParser, cpu_description, positive, run_cli  # noqa: E402
from smollm2 import smollm2_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PHRASINGS = ("Describe {} in one short sentence.", "What is {}? Answer in a few words.",
             "Say something about {} briefly.", "In one line, what do you think of {}?")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=40)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--batch-size", type=positive, default=8, help="prompts a step")
    parser.add_argument("--num-generations", type=positive, default=8)
    parser.add_argument("--max-completion-length", type=positive, default=24)
    parser.add_argument("--eval-every", type=positive, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--random-weights", action="store_true",
                        help="SmolLM2-135M's shapes with random weights (bench/smollm2.py), for a machine that cannot "
                             "fetch the checkpoint: no evaluation, only the step's time split")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/llama-jax-bench"))
    return parser


def prompts(topics: list[str]) -> str:
    return "".join(json.dumps({"prompt": [{"role": "user", "content": p.format(t)}]}) + "\n"
                   for p in PHRASINGS for t in topics)


def main() -> None:
    args = build_parser().parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from pretrained import HELD_OUT_TOPICS, TRAIN_TOPICS

    work = args.workdir / "grpo"
    work.mkdir(parents=True, exist_ok=True)
    # bench/sampler.py's conversion, shared
    converted = args.workdir / ("sampler-smollm2-random-jax" if args.random_weights else "sampler-smollm2-jax")
    if not (converted / "jax_checkpoint.json").is_file():
        checkpoint = smollm2_checkpoint(args.workdir, args.random_weights)
        done = run_cli(["convert-llama", "--src", checkpoint, "--out", converted, "--overwrite"])
        if not done.ok:
            raise SystemExit(f"convert-llama failed: {done.error_lines()}")
    (work / "train.jsonl").write_text(prompts(TRAIN_TOPICS))
    (work / "held-out.jsonl").write_text(prompts(HELD_OUT_TOPICS))
    doc = (ROOT / "docs" / "rl.md").read_text()
    (work / "rewards.py").write_text(re.search(r"```python\n(.*?)```", doc, re.DOTALL).group(1))
    out = work / "run"
    evaluation = [] if args.random_weights else ["--eval-data", work / "held-out.jsonl", "--eval-every",
                                                 args.eval_every]
    command = ["finetune-lora", "--model", converted, "--data", work / "train.jsonl", *evaluation,
               "--out", out, "--overwrite", "--objective", "grpo", "--reward",
               f"{work / 'rewards.py'}:brief", "--batch-size", args.batch_size, "--num-generations",
               args.num_generations, "--max-completion-length", args.max_completion_length, "--steps", args.steps,
               "--lr", args.lr, "--rank", "16", "--alpha", "32", "--dtype", args.dtype, "--mesh", "dp=1,fsdp=1,mp=1",
               "--checkpoint-every", args.steps, "--no-progress"]
    print(" ".join(map(str, command)), flush=True)
    done = run_cli(command)
    if not done.ok:
        raise SystemExit(f"finetune-lora failed: {done.error_lines()}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_reward"], r["eval_completions/mean_length"]) for r in records if "eval_reward" in r]
    steps = [r for r in records if "loss" in r]
    model = "SmolLM2-135M's shapes, random weights" if args.random_weights else "SmolLM2-135M-Instruct"
    print(f"\n{model}, {args.dtype}, GRPO (dapo, beta 0), {args.batch_size} prompts x {args.num_generations} "
          f"completions of at most {args.max_completion_length} tokens a step, LoRA r 16 on every projection, lr "
          f"{args.lr:g}, {args.steps} steps; {cpu_description()}; wall {done.seconds / 60:.1f} min, peak RSS "
          f"{done.peak_rss / GB:.2f} GB")
    if evals:
        base, final = evals[0][1], evals[-1][1]
        print("| step | held-out mean reward | held-out mean length |\n|---|---|---|")
        for step, reward, length in evals:
            print(f"| {step} | {reward:.3f} | {length:.1f} |")
        print(f"held-out reward {base:.3f} -> {final:.3f}: {final / max(base, 1e-9):.2f}x, {final - base:+.3f} "
              f"({'meets' if final >= 2 * base and final >= base + 0.15 else 'misses'} the goal: 2x and +0.15)")
        print(f"training reward, first 5 steps -> last 5: {statistics.mean(r['reward'] for r in steps[:5]):.3f} -> "
              f"{statistics.mean(r['reward'] for r in steps[-5:]):.3f}")
    # compiled, no evaluation in the step's time, and a step that sampled (with --num-iterations 1: every one)
    later = [r for r in steps[1:] if (not evals or r["step"] % args.eval_every) and "time/sample_s" in r]
    parts = {"sampling": [r["time/sample_s"] for r in later], "log-prob pass": [r["time/logps_s"] for r in later],
             "rewards": [r["time/rewards_s"] for r in later]}
    parts["training step (the rest)"] = [r["time/step_s"] - sum(r[k] for k in ("time/sample_s", "time/logps_s",
                                                                                "time/rewards_s")) for r in later]
    parts["whole step"] = [r["time/step_s"] for r in later]
    print(f"| part of a step ({len(later)} steps: not the first, none with an evaluation) | median s | spread s |\n"
          "|---|---|---|")
    for name, values in parts.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} |")


if __name__ == "__main__":
    main()
