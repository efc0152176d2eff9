"""The flags table of docs/serving.md, written from `mtp-serve`'s own argument parser.

    python -m mtp_serve.cli.flags_doc docs/serving.md     # rewrites the table between the flags markers
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

START, END = "<!-- flags -->", "<!-- /flags -->"


def _flag(action: argparse.Action) -> str:
    name = "`" + ", ".join(action.option_strings) + "`"
    if action.choices:
        return name + " " + "\\|".join(str(c) for c in action.choices)
    if action.nargs != 0 and action.metavar:
        return name + f" {action.metavar}"
    if action.nargs != 0:
        return name + f" {action.dest.upper()}"
    return name


def flags_table(parser: argparse.ArgumentParser) -> str:
    """One markdown row per flag: the flag (with its value or choices), its default, what it does."""
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        default = "" if action.default in (None, False, argparse.SUPPRESS) else f"`{action.default}`"
        text = (action.help or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {_flag(action)} | {default} | {text} |")
    return "\n".join(rows)


def rendered_block() -> str:
    from mtp_serve.cli.serve import build_parser

    return f"{START}\n{flags_table(build_parser())}\n{END}"


def replace_block(text: str) -> str:
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {START} ... {END} block")
    return pattern.sub(lambda _: rendered_block(), text)


def main(argv: list[str] | None = None) -> None:
    (path,) = argv if argv is not None else sys.argv[1:]
    doc = Path(path)
    doc.write_text(replace_block(doc.read_text()))


if __name__ == "__main__":
    main()
