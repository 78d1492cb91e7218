"""`export-peft`: a finetune-lora run's adapters as a PEFT adapter directory (and/or a merged model)."""

from __future__ import annotations

import argparse
import sys

from export.merge import MERGE_DTYPES
from jaxmodel.formats.peft_adapter import EXPERT_LAYOUTS, EXPORT_DTYPES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="export-peft", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     description="Export the LoRA adapters of a finetune-lora run in PEFT's format, "
                                                 "loadable with peft.PeftModel.from_pretrained.")
    parser.add_argument("--run", required=True, help="finetune-lora run directory (its --out)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the newest)")
    parser.add_argument("--out", default=None, help="adapter directory to write")
    parser.add_argument("--merge", metavar="OUT_DIR", default=None,
                        help="also (or instead) write the base with the adapters folded in, as a HF checkpoint")
    parser.add_argument("--merge-base", metavar="DIR", default=None,
                        help="with --merge: the unquantized weights to merge into, for a run on a quantized base "
                             "(convert-llama --quantize): a converted unquantized checkpoint of the same model, or "
                             "the HF checkpoint directory (default: the run's base, if unquantized)")
    parser.add_argument("--merge-dtype", default="keep", choices=list(MERGE_DTYPES),
                        help="with --merge: keep each tensor's dtype (an FP8 base's projections FP8, in its blocks, "
                             "requantized), or write every floating tensor as bfloat16")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard of --merge")
    parser.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES),
                        help="dtype of the adapter tensors (PEFT itself saves float32)")
    parser.add_argument("--expert-layout", default="fused", choices=list(EXPERT_LAYOUTS),
                        help="a mixture of experts' adapters: fused (PEFT's target_parameters on transformers 5's "
                             "fused experts) or per-expert (each expert's modules under the hub's names, "
                             "transformers 4's layout and vLLM's MoE LoRA format; PEFT reads it at rank 2r on "
                             "gate and up)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a PEFT adapter at --out / an HF checkpoint at --merge (never anything else)")
    parser.add_argument("--base-model", default=None,
                        help="base_model_name_or_path to record (default: the hub id and revision or the HF "
                             "directory the run's base was converted from, as convert-llama recorded it)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.out or args.merge):
        parser.error("give --out ADAPTER_DIR, --merge OUT_DIR, or both")
    if args.merge_base and not args.merge:
        parser.error("--merge-base goes with --merge")
    if args.merge_dtype != "keep" and not args.merge:
        parser.error("--merge-dtype goes with --merge")
    from export.adapter import check_export_targets, export_adapter, export_merged
    from export.merge import parse_size
    from export.serving_limits import serving_warnings
    from finetune.run.reading import run_model_config
    from jaxmodel.errors import UserError, report

    notes: list[str] = []

    def note(message: str) -> None:  # once, whether --out, --merge or both
        if message not in notes:
            notes.append(message)
            print(f"export-peft: note: {message}", file=sys.stderr)

    try:
        shard_size = parse_size(args.max_shard_size)
        check_export_targets(args.run, args.out, args.merge, overwrite=args.overwrite,  # both, before writing either
                             merge_base=args.merge_base)
        if args.out:
            out, step, lora = export_adapter(args.run, args.out, step=args.step, dtype=args.dtype,
                                             base_model=args.base_model, overwrite=args.overwrite, note=note,
                                             expert_layout=args.expert_layout)
            print(f"exported the LoRA adapters of step {step} (r={lora.rank}, alpha={lora.alpha:g}) -> {out}")
            for warning in serving_warnings(lora, run_model_config(args.run)):
                print(f"export-peft: warning: {warning}", file=sys.stderr)
        if args.merge:
            merged, step = export_merged(args.run, args.merge, step=args.step, max_shard_size=shard_size,
                                         overwrite=args.overwrite, merge_base=args.merge_base,
                                         dtype=args.merge_dtype,
                                         base_model=args.base_model, note=note)
            into = f"--merge-base {args.merge_base}" if args.merge_base else "the run's base"
            print(f"merged the LoRA adapters of step {step} into {into} -> {merged}")
    except UserError as e:
        return report("export-peft", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
