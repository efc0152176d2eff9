"""Pieces every mtp-* command shares: one-line argument errors, one-line failures,
prompt encoding."""

from __future__ import annotations

import argparse
import re
import sys
from typing import List

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def byte_size(text: str) -> int:
    """argparse type for a size in bytes: `0`, `1073741824`, `512M`, `8G`, `8GiB`, `1.5GB` (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 0, 512M, 8G)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def origins(text: str) -> List[str]:
    """argparse type for browser origins: comma-separated `scheme://host[:port]`, or `*` for any."""
    out = [o.strip().rstrip("/") for o in text.split(",") if o.strip()]
    for o in out:
        if o != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", o, re.IGNORECASE):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin (scheme://host[:port], e.g. http://localhost:5173, or *)")
    return out


def fail(prog: str, msg: str) -> int:
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 1


def encode_prompt(tokenizer, text: str, chat: bool) -> List[int]:
    """Token ids of `text`, wrapped as a user message by the chat template with `chat`."""
    if not chat:
        return list(tokenizer.encode(text))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)
