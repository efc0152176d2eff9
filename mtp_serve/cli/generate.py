"""mtp-generate: decode one prompt, with or without MTP, and print the text or JSON."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from mtp_serve import BACKEND
from mtp_serve.cli.common import OneLineParser, encode_prompt, fail


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="mtp-generate", description="Generate text with MTP speculative decoding.")
    p.add_argument("--model", help="local directory or Hugging Face repo id (default: the embedded demo model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    depth = p.add_mutually_exclusive_group()
    depth.add_argument("--mtp-depth", type=int, help="most drafts per round (default: the model card's); the depth "
                       "of each round is chosen up to it from measured costs and acceptance, as mtp-serve does")
    depth.add_argument("--no-mtp", action="store_true", help="plain decoding")
    p.add_argument("--fixed-depth", action="store_true", help="draft exactly --mtp-depth tokens every round, and copy drafts "
                   "wherever a copy is expected to emit more than the head, not by measured times (a run repeats exactly)")
    p.add_argument("--draft-vocab", type=int, metavar="N", help="draft from the checkpoint's N most frequent tokens "
                   "(its draft_vocab.json; default: the model card's draft_vocab_size, 0: the whole vocabulary)")
    p.add_argument("--draft-head-bits", type=int, choices=(0, 4, 8), help="draft from the head quantized to 4 or 8 bits "
                   "(default: the model card's draft_head_bits, as mtp-tune chose it; 0: the head as stored)")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids, finish_reason, stats")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from mtp_serve.engine.generator import generate
    from mtp_serve.engine.policy import DepthPolicy
    from mtp_serve.engine.sampling import SamplingParams
    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.models.loader import load_model

    def error(msg: str) -> int:
        return fail("mtp-generate", msg)

    if args.mtp_depth is not None and not 1 <= args.mtp_depth <= 8:
        return error("--mtp-depth must be between 1 and 8")
    try:
        params = SamplingParams(
            temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            seed=args.seed, max_tokens=args.max_tokens,
        )
        lm = load_model(args.model or default_model_path(), enable_mtp=not args.no_mtp, draft_vocab=args.draft_vocab,
                        draft_head_bits=args.draft_head_bits)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        return error(str(e))
    tok = lm.tokenizer
    prompt_ids = encode_prompt(tok, args.prompt, args.chat)
    if not prompt_ids:
        return error("the prompt encodes to no tokens")
    depth = 0 if args.no_mtp else (args.mtp_depth or lm.card.default_mtp_depth)

    text, ids, chunk = [], [], None
    policy = DepthPolicy.serving(depth, args.fixed_depth, lm.card.window_costs)
    for chunk in generate(lm.model, tok, prompt_ids, params, depth, policy=policy):
        ids += chunk.token_ids
        text.append(chunk.text)
        if not args.json:
            print(chunk.text, end="", flush=True)
    if args.json:
        print(json.dumps({
            "model": str(lm.path),
            "mtp": lm.mtp_status,
            "drafts": lm.model.drafts_note() if lm.model.has_mtp else None,
            "backend": BACKEND.note,
            "text": "".join(text),
            "token_ids": ids,
            "finish_reason": chunk.finish_reason,
            "stats": chunk.stats.as_dict(),
        }))
    else:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
