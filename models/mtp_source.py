"""Where an MTP head comes from, and where a converted model came from.

`open_source` reads the head of an original checkpoint, a local directory or
a Hugging Face repo. Of a repo only `config.json`, the index and the shard(s)
that hold `mtp.*` tensors are fetched, through huggingface_hub (its cache,
progress bar, resume and revisions; HF_HUB_OFFLINE works from the cache).

`graft_command` names the fix for a converted model whose head was dropped:
the `mtp-graft` command, with the original repo filled in where the checkpoint
names it (`_name_or_path` in its config, or `base_model` in its model card).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from .mtp_weights import RAW, SHIFTED, CheckpointError, is_mtp_key, is_raw_hf_layout
from .safetensors_files import INDEX_FILE, layout_format, read_header, weight_map

_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
SINGLE_FILE = "model.safetensors"


@dataclass
class MTPSource:
    name: str  # as the user gave it
    path: Path  # the local directory (a hub snapshot for a repo)
    config: dict
    tensors: Dict[str, mx.array]  # the head, under the source's own names
    files: List[str]  # the shards the head was read from
    repo: Optional[str] = None
    revision: Optional[str] = None
    commit: Optional[str] = None
    layout_hint: Optional[str] = None  # the norm format the rest of the checkpoint uses, if known
    notes: List[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.repo is None:
            return str(self.path)
        return f"{self.repo}@{self.commit[:12] if self.commit else self.revision or 'main'}"


def is_repo_id(name: str) -> bool:
    return not Path(name).expanduser().exists() and _REPO_ID.match(name) is not None


def open_source(name: str, revision: Optional[str] = None) -> MTPSource:
    """The MTP head of the checkpoint `name` (a directory or a hub repo id)."""
    path = Path(name).expanduser()
    if path.exists():
        if revision:
            raise CheckpointError(f"--revision applies to a Hugging Face repo; {name} is a local directory")
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path} has no config.json: not a model directory")
        return _read_head(MTPSource(name, path.resolve(), _read_json(path / "config.json"), {}, []), weight_map(path))
    if not is_repo_id(name):
        raise CheckpointError(f"source not found: {name} is neither a directory nor a Hugging Face repo id")
    return _open_repo(name, revision)


def _open_repo(repo: str, revision: Optional[str]) -> MTPSource:
    config_path = _hub_file(repo, "config.json", revision)
    src = MTPSource(repo, config_path.parent, _read_json(config_path), {}, [], repo=repo, revision=revision,
                    commit=config_path.parent.name)
    index_path = _hub_file(repo, INDEX_FILE, revision, missing_ok=True)
    if index_path is not None:
        names = _read_json(index_path).get("weight_map") or {}
        shards = sorted({f for k, f in names.items() if is_mtp_key(k)})
    else:
        shards = [SINGLE_FILE]
        src.notes.append(f"{repo} has no {INDEX_FILE}: its single {SINGLE_FILE} is needed whole")
    for shard in shards:  # only the shards holding the head
        _hub_file(repo, shard, revision)
    if index_path is None:
        names = {k: SINGLE_FILE for k in read_header(src.path / SINGLE_FILE) if k != "__metadata__"}
    return _read_head(src, names)


def _read_head(src: MTPSource, names: Dict[str, str]) -> MTPSource:
    mtp_names = {k: f for k, f in names.items() if is_mtp_key(k)}
    if not mtp_names:
        raise CheckpointError(
            f"{src.name} has no MTP head: no tensor under mtp., model.mtp., language_model.mtp. or "
            "model.language_model.mtp. (graft from the original checkpoint, which ships it)")
    for shard in sorted(set(mtp_names.values())):
        f = src.path / shard
        if not f.exists():
            raise CheckpointError(f"{src.name}: shard {shard} (listed in {INDEX_FILE}) is missing")
        try:
            weights = mx.load(str(f))
        except Exception as e:  # mlx raises RuntimeError/ValueError for corrupt files
            raise CheckpointError(f"{f}: cannot read safetensors file: {e}") from e
        src.tensors.update({k: v for k, v in weights.items() if mtp_names.get(k) == shard})
        src.files.append(shard)
        src.layout_hint = src.layout_hint or _layout_hint(f, weights)
    return src


def _layout_hint(path: Path, weights: Dict[str, mx.array]) -> Optional[str]:
    """Raw HF bodies (PyTorch-written, conv1d [C, 1, K]) store norms raw; MLX ones shifted."""
    if any("conv1d.weight" in k for k in weights):
        return RAW if is_raw_hf_layout(weights) else SHIFTED
    return {"pt": RAW, "mlx": SHIFTED}.get(layout_format(read_header(path)))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from e


def _hub_file(repo: str, filename: str, revision: Optional[str], missing_ok: bool = False) -> Optional[Path]:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    where = f"{repo}{'@' + revision if revision else ''}"
    try:
        return Path(hf_hub_download(repo, filename, revision=revision))
    except LocalEntryNotFoundError as e:
        if missing_ok and filename == INDEX_FILE and _cached(repo, SINGLE_FILE, revision):
            return None
        raise CheckpointError(f"{where}: {filename} is not in the local Hugging Face cache and the hub "
                              "cannot be reached (offline?)") from e
    except EntryNotFoundError as e:
        if missing_ok:
            return None
        raise CheckpointError(f"{where} has no file {filename}") from e
    except RevisionNotFoundError as e:
        raise CheckpointError(f"{repo}: no revision {revision!r} on the Hugging Face hub") from e
    except RepositoryNotFoundError as e:
        raise CheckpointError(f"{repo}: no such repository on the Hugging Face hub (or it is gated/private: "
                              "log in with `hf auth login`)") from e
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"{where}: could not download {filename} ({type(e).__name__}: {e})") from e


def _cached(repo: str, filename: str, revision: Optional[str]) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, filename, revision=revision), str)


# --- naming the fix ----------------------------------------------------------------

def original_source(model_dir: Path, config: dict) -> Optional[str]:
    """The checkpoint a converted model came from, where it says so."""
    name = config.get("_name_or_path")
    if isinstance(name, str) and (is_repo_id(name) or Path(name).expanduser().is_dir()):
        return name
    readme = Path(model_dir) / "README.md"
    if readme.exists():
        from huggingface_hub import ModelCard

        try:
            base = ModelCard.load(readme).data.to_dict().get("base_model")
        except Exception:  # noqa: BLE001 - a malformed card only costs the hint
            base = None
        base = base[0] if isinstance(base, list) and base else base
        if isinstance(base, str) and base:
            return base
    return None


def graft_command(model_dir: Path, config: dict) -> str:
    """The exact `mtp-graft` command that adds the head to `model_dir`."""
    source = original_source(model_dir, config)
    into = shlex.quote(str(model_dir))
    if source is None:
        return f"mtp-graft --from ORIGINAL_REPO --into {into}   (ORIGINAL_REPO: the Hugging Face repo it was converted from)"
    return f"mtp-graft --from {shlex.quote(source)} --into {into}"
