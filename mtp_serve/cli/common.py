"""Pieces every mtp-* command shares: one-line argument errors, one-line failures,
prompt encoding."""

from __future__ import annotations

import argparse
import sys
from typing import List


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(prog: str, msg: str) -> int:
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 1


def encode_prompt(tokenizer, text: str, chat: bool) -> List[int]:
    """Token ids of `text`, wrapped as a user message by the chat template with `chat`."""
    if not chat:
        return list(tokenizer.encode(text))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)
