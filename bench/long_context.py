"""Long-context LoRA training through the real `finetune-lora`, one CPU device: how the step's memory and time
grow with the sequence, `--attention xla` (dense [seq, seq] scores) against `--attention blockwise`
(flash-style, memory linear in the sequence).

Model: Llama-shaped, vocab 32000, hidden 1024, intermediate 4096, 4 layers, 16 heads / 4 kv heads, head_dim
64, max_position_embeddings 131072 (llama3 RoPE scaling), seeded random float32 weights, built locally with
demo.tiny and converted with `convert-llama` (reused from --workdir when it is there). LoRA and everything
else at finetune-lora's defaults (r=8 on all seven projections, loss chunk, MLP chunk, remat); batch 1,
`--dtype float32`, mesh dp=1,fsdp=1,cp=1,mp=1 (one CPU device using both cores).

For each sequence length (--seqs) and attention (--attentions):
  plan  `finetune-lora --plan --model-config MODEL/config.json ... --hbm-gb 1000`: the compiler's
        temporaries ("activations / temporaries") and the plan's total, per device;
  run   when the plan's total is below --ram-gb: `finetune-lora --model MODEL --data DATA --steps K ...`
        (--steps, default 3) as a child process: its peak RSS (ru_maxrss from wait4; this process stays
        small, see cli_runs.run_cli) and the seconds of steps 2..K from the run's metrics.jsonl (step 1
        compiles): median and min-max. Data: random corpus words, one document per sequence.
The two attentions alternate within each sequence length (xla first at one, blockwise first at the next, and
the other way round in the next round); --rounds repeats the runs (plans are deterministic: once).

"x per 4x seq" is temps(S) / temps(S/4), same attention, where S/4 was measured: 4.0x is linear.
Goals: temporaries at 4x the sequence <= 4.4x (blockwise, default options); blockwise at least as fast as
xla from 2048 positions on (where `--attention auto` switches to it).

    python bench/long_context.py [--seqs 2048,4096,8192,16384,32768] [--steps 3] [--rounds 1] [--ram-gb 18]
    python bench/long_context.py --quick          # seqs 512 and 1024, 2 steps: checks the script (~3 min)
    python bench/long_context.py --plan-only      # the plans alone (no training runs)

The plans of the real models at long context (405B, 70B, 8B): bench/plan_tables.py.

Run time on an idle 2-core machine, estimated (a step ~3 ms per token, from --quick, plus ~1e-6 s x seq^2 of
attention over the 4 layers, from the attention timings in docs/long-context.md): about 25 minutes for the
defaults, most of it blockwise at 16384 (~5 min a step). xla is skipped from 8192 on (plan 26 GB and more),
and so is blockwise at 32768 (plan 18.2 GB, just over --ram-gb 18; a run's RSS is ~0.7 GB above its plan):
--ram-gb 20 adds it on a 24 GiB machine, about an hour more (~20 min a step).

Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

from cli_runs import (GB, build_model, cpu_description, own_peak_rss, plan_figures, run_cli, step_seconds,
                      write_text_data)

MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=131072, initializer_range=0.02,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
MESH = "dp=1,fsdp=1,cp=1,mp=1"
SEQS = (2048, 4096, 8192, 16384, 32768)
QUICK_SEQS = (512, 1024)
BLOCKWISE_GOAL_FROM = 2048
TEMPS_GOAL = 4.4  # temporaries at 4x the sequence, at most this many times

TEMPS = "activations / temporaries"


def plan_args(config: Path, seq: int, attention: str, remat: str | None) -> list[str]:
    args = ["finetune-lora", "--plan", "--model-config", config, "--mesh", MESH, "--batch-size", "1",
            "--seq-len", seq, "--attention", attention, "--dtype", "float32", "--hbm-gb", "1000"]
    return args + (["--remat", remat] if remat else [])


def train_args(model: Path, data: Path, out: Path, seq: int, attention: str, steps: int,
               remat: str | None) -> list[str]:
    args = ["finetune-lora", "--model", model, "--data", data, "--out", out, "--steps", steps, "--batch-size", "1",
            "--seq-len", seq, "--attention", attention, "--dtype", "float32", "--mesh", MESH,
            "--checkpoint-every", "100000", "--no-progress", "--lr", "1e-4"]
    return args + (["--remat", remat] if remat else [])


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", help=f"comma-separated sequence lengths (default {','.join(map(str, SEQS))})")
    parser.add_argument("--attentions", default="xla,blockwise", help="finetune-lora --attention values to compare")
    parser.add_argument("--steps", type=int, default=None, help="steps per run; step 1 compiles (default 3)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the runs (alternating the attentions)")
    parser.add_argument("--ram-gb", type=float, default=18.0, help="run only where the plan's total is below this")
    parser.add_argument("--remat", default=None, help="passed to finetune-lora --remat (default: its default)")
    parser.add_argument("--workdir", default="/tmp/llama-jax-bench", help="model, data and run directories")
    parser.add_argument("--quick", action="store_true", help="seqs 512 and 1024, 2 steps: to check the script")
    parser.add_argument("--plan-only", action="store_true", help="plans only, no training runs")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()

    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else list(QUICK_SEQS if args.quick else SEQS)
    steps = args.steps or (2 if args.quick else 3)
    attentions = [a.strip() for a in args.attentions.split(",") if a.strip()]
    workdir = Path(args.workdir)
    print(f"CPU: {cpu_description()}", flush=True)
    model = build_model(workdir, MODEL)
    config = model / "config.json"
    plans: dict[tuple[int, str], dict] = {}
    runs: dict[tuple[int, str], list] = {(s, a): [] for s in seqs for a in attentions}
    notes: dict[tuple[int, str], str] = {}

    for seq in seqs:
        for attention in attentions:
            run = run_cli(plan_args(config, seq, attention, args.remat))
            figures = plan_figures(run.stdout)
            if "total" not in figures:
                notes[(seq, attention)] = f"plan failed (exit {run.returncode})"
                print(f"seq {seq} {attention}: plan failed (exit {run.returncode}): {run.error_lines()}", flush=True)
                continue
            plans[(seq, attention)] = figures
            print(f"seq {seq} {attention}: plan temporaries {figures[TEMPS]:.2f} GB, total {figures['total']:.2f} GB "
                  f"({run.seconds:.0f} s)", flush=True)
            if figures["total"] >= args.ram_gb:
                notes[(seq, attention)] = f"skipped: plan {figures['total']:.1f} GB > --ram-gb {args.ram_gb:g}"
    if not args.plan_only:
        for r in range(args.rounds):
            for i, seq in enumerate(seqs):
                data = workdir / f"data-{seq}x{steps}.jsonl"
                if not data.is_file():
                    write_text_data(data, seq * steps, seed=seq, row_words=seq - 2)
                order = attentions if (i + r) % 2 == 0 else attentions[::-1]
                for attention in order:
                    if (seq, attention) not in plans or (seq, attention) in notes:
                        continue
                    out = workdir / "runs" / f"{seq}-{attention}-{r}"
                    shutil.rmtree(out, ignore_errors=True)
                    run = run_cli(train_args(model, data, out, seq, attention, steps, args.remat))
                    if not run.ok:
                        notes[(seq, attention)] = f"run failed (exit {run.returncode})"
                        print(f"seq {seq} {attention} round {r + 1}: FAILED (exit {run.returncode}): "
                              f"{run.error_lines()}", flush=True)
                        continue
                    seconds = step_seconds(out)
                    runs[(seq, attention)].append((run.peak_rss, seconds))
                    print(f"seq {seq} {attention} round {r + 1}: peak RSS {run.peak_rss / GB:.2f} GB, steps 2..{steps} "
                          f"{', '.join(f'{s:.2f}' for s in seconds)} s ({run.seconds:.0f} s in all)", flush=True)
                    shutil.rmtree(out, ignore_errors=True)

    median: dict[tuple[int, str], float] = {}
    print()
    print(f"{MODEL['hidden_size']} hidden, {MODEL['num_hidden_layers']} layers, vocab {MODEL['vocab_size']}, batch 1, "
          f"float32, 1 CPU device, remat {args.remat or 'default'}, {steps} steps per run (step 1 compiles), "
          f"{args.rounds} round(s); CPU: {cpu_description()}")
    print()
    print("| seq | attention | temporaries GB | x per 4x seq | plan total GB | peak RSS GB | step s (median, min-max) "
          "| tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in seqs:
        for attention in attentions:
            figures = plans.get((seq, attention))
            temps = f"{figures[TEMPS]:.2f}" if figures else "-"
            quarter = plans.get((seq // 4, attention)) if seq % 4 == 0 else None
            growth = (f"{figures[TEMPS] / quarter[TEMPS]:.2f}x" if figures and quarter and quarter[TEMPS] > 0 else "-")
            total = f"{figures['total']:.2f}" if figures else "-"
            measured = runs[(seq, attention)]
            if measured and all(s for _, s in measured):
                all_steps = [s for _, steps_ in measured for s in steps_]
                median[(seq, attention)] = m = statistics.median(all_steps)
                rss = f"{max(p for p, _ in measured) / GB:.2f}"
                step = f"{m:.2f} ({min(all_steps):.2f}-{max(all_steps):.2f})"
                rate = f"{seq / m:,.0f}"
            else:
                note = notes.get((seq, attention), "plan only" if args.plan_only else "no steps after the first")
                rss, step, rate = note, "-", "-"
            print(f"| {seq} | {attention} | {temps} | {growth} | {total} | {rss} | {step} | {rate} |")
    print()

    options = "default options" if not args.remat else f"--remat {args.remat}, not the default options"
    ratios = []
    for seq in seqs:
        if seq % 4 == 0 and (seq, "blockwise") in plans and (seq // 4, "blockwise") in plans:
            quarter = plans[(seq // 4, "blockwise")][TEMPS]
            if quarter > 0:
                ratios.append((seq, plans[(seq, "blockwise")][TEMPS] / quarter))
    if ratios:
        verdict = "OK" if all(x <= TEMPS_GOAL for _, x in ratios) else "NOT MET"
        figures = ", ".join(f"{s // 4}->{s}: {x:.2f}x" for s, x in ratios)
    else:
        verdict, figures = "n/a", "no blockwise sequence length with its quarter also measured"
    print(f"temporaries 4x seq -> <= {TEMPS_GOAL}x (blockwise, {options}): {verdict} ({figures})")

    speed, below = [], []
    for seq in seqs:
        x, b = median.get((seq, "xla")), median.get((seq, "blockwise"))
        text = f"{seq}: {x / b:.2f}x" if x and b else f"{seq}: " + "; ".join(
            f"{a} {notes.get((seq, a), 'not measured')}" for a in ("xla", "blockwise") if not median.get((seq, a)))
        (speed if seq >= BLOCKWISE_GOAL_FROM else below).append((seq, x / b if x and b else None, text))
    compared = [r for _, r, _ in speed if r is not None]
    verdict = ("n/a" if not compared else "OK" if all(r >= 1.0 for r in compared) else "NOT MET")
    detail = ", ".join(t for _, _, t in speed) or f"no sequence length >= {BLOCKWISE_GOAL_FROM} measured"
    print(f"blockwise at least as fast as xla from {BLOCKWISE_GOAL_FROM} (xla step s / blockwise step s, per seq): "
          f"{verdict} ({detail})")
    if below:
        print(f"  below {BLOCKWISE_GOAL_FROM}, not a goal: {', '.join(t for _, _, t in below)}")
    for (seq, attention), measured in runs.items():
        if measured:
            print(f"raw step s, {seq} {attention}: {[[round(s, 2) for s in steps_] for _, steps_ in measured]}")
    print(f"peak RSS of this benchmark process (a floor under the runs' figures): {own_peak_rss() / GB:.3f} GB")


if __name__ == "__main__":
    main()
