"""Every `finetune-lora --plan` figure the docs quote, regenerated through the real CLI in one run.

Each row is `finetune-lora --plan --model-config CONFIG --mesh MESH --batch-size B --seq-len S [flags]` with
finetune-lora's defaults otherwise (bf16, LoRA r=8 on all seven projections, `--attention auto`, loss chunk
2048, MLP chunk 4096), judged on 192 GB devices (MI300X) with XLA_CLIENT_MEM_FRACTION=0.95 (`--fraction`),
the setting docs/405b-on-mi300x.md uses. Devices are simulated on CPU (the CLI does this for --plan).

    python bench/plan_tables.py                        # every row (about 15-25 minutes on 2 cores)
    python bench/plan_tables.py --only 405b-cp8        # rows whose name contains the text
    python bench/plan_tables.py --only 405b-dpo        # the DPO rows only
    python bench/plan_tables.py --fit                  # also the --plan --fit examples of the docs (SFT and DPO)
    python bench/plan_tables.py --time                 # predicted step times: 405B layouts, 8B/70B replicated
    python bench/plan_tables.py --families             # Qwen3-32B, Qwen2.5-72B, Mistral-Large-2, Gemma 3 27B

Prints two markdown tables, SFT rows then DPO rows (`--objective dpo --reference base`; `--batch-size` counts
pairs, and a step holds 2 rows a pair): weights, LoRA + AdamW, temporaries (the compiler's), the measured
margin, the total, and the verdict line of each plan.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from cli_runs import cpu_description, plan_figures, run_cli

REPO = Path(__file__).resolve().parent.parent
L405 = REPO / "tests/data/llama-3.1-405b-config.json"
L70 = REPO / "bench/configs/llama-3.1-70b-config.json"
L8 = REPO / "bench/configs/llama-3.1-8b-config.json"
Q3_32 = REPO / "bench/configs/qwen3-32b-config.json"
Q25_72 = REPO / "bench/configs/qwen2.5-72b-config.json"
ML2 = REPO / "bench/configs/mistral-large-2407-config.json"
G3_27 = REPO / "bench/configs/gemma-3-27b-config.json"
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
# Time (--time): 405B in bf16 and on an NF4 base at the reference run's shape and three longer ones, on fsdp, mp,
# their mixes and cp; 8B and 70B with a replicated base (dp=8) beside fsdp=8 and mp=8.
MP8, F4M2, F2M4, C2M4, DP8 = "dp=1,fsdp=1,mp=8", "dp=1,fsdp=4,mp=2", "dp=1,fsdp=2,mp=4", "dp=1,fsdp=1,cp=2,mp=4", \
    "dp=8,fsdp=1,mp=1"
_TIME_SHAPES = {"16x64": (16, 64, []), "16x2048": (16, 2048, ["--remat", "full"]),
                "8x8192": (8, 8192, ["--remat", "full"]), "1x65536": (1, 65536, ["--remat", "full"])}
_TIME_MESHES = {"16x64": (FSDP8, MP8, F4M2, F2M4), "16x2048": (FSDP8, MP8, F2M4),
                "8x8192": (FSDP8, MP8, F2M4, CP8), "1x65536": (CP8, MP8, C2M4)}
TIME_ROWS = {
    f"405b{base}-{shape}-{mesh}": (L405, mesh, batch, seq, [*extra, *quantize])
    for base, quantize in (("", []), ("-nf4", ["--quantize", "nf4"]))
    for shape, (batch, seq, extra) in _TIME_SHAPES.items() for mesh in _TIME_MESHES[shape]
}
TIME_ROWS.update({f"{name}-16x2048-{mesh}": (config, mesh, 16, 2048, ["--remat", "full"])
                  for name, config in (("8b", L8), ("70b", L70)) for mesh in (DP8, FSDP8, MP8)})

# Families (--families): the published configs of Qwen3-32B, Qwen2.5-72B, Mistral-Large-Instruct-2407 (123B) and
# Gemma 3 27B (its decoder: the multimodal config's text_config) at 16 x 2048 (remat full) on 8 devices: fsdp=8 and
# mp=8, and a replicated base (dp=8) where the weights fit a device.
FAMILY_ROWS = {f"{name}-16x2048-{mesh}": (config, mesh, 16, 2048, ["--remat", "full"])
               for name, config, meshes in (("qwen3-32b", Q3_32, (DP8, FSDP8, MP8)),
                                            ("qwen2.5-72b", Q25_72, (DP8, FSDP8, MP8)),
                                            ("mistral-large-2407", ML2, (FSDP8, MP8)),
                                            ("gemma-3-27b", G3_27, (DP8, FSDP8, MP8)))
               for mesh in meshes}

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


def time_table(rows: dict, env: dict, only: str = "") -> None:
    """Plan each row through the CLI with --plan-json and print one markdown table of memory and predicted time."""
    table = ["| plan | total a device | fits | predicted step | tokens/s | MFU | bound | collectives a device a step |",
             "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as workdir:
        for name, row in rows.items():
            if only not in name:
                continue
            path = Path(workdir) / f"{name}.json"
            run = run_cli([*plan_command(*row), "--plan-json", path], env=env)
            if not path.is_file():
                print(f"{name}: FAILED (exit {run.returncode}): {run.error_lines()}", flush=True)
                continue
            record = json.loads(path.read_text())
            p = record["predicted"]
            moved = ", ".join(f"{kind} {c['bytes'] / 1e9:,.1f} GB" for kind, c in sorted(record["collectives"].items())
                              if c["bytes"] >= 1e8) or "< 0.1 GB"
            line = (f"| {name} | {record['memory']['total_bytes'] / 1e9:.1f} GB | "
                    f"{'yes' if record['memory']['fits'] else 'no'} | {p['step_seconds']:.3g} s "
                    f"({p['overlapped_step_seconds']:.3g} s overlapped) | {p['tokens_per_s']:,.0f} | {p['mfu']:.1%} | "
                    f"{p['bound']} | {moved} |")
            print(f"{name}: {' '.join(map(str, plan_command(*row)[1:]))}  ({run.seconds:.0f} s)\n{line}", flush=True)
            table.append(line)
    print("\n".join(table), flush=True)


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="rows whose name contains this text")
    parser.add_argument("--fraction", default="0.95", help="XLA_CLIENT_MEM_FRACTION the plans are judged at")
    parser.add_argument("--fit", action="store_true", help="also run the docs' --plan --fit examples")
    parser.add_argument("--time", action="store_true",
                        help="the predicted-time table (405B on fsdp, mp, mixes and cp; 8B and 70B replicated) "
                             "instead of the memory tables")
    parser.add_argument("--families", action="store_true",
                        help="memory and predicted time of Qwen3-32B, Qwen2.5-72B, Mistral-Large-2 and Gemma 3 27B on "
                             "8 devices "
                             "instead of the memory tables")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    env = {"XLA_CLIENT_MEM_FRACTION": args.fraction}
    print(f"CPU: {cpu_description()}; XLA_CLIENT_MEM_FRACTION={args.fraction}, --hbm-gb 192", flush=True)
    if args.time:
        time_table(TIME_ROWS, env, args.only)
    if args.families:
        time_table(FAMILY_ROWS, env, args.only)
    for rows in (ROWS, DPO_ROWS) if not (args.time or args.families) else ():
        if any(args.only in name for name in rows):
            plan_table(rows, env, args.only)
    for example in (FIT, DPO_FIT) if args.fit else ():
        command = plan_command(*example) + ["--fit"]
        run = run_cli(command, env=env)
        print(f"\nXLA_CLIENT_MEM_FRACTION={args.fraction} {' '.join(command)}  ({run.seconds:.0f} s, exit "
              f"{run.returncode})\n{run.stdout}{run.stderr[-2000:] if run.returncode > 1 else ''}")


if __name__ == "__main__":
    main()
