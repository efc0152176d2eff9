"""Prompt log-probabilities: what eval harnesses ask for with `echo` and `logprobs`.

lm-evaluation-harness's loglikelihood tasks send a prompt with `echo: true`, `logprobs: N` and
`max_tokens: 0` (or 1), and read the log-probability the model gives each prompt token after the
ones before it (the first token has none). This is a plain forward pass over the prompt, in
chunks, from fresh caches (no prompt-cache snapshot is read or written), scored with the same
log-softmax the sampler reports logprobs with.

    steps = prompt_logprobs(model, ids, top_n=5, chunk=512)   # a generator: one chunk per next()
    ... the engine loop advances it between rounds; StopIteration.value is the list
"""

from __future__ import annotations

from typing import Generator, List, Optional

import mlx.core as mx

from mtp_serve.models.mtp_model import MTPModel

from .chunks import TokenLogprob


def prompt_logprobs(model: MTPModel, ids: List[int], top_n: int, chunk: int) -> Generator[None, None, List[Optional[TokenLogprob]]]:
    """Per prompt token: None for the first, then its log-probability given the tokens before it
    and the `top_n` most likely tokens there (best first)."""
    cache = model.make_cache()
    out: List[Optional[TokenLogprob]] = [None]
    for start in range(0, len(ids) - 1, chunk):
        end = min(len(ids) - 1, start + chunk)  # positions start..end-1 score tokens start+1..end
        _, logits = model.forward(mx.array([ids[start:end]]), cache)
        lp = logits[0].astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        targets = mx.array(ids[start + 1:end + 1])
        chosen = mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
        if top_n > 0:
            top = mx.argpartition(-lp, kth=top_n - 1, axis=-1)[:, :top_n]
            top_lp = mx.take_along_axis(lp, top, axis=-1)
            mx.eval(chosen, top, top_lp)
            tops = [sorted(zip(t, v), key=lambda tv: -tv[1]) for t, v in zip(top.tolist(), top_lp.tolist())]
        else:
            mx.eval(chosen)
            tops = [[] for _ in range(end - start)]
        out += [TokenLogprob(t, v, top) for t, v, top in zip(ids[start + 1:end + 1], chosen.tolist(), tops)]
        yield
    return out
