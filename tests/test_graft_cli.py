"""mtp-graft, mtp-convert, mtp-tune and mtp-serve's hint, run as a user runs them."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mtp_serve.models.demo_model import DEMO_MODEL_DIR
from mtp_serve.models.loader import load_model
from mtp_serve.models.model_card import load_card
from mtp_serve.models.mtp_weights import is_mtp_key

pytestmark = pytest.mark.slow  # the CLIs in subprocesses, a demo conversion (conftest.py: test tiers)

REV = "0123456789abcdef0123456789abcdef01234567"


def cli(command, *args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", f"mtp_serve.cli.{command}", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def same_head(a, b):
    pa, pb = dict(tree_flatten(a.model.head.parameters())), dict(tree_flatten(b.model.head.parameters()))
    return pa.keys() == pb.keys() and all(mx.array_equal(pa[k], pb[k]).item() for k in pa)


def offline_hub(tmp_path, src, repo="mtp-serve/raw"):
    """A Hugging Face cache (HF_HOME) holding, of `src`, only what a graft needs:
    config, index and the shards that hold mtp.* tensors. Returns (env, files kept)."""
    snap = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / REV
    snap.mkdir(parents=True)
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    keep = sorted({f for k, f in weight_map.items() if is_mtp_key(k)})
    for name in ["config.json", "model.safetensors.index.json", *keep]:
        shutil.copy(src / name, snap / name)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text(REV)
    return dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1"), keep


@pytest.mark.parametrize("layout", ["mtp shard", "mtp in body shards"])
def test_graft_from_the_hub_fetches_only_the_head_shards(layout, tmp_path, checkpoint_dir, stock_converted, loaded):
    options = {"agreeable": True} if layout == "mtp shard" else {"agreeable": True, "mtp_shard": False}
    src = checkpoint_dir("qwen3_5", **options)
    env, kept = offline_hub(tmp_path, src)
    all_shards = {p.name for p in src.glob("*.safetensors")}
    assert set(kept) < all_shards  # body-only shards are not in the cache at all
    dst = tmp_path / "target"
    shutil.copytree(stock_converted(src), dst)
    revision = ["--revision", REV] if layout == "mtp in body shards" else []
    out = cli("graft", "--from", "mtp-serve/raw", "--into", dst, *revision, "--no-verify", env=env)
    assert out.returncode == 0, out.stderr
    assert "grafted the MTP head of mtp-serve/raw@0123456789ab" in out.stdout
    record = json.loads((dst / "mtp_graft.json").read_text())
    assert record["source"]["repo"] == "mtp-serve/raw" and record["source"]["commit"] == REV
    assert record["source"]["files"] == kept
    assert same_head(load_model(str(dst)), loaded("qwen3_5", **options))

    # A head shard missing from the cache, offline: named, one line, target untouched.
    (tmp_path / "hf" / "hub" / "models--mtp-serve--raw" / "snapshots" / REV / kept[-1]).unlink()
    out = cli("graft", "--from", "mtp-serve/raw", "--into", dst, "--force", "--no-verify", env=env)
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0
    assert f"{kept[-1]} is not in the local Hugging Face cache" in out.stderr


def test_graft_cli_errors_are_one_line(tmp_path, checkpoint_dir):
    for args, says in [
        (("--from", tmp_path / "nope", "--into", checkpoint_dir("qwen3_5")), "source not found"),
        (("--from", checkpoint_dir("qwen3_5"), "--into", tmp_path), "no config.json"),
        (("--from", checkpoint_dir("qwen3_5"), "--into", checkpoint_dir("qwen3_5"), "--max-depth", "0"), "--max-depth"),
    ]:
        out = cli("graft", *args)
        assert out.returncode != 0 and out.stderr.strip().count("\n") == 0 and says in out.stderr, out.stderr


def test_convert_round_trip_on_the_demo_model(tmp_path, stock_converted):
    """mtp-convert -q: the body exactly as stock mlx-lm converts it (and stock mlx-lm
    loads it), the demo's head kept unquantized; verified and tuned on this machine."""
    out_dir = tmp_path / "demo-4bit"
    out = cli("convert", "--hf-path", DEMO_MODEL_DIR, "--mlx-path", out_dir, "-q", "--q-bits", "4", "--q-group-size", "32",
              "--tune-tokens", "16", "--tune-repeats", "1", "--max-depth", "2")
    assert out.returncode == 0, out.stderr
    assert "head is stored bfloat16" in out.stdout and "verdict: " in out.stdout
    rows = {line.split()[0] + line.split()[1]: line for line in out.stdout.splitlines() if line.startswith("depth ")}
    assert rows.keys() == {"depth1", "depth2"} and all(r.endswith("3/3") for r in rows.values())  # greedy = plain

    stock = stock_converted(DEMO_MODEL_DIR, quantize=True)
    ours, theirs = mx.load(str(out_dir / "model.safetensors")), mx.load(str(stock / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
    assert json.loads((out_dir / "config.json").read_text()) == json.loads((stock / "config.json").read_text())

    import mlx_lm

    model, tokenizer = mlx_lm.load(str(out_dir))  # stock mlx-lm: plain decoding, head ignored
    assert len(mlx_lm.generate(model, tokenizer, prompt="def add(a, b):", max_tokens=8)) > 0

    lm = load_model(str(out_dir), draft_head_bits=0)  # the head as stored: unquantized
    assert lm.model.has_mtp and not any(isinstance(m, nn.QuantizedLinear) for _, m in lm.model.head.named_modules())
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in lm.model.model.named_modules())
    assert same_head(lm, load_model(str(DEMO_MODEL_DIR)))
    tuned = json.loads((out_dir / "mtp_serve.json").read_text())
    assert load_card("qwen3_5", out_dir).default_mtp_depth == tuned["default_mtp_depth"] in (0, 1, 2)
    # The drafts were chosen by acceptance (the demo's 4,096-token vocabulary: the whole one) and are the default.
    assert "choosing the drafts" in out.stdout and tuned["draft_vocab_size"] == 0
    bits = tuned["draft_head_bits"]
    assert any(isinstance(m, nn.QuantizedLinear) and m.bits == bits
               for _, m in load_model(str(out_dir)).model.head.named_modules()) == bool(bits)


def test_tune_without_a_head_names_the_graft_command(tmp_path, checkpoint_dir, stock_converted):
    dst = stock_converted(checkpoint_dir("qwen3_5", agreeable=True))
    out = cli("tune", dst)
    error = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1 and error.startswith("mtp-tune: error:")
    assert f"mtp-graft --from ORIGINAL_REPO --into {dst}" in error


def test_serve_prints_the_graft_command(tmp_path, checkpoint_dir, stock_converted):
    dst = tmp_path / "converted"
    shutil.copytree(stock_converted(checkpoint_dir("qwen3_5", agreeable=True)), dst)
    (dst / "README.md").write_text("---\nbase_model: Qwen/Qwen3.5-0.8B\nlibrary_name: mlx\n---\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mtp_serve.cli.serve", "--model", str(dst), "--port", str(port),
                             "--enable-mtp"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, seen = time.time() + 120, []
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith("  mtp-graft"):
                break
        assert f"  mtp-graft --from Qwen/Qwen3.5-0.8B --into {dst}\n" in seen, "".join(seen)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
