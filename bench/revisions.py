"""Decode benchmarks across revisions of this repository, side by side in one run.

    with RevisionWorker("HEAD~3", model, 1, calibrate=False) as old, RevisionWorker(None, model, 1, calibrate=False) as new:
        old.decode(prompt_ids, max_tokens=128, depth=3)  # -> {"tokens": [...], "decode_s": ..., ...}

Each worker is a subprocess with the model loaded once. A revision is laid out
from `git archive` as an importable `mtp_serve` package (the same folders the
project installs: engine/, models/, server/, configs/ under mtp_serve/) and put
first on PYTHONPATH, so it runs its own engine code. Both sides run in
subprocesses so neither gets an advantage; callers alternate requests between
them and compare paired ratios (the machine is shared and noisy).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("engine", "models", "server", "configs")  # mapped into mtp_serve.* by setup.py

WORKER = r'''
import json, sys, time
import mtp_serve  # backend set-up before mlx
from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models.loader import load_model

lm = load_model(sys.argv[1])
if sys.argv[2] != "calibrate":  # the caller's choice: both sides of a comparison decode alike
    from mtp_serve.backend import set_decode_blas_threads
    set_decode_blas_threads(None if sys.argv[2] == "all" else int(sys.argv[2]))
else:
    from mtp_serve.engine.warmup import calibrate_blas_threads
    try:  # as mtp-serve does at start-up (its signature changed over time)
        calibrate_blas_threads(lm.model, lm.tokenizer)
    except TypeError:
        calibrate_blas_threads(lm.model)
print(json.dumps({"ready": True, "engine": mtp_serve.engine.__path__[0]}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    params = SamplingParams(max_tokens=req["max_tokens"], ignore_eos=True)
    tokens, stats = [], None
    for chunk in generate(lm.model, lm.tokenizer, req["prompt"], params, req["depth"]):
        tokens += chunk.token_ids
        stats = chunk.stats
    print(json.dumps({"tokens": tokens, "decode_s": stats.decode_s, "generated": stats.generated_tokens,
                      "passes": stats.backbone_passes}), flush=True)
'''


def materialize(rev: str, into: Path) -> Path:
    """The tree of `rev` as an importable package root (returned: put it on PYTHONPATH)."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    tree = into / "tree"
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(tree, filter="data")
    root = into / "pkg"
    shutil.copytree(tree / "mtp_serve", root / "mtp_serve")
    for d in PACKAGE_DIRS:
        if (tree / d).exists():
            (root / "mtp_serve" / d).symlink_to(tree / d, target_is_directory=True)
    return root


class RevisionWorker:
    def __init__(self, rev: Optional[str], model: str, blas_threads: Optional[int] = None, calibrate: bool = True):
        """`calibrate`: measure decode BLAS threads in the worker, as mtp-serve does;
        otherwise use `blas_threads` (None: every core). Two workers that calibrate
        alone can choose differently on a busy machine, and that, not their code,
        then decides the comparison: pass the same choice to both."""
        self.rev, self.model = rev, str(Path(model).resolve()) if Path(model).exists() else model
        self.threads = "calibrate" if calibrate else "all" if blas_threads is None else str(blas_threads)
        self._tmp: Optional[str] = None
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "RevisionWorker":
        env = dict(os.environ)
        if self.threads != "calibrate":  # decode alike: revisions without the skinny sgemm compute on OpenBLAS
            env.setdefault("MTP_SERVE_NO_SKINNY_GEMM", "1")
        if self.rev is not None:
            self._tmp = tempfile.mkdtemp(prefix="mtp-rev-")
            env["PYTHONPATH"] = str(materialize(self.rev, Path(self._tmp))) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, self.model, self.threads], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=self._tmp or str(REPO))
        hello = json.loads(self.proc.stdout.readline())
        self.engine_path = hello["engine"]
        return self

    def decode(self, prompt: list, max_tokens: int, depth: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens, "depth": depth}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
