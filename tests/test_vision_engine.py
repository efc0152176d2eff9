"""Images in the engine: with images in the prompt, greedy MTP output is
token-identical to greedy plain output (depths 1-3, one and two images, batched rows
with and without images, after a prompt-cache restore from memory and from disk,
under a grammar); the image reaches the model (a different image changes the
logits); the next turn of a conversation reuses the snapshot without encoding the
image again, and a different image with the same token count never matches.

The checkpoint is the agreeable synthetic Qwen3.5 with a tiny vision tower
(`write_synthetic_checkpoint(..., vision=True)`): 8 rotary dims, M-RoPE sections
[2, 1, 1] interleaved, so every position axis reaches the logits.
"""

import mlx.core as mx
import pytest

from mtp_serve.engine.generator import generate
from mtp_serve.engine.grammar import Constraint
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.prefill import prefill
from mtp_serve.engine.prompt_cache import PromptCache
from mtp_serve.engine.prompt_cache.disk import DiskTier
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler
from mtp_serve.engine.sequence import new_sequence
from mtp_serve.models.caches import FULL_KV
from mtp_serve.models.fingerprint import weights_fingerprint
from mtp_serve.models.loader import weight_files

from support.engine_images import assert_batched_rows_decode_as_alone, assert_mtp_identical_to_plain, image_prompt, pictures_for, run


@pytest.fixture(scope="module")
def vlm(loaded):
    return loaded("qwen3_5", agreeable=True, vision=True)


class CountingVision:
    """The model's vision tower, counting the images it encodes."""

    def __init__(self, vision):
        self.inner, self.spec, self.encoded = vision, vision.spec, 0

    def encode_steps(self, image, blocks_per_step=1):
        for piece in self.inner.encode_steps(image, blocks_per_step):
            self.encoded += piece is not None
            yield piece


@pytest.fixture
def counting(vlm):
    original = vlm.model.vision
    vlm.model.vision = CountingVision(original)
    yield vlm.model.vision
    vlm.model.vision = original


@pytest.fixture(scope="module")
def pictures(vlm):
    return pictures_for(vlm)


def first_logits(lm, prompt, images):
    seq = new_sequence(lm.model, lm.tokenizer, 0, prompt, SamplingParams(max_tokens=1), 0, images=images)
    seq.last_logits = None
    from mtp_serve.engine import prefill as prefill_module

    logits = []
    orig = prefill_module.target_logprobs

    def keep(row, *a, **k):
        logits.append(row)
        return orig(row, *a, **k)

    prefill_module.target_logprobs = keep
    try:
        prefill(lm.model, seq)
    finally:
        prefill_module.target_logprobs = orig
    return logits[0]


def test_the_image_reaches_the_model(vlm, pictures):
    a, b = pictures["a"], pictures["b"]
    assert a.n_tokens == b.n_tokens > 1
    la = first_logits(vlm, image_prompt(vlm, [a]), (a,))
    lb = first_logits(vlm, image_prompt(vlm, [b]), (b,))
    assert float(mx.abs(la - lb).max()) > 1e-3
    again = first_logits(vlm, image_prompt(vlm, [a]), (a,))
    assert mx.array_equal(la, again)


@pytest.mark.parametrize("names", [("a",), ("a", "c")], ids=["one-image", "two-images"])
def test_mtp_identical_to_plain_with_images(vlm, pictures, names):
    assert_mtp_identical_to_plain(vlm, pictures, names)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_6_moe"])
def test_mtp_identical_to_plain_with_images_moe(loaded, pictures, family):
    lm = loaded(family, agreeable=True, vision=True)
    images = (pictures["a"], pictures["c"])
    prompt = image_prompt(lm, images)
    plain, _ = run(lm, prompt, images, 0)
    for depth in (1, 3):
        assert run(lm, prompt, images, depth)[0] == plain, f"depth {depth}"


def test_batched_rows_with_and_without_images(vlm, pictures):
    assert_batched_rows_decode_as_alone(vlm, pictures)


def test_next_turn_reuses_the_image_without_encoding_it(vlm, pictures, counting, tmp_path):
    a, b = pictures["a"], pictures["b"]
    turn1 = image_prompt(vlm, [a])
    reply, _ = run(vlm, turn1, (a,), 0, max_tokens=6)
    turn2 = turn1 + reply + [40, 41, 42, 43, 44, 45]
    cold, _ = run(vlm, turn2, (a,), 2)
    cache = PromptCache(interval=0)
    run(vlm, turn1, (a,), 2, cache, max_tokens=6)
    assert counting.encoded == 3  # the reply, the cold run and turn 1
    warm, stats = run(vlm, turn2, (a,), 2, cache)
    assert counting.encoded == 3, "the image was encoded again"
    assert stats.cached_tokens >= len(turn1) and warm == cold
    # The same token count with another image: no reuse past the image's start.
    other = image_prompt(vlm, [b]) + reply + [40, 41, 42, 43, 44, 45]
    _, other_stats = run(vlm, other, (b,), 2, cache)
    assert other_stats.cached_tokens <= turn1.index(vlm.model.vision.spec.image_token_id)
    assert counting.encoded == 4


def test_image_snapshot_from_disk_after_restart(vlm, pictures, counting, tmp_path):
    a = pictures["a"]
    turn1 = image_prompt(vlm, [a])
    turn2 = turn1 + [40, 41, 42, 43, 44, 45, 46, 47]
    fp = weights_fingerprint(weight_files(vlm.path))
    layout = tuple(layer.is_linear for layer in vlm.model.layers)
    first = PromptCache(interval=0, disk=DiskTier(tmp_path, "m", fp, 1 << 30, layout, FULL_KV))
    run(vlm, turn1, (a,), 2, first, max_tokens=4)
    first.close()
    restarted = PromptCache(interval=0, disk=DiskTier(tmp_path, "m", fp, 1 << 30, layout, FULL_KV))
    before = counting.encoded
    warm, stats = run(vlm, turn2, (a,), 2, restarted)
    assert stats.cached_tokens == len(turn1) and counting.encoded == before
    cold, _ = run(vlm, turn2, (a,), 0)
    assert warm == cold


def test_mtp_identical_to_plain_with_an_image_under_a_grammar(vlm, pictures):
    a = pictures["a"]
    prompt = image_prompt(vlm, [a])
    constraint = Constraint("regex", r"[a-z]{3,12}( [a-z]{2,8}){1,4}")
    outs = [run(vlm, prompt, (a,), depth, params=SamplingParams(max_tokens=40, constraint=constraint))[0]
            for depth in (0, 2)]
    assert outs[0] == outs[1] and len(outs[0]) > 3


def test_a_text_only_model_refuses_images(loaded, pictures):
    lm = loaded("qwen3_5", agreeable=True)
    with pytest.raises(ValueError, match="no vision tower"):
        new_sequence(lm.model, lm.tokenizer, 0, [1, 2, 3], SamplingParams(max_tokens=1), 0, images=(pictures["a"],))


@pytest.mark.parametrize("family,n_images", [("qwen3_5", 1), ("qwen3_5", 2), ("qwen3_5_moe", 2)])
def test_logits_agree_with_mlx_vlm(loaded, pictures, family, n_images):
    """The whole vision-language forward (tower, image features in place of the pad
    tokens, M-RoPE) against mlx-vlm 0.7.10's Qwen3.5 model on the same checkpoint
    (tests/support/vlm_reference.py). Observed (dense): max |difference| 1.5e-5 with one image
    and 1.4e-4 with two, at max |logit| ~10; asserted: 2e-4 of max |logit|."""
    from support.vlm_reference import reference_logits

    lm = loaded(family, agreeable=True, vision=True)
    images = (pictures["a"], pictures["c"])[:n_images]
    prompt = image_prompt(lm, images)
    ours = first_logits(lm, prompt, images)[0]
    theirs = reference_logits(lm.path, prompt, images)[-1]
    scale = max(float(mx.abs(theirs).max()), 1.0)
    assert float(mx.abs(ours - theirs).max()) <= 2e-4 * scale
    assert int(mx.argmax(ours)) == int(mx.argmax(theirs))


def test_running_rows_decode_while_images_encode(vlm, pictures, counting):
    """Each engine step runs one block of the vision tower, and the running rows get their
    round in it (the tiny tower has 2 blocks: two steps an image)."""
    a, c = pictures["a"], pictures["c"]
    sched = Scheduler(vlm.model, vlm.tokenizer, max_batch_size=8, prefill_chunk=64,
                      policy=DepthPolicy(max_depth=2, fixed=True))
    sched.add("text", list(range(40, 60)), SamplingParams(max_tokens=40, ignore_eos=True), 2)
    while not sched.batch.rows:
        list(sched.step())
    sched.add("images", image_prompt(vlm, [a, c]), SamplingParams(max_tokens=4, ignore_eos=True), 2, images=(a, c))
    for expected in (0, 1, 1, 2):
        got = dict(sched.step())
        assert counting.encoded == expected and "text" in got and "images" not in got
    assert "images" in dict(sched.step())


def test_the_tower_in_pieces_gives_the_same_features(vlm, pictures):
    vision = vlm.model.vision
    for im in pictures.values():
        *pieces, features = vision.encode_steps(im, blocks_per_step=1)
        assert pieces == [None] and mx.array_equal(features, vision.encode([im])[0])


def test_copies_from_the_context_with_an_image_in_the_prompt(vlm, pictures):
    """Drafts copied from the context run their windows at the image prompt's M-RoPE positions:
    the output equals plain decoding's, with copies landing."""
    a = pictures["a"]
    prompt = image_prompt(vlm, [a])
    follows = generate_plain(vlm, prompt, (a,), 24)
    prompt = prompt + follows + list(prompt[-4:])  # what followed the prompt's end is in the context now
    ref = generate_plain(vlm, prompt, (a,), 40)
    ours, stats = run(vlm, prompt, (a,), 2, max_tokens=40)
    assert ours == ref and stats.copy_accepted > 0, stats


def generate_plain(lm, prompt, images, n):
    out = []
    for chunk in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=n, ignore_eos=True), 0, images=images,
                          copy_max=0):
        out += chunk.token_ids
    return out
