"""`convert-llama`: the command-line face of `converter.conversion`."""

from __future__ import annotations

import argparse
import sys

from converter.conversion import DTYPE_CHOICES, QUANTIZE_CHOICES, convert
from jaxmodel.quantization import DEFAULT_BLOCKS
from jaxmodel.errors import UserError, report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert-llama",
        description="Convert a HuggingFace checkpoint of Llama 3.x, Mistral, Qwen2/2.5, Qwen3 or Gemma 3 "
                    "(local directory or hub id) into the JAX checkpoint format, streaming tensor by tensor.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--src", required=True, help="checkpoint directory, or hub id such as meta-llama/Llama-3.1-8B")
    parser.add_argument("--out", required=True, help="output directory (written atomically)")
    parser.add_argument("--dtype", default="keep", choices=list(DTYPE_CHOICES),
                        help="dtype of the stored weights; 'keep' stores each tensor as the source has it")
    parser.add_argument("--quantize", default=None, choices=list(QUANTIZE_CHOICES),
                        help="store the projections of every layer (and the experts) quantized, for a frozen base "
                             "(QLoRA): nf4 (bitsandbytes' NF4 codes), int8, or fp8 (e4m3 in square blocks, the "
                             "layout of DeepSeek-V3's FP8 checkpoints, which convert as they are without this); "
                             "embeddings, norms, routers and the LM head keep --dtype")
    parser.add_argument("--quant-block", type=int, default=None, metavar="N",
                        help="values per scale along each projection's input dimension (nf4, int8; default "
                             f"{DEFAULT_BLOCKS['nf4']}), or the side of fp8's square blocks (default "
                             f"{DEFAULT_BLOCKS['fp8']}), with --quantize")
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) for a hub id")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing converted checkpoint at --out")
    parser.add_argument("--verify", action="store_true", help="re-read the output and check every checksum")
    parser.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = convert(args.src, args.out, dtype=args.dtype, quantize=args.quantize, quant_block=args.quant_block,
                          revision=args.revision, overwrite=args.overwrite, verify=args.verify,
                          progress=not args.no_progress)
    except UserError as e:
        return report("convert-llama", e)
    except KeyboardInterrupt:
        print("convert-llama: interrupted; nothing was written to --out", file=sys.stderr)
        return 130
    print(f"{summary}{' (verified)' if args.verify else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
