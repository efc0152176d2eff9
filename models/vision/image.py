"""Image bytes -> the vision tower's input: decode, check limits, resize, normalise, patchify.

Mirrors transformers' Qwen2VLImageProcessor (PIL backend), which Qwen3-VL and Qwen3.5 use:
smart_resize to multiples of patch*merge within [min_pixels, max_pixels], PIL bicubic on the
uint8 image, rescale by 1/255, normalise, and flatten patches in the merge-window order the
tower expects (the single image repeated temporal_patch_size times).
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np

from mtp_serve.models.vision.spec import VisionSpec

MAX_ASPECT_RATIO = 200  # the processor's own bound


@dataclass(frozen=True)
class ImageLimits:
    max_pixels: int = 16_777_216      # decoded width*height before resizing
    max_bytes: int = 20 * 2**20       # encoded bytes per image


class ImageError(ValueError):
    """A client's image cannot be used; str(e) is the 400 message."""


@dataclass(frozen=True)
class PreparedImage:
    pixels: np.ndarray   # float32 [n_patches, C*temporal*patch*patch]
    grid_thw: tuple      # (t, h, w) in patches
    digest: str          # sha256 of the decoded RGB pixels and their size: the prompt-cache key
    merge_size: int = 2

    @property
    def n_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (self.merge_size ** 2)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple:
    """Qwen2-VL's target size: sides multiples of factor, area within bounds, aspect kept."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 is above "
                         f"the limit of {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _to_rgb(img):
    """Any mode -> RGB; transparent pixels are composited on white, as transformers does."""
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def decode_rgb(data: bytes, limits: ImageLimits):
    """Decode to a PIL RGB image (first frame of an animation, EXIF orientation applied),
    enforcing `limits`."""
    from PIL import Image, ImageOps

    if not data:
        raise ImageError("image is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {len(data)} bytes, above the limit of {limits.max_bytes} bytes (max_image_bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            width, height = img.size  # from the header: checked before the pixels are decoded
            if width <= 0 or height <= 0:
                raise ImageError(f"image has zero size ({width}x{height})")
            if width * height > limits.max_pixels:
                raise ImageError(f"image is {width}x{height} = {width * height} pixels, above the limit of "
                                 f"{limits.max_pixels} pixels (max_image_pixels)")
            img.seek(0)
            img.load()
            # Camera photos store their orientation in EXIF; transformers' load_image and mlx-vlm apply it too.
            img = ImageOps.exif_transpose(img)
            return _to_rgb(img)
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError(f"image has too many pixels: {e}") from None
    except Image.UnidentifiedImageError:  # also zero-size images: Pillow refuses their headers
        raise ImageError("image cannot be decoded: unrecognised format, corrupt header or zero size "
                         "(PNG, JPEG, GIF, WebP, BMP, TIFF are supported)") from None
    except Exception as e:  # Pillow raises many types for bad data (OSError, SyntaxError, ValueError, ...)
        raise ImageError(f"image cannot be decoded: {type(e).__name__}: {e}") from None


def patchify(image: np.ndarray, spec: VisionSpec) -> np.ndarray:
    """[C, H, W] -> [grid_h*grid_w, C*temporal*patch*patch], rows in merge-window order."""
    c, height, width = image.shape
    p, m, tp = spec.patch_size, spec.spatial_merge_size, spec.temporal_patch_size
    gh, gw = height // p, width // p
    x = image.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, c * tp * p * p), dtype=np.float32)


def prepare_image(data: bytes, spec: VisionSpec, limits: ImageLimits = ImageLimits()) -> PreparedImage:
    """Encoded image bytes -> PreparedImage; every failure is an ImageError."""
    from PIL import Image

    rgb = decode_rgb(data, limits)
    width, height = rgb.size
    raw = np.asarray(rgb, dtype=np.uint8)
    digest = hashlib.sha256(f"{width}x{height}:".encode() + raw.tobytes()).hexdigest()
    new_h, new_w = smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)
    if (new_w, new_h) != (width, height):
        try:
            rgb = rgb.resize((new_w, new_h), resample=Image.BICUBIC)
        except (MemoryError, ValueError) as e:
            raise ImageError(f"image cannot be resized to {new_w}x{new_h}: {e}") from None
    x = np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
    # The processor's arithmetic: rescale in float64 then float32, normalise in float32.
    x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(spec.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(spec.image_std, dtype=np.float32)[:, None, None]
    x = (x - mean) / std
    pixels = patchify(x, spec)
    grid = (1, new_h // spec.patch_size, new_w // spec.patch_size)
    return PreparedImage(pixels=pixels, grid_thw=grid, digest=digest, merge_size=spec.spatial_merge_size)
