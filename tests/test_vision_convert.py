"""The vision tower survives mtp-convert and mtp-graft, unquantized.

Stock mlx-lm's convert drops the tower, `vision_config` and preprocessor_config.json;
mtp-convert puts them back (`vision.safetensors`, mlx-vlm's names and layout), and
mtp-graft, which never touches the body, keeps a tower the target already has.
"""

import contextlib
import io
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mtp_serve.models.loader import load_weights
from mtp_serve.models.vision import load_vision, prepare_image

Image = pytest.importorskip("PIL.Image")


def _encode(path, data):
    config = json.loads((path / "config.json").read_text())
    vision = load_vision(config, load_weights(path), path)
    assert vision is not None, f"{path} lost its vision tower"
    return vision.encode([prepare_image(data, vision.spec)])[0]


def _image() -> bytes:
    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(0).random((70, 100, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _vision_keys_unquantized(path):
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    vision = {k: f for k, f in names.items() if k.startswith("vision_tower.")}
    assert vision and set(vision.values()) == {"vision.safetensors"}
    assert not any(k.endswith((".scales", ".biases")) for k in vision)
    assert any(k.endswith(".scales") for k in names)  # while the body is quantized


def test_mtp_convert_keeps_the_tower_unquantized(tmp_path, checkpoint_dir):
    from mtp_serve.cli.convert import main

    src = checkpoint_dir("qwen3_5", vision=True)
    out = tmp_path / "q4"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(["--hf-path", str(src), "--mlx-path", str(out), "-q", "--q-bits", "4", "--q-group-size", "32",
                     "--no-verify"]) == 0
    assert "vision tower: 33 tensors kept unquantized" in printed.getvalue()
    _vision_keys_unquantized(out)
    config = json.loads((out / "config.json").read_text())
    source_config = json.loads((src / "config.json").read_text())
    assert config["vision_config"] == source_config["vision_config"]
    assert config["image_token_id"] == source_config["image_token_id"]
    assert (out / "preprocessor_config.json").read_text() == (src / "preprocessor_config.json").read_text()
    image = _image()
    assert mx.array_equal(_encode(out, image), _encode(src, image))  # fp32 both sides: the same tower
    import mlx_lm

    from mtp_serve.models.loader import load_model

    mlx_lm.load(str(out))  # stock mlx-lm still loads it (and skips the tower)
    assert load_model(str(out)).mtp_status == "MTP on"


def test_mtp_graft_keeps_an_mlx_layout_tower(tmp_path, checkpoint_dir, stock_converted):
    """An mlx-community-style target (vision_tower.*, conv in MLX layout, body 4-bit, no head)."""
    from mtp_serve.models.graft import graft
    from mtp_serve.models.mtp_source import open_source
    from mtp_serve.models.vision.carry import carry_vision

    src = checkpoint_dir("qwen3_5", vision=True)
    target = tmp_path / "target"
    shutil.copytree(stock_converted(src, quantize=True), target)
    assert load_vision(json.loads((target / "config.json").read_text()), load_weights(target), target) is None
    assert carry_vision(open_source(str(src)), target) == 33
    image = _image()
    before = _encode(target, image)
    assert graft(str(src), target).status == "grafted"
    _vision_keys_unquantized(target)
    assert mx.array_equal(_encode(target, image), before)
    assert load_weights(target)["vision_tower.patch_embed.proj.weight"].shape[-1] == 3  # MLX layout
