"""Pipelined plain decoding: the next step's backbone pass is built and started while
the current step's token is still being computed (mlx-lm's `generate_step` does the same
with `mx.async_eval`).

    tokens = plain_choice(verified, rows)      # this step's tokens, lazy [B]
    pending = launch(model, batch, tokens)     # next step's forward, built now, run async
    accepted = accept_plain(verified, tokens)  # the host waits for this step's tokens only
    ...
    verified = verify(model, batch, drafts, forwarded=pending.outputs)  # next round: no forward to build

The launched pass writes the next position into the backbone caches before the host
knows whether that position is wanted (the row may stop, leave, be cancelled, or the
next round may draft). `undo` takes it back out exactly: GatedDeltaNet layers get the
arrays they held before (MLX arrays are immutable: the pass assigned new ones), attention
caches drop their last entry. Only the scoring, sampling and grammar masks of a step run
after its tokens are known, with the row's history, matcher and random state as the
unpipelined round has them, so a pipelined step picks the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import mlx.core as mx

from mtp_serve.models.caches import before_step, set_capture, steps_back, undo_step
from mtp_serve.models.mtp_model import MTPModel
from mtp_serve.models.qwen4_exp_mtp import holds_rows

from .batch import Batch
from .sampling import choose
from .sequence import Sequence
from .speculative import Accepted, Verified, _accepts_by_match, _argmax_only

@dataclass
class Pending:
    """A started forward over the rows' next tokens, not yet committed."""

    rows: List[Sequence]  # the batch's rows it ran for, in order
    hidden: mx.array  # [B, 1, H]
    logits: mx.array  # [B, 1, V]
    saved: List[Optional[List[mx.array]]]  # per layer: a GatedDeltaNet layer's arrays before the pass

    @property
    def outputs(self) -> Tuple[mx.array, mx.array]:
        return self.hidden, self.logits

    def matches(self, batch: Batch) -> bool:
        return len(self.rows) == len(batch.rows) and all(a is b for a, b in zip(self.rows, batch.rows))


def can_pipeline(batch: Batch) -> bool:
    """Every backbone cache can take one step back (qwen4_exp's row-by-row caches and other
    kinds decode unpipelined)."""
    return batch.caches is not None and not holds_rows(batch.cache) and steps_back(batch.cache)


def plain_choice(verified: Verified, rows: List[Sequence]) -> mx.array:
    """Each row's token for a round without drafts, lazy [B]: what `accept` picks at depth 0
    (the argmax, the seeded draw over its noise, or one draw from the row's generator)."""
    drafts, p = verified.drafts, verified.p
    picks = []
    for i, s in enumerate(rows):
        if _argmax_only(s):
            picks.append(verified.argmax[i, :1])
        elif _accepts_by_match(s):
            picks.append(mx.argmax(p[i] if s.params.greedy else p[i] + drafts.noise[i], axis=-1)[:1])
        else:
            picks.append(choose(p[i][:1], s.params, s.rng))
    return mx.concatenate(picks).astype(mx.int32)


def launch(model: MTPModel, batch: Batch, tokens: mx.array) -> Pending:
    """Build the backbone pass over `tokens` [B] (the rows' next primaries, still lazy) and
    start it; the host goes on without waiting."""
    saved = before_step(batch.cache)
    set_capture(batch.cache, False)
    hidden, logits = model.forward(tokens[:, None], batch.cache, rope=batch.rope)
    mx.async_eval(hidden, logits)
    return Pending(list(batch.rows), hidden, logits, saved)


def undo(batch: Batch, pending: Pending) -> None:
    """Take the launched pass back out of the caches: every row as before `launch`."""
    undo_step(batch.cache, pending.saved, len(pending.rows))


def accept_plain(verified: Verified, tokens: mx.array) -> Accepted:
    """The round's result from the rows' tokens (waits for them, not for the launched pass)."""
    picked: List[Any] = tokens.tolist()
    return Accepted(verified, [0] * len(picked), [[t] for t in picked])
