"""Checkpoint loading through the public loader: layouts, shards, MTP head cases, errors."""

import json
import logging
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models.loader import CheckpointError, load_model
from mtp_serve.testing.synthetic import MLX_LM_FAMILIES, build_random, tiny_text_config


def _params(module):
    return dict(tree_flatten(module.parameters()))


def _assert_same(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    for k in a:
        assert mx.array_equal(a[k], b[k]).item(), k


@pytest.mark.parametrize("family", MLX_LM_FAMILIES)
def test_hf_layout_round_trip(family, checkpoint_dir):
    """Raw HF layout (sharded body, separate mtp.safetensors, zero-centred norms,
    per-expert or fused MTP experts) loads to exactly the source weights: the +1
    norm shift is applied once, experts are stacked or split correctly."""
    path = checkpoint_dir(family)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) >= {"mtp.safetensors"}
    mtp_keys = [k for k in index["weight_map"] if k.startswith("mtp.")]
    if family == "qwen3_6_moe":
        assert "mtp.layers.0.mlp.experts.gate_up_proj" in mtp_keys
    elif family != "qwen3_5":
        assert "mtp.layers.0.mlp.experts.3.up_proj.weight" in mtp_keys
    lm = load_model(str(path))
    assert lm.model.has_mtp and lm.mtp_status == "MTP on"
    model, head, _ = build_random(family, tiny_text_config(family), seed=0)
    _assert_same(_params(lm.model.model), _params(model))
    _assert_same(_params(lm.model.head), _params(head))


def _write_mlx_layout(dst, family="qwen3_5_moe", quantize_body=False):
    """mlx-lm converted layout: sanitized names and norms, mtp.* kept beside them."""
    model, head, config = build_random(family, tiny_text_config(family), seed=0)
    if quantize_body:
        nn.quantize(model, group_size=32, bits=4)
        config["quantization"] = {"group_size": 32, "bits": 4}
    weights = _params(model)
    weights.update({f"mtp.{k}": v for k, v in _params(head).items()})
    dst.mkdir(parents=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    (dst / "config.json").write_text(json.dumps(config))
    return model, head


def test_mlx_layout_with_mtp_loads(tmp_path, checkpoint_dir):
    src = checkpoint_dir("qwen3_5_moe")
    model, head = _write_mlx_layout(tmp_path / "m")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, tmp_path / "m")
    lm = load_model(str(tmp_path / "m"))
    _assert_same(_params(lm.model.model), _params(model))
    _assert_same(_params(lm.model.head), _params(head))


def test_quantized_body_keeps_unquantized_head(tmp_path, checkpoint_dir):
    src = checkpoint_dir("qwen3_5")
    _write_mlx_layout(tmp_path / "q", "qwen3_5", quantize_body=True)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, tmp_path / "q")
    lm = load_model(str(tmp_path / "q"))
    body_layers = [m for _, m in lm.model.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    head_quant = [m for _, m in lm.model.head.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert body_layers and not head_quant
    assert lm.model.head.fc.weight.dtype == mx.float32
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [t for c in generate(lm.model, lm.tokenizer, [1, 2, 3], params, 0) for t in c.token_ids]
    mtp = [t for c in generate(lm.model, lm.tokenizer, [1, 2, 3], params, 2) for t in c.token_ids]
    assert plain == mtp


def test_config_promises_mtp_but_weights_lack_it(checkpoint_dir, caplog):
    path = checkpoint_dir("qwen3_5", with_head=False)
    with caplog.at_level(logging.WARNING):
        lm = load_model(str(path))
    assert not lm.model.has_mtp
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no mtp.* tensors" in warnings[0].getMessage() and "Fix:" in warnings[0].getMessage()
    assert "MTP off" in lm.mtp_status
    out = [t for c in generate(lm.model, lm.tokenizer, [5, 6], SamplingParams(max_tokens=8, ignore_eos=True), 2) for t in c.token_ids]
    assert len(out) == 8


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir("qwen3_5"), tmp_path / "m")
    w = mx.load(str(path / "mtp.safetensors"))
    w.pop("mtp.fc.weight")
    mx.save_safetensors(str(path / "mtp.safetensors"), w)
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_model(str(path))


def test_wrong_shape_is_named(tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir("qwen3_5"), tmp_path / "m")
    w = mx.load(str(path / "mtp.safetensors"))
    w["mtp.fc.weight"] = w["mtp.fc.weight"][:, :10]
    mx.save_safetensors(str(path / "mtp.safetensors"), w)
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_model(str(path))


def test_corrupt_shard_and_missing_shard(tmp_path, checkpoint_dir):
    path = _copy(checkpoint_dir("qwen3_5"), tmp_path / "m")
    data = (path / "mtp.safetensors").read_bytes()
    (path / "mtp.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="mtp.safetensors"):
        load_model(str(path))
    (path / "mtp.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing: mtp.safetensors"):
        load_model(str(path))


def test_not_a_model(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(CheckpointError, match="model not found"):
        load_model(str(tmp_path / "nope"))


def test_hub_repo_id_from_offline_cache(tmp_path, checkpoint_dir):
    """A repo id resolves through huggingface_hub's cache (offline: pre-filled here)."""
    src = checkpoint_dir("qwen3_5")
    repo = tmp_path / "hub" / "models--mtp-serve--tiny"
    rev = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(src, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    code = "import mtp_serve; from mtp_serve.models.loader import load_model; lm = load_model('mtp-serve/tiny'); print(lm.mtp_status)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MTP on" in out.stdout
