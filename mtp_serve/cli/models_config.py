"""`mtp-serve --config FILE`: several models behind one server, from a TOML file.

    [server]
    max_loaded_bytes = "24G"      # weights budget (--max-loaded-bytes; default: the machine's memory)
    prompt_cache_bytes = "8G"     # shared out by the models' prompt_cache_share (--prompt-cache-bytes)

    [[model]]                     # the first is the default: requests without `model` go to it
    name = "main"                 # the served name (default: the folder's name, or the repo id)
    path = "~/models/Qwen3.5-27B" # a folder or Hugging Face repo id (default: the embedded demo model)
    aliases = ["claude-sonnet-4-5"]
    mtp = true                    # --enable-mtp
    mtp_depth = 3                 # --mtp-depth (the depth cap)
    draft_vocab = 32768           # --draft-vocab
    draft_head_bits = 8           # --draft-head-bits
    max_context = 65536           # --max-context
    max_batch_size = 4            # --max-batch-size
    max_queue = 64                # --max-queue
    prompt_cache_share = 0.75     # of the prompt cache budget (or prompt_cache_bytes = "6G")
    pinned = true                 # loaded at start and never unloaded (the first model always is)

Flags on the command line are every model's defaults; a model's keys override them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from mtp_serve.cli.common import byte_size

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser as the tomli package
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

MODEL_KEYS = {"name": str, "path": str, "aliases": list, "mtp": bool, "mtp_depth": int, "draft_vocab": int,
              "draft_head_bits": int, "max_context": int, "max_batch_size": int, "max_queue": int,
              "prompt_cache_bytes": (str, int),
              "prompt_cache_share": (float, int), "pinned": bool}
SERVER_KEYS = {"max_loaded_bytes": (str, int), "prompt_cache_bytes": (str, int)}


class ConfigError(ValueError):
    pass


REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name: a Hugging Face repo id


def check_path(path: str, where: str) -> None:
    """A model path is a checkpoint folder, or a repo id when it names nothing here (downloaded
    on first load); a file, or a missing folder that is no repo id, is a ConfigError."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConfigError(f"{where}: {path} is a file, not a checkpoint folder")
        if not (p / "config.json").is_file():
            raise ConfigError(f"{where}: {path} has no config.json: not a checkpoint folder")
        return
    if p.is_absolute() or path.startswith((".", "~")) or not REPO_ID.fullmatch(path):
        raise ConfigError(f"{where}: no such folder: {path}")


@dataclass
class ServeFile:
    models: List[Dict[str, Any]]
    max_loaded_bytes: Optional[int] = None
    prompt_cache_bytes: Optional[int] = None
    source: Optional[Path] = field(default=None, repr=False)


def _size(value, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: a size is a number of bytes or a string such as \"8G\"")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: must be 0 or more")
        return value
    try:
        return byte_size(value)
    except Exception as e:  # argparse's ArgumentTypeError
        raise ConfigError(f"{where}: {e}") from None


def _check(table: dict, keys: dict, where: str) -> None:
    for k, v in table.items():
        if k not in keys:
            raise ConfigError(f"{where}: unknown key '{k}' (known: {', '.join(sorted(keys))})")
        if isinstance(v, bool) and keys[k] is not bool or not isinstance(v, keys[k]):
            raise ConfigError(f"{where}.{k}: wrong type {type(v).__name__}")


def parse_config(text: str, base: Optional[Path] = None) -> ServeFile:
    """The file's models (dicts of MODEL_KEYS, sizes in bytes, paths resolved against the
    file's folder when they name one there) and server settings."""
    if tomllib is None:
        raise ConfigError("reading a TOML config needs Python 3.11 (tomllib) or the tomli package")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"not valid TOML: {e}") from None
    unknown = set(doc) - {"server", "model"}
    if unknown:
        raise ConfigError(f"unknown table '{sorted(unknown)[0]}' (a config has [server] and [[model]] tables)")
    server = doc.get("server", {})
    _check(server, SERVER_KEYS, "[server]")
    models = doc.get("model")
    if not isinstance(models, list) or not models:
        raise ConfigError("no [[model]] table: a config lists at least one model")
    out = []
    for i, m in enumerate(models):
        where = f"[[model]] {i + 1}"
        if not isinstance(m, dict):
            raise ConfigError(f"{where}: a [[model]] is a table")
        _check(m, MODEL_KEYS, where)
        if "name" in m:
            if not m["name"].strip():
                raise ConfigError(f"{where}.name: empty")
            where = f"[[model]] {i + 1} ('{m['name']}')"
        m = dict(m)
        if "aliases" in m and not all(isinstance(a, str) and a for a in m["aliases"]):
            raise ConfigError(f"{where}.aliases: a list of names")
        for k in ("mtp_depth",):
            if k in m and not 1 <= m[k] <= 8:
                raise ConfigError(f"{where}.mtp_depth: between 1 and 8")
        if m.get("draft_head_bits", 0) not in (0, 4, 8):
            raise ConfigError(f"{where}.draft_head_bits: 0 (the head as stored), 4 or 8")
        for k in ("max_batch_size", "max_queue", "max_context"):
            if k in m and m[k] < (2 if k == "max_context" else 1):
                raise ConfigError(f"{where}.{k}: too small")
        if "prompt_cache_bytes" in m:
            m["prompt_cache_bytes"] = _size(m["prompt_cache_bytes"], f"{where}.prompt_cache_bytes")
        if "prompt_cache_share" in m and not 0 <= m["prompt_cache_share"] <= 1:
            raise ConfigError(f"{where}.prompt_cache_share: between 0 and 1")
        if "path" in m and base is not None and not Path(m["path"]).expanduser().is_absolute():
            local = base / m["path"]
            if local.exists():
                m["path"] = str(local)
        if "path" in m:
            check_path(m["path"], f"{where}.path")
        out.append(m)
    shares = sum(m.get("prompt_cache_share", 0) for m in out)
    if shares > 1 + 1e-9:
        raise ConfigError(f"the models' prompt_cache_share add up to {shares:g}, more than 1")
    budget = _size(server["max_loaded_bytes"], "[server].max_loaded_bytes") if "max_loaded_bytes" in server else None
    if budget == 0:
        raise ConfigError("[server].max_loaded_bytes: must be more than 0")
    return ServeFile(out, budget,
                     _size(server["prompt_cache_bytes"], "[server].prompt_cache_bytes") if "prompt_cache_bytes" in server else None)


def read_config(path: str) -> ServeFile:
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(str(e)) from None
    f = parse_config(text, p.parent)
    f.source = p
    return f


def prompt_cache_parts(models: List[Dict[str, Any]], total: int) -> List[int]:
    """Each model's prompt cache bytes: its prompt_cache_bytes, else its share of `total`
    (models without either split what the shares leave, evenly)."""
    fixed = [m for m in models if "prompt_cache_bytes" not in m]
    given = sum(m.get("prompt_cache_share", 0) for m in fixed)
    rest = [m for m in fixed if "prompt_cache_share" not in m]
    even = max(0.0, 1 - given) / len(rest) if rest else 0.0
    return [m["prompt_cache_bytes"] if "prompt_cache_bytes" in m else int(total * m.get("prompt_cache_share", even))
            for m in models]
