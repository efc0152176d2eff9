"""Accept or correct drafted tokens against the target distributions.

Greedy: accept while the draft equals the target argmax; the first mismatch
(or the bonus position) emits the target argmax. Sampled (Leviathan et al.,
vLLM's rejection sampler): accept d_j with probability min(1, p_j(d)/q_j(d));
on the first rejection emit a draw from norm(max(p_j - q_j, 0)); if all K
are accepted emit the bonus token from p_{K+1}. The emitted sequence then has
exactly the target distribution. Knows nothing of models or caches.
"""

from __future__ import annotations

from typing import List, Tuple

import mlx.core as mx

from .sampling import Rng


def accept_greedy(drafts: List[int], target_argmax: List[int]) -> Tuple[int, int]:
    """Returns (accepted count m, emitted token)."""
    m = 0
    while m < len(drafts) and drafts[m] == target_argmax[m]:
        m += 1
    return m, target_argmax[m]


def rejection_sample(
    drafts: mx.array, p_logprobs: mx.array, q_logprobs: mx.array, rng: Rng
) -> Tuple[int, int]:
    """drafts [K], p_logprobs [K+1, V] (target), q_logprobs [K, V] (draft). Returns (m, token)."""
    K = drafts.shape[0]
    p = mx.exp(p_logprobs)
    q = mx.exp(q_logprobs)
    rows = mx.arange(K)
    p_d = p[rows, drafts]
    q_d = q[rows, drafts]
    u = mx.random.uniform(shape=(K,), key=rng.next())
    accepted = (q_d > 0) & (u * q_d < p_d)
    residual = mx.maximum(p[:K] - q, 0.0)
    # Where p == q exactly the residual is empty and rejection has probability 0.
    residual = mx.where(residual.sum(-1, keepdims=True) > 0, residual, p[:K])
    corrections = mx.random.categorical(mx.log(residual), key=rng.next())
    bonus = mx.random.categorical(p_logprobs[K], key=rng.next())
    mx.eval(accepted, corrections, bonus)
    flags = accepted.tolist()
    m = 0
    while m < K and flags[m]:
        m += 1
    return m, (bonus.item() if m == K else corrections[m].item())
