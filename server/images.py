"""Images in prompts: what every API's image part becomes (`ImageRef`), and resolving refs into
the model's prepared images: data URLs and base64 decoded, http(s) URLs fetched (size, time and
address limits: image_fetch.py), each decoded and resized by the checkpoint's processor config (models/vision).

    ref = image_ref(part, "messages[0].content[1]", "messages.0.content")   # a 400 for a malformed part
    images = resolve([ref, ...], vision, settings)                            # on the tokenizer pool

Every failure is a 400 naming the part and the limit or defect (never a 500); resolving runs
where rendering runs, off the event loop and off the engine thread.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from mtp_serve.server.errors import APIError, bad_request
from mtp_serve.server.image_fetch import AllowList, FetchFailed, fetch_url, timed_out

IMAGE_PARTS = ("image_url", "image", "input_image")  # chat, Anthropic Messages, Responses
# Image downloads: threads that wait on the network, beside the tokenizer threads that render.
FETCHERS = ThreadPoolExecutor(8, thread_name_prefix="mtp-image-fetch")


@dataclass(frozen=True)
class ImageSettings:
    """The server's image limits (mtp-serve flags of the same names)."""

    max_images: int = 16  # --max-images: per request, all turns together
    max_image_bytes: int = 20 << 20  # --max-image-bytes: encoded bytes per image
    max_image_pixels: int = 16_777_216  # --max-image-pixels: decoded width * height, before resizing
    fetch_timeout: float = 10.0  # --image-fetch-timeout: seconds to fetch one http(s) image, all of it
    max_image_tokens: int = 0  # --max-image-tokens: resize larger images down to this many tokens (0: the model's bounds)
    fetch_allow_hosts: Tuple[str, ...] = ()  # --image-fetch-allow-hosts: names, addresses, networks fetched though not public


def capped_spec(spec, max_tokens: int):
    """The checkpoint's VisionSpec with its resize bound lowered to `max_tokens` image tokens
    (one token covers factor x factor pixels); unchanged for 0 or a bound already below it."""
    if max_tokens <= 0 or spec.max_pixels <= max_tokens * spec.factor ** 2:
        return spec
    return replace(spec, max_pixels=max(spec.min_pixels, max_tokens * spec.factor ** 2))


@dataclass(frozen=True, eq=False)
class ImageRef:
    """One image part of a request, in message order: a `data:` or http(s) URL."""

    url: str
    where: str  # the part, as messages name it: "messages[2].content[0]"
    param: Optional[str] = None  # the API's param path, for the error object
    kind: str = "image"  # the part's type in its API: image_url, image, input_image

    def error(self, message: str) -> APIError:
        return bad_request(f"{self.where}: {message}", self.param, "invalid_image")


def image_ref(part: dict, where: str, param: Optional[str]) -> ImageRef:
    """An image content part of any API as an ImageRef (a 400 when it has no usable source):
    chat `image_url` ({"image_url": url | {"url", "detail"}}), Messages `image`
    ({"source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}),
    Responses `input_image` ({"image_url": url}; a `file_id` is not supported)."""
    kind = part.get("type")
    if kind == "image":
        source = part.get("source")
        if not isinstance(source, dict):
            raise bad_request(f"{where}: an image block needs a 'source' object", param)
        if source.get("type") == "base64":
            data, media = source.get("data"), source.get("media_type")
            if not isinstance(data, str) or not isinstance(media, str):
                raise bad_request(f"{where}: a base64 image source needs string 'media_type' and 'data'", param)
            return ImageRef(f"data:{media};base64,{data}", where, param, kind)
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return ImageRef(source["url"], where, param, kind)
        raise bad_request(f"{where}: image source type {source.get('type')!r} is not supported (base64 or url)", param)
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if isinstance(url, str):
        return ImageRef(url, where, param, kind)
    if kind == "input_image" and part.get("file_id") is not None:
        raise bad_request(f"{where}: input_image with a file_id is not supported (send image_url: a data: or http(s) URL)", param)
    raise bad_request(f"{where}: an {kind} part needs an image URL ('image_url' as a string or {{'url': ...}})", param)


# ---------------------------------------------------------------- resolving


def resolve(refs: Sequence[ImageRef], vision, settings: ImageSettings) -> Tuple[Any, ...]:
    """The refs' PreparedImages, in order: a 400 naming the first bad image. `vision` is the
    model's vision tower (None: a text-only model, refused)."""
    if not refs:
        return ()
    if vision is None:
        raise bad_request(f"{refs[0].where}: {refs[0].kind} content needs a model that reads images, and this model has no "
                          "vision tower: it reads text only (serve a Qwen3.5 / Qwen3.6 checkpoint with its vision tower "
                          "to send images)", refs[0].param, "model_not_multimodal")
    if len(refs) > settings.max_images:
        raise bad_request(f"{refs[settings.max_images].where}: at most {settings.max_images} images per request "
                          f"(--max-images); this one has {len(refs)}", refs[settings.max_images].param, "too_many_images")
    from mtp_serve.models.vision import ImageError, ImageLimits, prepare_image

    limits = ImageLimits(max_pixels=settings.max_image_pixels, max_bytes=settings.max_image_bytes)
    spec = capped_spec(vision.spec, settings.max_image_tokens)
    # URLs are fetched side by side (a request's images take one fetch time, not one each)
    fetches = {ref: FETCHERS.submit(fetch, ref, settings) for ref in refs if is_http(ref.url)}
    deadline = time.monotonic() + settings.fetch_timeout + 0.5  # the fetches keep their own; this bounds the wait
    out = []
    for ref in refs:
        try:
            data = fetched(ref, fetches[ref], deadline, settings) if ref in fetches else image_bytes(ref, settings)
        except APIError:
            for f in fetches.values():
                f.cancel()
            raise
        try:
            out.append(prepare_image(data, spec, limits))
        except ImageError as e:
            raise ref.error(with_flag(str(e))) from e
    return tuple(out)


def fetched(ref: ImageRef, future, deadline: float, settings: ImageSettings) -> bytes:
    """A fetch's bytes, waiting at most until `deadline` (a name lookup cannot be interrupted)."""
    try:
        return future.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        raise ref.error(f"could not fetch the image ({timed_out(settings.fetch_timeout)})") from None


def with_flag(message: str) -> str:
    """An ImageError's message naming the server flag of the limit it names."""
    for name, flag in (("max_image_pixels", "--max-image-pixels"), ("max_image_bytes", "--max-image-bytes")):
        if name in message:
            return message.replace(name, flag)
    return message + (" (--max-image-pixels)" if "too many pixels" in message else "")


def scheme(url: str) -> str:
    return urlsplit(url[:64]).scheme.lower() if ":" in url[:64] else ""


def is_http(url: str) -> bool:
    return scheme(url) in ("http", "https")


def image_bytes(ref: ImageRef, settings: ImageSettings) -> bytes:
    """The encoded image a ref points at: a data URL decoded, an http(s) URL fetched."""
    kind = scheme(ref.url)
    if kind == "data":
        return data_url_bytes(ref, settings)
    if kind in ("http", "https"):
        return fetch(ref, settings)
    shown = f"scheme {kind!r}" if kind else "a URL without a scheme"
    raise ref.error(f"{shown} is not supported for images (data:, http:, https:)")


DATA_URL = re.compile(r"data:(?P<media>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I)


def data_url_bytes(ref: ImageRef, settings: ImageSettings) -> bytes:
    m = DATA_URL.match(ref.url[:512])
    if m is None:
        raise ref.error("not a valid data: URL (data:image/png;base64,...)")
    if not m.group("b64"):
        raise ref.error("a data: URL image must be base64-encoded (data:<media type>;base64,...)")
    payload = ref.url[m.end():]
    if len(payload) * 3 // 4 > settings.max_image_bytes + 2:  # before decoding: its size is known
        raise ref.error(too_big(settings, at_least=len(payload) * 3 // 4))
    try:
        data = base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        try:  # some clients wrap base64 lines or use the URL-safe alphabet
            data = base64.b64decode(re.sub(r"\s+", "", payload).replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError) as e:
            raise ref.error(f"the image data is not valid base64 ({e})") from e
    if not data:
        raise ref.error("the image data is empty")
    if len(data) > settings.max_image_bytes:
        raise ref.error(too_big(settings, at_least=len(data)))
    return data


def too_big(settings: ImageSettings, at_least: int) -> str:
    return f"the image has {at_least:,} bytes; at most {settings.max_image_bytes:,} per image (--max-image-bytes)"


def fetch(ref: ImageRef, settings: ImageSettings) -> bytes:
    """GET an http(s) image (image_fetch.py): at most `max_image_bytes` within `fetch_timeout`
    seconds in all, from public addresses or those `fetch_allow_hosts` lists."""
    try:
        return fetch_url(ref.url, settings.max_image_bytes, settings.fetch_timeout, AllowList(settings.fetch_allow_hosts))
    except FetchFailed as e:
        raise ref.error(f"could not fetch the image ({e})") from e

