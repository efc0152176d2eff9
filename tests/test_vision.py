"""Image input's building blocks: preprocessing, the vision tower, M-RoPE.

References: transformers' Qwen2VLImageProcessor (PIL backend) for preprocessing, and
mlx-vlm 0.7.10's Qwen3.5 vision tower, get_rope_index and interleaved M-RoPE
(install.sh --test installs mlx-vlm with --no-deps). Everything runs on tiny shapes.
"""

import io
import json
import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mtp_serve.models.vision import (ImageError, ImageLimits, VisionSpec, apply_mrope, load_vision, mrope_positions,
                                     prepare_image)
from mtp_serve.models.vision.loader import tower_weights
from mtp_serve.models.vision.tower import TowerConfig
from mtp_serve.testing.synthetic import random_vision_weights

Image = pytest.importorskip("PIL.Image")

TOWER_ATOL = 1e-5  # fp32, depth 2, width 32: observed max |diff| ~5e-7 against mlx-vlm


def png(array: np.ndarray, fmt: str = "PNG", mode=None) -> bytes:
    img = Image.fromarray(array) if mode is None else Image.fromarray(array).convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def noise(h: int, w: int, c: int = 3, seed: int = 0) -> np.ndarray:
    shape = (h, w, c) if c > 1 else (h, w)
    return (np.random.default_rng(seed).random(shape) * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def vl_dir(checkpoint_dir):
    return checkpoint_dir("qwen3_5", vision=True)


@pytest.fixture(scope="module")
def vl(vl_dir):
    from mtp_serve.models.loader import load_weights

    config = json.loads((vl_dir / "config.json").read_text())
    weights = load_weights(vl_dir)
    return config, weights, load_vision(config, weights, vl_dir)


def spec_of(**overrides) -> VisionSpec:
    base = dict(image_token_id=7, vision_start_token_id=5, vision_end_token_id=6, patch_size=16, temporal_patch_size=2,
                spatial_merge_size=2, min_pixels=32 * 32, max_pixels=128 * 128, image_mean=(0.48, 0.45, 0.40),
                image_std=(0.26, 0.26, 0.27), mrope_section=(2, 1, 1), mrope_interleaved=True)
    base.update(overrides)
    return VisionSpec(**base)


# --- preprocessing -------------------------------------------------------------------

IMAGES = {
    "rgb odd size": lambda: png(noise(50, 90)),
    "upscaled tiny": lambda: png(noise(5, 9, seed=1)),
    "downscaled big": lambda: png(noise(300, 410, seed=2)),
    "rgba": lambda: png(noise(40, 70, 4, seed=3)),
    "grayscale": lambda: png(noise(64, 64, 1, seed=4)),
    "palette": lambda: png(noise(33, 77, seed=5), mode="P"),
    "jpeg": lambda: png(noise(48, 96, seed=6), fmt="JPEG"),
}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_prepare_image_matches_transformers_processor(name):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec = spec_of()
    data = IMAGES[name]()
    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
                                    patch_size=16, temporal_patch_size=2, merge_size=2,
                                    image_mean=list(spec.image_mean), image_std=list(spec.image_std))
    ref = proc(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    got = prepare_image(data, spec)
    assert got.grid_thw == tuple(ref["image_grid_thw"][0])
    assert got.pixels.dtype == np.float32 and got.pixels.shape == ref["pixel_values"].shape
    np.testing.assert_array_equal(got.pixels, ref["pixel_values"])  # the same arithmetic: bit for bit
    assert got.n_tokens == int(np.prod(got.grid_thw)) // 4


def test_prepare_image_digest_is_the_decoded_pixels():
    spec = spec_of()
    a = noise(40, 60)
    assert prepare_image(png(a), spec).digest == prepare_image(png(a, fmt="BMP"), spec).digest
    b = a.copy()
    b[0, 0, 0] ^= 1
    assert prepare_image(png(b), spec).digest != prepare_image(png(a), spec).digest


def test_animated_image_uses_first_frame():
    spec = spec_of()
    frames = [Image.fromarray(noise(32, 48, seed=s)) for s in (1, 2)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    first = io.BytesIO()
    frames[0].save(first, "GIF")
    assert prepare_image(buf.getvalue(), spec).digest == prepare_image(first.getvalue(), spec).digest


def test_exif_orientation_is_applied():
    spec = spec_of()
    pixels = noise(40, 100)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", exif=exif.tobytes())
    shown = prepare_image(buf.getvalue(), spec)
    upright = prepare_image(png(np.ascontiguousarray(np.rot90(pixels, -1))), spec)
    assert shown.grid_thw == upright.grid_thw and shown.grid_thw[1] > shown.grid_thw[2]
    assert shown.digest == upright.digest


def _zero_width_bmp() -> bytes:
    import struct

    header = struct.pack("<2sIHHI", b"BM", 54, 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, 0, 4, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return header + info


@pytest.mark.parametrize("data, limits, message", [
    (b"\x89PNG\r\n\x1a\n not really a png", ImageLimits(), "cannot be decoded"),
    (b"", ImageLimits(), "empty"),
    (None, ImageLimits(max_pixels=60 * 60), "max_image_pixels"),
    (None, ImageLimits(max_bytes=1000), "max_image_bytes"),
    (_zero_width_bmp(), ImageLimits(), "zero size"),
    (png(noise(64, 64))[:200], ImageLimits(), "cannot be decoded"),  # truncated
    (None, "aspect", "aspect ratio"),
])
def test_bad_images_raise_image_error(data, limits, message):
    if limits == "aspect":
        data, limits = png(noise(2, 500)), ImageLimits()
    elif data is None:
        data = png(noise(64, 64))
    with pytest.raises(ImageError) as e:
        prepare_image(data, spec_of(), limits)
    assert message in str(e.value)
    assert "BytesIO" not in str(e.value)  # a message for the client, not a repr


def test_pixel_limit_is_checked_before_decoding():
    """A huge image is refused from its header: no pixels are decoded."""
    data = png(np.zeros((4000, 5000), dtype=np.uint8))  # 20 Mpx, compresses to a few KB
    with pytest.raises(ImageError, match="max_image_pixels"):
        prepare_image(data, spec_of(), ImageLimits(max_pixels=16_777_216))


# --- the vision tower ------------------------------------------------------------------

def test_tower_matches_mlx_vlm(vl):
    vision_mod = pytest.importorskip("mlx_vlm.models.qwen3_5.vision")
    from mlx_vlm.models.qwen3_5.config import VisionConfig

    config, weights, vision = vl
    vc = config["vision_config"]
    ref = vision_mod.VisionModel(VisionConfig(**{k: v for k, v in vc.items() if k in VisionConfig.__dataclass_fields__}))
    hf = {k[len("model.visual."):]: v for k, v in weights.items() if k.startswith("model.visual.")}
    ref.load_weights(list(ref.sanitize(hf).items()), strict=True)

    images = [prepare_image(png(noise(50, 90, seed=s)), vision.spec) for s in (0,)]
    images.append(prepare_image(png(noise(130, 70, seed=1)), vision.spec))
    ours = vision.encode(images)
    assert [o.shape for o in ours] == [(i.n_tokens, config["text_config"]["hidden_size"]) for i in images]
    expected, _ = ref(mx.array(np.concatenate([i.pixels for i in images])), mx.array([i.grid_thw for i in images]))
    diff = mx.abs(mx.concatenate(ours) - expected).max().item()
    assert diff < TOWER_ATOL, diff
    assert mx.abs(expected).max().item() > 0.1  # a tower whose output is ~0 would pass anything


def test_large_images_attend_in_blocks_with_the_same_result(vl, monkeypatch):
    """A big image's attention runs in blocks of query rows (bounded memory), bit for bit the same."""
    from mtp_serve.models.vision import tower

    _, _, vision = vl
    image = prepare_image(png(noise(128, 128)), vision.spec)  # 64 patches
    whole = vision.encode([image])[0]
    monkeypatch.setattr(tower, "SCORE_BUDGET", 4 * 64 * 2 * 10)  # 10 query rows per block
    assert mx.array_equal(vision.encode([image])[0], whole)


def test_mlx_layout_loads_the_same_tower(vl, vl_dir):
    """mlx-vlm / mlx-community names (`vision_tower.*`, conv in MLX layout) give the same tower."""
    config, weights, vision = vl
    mlx_w = {k.replace("model.visual.", "vision_tower."): v for k, v in weights.items() if k.startswith("model.visual.")}
    mlx_w["vision_tower.patch_embed.proj.weight"] = mlx_w["vision_tower.patch_embed.proj.weight"].transpose(0, 2, 3, 4, 1)
    other = load_vision(config, mlx_w, vl_dir)
    image = prepare_image(png(noise(70, 70)), vision.spec)
    assert mx.array_equal(other.encode([image])[0], vision.encode([image])[0])


def test_quantized_tower_is_dequantized(vl, vl_dir):
    config, weights, vision = vl
    q = {k.replace("model.visual.", "vision_tower."): v for k, v in weights.items() if k.startswith("model.visual.")}
    key = "vision_tower.blocks.0.mlp.linear_fc1.weight"
    w, s, b = mx.quantize(q[key], group_size=32, bits=8)
    q.update({key: w, key[:-len("weight")] + "scales": s, key[:-len("weight")] + "biases": b})
    got = tower_weights(q, "vision_tower.", TowerConfig.from_dict(config["vision_config"]),
                        {"group_size": 32, "bits": 8})
    assert got["blocks.0.mlp.linear_fc1.weight"].shape == weights["model.visual.blocks.0.mlp.linear_fc1.weight"].shape
    assert mx.allclose(got["blocks.0.mlp.linear_fc1.weight"], weights["model.visual.blocks.0.mlp.linear_fc1.weight"],
                       atol=0.02).item()
    loaded = load_vision({**config, "quantization": {"group_size": 32, "bits": 8}}, q, vl_dir)
    image = prepare_image(png(noise(64, 64)), vision.spec)
    assert mx.abs(loaded.encode([image])[0] - vision.encode([image])[0]).max().item() < 0.05


def test_load_vision_none_without_tower(vl, vl_dir, caplog):
    config, weights, _ = vl
    text_only = {k: v for k, v in weights.items() if not k.startswith("model.visual.")}
    assert load_vision({k: v for k, v in config.items() if k != "vision_config"}, weights, vl_dir) is None
    assert load_vision(config, text_only, vl_dir) is None
    assert "no vision tower" in caplog.text
    deepstack = {**config, "vision_config": {**config["vision_config"], "deepstack_visual_indexes": [0]}}
    assert load_vision(deepstack, weights, vl_dir) is None  # Qwen3-VL's deepstack: text only, with a warning
    assert "deepstack" in caplog.text
    assert len(weights) > len(text_only)  # the checkpoint's dict is left whole


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_synthetic_vl_checkpoint_loads(checkpoint_dir, family):
    from transformers import AutoTokenizer

    from mtp_serve.models.loader import load_model, load_weights

    path = checkpoint_dir(family, vision=True)
    config = json.loads((path / "config.json").read_text())
    assert load_model(str(path)) is not None  # the text model still loads with model.visual.* beside it
    vision = load_vision(config, load_weights(path), path)
    spec = vision.spec
    tok = AutoTokenizer.from_pretrained(str(path))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image"},
                                         {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(spec.image_token_id) == 2 and ids.count(spec.vision_start_token_id) == 2
    assert ids.index(spec.vision_start_token_id) + 1 == ids.index(spec.image_token_id)
    emb = vision.encode([prepare_image(png(noise(200, 300)), spec)])[0]
    assert emb.shape == (12, config["text_config"]["hidden_size"])  # 200x300 -> 96x128 -> 3x4 tokens
    # HF layout on disk: PyTorch's Conv3d order [out, C, t, p, p].
    assert load_weights(path)["model.visual.patch_embed.proj.weight"].shape[1] == 3


# --- M-RoPE ----------------------------------------------------------------------------

def _rope_index_reference(ids, grids, spec):
    lang = pytest.importorskip("mlx_vlm.models.qwen3_5.language")
    cfg = types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=spec.spatial_merge_size),
                                image_token_id=spec.image_token_id, video_token_id=99,
                                vision_start_token_id=spec.vision_start_token_id)
    pos, delta = lang.LanguageModel.get_rope_index(types.SimpleNamespace(config=cfg), mx.array([ids]),
                                                  image_grid_thw=mx.array(grids))
    return np.array(pos)[:, 0], int(np.array(delta).reshape(-1)[0])


def _prompt(spec, parts):
    """parts: ints (text token counts) and (t, h, w) grids, in order."""
    ids, grids, tok = [], [], 20
    for p in parts:
        if isinstance(p, tuple):
            n = p[0] * p[1] * p[2] // spec.spatial_merge_size ** 2
            ids += [spec.vision_start_token_id] + [spec.image_token_id] * n + [spec.vision_end_token_id]
            grids.append(p)
        else:
            ids += list(range(tok, tok + p))
            tok += p
    return ids, grids


@pytest.mark.parametrize("parts", [
    [3, (1, 4, 6), 5],
    [2, (1, 8, 4), 3, (1, 4, 4), 4],
    [(1, 2, 2), (1, 6, 2)],
])
def test_mrope_positions_match_mlx_vlm(parts):
    spec = spec_of()
    ids, grids = _prompt(spec, parts)
    pos, delta = mrope_positions(ids, grids, spec)
    ref_pos, ref_delta = _rope_index_reference(ids, grids, spec)
    np.testing.assert_array_equal(pos, ref_pos)
    assert delta == ref_delta == int(pos.max()) + 1 - len(ids)


def test_mrope_positions_text_only_and_mismatch():
    spec = spec_of()
    pos, delta = mrope_positions([1, 2, 3], [], spec)
    np.testing.assert_array_equal(pos, np.tile(np.arange(3), (3, 1)))
    assert delta == 0
    ids, grids = _prompt(spec, [2, (1, 4, 4), 1])
    with pytest.raises(ValueError):
        mrope_positions(ids, [(1, 4, 8)], spec)
    with pytest.raises(ValueError):
        mrope_positions(ids + ids, grids, spec)


@pytest.mark.parametrize("traditional", [False, True])
def test_apply_mrope_equals_rope_when_rows_are_equal(traditional):
    rope = nn.RoPE(8, traditional=traditional, base=10000.0)
    x = mx.random.normal((2, 3, 9, 16), key=mx.random.key(0))
    for offset in (0, 37):
        pos = mx.broadcast_to(mx.arange(9)[None] + offset, (3, 9))
        diff = mx.abs(apply_mrope(x, pos, rope, spec_of()) - rope(x, offset=offset)).max().item()
        assert diff < 1e-5, diff


def test_apply_mrope_matches_mlx_vlm_interleaved():
    lang = pytest.importorskip("mlx_vlm.models.qwen3_5.language")
    spec = spec_of(mrope_section=(11, 11, 10))
    dims, head_dim = 64, 128
    ids, grids = _prompt(spec, [3, (1, 8, 6), 4])
    pos, _ = mrope_positions(ids, grids, spec)
    T = len(ids)
    x = mx.random.normal((1, 2, T, head_dim), key=mx.random.key(1))
    ref_rope = lang.Qwen3_5RotaryEmbedding(dims, base=1e7, mrope_section=list(spec.mrope_section))
    cos, sin = ref_rope(x, mx.array(pos)[:, None, :])
    rot, _ = lang.apply_multimodal_rotary_pos_emb(x[..., :dims], x[..., :dims], cos, sin)
    expected = mx.concatenate([rot, x[..., dims:]], axis=-1)
    got = apply_mrope(x, mx.array(pos), nn.RoPE(dims, base=1e7), spec)
    assert mx.abs(got - expected).max().item() < 1e-4
    assert mx.abs(got - nn.RoPE(dims, base=1e7)(x)).max().item() > 0.1  # image positions do move it


# --- against Hugging Face transformers itself (only where PyTorch is installed) ------------

def test_tower_mrope_and_rope_index_match_transformers(vl):
    torch = pytest.importorskip("torch")
    M = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig, Qwen3_5VisionConfig

    config, weights, vision = vl
    hf = M.Qwen3_5VisionModel(Qwen3_5VisionConfig(**{k: v for k, v in config["vision_config"].items()
                                                      if k != "model_type"})).eval()
    hf.load_state_dict({k[len("model.visual."):]: torch.from_numpy(np.array(v)) for k, v in weights.items()
                        if k.startswith("model.visual.")}, strict=True)
    images = [prepare_image(png(noise(50, 90, seed=0)), vision.spec), prepare_image(png(noise(130, 70, seed=1)), vision.spec)]
    with torch.no_grad():
        ref = hf(torch.from_numpy(np.concatenate([i.pixels for i in images])),
                 grid_thw=torch.tensor([i.grid_thw for i in images])).pooler_output.numpy()
    assert np.abs(np.array(mx.concatenate(vision.encode(images))) - ref).max() < TOWER_ATOL

    spec = spec_of(mrope_section=(11, 11, 10))
    ids, grids = _prompt(spec, [2, (1, 8, 4), 3, (1, 4, 4), 4])
    model = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=2)),
                                  get_vision_position_ids=lambda *a, **k: M.Qwen3_5Model.get_vision_position_ids(None, *a, **k))
    types_ = torch.tensor([[int(i == spec.image_token_id) for i in ids]])
    ref_pos, ref_delta = M.Qwen3_5Model.get_rope_index(model, torch.tensor([ids]), types_, image_grid_thw=torch.tensor(grids))
    pos, delta = mrope_positions(ids, grids, spec)
    np.testing.assert_array_equal(pos, ref_pos[:, 0].numpy())
    assert delta == int(ref_delta[0, 0])

    text = Qwen3_5TextConfig(head_dim=256, hidden_size=1024, num_attention_heads=4,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                              "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    x = np.random.default_rng(0).standard_normal((1, 4, len(ids), 256)).astype(np.float32)
    cos, sin = M.Qwen3_5TextRotaryEmbedding(text)(torch.from_numpy(x), torch.from_numpy(pos)[:, None, :])
    ref_x, _ = M.apply_rotary_pos_emb(torch.from_numpy(x), torch.from_numpy(x), cos, sin)
    got = apply_mrope(mx.array(x), mx.array(pos), nn.RoPE(64, base=1e7), spec)
    assert np.abs(np.array(got) - ref_x.numpy()).max() < 1e-5


# --- the reference vision forward the engine's exactness tests compare with ---------------

@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_reference_forward_reads_the_synthetic_checkpoint_as_mtp_serve_does(family, checkpoint_dir, loaded):
    """tests/support/vlm_reference.py (mlx-vlm's Qwen3.5 model) agrees with mtp-serve's plain forward on
    text, and its logits after an image depend on the image."""
    pytest.importorskip("mlx_vlm.models.qwen3_5")
    from support.vlm_reference import reference_logits

    path = checkpoint_dir(family, vision=True)
    lm = loaded(family, vision=True)
    ids = [10, 42, 7, 99, 3, 250, 17]
    _, ours = lm.model.forward(mx.array([ids]), lm.model.make_cache())
    diff = mx.abs(ours[0] - reference_logits(path, ids)).max().item()
    assert diff < 1e-4, diff

    from mtp_serve.models.loader import load_weights

    vision = load_vision(lm.config, load_weights(path), path)
    spec = vision.spec
    a, b = (prepare_image(png(noise(64, 96, seed=s)), spec) for s in (1, 2))
    prompt = [10, 42, spec.vision_start_token_id] + [spec.image_token_id] * a.n_tokens + [spec.vision_end_token_id, 7]
    la, lb = reference_logits(path, prompt, [a]), reference_logits(path, prompt, [b])
    assert mx.abs(la[-1] - lb[-1]).max().item() > 1e-3
    assert mx.abs(la[:2] - lb[:2]).max().item() == 0  # causal: text before the image is untouched
