"""qwen4_exp's PLE n-gram tables, memory-mapped from the checkpoint's safetensors files.

The tables are large (~90 GiB in the published checkpoint) and a token reads only a few
rows of each. MLX's `mx.load` is lazy only until first use: a row lookup (`take`)
evaluates the whole table into memory (measured: a 64 MiB table, one 3-row lookup,
64 MiB of MLX memory). So the tables are not MLX arrays here: each shard is a numpy
memmap over its bytes in the file, the lookup gathers the rows on the host, and only the
pages those rows lie on are read (by the OS, shared, and dropped under pressure). The
gathered rows are cast to the compute dtype as a loaded table would have been, so the
numbers are those of the in-memory table bit for bit.

Full-precision tables only (the raw Hugging Face or mlx-community shards, or an unquantized
`mtp-convert` output); a quantized table loads into memory as before.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

# safetensors dtype -> (numpy dtype of the stored bits, MLX dtype they view as)
_DTYPES = {"F32": (np.float32, mx.float32), "F16": (np.float16, mx.float16), "BF16": (np.uint16, mx.bfloat16)}
_HF = re.compile(r"^model\.language_model\.layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")
_MLX_LM = re.compile(r"^model\.layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")  # mlx-community
_OWN = re.compile(r"^language_model\.model\.layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.weight$")


def _header(path: Path) -> Tuple[dict, int]:
    """A safetensors file's header and where its data starts."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


class MappedTable:
    """A table's rows as the memmaps of its shards (in row order); `take` gathers rows."""

    def __init__(self, shards: List[np.ndarray], dtype: mx.Dtype):
        self.shards = shards
        self.dtype = dtype  # what the stored bits are (bf16 kept as uint16 in numpy)
        self.target = dtype  # the compute dtype rows are cast to (the loader sets it)
        self.starts = np.cumsum([0] + [s.shape[0] for s in shards])
        self.shape = (int(self.starts[-1]), shards[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def take(self, ids: mx.array) -> mx.array:
        """Rows `ids` (any shape) -> [*ids.shape, D] at the compute dtype."""
        flat = np.array(ids).reshape(-1).astype(np.int64)
        out = np.empty((flat.size, self.shape[1]), self.shards[0].dtype)
        which = np.searchsorted(self.starts, flat, side="right") - 1
        for i, shard in enumerate(self.shards):
            sel = np.nonzero(which == i)[0]
            if sel.size:
                out[sel] = shard[flat[sel] - self.starts[i]]
        rows = mx.array(out)
        if self.dtype == mx.bfloat16:
            rows = rows.view(mx.bfloat16)
        return rows.astype(self.target).reshape(*ids.shape, self.shape[1])


def _random_access(arr: np.ndarray) -> None:
    """Tell the OS the rows are read at random, so a page fault on a row not in the page
    cache reads that page, not the pages after it too."""
    m = getattr(arr, "_mmap", None)
    if m is not None and hasattr(mmap, "MADV_RANDOM"):
        m.madvise(mmap.MADV_RANDOM)


def mapped_tables(files: List[Path], weight_map: Optional[Dict[str, str]]) -> Dict[int, Tuple[MappedTable, List[str]]]:
    """Per layer index, its n-gram table mapped from `files` and the tensor names it covers
    (to be left out of the loaded weights). Layers whose table is quantized or stored in a
    dtype numpy cannot map are absent (they load into memory)."""
    parts: Dict[int, Dict[int, Tuple[np.ndarray, mx.Dtype, str]]] = {}
    quantized = set()
    for f in files:
        header, start = _header(f)
        for name, info in header.items():
            if name == "__metadata__" or (weight_map is not None and weight_map.get(name) != f.name):
                continue
            m = _HF.match(name) or _MLX_LM.match(name) or _OWN.match(name)
            if m is None:
                if name.endswith(".ngram_embedding.scales"):
                    quantized.add(int(name.split(".layers.")[1].split(".")[0]))
                continue
            if info["dtype"] not in _DTYPES:
                quantized.add(int(m.group(1)))
                continue
            np_dtype, mx_dtype = _DTYPES[info["dtype"]]
            a, b = info["data_offsets"]
            shape = tuple(info["shape"])
            arr = np.memmap(f, dtype=np_dtype, mode="r", offset=start + a, shape=shape) if b > a else np.zeros(shape, np_dtype)
            _random_access(arr)
            shard = int(m.group(2)) if m.re is not _OWN else 0
            parts.setdefault(int(m.group(1)), {})[shard] = (arr, mx_dtype, name)
    out = {}
    for layer, shards in parts.items():
        if layer in quantized or len({d for _, d, _ in shards.values()}) != 1:
            continue
        ordered = [shards[i] for i in sorted(shards)]
        out[layer] = (MappedTable([a for a, _, _ in ordered], ordered[0][1]), [n for _, _, n in ordered])
    return out
