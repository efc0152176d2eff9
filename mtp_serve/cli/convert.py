"""mtp-convert: mlx-lm's conversion, keeping the MTP head.

    mtp-convert --hf-path Qwen/Qwen3.5-4B --mlx-path ./Qwen3.5-4B-4bit -q --q-bits 4

The body is converted (and quantized) by mlx-lm's own `convert`, so the result
loads in stock mlx-lm for plain decoding; the head, which mlx-lm drops, is then
grafted from the same source exactly as `mtp-graft` does: stored unquantized
whatever the body (unless --quantize-head); the verify step then chooses the
precision it drafts at and the draft vocabulary. Everything is written to a temporary
directory beside the output and renamed into place at the end. Then the model
is measured on this machine and the depth that pays is stored.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from mtp_serve.cli.common import OneLineParser
from mtp_serve.cli.graft import add_head_arguments, report_and_verify
from mtp_serve.cli.tune import run_command


def build_parser() -> argparse.ArgumentParser:
    from mtp_serve.models.mlx_lm_compat import conversion_choices

    MODEL_CONVERSION_DTYPES, QUANT_RECIPES = conversion_choices()

    p = OneLineParser(prog="mtp-convert", description="Convert a Hugging Face checkpoint to MLX (mlx-lm's converter), keeping its MTP head.")
    p.add_argument("--hf-path", "--model", dest="hf_path", required=True, metavar="REPO_OR_DIR",
                   help="the original checkpoint: Hugging Face repo id or local directory")
    p.add_argument("--mlx-path", default="mlx_model", help="output directory (must not exist; default mlx_model)")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the body (the head is stored unquantized; the verify step chooses the precision it drafts at)")
    p.add_argument("--q-bits", type=int, help="bits per weight (mlx-lm's default: 4)")
    p.add_argument("--q-group-size", type=int, help="quantization group size (mlx-lm's default: 64)")
    p.add_argument("--q-mode", default="affine", choices=("affine", "mxfp4", "nvfp4", "mxfp8"))
    p.add_argument("--quant-predicate", choices=QUANT_RECIPES, help="mlx-lm's mixed-bit recipe for the body")
    p.add_argument("--dtype", choices=MODEL_CONVERSION_DTYPES,
                   help="dtype of the unquantized weights, head included (default: the config's torch_dtype)")
    p.add_argument("--revision", help="branch, tag or commit of the source repo")
    add_head_arguments(p)
    return p


def _convert(args) -> int:
    if args.quantize_head and not args.quantize:
        raise ValueError("--quantize-head needs -q (the head is quantized like the body)")
    out = Path(args.mlx_path)
    if out.exists():
        raise ValueError(f"{out} already exists; choose a new --mlx-path (or graft into it with mtp-graft)")
    from mtp_serve.models.graft import graft
    from mtp_serve.models.mlx_lm_compat import convert
    from mtp_serve.models.mtp_source import open_source
    from mtp_serve.models.vision.carry import carry_vision

    tmp = out.parent / f".{out.name}.mtp-convert-tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run
    try:
        source = open_source(args.hf_path, args.revision)  # fails early on a source without a head
        if source.config.get("model_type") == "qwen4_exp":  # no mlx-lm model: the project's own converter
            from mtp_serve.models import qwen4_exp_convert

            if args.quant_predicate:
                raise ValueError("qwen4_exp: --quant-predicate is not supported yet (mlx-lm's recipes need its model)")
            qwen4_exp_convert.convert(source.path, tmp, quantize=args.quantize, q_group_size=args.q_group_size,
                                      q_bits=args.q_bits, q_mode=args.q_mode, dtype=args.dtype)
        else:
            convert(args.hf_path, str(tmp), quantize=args.quantize, q_group_size=args.q_group_size, q_bits=args.q_bits,
                    q_mode=args.q_mode, dtype=args.dtype, revision=args.revision, quant_predicate=args.quant_predicate)
        vision = carry_vision(source, tmp, args.dtype)  # mlx-lm drops the tower; it stays unquantized
        result = graft(source, tmp, quantize_head=args.quantize_head, norms=args.norms)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result.target = out
    if vision:
        print(f"mtp-convert: vision tower: {vision} tensors kept unquantized in {out / 'vision.safetensors'}", flush=True)
    return report_and_verify("mtp-convert", result, args)


def main(argv=None) -> int:
    return run_command("mtp-convert", build_parser(), argv, _convert)


if __name__ == "__main__":
    sys.exit(main())
