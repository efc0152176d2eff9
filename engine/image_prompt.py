"""A prompt's images as the engine handles them.

The server expands each image into `n_tokens` image-pad tokens (in order) and
hands the prepared images along with the prompt. Here:

* `spans`: where each image's pad tokens sit;
* `positions` / `delta`: multimodal RoPE for the prompt (explicit three-axis
  positions during prefill, then index + delta for every later token);
* `key`: the prompt as the prompt cache sees it, each image's pad tokens
  replaced by negative ids drawn from the image's content hash, so a prefix
  with an image matches only a prefix with the same image (in memory, on disk,
  across restarts), and a different image of the same size never does;
* features: each image is encoded once, when prefill first reaches it, one
  tower block per engine step (running rows decode between the pieces); images
  wholly inside a restored prefix are never encoded.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from mtp_serve.models.rope_positions import RopePositions

_KEY_RANGE = 2**31 - 2


class ImagePrompt:
    def __init__(self, prompt: Sequence[int], images: Sequence[Any], vision: Any) -> None:
        from mtp_serve.models.vision import mrope_positions

        self.images = tuple(images)
        self.vision = vision
        self.spans = image_spans(prompt, vision.spec.image_token_id, [im.n_tokens for im in self.images])
        positions, self.delta = mrope_positions(prompt, [im.grid_thw for im in self.images], vision.spec)
        self.positions = mx.array(np.asarray(positions, dtype=np.int32))
        key = list(prompt)
        for im, (a, b) in zip(self.images, self.spans):
            base = int(im.digest[:15], 16)
            key[a:b] = [-1 - (base + j) % _KEY_RANGE for j in range(b - a)]
        self.key = key
        self.features: Dict[int, mx.array] = {}
        self._encoding: Optional[Tuple[int, Iterator[Optional[mx.array]]]] = None  # (image, its pieces)

    def inside(self, n: int) -> bool:
        """Whether a prefix of n tokens ends inside an image (no snapshot there: restoring
        it would mean encoding that image again)."""
        return any(a < n < b for a, b in self.spans)

    def encode_next(self, start: int, end: int) -> bool:
        """Run the next piece (a tower block) of the encoding of the first image overlapping
        prompt tokens [start, end) that is not encoded yet; False when there is none."""
        for i, (a, b) in enumerate(self.spans):
            if a < end and b > start and i not in self.features:
                if self._encoding is None or self._encoding[0] != i:
                    self._encoding = (i, self.vision.encode_steps(self.images[i]))
                feat = next(self._encoding[1])
                if feat is not None:
                    mx.eval(feat)
                    self.features[i], self._encoding = feat, None
                return True
        return False

    def embeds(self, embed_tokens: Any, tokens: List[int], start: int) -> mx.array:
        """Embeddings [1, T, H] of prompt tokens [start, start+T): image features where images are."""
        end = start + len(tokens)
        pieces, j = [], start
        for i, (a, b) in enumerate(self.spans):
            lo, hi = max(a, start), min(b, end)
            if lo >= hi:
                continue
            if j < lo:
                pieces.append(embed_tokens(mx.array(tokens[j - start : lo - start])))
            pieces.append(self.features[i][lo - a : hi - a])
            j = hi
        if j < end:
            pieces.append(embed_tokens(mx.array(tokens[j - start :])))
        h = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)
        return h[None]

    def rope(self, start: int, end: int) -> RopePositions:
        """Positions of prompt tokens [start, end) (also the head's entries there)."""
        return RopePositions(grid=self.positions[:, start:end], spec=self.vision.spec)


def image_spans(prompt: Sequence[int], image_token_id: int, sizes: Sequence[int]) -> List[Tuple[int, int]]:
    """[start, end) of each run of image-pad tokens; raises ValueError unless the runs are,
    in order, exactly as long as the images' token counts."""
    runs: List[Tuple[int, int]] = []
    i, n = 0, len(prompt)
    while i < n:
        if prompt[i] == image_token_id:
            j = i
            while j < n and prompt[j] == image_token_id:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    if [b - a for a, b in runs] != list(sizes):
        raise ValueError(f"the prompt's image tokens ({[b - a for a, b in runs]}) do not match its images ({list(sizes)})")
    return runs


def row_delta(rows: Sequence[Any]) -> Optional[RopePositions]:
    """The RoPE shift of a batch's rows (None when no row has images)."""
    deltas = [s.images.delta if s.images is not None else 0 for s in rows]
    if not any(deltas):
        return None
    return RopePositions(delta=deltas[0] if len(deltas) == 1 else mx.array(deltas))
