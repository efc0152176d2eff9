"""Snapshots and blocks as safetensors files (the prompt cache's disk tier format).

A file's metadata says what it is (`kind`: snapshot, kv or head block), which
model and weights computed it, the snapshot's layout, and a CRC-32 and dtype
per tensor: a file that is truncated, altered or from other weights fails to
read with `BadFile` instead of restoring wrong state. Quantized KV parts are
three tensors (`.k.0` packed, `.k.1` scales, `.k.2` biases) where a full
precision part is one (`.k`), and the snapshot's info names its KV setting. A layer's parts past
keys and values (qwen4_exp: the indexer's keys; a PLE layer's n-gram and conv windows) follow as
`.e0`, `.e1`, ..., so they restore exactly. Writes go to a temporary
name in the same directory and are renamed into place, so a file under its
final name is always complete.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from mtp_serve.models.caches import FULL_KV, KVSetting

from .snapshot import Block, Pair, Snapshot, block_hashes, kv_salt

FORMAT = "mtp-serve-prompt-cache/1"
Tensors = Dict[str, np.ndarray]


class BadFile(Exception):
    """A cache file that cannot be used (corrupt, partial, or another model's)."""


def to_numpy(x: mx.array) -> Tuple[np.ndarray, str]:
    dtype = str(x.dtype).split(".")[-1]
    if x.dtype == mx.bfloat16:  # numpy has no bfloat16: keep the bits
        x = x.view(mx.uint16)
    # C order: MLX keeps a transposed result's strides, and safetensors writes the raw buffer.
    return np.ascontiguousarray(np.array(x)), dtype


def _from_numpy(a: np.ndarray, dtype: str) -> mx.array:
    x = mx.array(a)
    return x.view(mx.bfloat16) if dtype == "bfloat16" else x


def _put(tensors: Tensors, dtypes: Dict[str, str], name: str, x: Optional[mx.array]) -> None:
    if x is not None:
        tensors[name], dtypes[name] = to_numpy(x)


def _put_pair(tensors: Tensors, dtypes: Dict[str, str], prefix: str, pair: Optional[Pair]) -> None:
    """A layer's parts: `.k`, `.v`, then any further ones as `.e0`, `.e1`, ... (qwen4_exp's
    indexer keys beside the KV; its PLE n-gram and conv windows beside a GatedDeltaNet state)."""
    if pair is None:
        return
    names = [prefix + ".k", prefix + ".v"] + [f"{prefix}.e{i}" for i in range(len(pair) - 2)]
    for name, part in zip(names, pair):
        if isinstance(part, tuple):  # quantized: packed, scales, biases
            for i, x in enumerate(part):
                _put(tensors, dtypes, f"{name}.{i}", x)
        else:
            _put(tensors, dtypes, name, part)


def snapshot_tensors(snap: Snapshot) -> Tuple[Tensors, Dict[str, str], dict]:
    """(tensors, dtypes, info) for a snapshot file. Call on the thread that owns MLX."""
    tensors: Tensors = {"tokens": snap.tokens}
    dtypes = {"tokens": "int32"}
    for i, pair in enumerate(snap.layers):
        _put_pair(tensors, dtypes, f"layer{i}", pair)
    _put_pair(tensors, dtypes, "head", snap.head_tail)
    _put(tensors, dtypes, "owed", snap.owed)
    info = {"n": snap.n, "linear": list(snap.linear), "head_blocks": snap.head_blocks, "has_head": snap.has_head,
            "kv": [snap.kv.bits, snap.kv.group_size]}
    return tensors, dtypes, info


def block_tensors(block: Block, head: bool) -> Tuple[Tensors, Dict[str, str]]:
    """The backbone part (per attention layer) or the head part of a block."""
    tensors: Tensors = {}
    dtypes: Dict[str, str] = {}
    if head:
        _put_pair(tensors, dtypes, "head", block.head)
    else:
        for j, pair in enumerate(block.kv):
            _put_pair(tensors, dtypes, f"attn{j}", pair)
    return tensors, dtypes


def write_file(path: Path, tensors: Tensors, dtypes: Dict[str, str], meta: dict) -> int:
    """Atomically write a cache file; returns its size."""
    metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    metadata["format"] = FORMAT
    metadata["dtypes"] = json.dumps(dtypes)
    metadata["crc"] = json.dumps({k: zlib.crc32(v.data) for k, v in tensors.items()})
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path.stat().st_size


def read_metadata(path: Path) -> dict:
    try:
        with safe_open(str(path), "numpy") as f:
            meta = dict(f.metadata() or {})
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise BadFile(f"not a readable safetensors file ({e})") from e
    if meta.get("format") != FORMAT:
        raise BadFile(f"not a prompt-cache file of this version (format {meta.get('format')!r})")
    return meta


def read_file(path: Path, expect: dict) -> Tuple[Dict[str, mx.array], dict]:
    """Tensors and metadata, checked against `expect` (metadata values) and the CRCs."""
    if not path.exists():
        raise BadFile("it is missing")
    meta = read_metadata(path)
    for k, v in expect.items():
        if meta.get(k) != v:
            raise BadFile(f"its {k} is {meta.get(k)!r}, expected {v!r}")
    try:
        crcs, dtypes = json.loads(meta["crc"]), json.loads(meta["dtypes"])
        out = {}
        with safe_open(str(path), "numpy") as f:
            if set(f.keys()) != set(crcs):
                raise BadFile("its tensors do not match its metadata")
            for name in f.keys():
                a = f.get_tensor(name)
                if zlib.crc32(np.ascontiguousarray(a).data) != crcs[name]:
                    raise BadFile(f"tensor {name} fails its checksum")
                out[name] = _from_numpy(a, dtypes[name])
    except BadFile:
        raise
    except Exception as e:  # noqa: BLE001 - truncated data, bad JSON, ...
        raise BadFile(f"cannot read it ({type(e).__name__}: {e})") from e
    return out, meta


def _part(tensors: Dict[str, mx.array], name: str):
    if name in tensors:
        return tensors[name]
    if name + ".0" in tensors:
        return tuple(tensors[f"{name}.{i}"] for i in range(3))
    return None


def _pair(tensors: Dict[str, mx.array], prefix: str) -> Optional[Pair]:
    k, v = _part(tensors, prefix + ".k"), _part(tensors, prefix + ".v")
    if k is None or v is None:
        return None
    extra = []
    while (x := _part(tensors, f"{prefix}.e{len(extra)}")) is not None:
        extra.append(x)
    return (k, v, *extra)


def snapshot_from(tensors: Dict[str, mx.array], meta: dict, linear: Tuple[bool, ...], kv: KVSetting = FULL_KV) -> Snapshot:
    """A snapshot read back (its blocks are read separately); checks it fits the model's
    layout and was taken at KV setting `kv`."""
    info = json.loads(meta["info"])
    tokens = np.array(tensors["tokens"], dtype=np.int32)
    if tuple(info["linear"]) != tuple(linear) or len(tokens) != info["n"]:
        raise BadFile("its layout does not match this model")
    bits, group_size = info.get("kv", [None, 64])
    taken = KVSetting(bits, group_size) if bits is not None else FULL_KV
    if taken != kv:
        raise BadFile(f"it was taken at KV {taken.tag}, not {kv.tag}")
    layers: List[Pair] = []
    for i in range(len(linear)):
        pair = _pair(tensors, f"layer{i}")
        if pair is None:
            raise BadFile(f"layer {i} is missing")
        layers.append(pair)
    head_tail = _pair(tensors, "head") if info["has_head"] else None
    return Snapshot(tokens, block_hashes(tokens, salt=kv_salt(kv)), tuple(linear), layers, info["head_blocks"], head_tail,
                    tensors.get("owed"), kv)


def block_part_from(tensors: Dict[str, mx.array], head: bool, n_attention: int) -> object:
    """A block file's content: the head pair, or the backbone pairs per attention layer."""
    if head:
        pair = _pair(tensors, "head")
        if pair is None:
            raise BadFile("no head tensors")
        return pair
    kv = [_pair(tensors, f"attn{j}") for j in range(n_attention)]
    if any(p is None for p in kv):
        raise BadFile("attention layers are missing")
    return kv
