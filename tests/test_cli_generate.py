"""mtp-generate from the outside: JSON output, greedy identity, errors."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the CLI in subprocesses (conftest.py: test tiers)


def run(*args):
    return subprocess.run([sys.executable, "-m", "mtp_serve.cli.generate", *args], capture_output=True, text=True, timeout=300)


def test_json_output_and_mtp_matches_plain(checkpoint_dir):
    path = str(checkpoint_dir("qwen3_5", agreeable=True))
    mtp = run("--model", path, "--prompt", "hello world", "--max-tokens", "32", "--mtp-depth", "2", "--json")
    assert mtp.returncode == 0, mtp.stderr
    out = json.loads(mtp.stdout)
    for key in ("text", "token_ids", "finish_reason", "stats"):
        assert key in out
    for key in ("drafted", "accepted", "acceptance_rate", "tokens_per_pass", "decode_tok_s", "prefill_tok_s"):
        assert key in out["stats"]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 32
    assert out["stats"]["drafted"] > 0 and out["stats"]["tokens_per_pass"] > 1
    plain = json.loads(run("--model", path, "--prompt", "hello world", "--max-tokens", "32", "--no-mtp", "--json").stdout)
    assert plain["token_ids"] == out["token_ids"]
    assert plain["stats"]["drafted"] == 0


def test_sampled_seed_is_reproducible(checkpoint_dir):
    path = str(checkpoint_dir("qwen3_5", agreeable=True))
    args = ("--model", path, "--prompt", "x", "--max-tokens", "16", "--temp", "1.0", "--top-k", "4", "--seed", "7", "--json")
    a, b = run(*args), run(*args)
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


def test_errors_are_one_line_and_nonzero(tmp_path):
    missing = run("--model", str(tmp_path / "none"), "--prompt", "hi")
    assert missing.returncode != 0 and missing.stderr.strip().count("\n") == 0 and "model not found" in missing.stderr
    bad = run("--prompt", "hi", "--max-tokens", "x")
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0
    bad_temp = run("--model", str(tmp_path), "--prompt", "hi", "--temp", "-1")
    assert bad_temp.returncode != 0 and "temperature" in bad_temp.stderr
