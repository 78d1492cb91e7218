"""`export-peft`: a finetune-lora run's adapters as a PEFT adapter directory (and/or a merged model)."""

from __future__ import annotations

import argparse
import sys

from export.peft import EXPORT_DTYPES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="export-peft", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     description="Export the LoRA adapters of a finetune-lora run in PEFT's format, "
                                                 "loadable with peft.PeftModel.from_pretrained.")
    parser.add_argument("--run", required=True, help="finetune-lora run directory (its --out)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the newest)")
    parser.add_argument("--out", required=True, help="adapter directory to write")
    parser.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES),
                        help="dtype of the adapter tensors (PEFT itself saves float32)")
    parser.add_argument("--base-model", default=None,
                        help="base_model_name_or_path to record (default: the converted checkpoint the run used)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from export.peft import AdapterError, save_peft_adapter
    from export.run import load_run
    from jaxmodel.checkpoint import CheckpointError
    from jaxmodel.config import ConfigError

    try:
        lora, config, step = load_run(args.run, args.step)
        out = save_peft_adapter(args.out, lora, config.lora_config(), base_model=args.base_model or config.model,
                                dtype=args.dtype, card={"training steps": step, "learning rate": config.lr,
                                                        "sequence length": config.seq_len})
    except (AdapterError, CheckpointError, ConfigError) as e:
        print(f"export-peft: error: {e}", file=sys.stderr)
        return 1
    print(f"exported the LoRA adapters of step {step} (r={config.rank}, alpha={config.alpha:g}) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
