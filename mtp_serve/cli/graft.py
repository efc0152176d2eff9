"""mtp-graft: add the original checkpoint's MTP head to an already converted model.

    mtp-graft --from Qwen/Qwen3.5-4B --into ./Qwen3.5-4B-4bit

Only the shard(s) of the source that hold the head are downloaded. The
target's body is not touched; the head goes into its own shard (unquantized,
norms shifted exactly once), the index, config and a provenance file
(`mtp_graft.json`) are updated. Then the model is loaded and measured on this
machine (`mtp-tune`): beside a quantized body the drafts are chosen (the head's
precision and the draft vocabulary, by acceptance), and the depth that pays is stored.
"""

from __future__ import annotations

import argparse
import sys

from mtp_serve.cli.common import OneLineParser
from mtp_serve.cli.tune import add_tune_arguments, exit_status, run_command, verify_and_tune


def add_head_arguments(p: argparse.ArgumentParser) -> None:
    """Options mtp-graft and mtp-convert share."""
    p.add_argument("--quantize-head", action="store_true",
                   help="store the head quantized like the body (lossy; without it the verify step quantizes it in memory "
                   "only where acceptance holds)")
    p.add_argument("--norms", choices=("raw", "shifted"),
                   help="how the source stores the head's RMSNorm weights (default: detected from the values)")
    p.add_argument("--no-verify", action="store_true", help="skip loading and measuring the model afterwards")
    add_tune_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="mtp-graft", description="Add the original checkpoint's MTP head to a converted MLX model.")
    p.add_argument("--from", dest="source", required=True, metavar="REPO_OR_DIR",
                   help="the original checkpoint (Hugging Face repo id or directory) that ships the MTP head")
    p.add_argument("--into", dest="target", required=True, metavar="MLX_DIR",
                   help="the converted model to add the head to (a directory, or a repo id in the hub cache)")
    p.add_argument("--revision", help="branch, tag or commit of the source repo")
    p.add_argument("--force", action="store_true", help="replace a head the target already has")
    add_head_arguments(p)
    return p


def report(result, out=print) -> None:
    """What a graft did, for the user (shared with mtp-convert)."""
    src, n = result.source, result.norms
    if result.status == "unchanged":
        out(f"{result.target} already holds this head (from {src.describe()}): nothing to do "
            f"(mtp-tune {result.target} measures it again)")
        return
    stat = f"median {n.statistic:.3f}, " if n.statistic == n.statistic else ""
    shift = "shifted +1 once" if n.needs_shift else "kept as they are"
    out(f"{result.status} the MTP head of {src.describe()} (read from {', '.join(src.files)}) into "
        f"{result.target}: {result.tensors} tensors in mtp.safetensors, {'quantized' if result.quantized_head else result.dtype}; "
        f"norms found {n.stored} ({stat}decided by {n.decided_by}), {shift}; experts: {result.experts.replace('_', '-')}; "
        f"provenance in mtp_graft.json")
    for w in result.warnings:
        out(f"warning: {w}")


def report_and_verify(prog: str, result, args) -> int:
    """Say what the graft did, then (unless --no-verify, or nothing changed) measure the model."""
    report(result, out=lambda s: print(f"{prog}: {s}", flush=True))
    if result.status == "unchanged" or args.no_verify:
        return 0
    return exit_status(verify_and_tune(str(result.target), args))


def _graft(args) -> int:
    from mtp_serve.models.graft import graft
    from mtp_serve.models.loader import resolve_model_path

    target = resolve_model_path(args.target)
    result = graft(args.source, target, revision=args.revision, force=args.force,
                   quantize_head=args.quantize_head, norms=args.norms)
    return report_and_verify("mtp-graft", result, args)


def main(argv=None) -> int:
    return run_command("mtp-graft", build_parser(), argv, _graft)


if __name__ == "__main__":
    sys.exit(main())
