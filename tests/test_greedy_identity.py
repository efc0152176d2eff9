"""Greedy MTP output is token-identical to mlx-lm's own plain greedy decoding.

The reference is stock mlx-lm: `mlx_lm.load` on the same checkpoint (which
drops mtp.*) and `mlx_lm.generate.generate_step`, both in fp32. Tie rule: where
some decode-sized fp32 product is not row-invariant (OpenBLAS computing the
small ones: no skinny sgemm shim), a T=K+1 verify and a T=1 step can differ in
the last bits, and a divergence is tolerated only if, at the first differing
token, the reference's top-two logits are within 1e-4 of each other (a
near-tie). With the shim (or without OpenBLAS) every product gives a row the
same bits at any row count, and the tokens must be identical.
"""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from mtp_serve import BACKEND, skinny_gemm
from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams

from mtp_serve.testing.synthetic import FAMILIES

NEAR_TIE = 1e-4
# what this file's own tests allow: nothing where the small products are row-invariant
ALLOWED_TIE = 0.0 if skinny_gemm.row_invariant() or not BACKEND.blas else NEAR_TIE
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11], list(range(30, 130, 3)), [200] * 5 + [201, 202]]
N_TOKENS = 64


def reference_greedy(path, prompt, n):
    if json.loads((path / "config.json").read_text())["model_type"] == "qwen4_exp":
        return own_reference_greedy(path, prompt, n)
    model, _ = mlx_lm_load(str(path))
    model.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x, model.parameters()))
    tokens, gaps = [], []
    for (tok, logprobs), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
        top2 = mx.sort(logprobs)[-2:]
        tokens.append(int(tok))
        gaps.append(float(top2[1] - top2[0]))
    return tokens, gaps


def own_reference_greedy(path, prompt, n):
    """qwen4_exp has no mlx-lm model: the reference is the project's own backbone (checked
    against transformers' forward by tests/test_qwen4_exp.py) stepped one token at a time."""
    from mtp_serve.models import qwen4_exp
    from mtp_serve.models.loader import load_weights

    config = json.loads((path / "config.json").read_text())
    model = qwen4_exp.build(config)
    body = {k: v.astype(mx.float32) for k, v in load_weights(path).items() if not k.startswith("mtp.")}
    model.load_weights(list(model.sanitize(body).items()), strict=True)
    cache, tokens, gaps = model.make_cache(), [], []
    logits = model(mx.array([prompt]), cache)[0, -1]
    for _ in range(n):
        top2 = mx.sort(logits)[-2:]
        tok = int(mx.argmax(logits))
        tokens.append(tok)
        gaps.append(float(top2[1] - top2[0]))
        logits = model(mx.array([[tok]]), cache)[0, -1]
    return tokens, gaps


def mtp_greedy(lm, prompt, depth, n=N_TOKENS):
    out, stats = [], None
    for chunk in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=n, ignore_eos=True), depth=depth):
        out += chunk.token_ids
        stats = chunk.stats
    return out, stats


def assert_identical_or_near_tie(ours, ref, gaps, label, tie=NEAR_TIE):
    assert len(ours) == len(ref), label
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[i] < tie, f"{label}: token {i} differs ({a} vs {b}) and the reference gap {gaps[i]:.3g} is no near-tie"
            return


_ref_cache = {}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_random_head(family, checkpoint_dir, loaded):
    lm = loaded(family)
    for pi, prompt in enumerate(PROMPTS):
        ref, gaps = reference_greedy(checkpoint_dir(family), prompt, N_TOKENS)
        for depth in (0, 1, 2, 3):
            ours, _ = mtp_greedy(lm, prompt, depth)
            assert_identical_or_near_tie(ours, ref, gaps, f"{family} prompt {pi} depth {depth}", ALLOWED_TIE)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp"])
def test_greedy_identity_agreeable_head_runs_accept_and_reject(family, checkpoint_dir, loaded):
    """A head that often agrees with the backbone: both accept and reject paths run."""
    lm = loaded(family, agreeable=True)
    for pi, prompt in enumerate(PROMPTS[:2]):
        ref, gaps = reference_greedy(checkpoint_dir(family, agreeable=True), prompt, N_TOKENS)
        for depth in (1, 2, 3):
            ours, stats = mtp_greedy(lm, prompt, depth)
            assert_identical_or_near_tie(ours, ref, gaps, f"{family} agreeable prompt {pi} depth {depth}", ALLOWED_TIE)
            rate = stats.acceptance_rate
            assert 0.2 <= rate <= 0.95, f"acceptance {rate:.2f} outside [0.2, 0.95]: not both paths exercised"
            assert stats.tokens_per_pass > 1.0


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_greedy_identity_on_mlx_ops_without_the_native_kernels(family, checkpoint_dir, monkeypatch):
    """Where the native recurrence and activations are off (not built, MTP_SERVE_NO_QMM=1, a GPU),
    mlx-lm's ops compute them, and greedy MTP still equals plain mlx-lm."""
    from mtp_serve.models import activations, gdn
    from mtp_serve.models.loader import load_model

    monkeypatch.setattr(gdn, "NATIVE", False)
    monkeypatch.setattr(activations, "NATIVE", False)
    lm = load_model(str(checkpoint_dir(family, agreeable=True)))  # fresh: compiled steps keep their first trace
    prompt = PROMPTS[1]
    ref, gaps = reference_greedy(checkpoint_dir(family, agreeable=True), prompt, N_TOKENS)
    for depth in (1, 3):
        ours, stats = mtp_greedy(lm, prompt, depth)
        assert_identical_or_near_tie(ours, ref, gaps, f"{family} on mlx ops, depth {depth}", ALLOWED_TIE)
        assert stats.tokens_per_pass > 1.0


@pytest.mark.skipif(ALLOWED_TIE > 0, reason="a decode-sized fp32 product here is not row-invariant")
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_verify_window_on_mlx_ops_is_plain_steps_bit_for_bit(family, checkpoint_dir, monkeypatch):
    """Off the native kernels (a GPU's path for the GatedDeltaNet layers), a capturing verify window
    scores each position with the bits of a plain step, and the state it keeps after 3 of 4
    positions is the one 3 plain steps reach: windows step the recurrence token by token."""
    from support.verify_windows import assert_window_is_plain_steps

    from mtp_serve.models import activations, gdn
    from mtp_serve.models.loader import load_model

    monkeypatch.setattr(gdn, "NATIVE", False)
    monkeypatch.setattr(activations, "NATIVE", False)
    model = load_model(str(checkpoint_dir(family, agreeable=True))).model
    assert_window_is_plain_steps(model, PROMPTS[1], [7, 300, 42, 9], f"{family} on mlx ops")
