"""A short, stable name for "these exact weights", without reading them all.

Saved model state (the prompt cache's disk tier) is only valid for the weights
that computed it. Hashing every byte of a 50 GB checkpoint at start-up would
take minutes, so the fingerprint covers each safetensors file's name, size and
header (tensor names, dtypes, shapes, offsets) plus the first and last bytes of
every tensor's data: a fine-tune, a re-quantization or a grafted head changes
them, a re-download of the same files does not.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Iterable

SAMPLE_BYTES = 64  # per tensor, at each end of its data


def _file_digest(h, path: Path) -> None:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header_bytes = f.read(n)
        h.update(path.name.encode() + struct.pack("<Q", path.stat().st_size) + header_bytes)
        header = json.loads(header_bytes)
        base = 8 + n
        for name in sorted(k for k in header if k != "__metadata__"):
            start, end = header[name]["data_offsets"]
            f.seek(base + start)
            h.update(f.read(min(SAMPLE_BYTES, end - start)))
            if end - start > SAMPLE_BYTES:
                f.seek(base + max(start + SAMPLE_BYTES, end - SAMPLE_BYTES))
                h.update(f.read(end - max(start + SAMPLE_BYTES, end - SAMPLE_BYTES)))


def weights_fingerprint(files: Iterable[Path], *extra: str) -> str:
    """Hex digest over the safetensors `files` (see the module docstring) and `extra`
    strings (settings that change the computed state, such as the compute dtype)."""
    h = hashlib.sha256()
    for path in sorted(Path(p) for p in files):
        _file_digest(h, path)
    for s in extra:
        h.update(b"\0" + s.encode())
    return h.hexdigest()
