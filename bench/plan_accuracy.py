"""How well `finetune-lora --plan` predicts the memory of the run it plans: the plan's figures against the peak
RSS of the same run through the real CLI, on CPU (where device memory is host memory, so the process's RSS
holds it).

Model: Llama-shaped, vocab 32000, hidden 1024, intermediate 4096, 4 layers, 16 heads / 4 kv heads, head_dim
64 (the model of bench/long_context.py, built and converted the same way and shared through --workdir);
float32; LoRA and everything not listed at finetune-lora's defaults. Configs (seq, --remat, --attention), batch 1,
one CPU device: (1024, dots, xla), (4096, dots, xla), (4096, none, xla), (4096, full, blockwise),
(8192, dots, blockwise), (8192, full, blockwise); and one on 8 simulated devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8): mesh dp=1,fsdp=8,cp=1,mp=1, batch 8 x seq 1024 (dots,
xla). For each:

  plan       `finetune-lora --plan --model-config MODEL/config.json ... --dtype float32 --hbm-gb 1000`: the
             compiler's figure (total - margin, the report's "margin ..." line; 0 where there is none) and the
             total as printed, per device;
  run        the same config trained for --steps steps (default 2): the child's peak RSS (ru_maxrss from wait4;
             this process stays small, see cli_runs.run_cli);
  tiny run   a run identical except `--seq-len 128 --attention xla --remat dots`, once per distinct mesh and
             batch (cached), and its plan.

  measured = peak RSS(config) - peak RSS(tiny) + compiler's figure(tiny)

The process's RSS holds more than device memory: the Python and XLA runtimes, the compiler's own working
memory, the tokenizer and data, the checkpoint files read at load. Both runs hold all that alike, so the growth
from the tiny run to the config is the growth of what the device needs. The growth alone leaves out what both
runs hold on the device (the weights, the LoRA parameters and AdamW state, and the tiny run's own activations):
the compiler's figure for the tiny run puts that back, weights included (without the margin, so that the margin
the measurements ask for does not depend on itself). On the 8-device config the plan is per device and the
process holds all eight: there every plan figure is taken x 8 (per-process sums), the tiny run's too.

Columns: the plan's figures; the RSS growth; measured; measured / the compiler's figure; whether the printed
total covers the measurement. At the end, the margin the measurements need: max over configs of
(measured - compiler's figure) / the plan's temporaries, and whether the printed totals cover every measurement.

    python bench/plan_accuracy.py [--steps 2] [--workdir /tmp/llama-jax-bench]
    python bench/plan_accuracy.py --quick                    # two configs at seq 256 / 512: checks the script
    python bench/plan_accuracy.py --configs 2048:dots:xla,1024:dots:xla:8dev   # SEQ:REMAT:ATTENTION[:8dev]
    python bench/plan_accuracy.py --plan-only                # the plans alone (no training runs)

Run time on an idle 2-core machine, estimated from --quick: about 15 minutes for the built-in list (the two
8192 configs 3-4 minutes each). Run it on an idle machine: the peak RSS of a run does not depend on load, but nothing
else may crowd the machine's memory while a large config runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

from cli_runs import GB, build_model, cpu_description, own_peak_rss, plan_figures, run_cli, write_text_data
from long_context import MODEL

ONE_DEVICE = "dp=1,fsdp=1,cp=1,mp=1"
EIGHT_DEVICES = "dp=1,fsdp=8,cp=1,mp=1"
TINY_SEQ = 128
TEMPS = "activations / temporaries"


@dataclasses.dataclass(frozen=True)
class Config:
    seq: int
    remat: str
    attention: str
    mesh: str = ONE_DEVICE
    batch: int = 1
    devices: int = 1  # devices in the process: plan figures are per device, x this for the process

    @property
    def env(self) -> dict[str, str]:
        if self.devices == 1:
            return {}
        return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={self.devices}"}

    @property
    def label(self) -> str:
        where = "1 device" if self.devices == 1 else f"{self.devices} devices ({self.mesh.split(',')[1]})"
        return f"{self.batch} x {self.seq}, {self.remat}, {self.attention}, {where}"

    def tiny(self) -> "Config":
        return dataclasses.replace(self, seq=TINY_SEQ, attention="xla", remat="dots")


CONFIGS = [Config(1024, "dots", "xla"), Config(4096, "dots", "xla"), Config(4096, "none", "xla"),
           Config(4096, "full", "blockwise"), Config(8192, "dots", "blockwise"), Config(8192, "full", "blockwise"),
           Config(1024, "dots", "xla", mesh=EIGHT_DEVICES, batch=8, devices=8)]
QUICK = [Config(256, "dots", "xla"), Config(512, "full", "blockwise")]


def parse_configs(text: str) -> list[Config]:
    """SEQ:REMAT:ATTENTION[:8dev], comma-separated; 8dev is the 8-simulated-device config (fsdp=8, batch 8)."""
    configs = []
    for spec in text.split(","):
        parts = spec.strip().split(":")
        if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "8dev"):
            raise SystemExit(f"--configs: expected SEQ:REMAT:ATTENTION[:8dev], got {spec!r}")
        extra = dict(mesh=EIGHT_DEVICES, batch=8, devices=8) if len(parts) == 4 else {}
        configs.append(Config(int(parts[0]), parts[1], parts[2], **extra))
    return configs


def plan(model: Path, c: Config) -> dict:
    run = run_cli(["finetune-lora", "--plan", "--model-config", model / "config.json", "--mesh", c.mesh,
                   "--batch-size", c.batch, "--seq-len", c.seq, "--attention", c.attention, "--remat", c.remat,
                   "--dtype", "float32", "--hbm-gb", "1000"], env=c.env)
    figures = plan_figures(run.stdout)
    if "total" not in figures:
        raise SystemExit(f"plan of {c.label} failed (exit {run.returncode}): {run.error_lines()}")
    print(f"plan {c.label}: temporaries {figures[TEMPS]:.2f} GB, compiler's {figures['compiler']:.2f} GB, total "
          f"{figures['total']:.2f} GB per device ({run.seconds:.0f} s)", flush=True)
    return figures


def train(model: Path, workdir: Path, c: Config, steps: int) -> int | None:
    """Peak RSS in bytes of a run at config `c`, or None if it failed."""
    data = workdir / f"data-{c.batch}x{c.seq}x{steps}.jsonl"
    if not data.is_file():
        write_text_data(data, c.batch * c.seq * steps, seed=c.seq, row_words=c.seq - 2)
    out = workdir / "runs" / f"accuracy-{c.batch}x{c.seq}-{c.remat}-{c.attention}-{c.devices}"
    shutil.rmtree(out, ignore_errors=True)
    run = run_cli(["finetune-lora", "--model", model, "--data", data, "--out", out, "--steps", steps,
                   "--batch-size", c.batch, "--seq-len", c.seq, "--attention", c.attention, "--remat", c.remat,
                   "--dtype", "float32", "--mesh", c.mesh, "--checkpoint-every", "100000", "--no-progress",
                   "--lr", "1e-4"], env=c.env)
    shutil.rmtree(out, ignore_errors=True)
    if not run.ok:
        print(f"run {c.label}: FAILED (exit {run.returncode}): {run.error_lines()}", flush=True)
        return None
    print(f"run {c.label}: peak RSS {run.peak_rss / GB:.2f} GB ({run.seconds:.0f} s)", flush=True)
    return run.peak_rss


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="steps per run")
    parser.add_argument("--workdir", default="/tmp/llama-jax-bench", help="model, data and run directories")
    parser.add_argument("--quick", action="store_true", help="two small configs (seq 256, 512): checks the script")
    parser.add_argument("--configs", help="SEQ:REMAT:ATTENTION[:8dev],... instead of the built-in list")
    parser.add_argument("--plan-only", action="store_true", help="plans only, no training runs")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    configs = parse_configs(args.configs) if args.configs else QUICK if args.quick else CONFIGS
    workdir = Path(args.workdir)
    print(f"CPU: {cpu_description()}", flush=True)
    model = build_model(workdir, MODEL)

    tiny: dict[tuple, tuple[dict, int | None]] = {}
    rows = []
    for c in configs:
        figures = plan(model, c)
        if args.plan_only:
            rows.append((c, figures, None, None))
            continue
        key = (c.mesh, c.batch, c.devices)
        if key not in tiny:
            t = c.tiny()
            tiny[key] = (plan(model, t), train(model, workdir, t, args.steps))
        rows.append((c, figures, train(model, workdir, c, args.steps), tiny[key]))

    print()
    print(f"{MODEL['hidden_size']} hidden, {MODEL['num_hidden_layers']} layers, vocab {MODEL['vocab_size']}, float32, "
          f"{args.steps} steps per run; tiny run: seq {TINY_SEQ}, xla, dots; CPU: {cpu_description()}. "
          "GB per process (8-device config: 8 x the plan's per-device figures)")
    print()
    print("| config | plan: compiler's GB | plan: total with margin GB | peak RSS growth GB | measured GB | "
          "measured / compiler's | total >= measured? |")
    print("|---|---|---|---|---|---|---|")
    needed, uncovered, compared = [], [], 0
    for c, figures, rss, tiny_run in rows:
        n = c.devices
        compiler, total, temps = n * figures["compiler"], n * figures["total"], n * figures[TEMPS]
        if rss is None or tiny_run is None or tiny_run[1] is None:
            why = "plan only" if args.plan_only else "run failed"
            print(f"| {c.label} | {compiler:.2f} | {total:.2f} | {why} | - | - | - |")
            continue
        tiny_figures, tiny_rss = tiny_run
        growth = (rss - tiny_rss) / GB
        measured = growth + n * tiny_figures["compiler"]
        covered = total >= measured
        compared += 1
        if not covered:
            uncovered.append(c.label)
        if temps > 0:
            needed.append(((measured - compiler) / temps, c.label))
        print(f"| {c.label} | {compiler:.2f} | {total:.2f} | {growth:.2f} | {measured:.2f} | "
              f"{measured / compiler:.2f}x | {'yes' if covered else 'NO'} |")
    print()
    for (mesh, batch, devices), (figures, rss) in tiny.items():
        where = f"{batch} x {TINY_SEQ}, {mesh}"
        rss_text = f"{rss / GB:.2f} GB" if rss is not None else "run failed"
        print(f"tiny run {where}: peak RSS {rss_text}, plan total {figures['total']:.2f} GB per device "
              f"(x {devices} = {devices * figures['total']:.2f} GB; compiler's {figures['compiler']:.2f}, "
              f"weights {figures.get('frozen weights', 0.0):.2f}, temporaries {figures[TEMPS]:.2f})")
    margin_names = sorted({f["margin_name"] for _, f, _, _ in rows if f["margin_name"]})
    print(f"plan's margin line: {', '.join(margin_names) if margin_names else 'none (margin 0)'}")
    if needed:
        worst, label = max(needed)
        print(f"margin needed: {worst:+.0%} of temporaries (worst: {label}; per config in table order: "
              f"{', '.join(f'{x:+.0%}' for x, _ in needed)})")
    if compared:
        verdict = "yes" if not uncovered else f"NO: not covered at {'; '.join(uncovered)}"
        print(f"printed totals cover every measurement ({compared} configs): {verdict}")
    print(f"peak RSS of this benchmark process (a floor under the runs' figures): {own_peak_rss() / GB:.3f} GB")


if __name__ == "__main__":
    main()
