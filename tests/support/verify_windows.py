"""A verify window against plain steps, bit for bit (shared by the exactness tests)."""

import mlx.core as mx

from mtp_serve.models.caches import SpeculativeGDNCache, keep_verified, set_capture


def assert_window_is_plain_steps(model, prompt: list, window: list, label: str, keep: int = 3) -> None:
    """After `prompt`, a capturing verify window over `window` scores each position with the bits
    of a plain step, and after a commit keeping `keep` positions its GatedDeltaNet layers hold the
    conv state and recurrent state that `keep` plain steps reach."""
    plain, verify, check = model.make_cache(), model.make_cache(), model.make_cache()
    for cache in (plain, verify, check):
        mx.eval(model.forward(mx.array([prompt]), cache, last_logits=True))
    steps = [model.forward(mx.array([[t]]), plain)[1][0, -1] for t in window]
    set_capture(verify, True)
    _, logits = model.forward(mx.array([window]), verify)
    set_capture(verify, False)
    keep_verified(verify, [keep], len(window))
    for t, step in enumerate(steps):
        assert mx.array_equal(logits[0, t], step).item(), f"{label}: window position {t} differs from its step"
    for t in window[:keep]:
        model.forward(mx.array([[t]]), check)
    kept = [(a, b) for a, b in zip(verify, check) if isinstance(a, SpeculativeGDNCache)]
    assert kept, f"{label}: no GatedDeltaNet layer"
    for a, b in kept:
        assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item(), f"{label}: kept state"
