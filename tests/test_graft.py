"""mtp-graft: a raw checkpoint's MTP head onto its stock-mlx-lm conversion (which
dropped it), and every way that is reported to go wrong."""

import contextlib
import hashlib
import io
import json
import os
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models import graft as graft_module
from mtp_serve.models.graft import graft
from mtp_serve.models.loader import CheckpointError, load_model
from mtp_serve.models.mtp_source import graft_command
from mtp_serve.models.mtp_weights import RAW, SHIFTED, detect_norm_format, is_norm_key
from mtp_serve.testing.synthetic import MLX_LM_FAMILIES

EXPERTS = {"qwen3_5": "none", "qwen3_5_moe": "per_expert", "qwen3_6_moe": "fused", "qwen3_next": "per_expert"}


def snapshot(d):
    """Every file of a directory, by name, with its content hash."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def head_params(lm):
    return dict(tree_flatten(lm.model.head.parameters()))


def assert_same_head(a, b):
    pa, pb = head_params(a), head_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert mx.array_equal(pa[k], pb[k]).item(), k


def decode(lm, depth, n=32):
    chunks = list(generate(lm.model, lm.tokenizer, [1, 2, 3, 4, 5], SamplingParams(max_tokens=n, ignore_eos=True), depth))
    return [t for c in chunks for t in c.token_ids], list(chunks[-1].stats.accepted)


@pytest.fixture
def target(tmp_path, checkpoint_dir, stock_converted):
    """Factory: a fresh copy of `family`'s agreeable raw checkpoint converted by stock mlx-lm."""

    def make(family="qwen3_5", quantize=False):
        dst = tmp_path / f"{family}-{'q4' if quantize else 'plain'}-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(stock_converted(checkpoint_dir(family, agreeable=True), quantize), dst)
        return dst

    return make


@pytest.mark.parametrize("quantize", [False, True], ids=["plain", "q4"])
@pytest.mark.parametrize("family", MLX_LM_FAMILIES)
def test_grafted_model_decodes_as_the_raw_checkpoint(family, quantize, target, checkpoint_dir):
    """Stock mlx-lm conversion + graft == the project loading the raw checkpoint at the
    same body precision: same greedy tokens, same acceptance per draft position."""
    raw = checkpoint_dir(family, agreeable=True)
    dst = target(family, quantize)
    body = snapshot(dst)
    result = graft(str(raw), dst)
    assert result.status == "grafted" and result.experts == EXPERTS[family]
    assert result.norms.stored == RAW and result.norms.decided_by == "values"
    after = snapshot(dst)
    assert all(after[k] == h for k, h in body.items() if k not in ("model.safetensors.index.json", "config.json"))
    assert {"mtp.safetensors", "mtp_graft.json"} <= after.keys()

    grafted, ref = load_model(str(dst)), load_model(str(raw))
    if quantize:  # the raw checkpoint's body quantized exactly as mlx-lm's convert does
        from mlx_lm.utils import quantize_model

        from mtp_serve.models.quantized_layers import install_decode_qmm

        with contextlib.redirect_stdout(io.StringIO()):
            quantize_model(ref.model.model, ref.config, 32, 4)
        install_decode_qmm([ref.model.model])  # the decode kernel the loader installs on a quantized body
        assert any(isinstance(m, nn.QuantizedLinear) for _, m in grafted.model.model.named_modules())
        assert not any(isinstance(m, nn.QuantizedLinear) for _, m in grafted.model.head.named_modules())
    assert_same_head(grafted, ref)
    tokens, accepted = decode(grafted, 2)
    assert (tokens, accepted) == decode(ref, 2)
    assert sum(accepted) > 0
    assert tokens == decode(grafted, 0)[0]


@pytest.mark.parametrize("prefix", ["mtp.", "model.mtp.", "language_model.mtp.", "model.language_model.mtp."])
def test_head_found_under_each_prefix(prefix, tmp_path, target, checkpoint_dir, loaded):
    raw = checkpoint_dir("qwen3_5", agreeable=True)
    src = tmp_path / "src"
    shutil.copytree(raw, src)
    head = mx.load(str(src / "mtp.safetensors"))
    mx.save_safetensors(str(src / "mtp.safetensors"), {prefix + k[len("mtp."):]: v for k, v in head.items()}, metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {(prefix + k[len("mtp."):] if k.startswith("mtp.") else k): f for k, f in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    dst = target()
    graft(str(src), dst)
    assert_same_head(load_model(str(dst)), loaded("qwen3_5", agreeable=True))


def test_norms_already_shifted_are_shifted_once(tmp_path, target, checkpoint_dir, loaded):
    """A raw-layout checkpoint whose head norms some script already shifted: detected
    from the values, by the graft and by the loader alike; never shifted twice."""
    src = tmp_path / "src"
    shutil.copytree(checkpoint_dir("qwen3_5", agreeable=True), src)
    head = mx.load(str(src / "mtp.safetensors"))
    shifted = {k: (v + 1.0 if is_norm_key(k[len("mtp."):]) else v) for k, v in head.items()}
    mx.save_safetensors(str(src / "mtp.safetensors"), shifted, metadata={"format": "pt"})
    ref = loaded("qwen3_5", agreeable=True)
    assert_same_head(load_model(str(src)), ref)
    dst = target()
    result = graft(str(src), dst)
    assert result.norms.stored == SHIFTED and not result.norms.needs_shift
    assert json.loads((dst / "mtp_graft.json").read_text())["norm_format_found"] == SHIFTED
    assert_same_head(load_model(str(dst)), ref)


def test_norm_format_from_values_with_layout_as_tie_break():
    norms = lambda value: {"norm.weight": mx.full((8,), value), "fc.weight": mx.zeros((8, 16))}  # noqa: E731
    assert detect_norm_format(norms(0.02)).stored == RAW
    assert detect_norm_format(norms(1.03), layout_hint=RAW).stored == SHIFTED  # clear values win over the layout
    ambiguous = detect_norm_format(norms(0.55), layout_hint=RAW)
    assert ambiguous.stored == RAW and ambiguous.decided_by == "layout"


def test_second_graft_is_a_no_op_and_force_replaces(target, checkpoint_dir, loaded):
    raw = checkpoint_dir("qwen3_5", agreeable=True)
    dst = target()
    graft(str(raw), dst)
    before = snapshot(dst)
    assert graft(str(raw), dst).status == "unchanged"
    assert snapshot(dst) == before

    other = checkpoint_dir("qwen3_5", agreeable=True, seed=1)  # same architecture, another head
    with pytest.raises(CheckpointError, match="already has a different MTP head.*--force"):
        graft(str(other), dst)
    assert snapshot(dst) == before
    assert graft(str(other), dst, force=True).status == "replaced"
    assert_same_head(load_model(str(dst)), loaded("qwen3_5", agreeable=True, seed=1))
    assert graft(str(raw), dst, force=True).status == "replaced"  # and back: still shifted exactly once
    assert_same_head(load_model(str(dst)), loaded("qwen3_5", agreeable=True))
    assert snapshot(dst) == before


@pytest.mark.parametrize("family,override,named", [
    ("qwen3_5", {"hidden_size": 96}, "hidden_size 96 (source) vs 64 (target)"),
    ("qwen3_5", {"vocab_size": 384}, "vocab_size 384 (source) vs 320 (target)"),
    ("qwen3_5", {"tie_word_embeddings": True}, "tie_word_embeddings True (source) vs False (target)"),
    ("qwen3_5_moe", {"num_experts": 8}, "num_experts 8 (source) vs 4 (target)"),
    ("qwen3_5", {"head_dim": 32}, "head_dim 32 (source) vs 16 (target)"),
])
def test_mismatched_architecture_is_refused(family, override, named, target, checkpoint_dir):
    dst = target(family)
    before = snapshot(dst)
    with pytest.raises(CheckpointError, match="different model") as e:
        graft(str(checkpoint_dir(family, **override)), dst)
    assert named in str(e.value)
    assert snapshot(dst) == before


def test_head_shapes_are_checked_even_when_the_configs_agree(tmp_path, target, checkpoint_dir):
    src = tmp_path / "src"
    shutil.copytree(checkpoint_dir("qwen3_5", head_dim=32), src)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["head_dim"] = 16  # a config that lies about its tensors
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mtp.layers.0.self_attn.q_norm.weight: shape \[32\] \(source\) vs \[16\]"):
        graft(str(src), target())


def test_source_without_head_and_quantized_head_are_refused(target, checkpoint_dir, tmp_path):
    with pytest.raises(CheckpointError, match="has no MTP head"):
        graft(str(checkpoint_dir("qwen3_5", with_head=False)), target())
    quantized = target("qwen3_5", quantize=True)
    result = graft(str(checkpoint_dir("qwen3_5", agreeable=True)), quantized, quantize_head=True)
    assert result.quantized_head and any("acceptance" in w for w in result.warnings)
    lm = load_model(str(quantized))
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in lm.model.head.named_modules())
    with pytest.raises(CheckpointError, match="MTP head in .* is quantized"):
        graft(str(quantized), target())


def test_quantized_body_keeps_the_head_stored_unquantized_with_a_note(target, checkpoint_dir):
    dst = target("qwen3_5", quantize=True)
    result = graft(str(checkpoint_dir("qwen3_5", agreeable=True)), dst)
    assert not result.quantized_head and result.dtype == "float32"
    assert any("body is quantized (4-bit) and the head is stored float32" in w for w in result.warnings)
    with pytest.raises(CheckpointError, match="not quantized"):
        graft(str(checkpoint_dir("qwen3_5", agreeable=True)), target("qwen3_5"), quantize_head=True)


def _fail_on_call(n, real):
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError("disk full (injected)")
        return real(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("where", ["writing the shard", "renaming into place"])
def test_interrupted_write_leaves_the_target_intact(where, monkeypatch, target, checkpoint_dir):
    raw = checkpoint_dir("qwen3_5", agreeable=True)
    dst = target()
    before = snapshot(dst)
    if where == "writing the shard":
        def partial_write(path, arrays, metadata=None):
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError("disk full (injected)")

        monkeypatch.setattr(graft_module.mx, "save_safetensors", partial_write)
    else:  # the third rename: the shard and the provenance are in place, the index is being backed up
        monkeypatch.setattr(graft_module.os, "replace", _fail_on_call(3, os.replace))
    with pytest.raises(OSError, match="injected"):
        graft(str(raw), dst)
    assert snapshot(dst) == before
    monkeypatch.undo()
    assert graft(str(raw), dst).status == "grafted"


def test_leftovers_of_a_killed_graft_are_undone(target, checkpoint_dir):
    dst = target()
    before = snapshot(dst)
    config = (dst / "config.json").read_bytes()
    (dst / ".mtp-graft-tmp-mtp.safetensors").write_bytes(b"partial")
    (dst / ".mtp-graft-bak-config.json").write_bytes(config)
    (dst / "config.json").write_text("{}")  # killed between the two renames of config.json
    graft_module._recover_interrupted(dst)
    assert snapshot(dst) == before


def test_graft_command_names_the_source(target, tmp_path):
    dst = target()
    config = json.loads((dst / "config.json").read_text())
    assert graft_command(dst, config).startswith("mtp-graft --from ORIGINAL_REPO --into ")
    (dst / "README.md").write_text("---\nbase_model: Qwen/Qwen3.5-0.8B\nlibrary_name: mlx\n---\n")
    assert graft_command(dst, config) == f"mtp-graft --from Qwen/Qwen3.5-0.8B --into {dst}"
    assert graft_command(dst, {**config, "_name_or_path": "Qwen/Qwen3.6-27B"}).startswith("mtp-graft --from Qwen/Qwen3.6-27B ")
    lm = load_model(str(dst))
    assert not lm.model.has_mtp and lm.mtp_fix == f"mtp-graft --from Qwen/Qwen3.5-0.8B --into {dst}"
