"""Every `finetune-lora --plan` figure the docs quote, regenerated through the real CLI in one run.

Each row is `finetune-lora --plan --model-config CONFIG --mesh MESH --batch-size B --seq-len S [flags]` with
finetune-lora's defaults otherwise (bf16, LoRA r=8 on all seven projections, `--attention auto`, loss chunk
2048, MLP chunk 4096), judged on 192 GB devices (MI300X) with XLA_CLIENT_MEM_FRACTION=0.95 (`--fraction`),
the setting docs/405b-on-mi300x.md uses. Devices are simulated on CPU (the CLI does this for --plan).

    python bench/plan_tables.py                        # every row (about 15-25 minutes on 2 cores)
    python bench/plan_tables.py --only 405b-cp8        # rows whose name contains the text
    python bench/plan_tables.py --only 405b-dpo        # the DPO rows only
    python bench/plan_tables.py --fit                  # also the --plan --fit examples of the docs (SFT and DPO)

Prints two markdown tables, SFT rows then DPO rows (`--objective dpo --reference base`; `--batch-size` counts
pairs, and a step holds 2 rows a pair): weights, LoRA + AdamW, temporaries (the compiler's), the measured
margin, the total, and the verdict line of each plan.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cli_runs import cpu_description, plan_figures, run_cli

REPO = Path(__file__).resolve().parent.parent
L405 = REPO / "tests/data/llama-3.1-405b-config.json"
L70 = REPO / "bench/configs/llama-3.1-70b-config.json"
L8 = REPO / "bench/configs/llama-3.1-8b-config.json"
FSDP8, CP8, ONE = "dp=1,fsdp=8,mp=1", "dp=1,fsdp=1,cp=8,mp=1", "dp=1,fsdp=1,cp=1,mp=1"

# name: (config, mesh, batch, seq, extra flags)
ROWS = {
    "405b-fsdp8-16x64": (L405, FSDP8, 16, 64, []),
    "405b-fsdp8-16x64-none": (L405, FSDP8, 16, 64, ["--remat", "none"]),
    "405b-fsdp8-16x64-full": (L405, FSDP8, 16, 64, ["--remat", "full"]),
    "405b-fsdp8-16x2048-full": (L405, FSDP8, 16, 2048, ["--remat", "full"]),
    "405b-fsdp8-16x4096-full": (L405, FSDP8, 16, 4096, ["--remat", "full"]),
    "405b-fsdp8-16x8192-full": (L405, FSDP8, 16, 8192, ["--remat", "full"]),
    "405b-fsdp8-16x8192-full-accum2": (L405, FSDP8, 16, 8192, ["--remat", "full", "--grad-accum", "2"]),
    "405b-cp8-1x32768-full": (L405, CP8, 1, 32768, ["--remat", "full"]),
    "405b-cp8-1x65536-full": (L405, CP8, 1, 65536, ["--remat", "full"]),
    "405b-cp8-1x131072-full": (L405, CP8, 1, 131072, ["--remat", "full"]),
    "405b-fsdp16-32x64": (L405, "dp=1,fsdp=16,mp=1", 32, 64, []),
    "70b-cp8-1x32768-full": (L70, CP8, 1, 32768, ["--remat", "full"]),
    "70b-cp8-1x131072-full": (L70, CP8, 1, 131072, ["--remat", "full"]),
    "8b-1dev-1x32768-full": (L8, ONE, 1, 32768, ["--remat", "full"]),
    "8b-1dev-1x131072-full": (L8, ONE, 1, 131072, ["--remat", "full"]),
}
# DPO against the base model (LoRA's reference: the adapters off, in the same step); batch = pairs.
DPO = ["--objective", "dpo", "--reference", "base"]
DPO_ROWS = {
    "405b-dpo-fsdp8-8x2048": (L405, FSDP8, 8, 2048, DPO),
    "405b-dpo-fsdp8-8x2048-full": (L405, FSDP8, 8, 2048, [*DPO, "--remat", "full"]),
    "405b-dpo-fsdp8-16x2048-full": (L405, FSDP8, 16, 2048, [*DPO, "--remat", "full"]),
    "405b-dpo-fsdp8-8x4096-full": (L405, FSDP8, 8, 4096, [*DPO, "--remat", "full"]),
    "405b-dpo-fsdp8-8x8192-full": (L405, FSDP8, 8, 8192, [*DPO, "--remat", "full"]),
    "405b-dpo-fsdp8-8x4096-full-precomputed": (L405, FSDP8, 8, 4096,
                                               [*DPO, "--remat", "full", "--precompute-reference"]),
}
# The --fit examples: 405B, 16 x 8192 on the node; DPO, 8 pairs x 8192.
FIT = (L405, FSDP8, 16, 8192, [])
DPO_FIT = (L405, FSDP8, 8, 8192, DPO)


def plan_command(config: Path, mesh: str, batch: int, seq: int, extra: list[str]) -> list[str]:
    return ["finetune-lora", "--plan", "--model-config", str(config), "--mesh", mesh, "--batch-size", str(batch),
            "--seq-len", str(seq), *extra]


def plan_table(rows: dict, env: dict, only: str = "") -> None:
    """Plan each row (name -> plan_command arguments) whose name contains `only` through the CLI, printing each
    plan, then one markdown table of them all."""
    table = ["| plan | weights | LoRA + AdamW | temporaries | margin | total | verdict |", "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        if only not in name:
            continue
        run = run_cli(plan_command(*row), env=env)
        figures = plan_figures(run.stdout)
        verdict = next((line.strip() for line in run.stdout.splitlines()
                        if line.startswith("  fits in") or line.startswith("  DOES NOT FIT")), None)
        if "total" not in figures or verdict is None:
            print(f"{name}: FAILED (exit {run.returncode}): {run.error_lines()}", flush=True)
            continue
        print(f"{name}: {' '.join(plan_command(*row)[1:])}  ({run.seconds:.0f} s)\n{run.stdout}", flush=True)
        table.append(f"| {name} | {figures['frozen weights']:.1f} GB | {figures['LoRA params + AdamW state']:.2f} GB | "
                     f"{figures['activations / temporaries']:.1f} GB | {figures['margin']:.1f} GB | "
                     f"{figures['total']:.1f} GB | {verdict} |")
    print("\n".join(table), flush=True)


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="rows whose name contains this text")
    parser.add_argument("--fraction", default="0.95", help="XLA_CLIENT_MEM_FRACTION the plans are judged at")
    parser.add_argument("--fit", action="store_true", help="also run the docs' --plan --fit examples")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    env = {"XLA_CLIENT_MEM_FRACTION": args.fraction}
    print(f"CPU: {cpu_description()}; XLA_CLIENT_MEM_FRACTION={args.fraction}, --hbm-gb 192", flush=True)
    for rows in (ROWS, DPO_ROWS):
        if any(args.only in name for name in rows):
            plan_table(rows, env, args.only)
    for example in (FIT, DPO_FIT) if args.fit else ():
        command = plan_command(*example) + ["--fit"]
        run = run_cli(command, env=env)
        print(f"\nXLA_CLIENT_MEM_FRACTION={args.fraction} {' '.join(command)}  ({run.seconds:.0f} s, exit "
              f"{run.returncode})\n{run.stdout}{run.stderr[-2000:] if run.returncode > 1 else ''}")


if __name__ == "__main__":
    main()
