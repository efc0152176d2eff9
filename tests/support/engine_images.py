"""Images in the engine, shared by the vision tests of each family: test pictures, prompts
with image tokens, greedy runs, and the batch of rows with and without images."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from mtp_serve.engine.generator import generate
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler
from mtp_serve.models.vision import prepare_image


def png(seed: int, size=(64, 48)) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def pictures_for(lm) -> dict:
    """Three prepared pictures: "a" and "b" of one size, "c" of another."""
    spec = lm.model.vision.spec
    return {name: prepare_image(png(seed, size), spec) for name, seed, size in
            [("a", 1, (64, 48)), ("b", 2, (64, 48)), ("c", 3, (40, 72))]}


def image_prompt(lm, images, before=(10, 11, 12, 13, 14), between=(20, 21, 22), after=(30, 31, 32, 33)):
    spec = lm.model.vision.spec
    ids = list(before)
    for i, im in enumerate(images):
        if i:
            ids += list(between)
        ids += [spec.vision_start_token_id] + [spec.image_token_id] * im.n_tokens + [spec.vision_end_token_id]
    return ids + list(after)


def run(lm, prompt, images, depth, cache=None, max_tokens=24, params=None, checkpoints=()):
    out, stats = [], None
    params = params or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for chunk in generate(lm.model, lm.tokenizer, prompt, params, depth, cache, checkpoints=checkpoints, images=images):
        out += chunk.token_ids
        stats = chunk.stats
    return out, stats


def assert_mtp_identical_to_plain(vlm, pictures, names) -> None:
    """Greedy MTP at depths 1-3 gives plain's tokens with the named pictures in the prompt, drafts landing."""
    images = tuple(pictures[n] for n in names)
    prompt = image_prompt(vlm, images)
    plain, _ = run(vlm, prompt, images, 0)
    for depth in (1, 2, 3):
        mtp, stats = run(vlm, prompt, images, depth)
        assert mtp == plain, f"depth {depth}"
        assert sum(stats.accepted) > 0


def assert_batched_rows_decode_as_alone(vlm, pictures) -> None:
    """Rows with one image, none and two, arriving at different steps and decoding together at
    depth 3, give each row's greedy plain output alone."""
    a, c = pictures["a"], pictures["c"]
    prompts = {"a": (image_prompt(vlm, [a]), (a,)), "text": (list(range(40, 75)), ()),
               "ac": (image_prompt(vlm, [a, c], before=(50, 51)), (a, c))}
    single = {k: run(vlm, p, ims, 0, max_tokens=20)[0] for k, (p, ims) in prompts.items()}
    arrivals = {"a": 0, "text": 1, "ac": 3}
    sched = Scheduler(vlm.model, vlm.tokenizer, max_batch_size=8, prefill_chunk=8,
                      policy=DepthPolicy(max_depth=3, fixed=True))
    out = {k: [] for k in prompts}
    step = 0
    while step == 0 or sched.has_work() or any(t >= step for t in arrivals.values()):
        for k, t in arrivals.items():
            if t == step:
                sched.add(k, prompts[k][0], SamplingParams(max_tokens=20, ignore_eos=True), 3, images=prompts[k][1])
        for key, chunk in sched.step():
            assert not isinstance(chunk, Exception), chunk
            out[key] += chunk.token_ids
        step += 1
        assert step < 500
    assert out == single
