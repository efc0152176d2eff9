"""The prompt cache's disk tier: snapshots that outlive the process.

    disk = DiskTier(Path("~/.cache/mtp-serve"), "Qwen3.6-27B", fingerprint, 16 << 30, layout)
    disk.write(snap, blocks)        # from the engine thread; written by a background thread
    entry = disk.lookup(tokens, chain, max_n, needs_head)
    snap, blocks = disk.read(entry, have)   # on the engine thread, when a prompt needs it

Layout: DIR/<model>-<fingerprint[:16]>/ (the weights decide: the same weights
served under another name find their folder) holds `index.json` (what is
there, for a fast start) and safetensors files named `<fingerprint[:16]>-<kind>-<hash>`:
`s` a snapshot's own arrays, `k` a block's backbone KV, `h` a block's head KV
(blocks are written once and shared by the snapshots naming them, as in
memory). Another model's (or other weights') files live in another folder and
are never looked at; so are another KV setting's (`--kv-bits`: part of the
fingerprint, and each file's metadata and the index name it). At start the index is checked against the folder: files
it lacks are read whole and adopted when sound, partial writes (`*.tmp`) are
removed, and a file that is corrupt or not ours is skipped with a warning;
reading a file that turns out corrupt drops it, with a warning, and the
request prefills instead. Nothing here raises into the engine.

Every snapshot the memory tier keeps is written through (in the background,
so a restart, even a crash, loses at most the last few), and over the byte
budget the least recently used snapshots go first, those that several
conversations share last; blocks go with the last snapshot naming them.

The writer survives any error (a full disk, a folder it may not write, the
safetensors library's own exceptions): the write counts as dropped, each cause
is logged once a minute at most, and writes are dropped without trying for a
while that doubles with each failure (up to a minute), so a broken disk costs
neither memory nor time. What waits to be written is bounded in bytes
(`max_pending_bytes`), and `close` waits at most its timeout, dropping what is
left. A file that cannot be removed costs a warning, never a lookup.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from mtp_serve.models.caches import FULL_KV, KVSetting

from .prefix_index import PrefixIndex
from .snapshot import BLOCK_TOKENS, Block, BlockStore, Snapshot
from .files import (
    BadFile,
    block_part_from,
    block_tensors,
    read_file,
    snapshot_from,
    snapshot_tensors,
    write_file,
)

log = logging.getLogger("mtp_serve.prompt_cache")

INDEX = "index.json"
MAX_PENDING_BYTES = 1 << 30  # writes queued beyond this are dropped (the disk is too slow)
CLOSE_SECONDS = 30.0  # the most a clean shutdown waits for queued writes
BACKOFF_SECONDS = (0.5, 60.0)  # after a failed write: drop writes for this long, doubling up to the second
LOG_EVERY_SECONDS = 60.0  # one warning per cause at most this often


@dataclass(eq=False)
class DiskEntry:
    key: str
    n: int
    chain: List[str]
    tail: np.ndarray
    has_head: bool
    head_blocks: int
    nbytes: int
    used: float
    shared: bool = False

    def as_json(self) -> dict:
        return {"n": self.n, "chain": self.chain, "tail": self.tail.tolist(), "has_head": self.has_head,
                "head_blocks": self.head_blocks, "bytes": self.nbytes, "used": self.used, "shared": self.shared}

    @classmethod
    def of(cls, key: str, d: dict) -> "DiskEntry":
        return cls(key, int(d["n"]), list(d["chain"]), np.asarray(d["tail"], dtype=np.int32), bool(d["has_head"]),
                   int(d["head_blocks"]), int(d["bytes"]), float(d["used"]), bool(d.get("shared", False)))

    def blocks(self) -> List[Tuple[str, str]]:
        """(kind, block) of every block file it needs."""
        return [("k", b) for b in self.chain] + [("h", b) for b in self.chain[: self.head_blocks]]


def model_folder(root: Path, name: str, fingerprint: str) -> Path:
    """`root/<name>-<fingerprint[:16]>`, or the folder these weights already have under
    another name (the name is for people; the fingerprint decides)."""
    have = sorted(p for p in root.glob(f"*-{fingerprint[:16]}") if p.is_dir()) if root.is_dir() else []
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"
    return have[0] if have else root / f"{slug[:64]}-{fingerprint[:16]}"


class DiskTier:
    def __init__(self, root: Path, model_name: str, fingerprint: str, max_bytes: int, layout: Tuple[bool, ...],
                 kv: KVSetting = FULL_KV, max_pending_bytes: int = MAX_PENDING_BYTES):
        self.dir = model_folder(Path(root).expanduser(), model_name, fingerprint)
        self.dir.mkdir(parents=True, exist_ok=True)  # an unusable folder is an error at start-up
        self.model, self.fingerprint, self.max_bytes = model_name, fingerprint, max_bytes
        self.layout = layout
        self.kv = kv
        self.prefix = fingerprint[:16]
        self._meta = {"weights": fingerprint}  # what a file must say to be read; it also names the model
        if kv.quantized:  # (full-precision files carry no kv entry: those written before it existed stay valid)
            self._meta["kv"] = kv.tag
        self.entries: Dict[str, DiskEntry] = {}
        self.block_files: Dict[str, int] = {}  # file name -> bytes
        self._bytes = 0  # of the snapshot and block files listed
        self.index: PrefixIndex[DiskEntry] = PrefixIndex()
        self._lock = threading.Lock()
        self._jobs: "queue.Queue" = queue.Queue()
        self._pending: set = set()  # block files queued
        self._queued: Dict[str, DiskEntry] = {}  # snapshots queued, by key
        self._queued_bytes = 0
        self.max_pending_bytes = max_pending_bytes
        self._writer: Optional[threading.Thread] = None
        self._closing = threading.Event()
        self._backoff = 0.0  # seconds; 0 while writes succeed
        self._retry_at = 0.0  # monotonic time before which writes are dropped without trying
        self._logged: Dict[str, Tuple[float, int]] = {}  # cause -> (when last logged, drops since)
        self._dirty = False
        self.stats = {"evictions": 0, "reads": 0, "read_s": 0.0, "writes": 0, "write_s": 0.0, "write_bytes": 0,
                      "skipped_files": 0, "dropped_writes": 0}
        self._open()

    # -- names

    def _snap_file(self, key: str) -> str:
        return f"{self.prefix}-s-{key}.safetensors"

    def _block_file(self, kind: str, block: str) -> str:
        return f"{self.prefix}-{kind}-{block}.safetensors"

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self.entries)

    # -- start-up

    def _skip(self, name: str, why: str) -> None:
        self.stats["skipped_files"] += 1
        log.warning("prompt cache: skipping %s: %s", self.dir / name, why)

    def _open(self) -> None:
        known, known_blocks = self._read_index()
        for path in sorted(self.dir.iterdir()):
            name = path.name
            if name == INDEX or not path.is_file():
                continue
            if name.endswith(".tmp"):  # a write cut short
                log.warning("prompt cache: removing partial file %s", path)
                self._unlink(path)
                continue
            m = re.fullmatch(r"([0-9a-f]{16})-([skh])-([0-9a-f]{32})\.safetensors", name)
            if m is None or m.group(1) != self.prefix:
                self._skip(name, "not a prompt-cache file of this model and weights")
                continue
            kind, key, size = m.group(2), m.group(3), path.stat().st_size
            if kind == "s" and key in known and known[key].nbytes == size:
                self._add_entry(known[key])
            elif kind != "s" and known_blocks.get(name) == size:
                self._add_block(name, size)
            else:
                self._adopt(path, kind, key, size)
        self._dirty = True
        self._evict()

    def _read_index(self) -> Tuple[Dict[str, DiskEntry], Dict[str, int]]:
        path = self.dir / INDEX
        if not path.exists():
            return {}, {}
        try:
            data = json.loads(path.read_text())
            if (data.get("weights") != self.fingerprint or data.get("block_tokens") != BLOCK_TOKENS
                    or data.get("kv", "full") != self.kv.tag):
                raise ValueError("it names other weights or another format")
            return ({k: DiskEntry.of(k, d) for k, d in data["snapshots"].items()},
                    {str(k): int(v) for k, v in data["blocks"].items()})
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("prompt cache: ignoring %s (%s); rebuilding it from the files", path, e)
            return {}, {}

    def _adopt(self, path: Path, kind: str, key: str, size: int) -> None:
        """A file the index does not list (written just before a crash): checked whole, then used."""
        try:
            if kind != "s":
                read_file(path, {**self._meta, "kind": "kv" if kind == "k" else "head", "block": key})
                self._add_block(path.name, size)
                return
            snap = snapshot_from(*read_file(path, {**self._meta, "kind": "snapshot"}), self.layout, self.kv)
            if snap.key != key:
                raise BadFile("its name does not match its tokens")
        except BadFile as e:
            self._skip(path.name, str(e))
            return
        self._add_entry(DiskEntry(key, snap.n, snap.chain, snap.tail.copy(), snap.has_head, snap.head_blocks, size,
                                  path.stat().st_mtime))

    def _add_entry(self, e: DiskEntry) -> None:
        self.entries[e.key] = e
        self.index.add(e)
        self._bytes += e.nbytes

    def _drop_entry(self, e: DiskEntry) -> None:
        if self.entries.pop(e.key, None) is not None:
            self.index.remove(e)
            self._bytes -= e.nbytes
            self._unlink(self.dir / self._snap_file(e.key))
            self._dirty = True

    def _add_block(self, fname: str, size: int) -> None:
        self._bytes += size - self.block_files.get(fname, 0)
        self.block_files[fname] = size

    def _drop_block(self, fname: str) -> None:
        self._unlink(self.dir / fname)
        self._bytes -= self.block_files.pop(fname, 0)
        self._dirty = True

    def _unlink(self, path: Path) -> None:
        """Remove a file; one that cannot be removed (permissions, a read-only disk) stays,
        forgotten by the index, with a warning."""
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            self._warn(f"unlink {type(e).__name__} {e.errno}", "prompt cache: cannot remove %s: %s", path, e)

    def _warn(self, cause: str, msg: str, *args) -> None:
        """Log `msg` for `cause` at most once a minute (with the drops counted meanwhile)."""
        now = time.monotonic()
        last, count = self._logged.get(cause, (None, 0))
        if last is not None and now - last < LOG_EVERY_SECONDS:
            self._logged[cause] = (last, count + 1)
            return
        self._logged[cause] = (now, 0)
        log.warning(msg + (f" ({count} more since the last warning)" if count else ""), *args)

    # -- lookups (engine thread)

    def lookup(self, tokens: np.ndarray, chain: List[str], max_n: int, needs_head: bool) -> Optional[DiskEntry]:
        with self._lock:
            return self.index.longest_prefix(tokens, chain, max_n, lambda e: e.has_head or not needs_head)

    def touch(self, key: str, shared: bool = False) -> None:
        with self._lock:
            e = self.entries.get(key) or self._queued.get(key)
            if e is not None:
                e.used = time.time()
                e.shared = e.shared or shared
                self._dirty = True

    def read(self, entry: DiskEntry, have: Callable[[str], Optional[Block]]) -> Optional[Tuple[Snapshot, Dict[str, Block]]]:
        """The snapshot and the blocks (or block head parts) `have` (the memory tier) lacks;
        None when a file is gone (evicted meanwhile) or bad (then dropped, with a warning)."""
        try:
            return self._read(entry, have)
        except Exception as e:  # noqa: BLE001 - nothing here raises into the engine: the request prefills instead
            self._warn(f"read {type(e).__name__}", "prompt cache: cannot read %s: %s: %s", entry.key, type(e).__name__, e)
            return None

    def _read(self, entry: DiskEntry, have: Callable[[str], Optional[Block]]):
        t0 = time.perf_counter()
        path = self.dir / self._snap_file(entry.key)
        if not path.exists():
            with self._lock:
                self._drop_entry(entry)
            return None
        try:
            snap = snapshot_from(*read_file(path, {**self._meta, "kind": "snapshot"}), self.layout, self.kv)
            if snap.n != entry.n or not np.array_equal(snap.tail, entry.tail) or snap.chain != entry.chain:
                raise BadFile("its tokens are not the ones its name promises")
            blocks: Dict[str, Block] = {}
            for i, name in enumerate(snap.chain):
                mem = have(name)
                needs_head = i < snap.head_blocks and (mem is None or mem.head is None)
                if mem is None or needs_head:
                    path = self.dir / self._block_file("k", name)
                    kv = mem.kv if mem is not None else self._read_block(path, name, head=False)
                    path = self.dir / self._block_file("h", name)
                    blocks[name] = Block(kv, self._read_block(path, name, head=True) if needs_head else None)
        except (BadFile, OSError) as e:
            self._skip(path.name, str(e))
            with self._lock:
                self._drop_block(path.name)  # (the snapshot file itself: just removed)
                self._drop_entry(entry)
            return None
        self.stats["reads"] += 1
        self.stats["read_s"] += time.perf_counter() - t0
        self.touch(entry.key)
        return snap, blocks

    def _read_block(self, path: Path, name: str, head: bool):
        tensors, _ = read_file(path, {**self._meta, "kind": "head" if head else "kv", "block": name})
        return block_part_from(tensors, head, sum(not lin for lin in self.layout))

    # -- writes

    def write(self, snap: Snapshot, store: BlockStore, shared: bool = False) -> None:
        """Queue `snap` (and the blocks the disk lacks) for writing, unless already there (or the
        disk failed a moment ago, or too much waits already: then it counts as dropped)."""
        key = snap.key
        with self._lock:
            if key in self.entries or key in self._queued:
                return
            if self._closing.is_set() or time.monotonic() < self._retry_at:
                self.stats["dropped_writes"] += 1
                return
            wanted = []
            for i, name in enumerate(snap.chain):
                for kind in ("k", "h") if i < snap.head_blocks else ("k",):
                    fname = self._block_file(kind, name)
                    if fname not in self.block_files and fname not in self._pending:
                        wanted.append((kind, name, fname))
        files = []
        for kind, name, fname in wanted:
            tensors, dtypes = block_tensors(store.blocks[name], head=kind == "h")
            files.append((fname, tensors, dtypes, {**self._meta, "model": self.model, "kind": "kv" if kind == "k" else "head",
                                                   "block": name}))
        tensors, dtypes, info = snapshot_tensors(snap)
        meta = {**self._meta, "model": self.model, "kind": "snapshot", "info": info}
        entry = DiskEntry(key, snap.n, snap.chain, snap.tail.copy(), snap.has_head, snap.head_blocks, 0, time.time(), shared)
        files.append((self._snap_file(key), tensors, dtypes, meta))
        size = sum(a.nbytes for f in files for a in f[1].values())
        with self._lock:
            if self._queued_bytes + size > self.max_pending_bytes or size > self.max_bytes:
                self.stats["dropped_writes"] += 1
                return
            for fname, *_ in files[:-1]:
                self._pending.add(fname)
            self._queued[key] = entry
            self._queued_bytes += size
        self._jobs.put((entry, files))
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="mtp-prompt-cache-writer", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            entry, files = job
            try:
                if self._closing.is_set() or time.monotonic() < self._retry_at:
                    self.stats["dropped_writes"] += 1  # the disk failed a moment ago, or shutdown ran out of time
                else:
                    self._write_job(entry, files)
                    self._backoff = 0.0
            except Exception as e:  # noqa: BLE001 - any failure (OSError, safetensors' own errors): dropped, the writer goes on
                self._failed(entry, e)
            finally:
                try:
                    with self._lock:
                        for fname, *_ in files[:-1]:
                            self._pending.discard(fname)
                        self._queued.pop(entry.key, None)
                        self._queued_bytes -= sum(a.nbytes for f in files for a in f[1].values())
                        if self._jobs.qsize() == 0:
                            self._save_index()
                except Exception as e:  # noqa: BLE001
                    self._warn(f"index {type(e).__name__}", "prompt cache: cannot update the index: %s: %s", type(e).__name__, e)
                self._jobs.task_done()

    def _failed(self, entry: DiskEntry, e: BaseException) -> None:
        """A write failed: dropped, logged once per cause, and the next writes wait a while."""
        self.stats["dropped_writes"] += 1
        self._backoff = min(max(2 * self._backoff, BACKOFF_SECONDS[0]), BACKOFF_SECONDS[1])
        self._retry_at = time.monotonic() + self._backoff
        errno = getattr(e, "errno", None)
        cause = f"write {type(e).__name__} {errno if errno is not None else str(e)[:60]}"
        self._warn(cause, "prompt cache: cannot write to %s (%s: %s); writes are dropped for %.1fs", self.dir,
                   type(e).__name__, e, self._backoff)

    def _write_job(self, entry: DiskEntry, files) -> None:
        t0 = time.perf_counter()
        written = 0
        for fname, tensors, dtypes, meta in files[:-1]:
            size = write_file(self.dir / fname, tensors, dtypes, meta)
            written += size
            with self._lock:
                self._add_block(fname, size)
        with self._lock:  # a block it names may have been evicted meanwhile
            missing = [k for k, b in entry.blocks() if self._block_file(k, b) not in self.block_files]
        if missing:
            return
        fname, tensors, dtypes, meta = files[-1]
        entry.nbytes = write_file(self.dir / fname, tensors, dtypes, meta)
        written += entry.nbytes
        with self._lock:
            self._add_entry(entry)
            self._dirty = True
            self.stats["writes"] += 1
            self.stats["write_s"] += time.perf_counter() - t0
            self.stats["write_bytes"] += written
            self._evict()

    def _evict(self) -> None:
        """Over the budget: least recently used first, shared snapshots last; then
        the blocks no snapshot names any more. Called with the lock held."""
        if self.nbytes > self.max_bytes:
            for e in sorted(self.entries.values(), key=lambda e: (e.shared, e.used)):
                if self.nbytes <= self.max_bytes:
                    break
                self._drop_entry(e)
                self.stats["evictions"] += 1
            self._collect_blocks()

    def _collect_blocks(self) -> None:
        named = {self._block_file(k, b) for e in self.entries.values() for k, b in e.blocks()}
        for fname in [f for f in self.block_files if f not in named and f not in self._pending]:
            self._drop_block(fname)

    def _save_index(self) -> None:
        if not self._dirty:
            return
        data = {"format": 1, "model": self.model, "weights": self.fingerprint, "block_tokens": BLOCK_TOKENS, "kv": self.kv.tag,
                "snapshots": {k: e.as_json() for k, e in self.entries.items()}, "blocks": self.block_files}
        tmp = self.dir / f"{INDEX}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.dir / INDEX)
            self._dirty = False
        except Exception as e:  # noqa: BLE001 - the index is rebuilt from the files at the next start
            self._warn(f"index {type(e).__name__}", "prompt cache: cannot write %s: %s", self.dir / INDEX, e)

    def flush(self, timeout: float = CLOSE_SECONDS) -> bool:
        """Wait for queued writes (up to `timeout`); save the index. True when all were written."""
        deadline = time.monotonic() + timeout
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            if self._writer is None or not self._writer.is_alive():
                break
            time.sleep(0.01)
        with self._lock:
            try:
                self._save_index()
            except Exception as e:  # noqa: BLE001
                self._warn(f"index {type(e).__name__}", "prompt cache: cannot save the index: %s", e)
        return not self._jobs.unfinished_tasks

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Wait up to `timeout` for the queued writes, then drop the rest: never longer (a write
        in progress then finishes in the background)."""
        t0 = time.monotonic()
        if not self.flush(timeout):
            log.warning("prompt cache: %d writes still queued after %.0fs; dropped", self._jobs.unfinished_tasks, timeout)
        self._closing.set()  # the writer drops what is left without writing
        if self._writer is not None:
            self._jobs.put(None)
            self._writer.join(max(0.0, min(1.0, timeout - (time.monotonic() - t0))))
            self._writer = None
