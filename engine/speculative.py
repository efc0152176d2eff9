"""The speculative round over the running batch (1..B rows), top to bottom:

    drafts   = draft(model, batch, depths, certain)  # row i: K_i tokens from the MTP head, copied or forced
    verified = verify(model, batch, drafts)  # one backbone pass over [x, d_1 .. d_W-1] per row
    accepted = accept(verified, batch.rows)  # row i keeps m_i <= K_i drafts, plus one token
    commit(batch, accepted)                  # each row's caches keep exactly what it kept

The plain decode step is the same round with every depth 0 (a window of one
token, nothing drafted, nothing to roll back).

State between rounds, per row: the backbone caches hold every committed token
except the primary x (the last emitted token, not yet forwarded); the head's
cache holds entries up to two positions before x, and the row's owed pairs
(H[p], x[p+1]) cover the rest (see `OwedPairs`): running the head over them
yields the first draft.

Per-row depth: row i drafts K_i tokens (0 .. its cap; `policy.py` chooses), from the
MTP head or, where the scheduler found them, drafts that come with certainty: copied
from the row's context (`context_drafts.py`) or the only tokens its grammar admits
next. Their draft distribution q is a point mass, and the head does not run over them.
The verify window is W = max K_i + 1 wide for every row. A row's positions
past K_i + 1 are padding: drafted greedily (no randomness consumed), never
accepted, and trimmed from its caches by the commit like any rejected draft.

Exactness: greedy rows accept while the draft equals the target argmax; seeded
rows the same over their position noise (the target draw argmax(log p + g) at
each position, see `sampling.py`), so they emit exactly the tokens plain
decoding draws with that seed; other sampled rows use rejection sampling
against the draft distribution q (Leviathan et al.), so the emitted tokens
have exactly the plain sampler's distribution. Both p and q come from the
request's full sampling pipeline, with the drafted prefix counted by the
penalties.

Grammars: a constrained row's matcher is masked, position by position, with
the state after the drafted prefix: the mask a draft is sampled under is the
mask its verify position is scored under (computed once), so p and q stay the
constrained plain sampler's; the matcher advances through the drafts and the
commit rolls it back over the rejected ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Protocol, Tuple

import mlx.core as mx

from mtp_serve.models.caches import keep_verified, set_capture, trim_per_row
from mtp_serve.models.mtp_model import MTPModel

from .batch import Batch
from .rejection import accept_greedy, rejection_sample
from .sampling import choose, coupled, position_noise, target_logprobs
from .sequence import Emitted, OwedPairs, Sequence

# Owed head pairs a row may pile up while it does not draft, before the head absorbs them.
MAX_OWED_PAIRS = 32


def _argmax_only(seq: Sequence) -> bool:
    """Greedy without penalties, logit bias or grammar: the pipeline is the identity, the token the argmax."""
    return seq.params.argmax_only and seq.grammar is None


def _accepts_by_match(seq: Sequence) -> bool:
    """Greedy and seeded rows keep drafts that equal the target's own choice."""
    return seq.params.greedy or coupled(seq.params)


@dataclass
class Drafts:
    depths: List[int]  # K_i
    tokens: Optional[mx.array]  # [B, W-1]; row i's first K_i are its drafts, the rest padding
    q: List[Optional[mx.array]]  # row i: [K_i, V] draft log-probs (unseeded sampled rows with K_i > 0)
    noise: List[Optional[mx.array]]  # row i: [W, V] its position noise (seeded rows)
    masks: List[Optional[List[mx.array]]]  # row i: its grammar's mask [V] per position so far (constrained rows)
    grammar_start: List[int]  # row i: tokens its matcher held before this round's drafts
    head_steps: int = 0  # entries the head chained on its own drafts (dropped again at the commit)
    absorbed: bool = False  # the head ran over every row's owed pairs (the commit starts them afresh)
    sources: Optional[List[str]] = None  # row i's drafts came with certainty: "copy" or "forced" ("": the head's)

    @property
    def width(self) -> int:
        """Verify window: the primary plus the longest row's drafts."""
        return max(self.depths) + 1

    @classmethod
    def given(cls, rows: List[Sequence], depths: List[int], tokens: Optional[mx.array]) -> "Drafts":
        """Drafts decided elsewhere (rank 0, serving across ranks): tokens only, no
        draft scores, noise or masks; each grammar where it stands."""
        n, K = len(rows), max(depths)
        return cls(depths, tokens, [None] * n, [None] * n, [None] * n,
                   [s.grammar.consumed if s.grammar is not None else 0 for s in rows], max(K - 1, 0), K > 0)


@dataclass
class Verified:
    drafts: Drafts
    hidden: mx.array  # [B, W, H] backbone hiddens (the head's next inputs)
    p: List[mx.array]  # row i: [W, V] target scores (log-probs; greedy rows: penalized logits)
    argmax: Optional[mx.array]  # [B, W] argmax of the raw logits (argmax-only rows use it)


@dataclass
class Accepted:
    verified: Verified
    counts: List[int]  # m_i: drafts row i accepted
    tokens: List[List[int]]  # row i emits d_1 .. d_m, then the correction or bonus token

    def emitted(self, i: int) -> Emitted:
        return self.tokens[i], self.verified.p[i][: self.counts[i] + 1]


class RoundSync(Protocol):
    """The hooks through which ranks serving one model agree (`distributed.py`): rank 0
    decides as usual and shares (`LeaderSync`), the other ranks take its decisions
    (`FollowerSync`). The scheduler calls them at each decision a rank could make alone."""

    def first_token(self, seq: Sequence, emitted: Emitted) -> Emitted: ...

    def depths(self, rows: List[Sequence], depths: List[int]) -> List[int]: ...

    def draft(self, model: MTPModel, batch: Batch, depths: List[int]) -> Drafts: ...

    def accept(self, verified: Verified, rows: List[Sequence]) -> Accepted: ...


def run_round(model: MTPModel, batch: Batch, depths: List[int], sync: Optional[RoundSync] = None,
              certain: Optional["CertainDrafts"] = None) -> Accepted:
    """`certain`: rows' drafts copied from their context or forced by their grammar (their
    depth is then 0). With `sync` (serving across ranks, `distributed.py`), rank 0's drafts
    and accept decisions are shared and the other ranks use them (no certain drafts)."""
    drafts = sync.draft(model, batch, depths) if sync else draft(model, batch, depths, certain)
    verified = verify(model, batch, drafts)
    accepted = sync.accept(verified, batch.rows) if sync else accept(verified, batch.rows)
    commit(batch, accepted)
    return accepted


# ---------------------------------------------------------------- 1. draft


@dataclass
class CertainDrafts:
    """Drafts that come with certainty, per row ([] and "" where a row has none)."""

    chains: List[List[int]]
    sources: List[str]  # "copy": from the row's context; "forced": the only tokens its grammar admits


def draft(model: MTPModel, batch: Batch, depths: List[int], certain: Optional[CertainDrafts] = None) -> Drafts:
    """The head over each row's owed pairs gives d_1; then it chains on its own hidden.
    Every row runs through the head (absorbing its owed pairs) when any row drafts from
    it; when none does, the head only absorbs the pairs rows piled up meanwhile. Rows
    with `certain` drafts draft those tokens instead (their depth is 0)."""
    rows = batch.rows
    K = max(depths)
    width = max([K] + [len(c) for c in certain.chains]) if certain is not None else K
    noise = [position_noise(s.params.seed, len(s.committed), width + 1, model.vocab_size) if coupled(s.params) else None
             for s in rows]
    masks = [[] if s.grammar is not None else None for s in rows]
    grammar_start = [s.grammar.consumed if s.grammar is not None else 0 for s in rows]
    if K == 0:
        if batch.head_cache is not None and max(len(s.owed) for s in rows) > MAX_OWED_PAIRS:
            head_over_owed(model, batch, keep_last=True)
        drafts = Drafts(depths, None, [None] * len(rows), noise, masks, grammar_start)
        return _with_certain(drafts, rows, certain, model.vocab_size) if certain is not None else drafts
    q: List[Optional[List[mx.array]]] = [[] if d and not _accepts_by_match(s) else None for s, d in zip(rows, depths)]
    hidden, logits = head_over_owed(model, batch)
    rope = batch.rope
    dv = model.draft_vocab
    columns: List[mx.array] = []
    for j in range(K):
        column = model.draft_argmax(logits)  # argmax-only rows and padding
        picked = {}
        for i, s in enumerate(rows):
            if j < depths[i] and not _argmax_only(s):
                prefix = mx.stack(columns, axis=1)[i] if columns else None
                allowed = None
                if s.grammar is not None:
                    allowed = s.grammar.mask()
                    masks[i].append(allowed)
                row = logits[i : i + 1] if dv is None else dv.to_vocab(logits[i : i + 1], model.vocab_size)
                lp = target_logprobs(row, s.params, s.history, prefix, allowed)
                picked[i] = choose(lp, s.params, s.rng, noise[i][j : j + 1] if noise[i] is not None else None)
                if s.grammar is not None:
                    s.grammar.consume([picked[i].item()])  # the matcher needs the token now: a host sync
                if q[i] is not None:
                    q[i].append(lp)
        if picked:
            column = mx.concatenate([picked.get(i, column[i : i + 1]) for i in range(len(rows))])
        columns.append(column)
        if j < K - 1:
            hidden, out = model.draft(hidden, column[:, None], batch.head_cache, rope)
            logits = out[:, -1]
            if any(m is not None for m in masks):
                mx.async_eval(logits)  # the head runs while the CPU computes the next masks
    drafts = Drafts(depths, mx.stack(columns, axis=1), [mx.concatenate(r) if r else None for r in q], noise, masks,
                    grammar_start, head_steps=K - 1, absorbed=True)
    return _with_certain(drafts, rows, certain, model.vocab_size) if certain is not None else drafts


def _with_certain(drafts: Drafts, rows: List[Sequence], certain: CertainDrafts, vocab: int) -> Drafts:
    """The head's drafts with the certain chains put in: the window widens to the longest
    chain (the other rows' extra positions are padding); each sampled row that matches no
    target draw gets its chain's q, a point mass on each token; a constrained row's matcher
    takes its chain, with the mask at each position (as the head's drafts do)."""
    W = max([max(drafts.depths)] + [len(c) for c in certain.chains])
    head = drafts.tokens.tolist() if drafts.tokens is not None else [[] for _ in rows]
    tokens, depths, q = [], list(drafts.depths), list(drafts.q)
    for i, (s, c) in enumerate(zip(rows, certain.chains)):
        row = c if c else head[i]
        tokens.append(row + [row[-1] if row else 0] * (W - len(row)))
        if not c:
            continue
        depths[i] = len(c)
        if not _accepts_by_match(s):
            q[i] = mx.where(mx.arange(vocab)[None] == mx.array(c)[:, None], 0.0, -mx.inf)
        if s.grammar is not None:
            for t in c:
                drafts.masks[i].append(s.grammar.mask())
                s.grammar.consume([t])
    return Drafts(depths, mx.array(tokens), q, drafts.noise, drafts.masks, drafts.grammar_start,
                  drafts.head_steps, drafts.absorbed, certain.sources)


def head_over_owed(model: MTPModel, batch: Batch, keep_last: bool = False):
    """Run the head over each row's owed pairs (right-padded to a common length in
    a batch; the padding entries are trimmed again). Returns the head's hidden and
    logits at each row's last pair [B,1,H], [B,V]. With `keep_last`, each row's
    last pair stays owed (absorbing a backlog without drafting)."""
    rows = batch.rows
    take = [len(s.owed) - (1 if keep_last else 0) for s in rows]
    if len(rows) == 1:
        n, owed = take[0], rows[0].owed
        out = model.head_pass(owed.hidden[:, :n], mx.array([owed.tokens[:n]]), batch.head_cache, batch.rope)
        last_hidden = out[:, n - 1 : n]
    else:
        N = max(take)
        hidden = mx.concatenate([_pad_right(s.owed.hidden[:, :n], N) for s, n in zip(rows, take)])
        tokens = mx.array([s.owed.tokens[:n] + [0] * (N - n) for s, n in zip(rows, take)])
        out = model.head_pass(hidden, tokens, batch.head_cache, batch.rope)
        trim_per_row(batch.head_cache, [N - n for n in take])
        last_hidden = out[mx.arange(len(rows)), mx.array([n - 1 for n in take])][:, None]
    # Scores at the last pair only (the drafts start there): the LM head over every owed pair was
    # up to K+1 rows of the whole vocabulary a round.
    last_logits = model.draft_logits(last_hidden)[:, 0]
    if keep_last:
        mx.eval(batch.head_cache.state)  # keep the lazy graph bounded
    for s, n in zip(rows, take):
        s.owed.drop_first(n)
    return last_hidden, last_logits


def _pad_right(x: mx.array, n: int) -> mx.array:
    return mx.pad(x, [(0, 0), (0, n - x.shape[1]), (0, 0)]) if x.shape[1] < n else x


# ---------------------------------------------------------------- 2. verify


def verify(model: MTPModel, batch: Batch, drafts: Drafts,
           forwarded: Optional[Tuple[mx.array, mx.array]] = None) -> Verified:
    """One backbone pass over [x, d_1 .. d_W-1] per row. GatedDeltaNet layers capture
    the window's states so the commit can keep any prefix (nothing to capture at W=1).
    `forwarded`: the pass's (hidden, logits), already started over the primaries (a plain
    round of pipelined decoding, `pipeline.py`)."""
    rows = batch.rows
    if forwarded is not None:
        hidden, logits = forwarded
    else:
        hidden, logits = _forward(model, batch, drafts)
    allowed = _window_masks(rows, drafts, logits)
    p = [
        logits[i] if _argmax_only(s) else
        target_logprobs(logits[i], s.params, s.history, drafts.tokens[i] if drafts.tokens is not None else None,
                        allowed[i])
        for i, s in enumerate(rows)
    ]
    argmax = mx.argmax(logits, axis=-1) if any(_argmax_only(s) for s in rows) else None
    return Verified(drafts, hidden, p, argmax)


def _forward(model: MTPModel, batch: Batch, drafts: Drafts) -> Tuple[mx.array, mx.array]:
    inputs = mx.array([[s.primary] for s in batch.rows])
    if drafts.tokens is not None:
        inputs = mx.concatenate([inputs, drafts.tokens], axis=1)
    capture = drafts.width > 1
    set_capture(batch.cache, capture)
    hidden, logits = model.forward(inputs, batch.cache, rope=batch.rope)
    if capture:
        set_capture(batch.cache, False)
    return hidden, logits


def _window_masks(rows: List[Sequence], drafts: Drafts, logits: mx.array) -> List[Optional[mx.array]]:
    """Each constrained row's masks over the window [W, V]: those its drafts were
    sampled under, the one after its last draft (computed while the backbone runs),
    and no constraint on padding positions (never accepted)."""
    if all(s.grammar is None for s in rows):
        return [None] * len(rows)
    mx.async_eval(logits)
    W = drafts.width
    out = []
    for s, masks in zip(rows, drafts.masks):
        if masks is None:
            out.append(None)
            continue
        masks.append(s.grammar.mask())
        pad = [mx.ones_like(masks[0])] * (W - len(masks))
        out.append(mx.stack(masks + pad))
    return out


# ---------------------------------------------------------------- 3. accept


def accept(verified: Verified, rows: List[Sequence]) -> Accepted:
    """Each row independently: how many of its own drafts it keeps, and the token after them."""
    drafts, p = verified.drafts, verified.p
    targets = [
        verified.argmax[i] if _argmax_only(s) else
        mx.argmax(p[i] if s.params.greedy else p[i] + drafts.noise[i], axis=-1) if _accepts_by_match(s) else None
        for i, s in enumerate(rows)
    ]
    mx.eval([t for t in targets if t is not None], drafts.tokens if drafts.tokens is not None else [])
    draft_lists = drafts.tokens.tolist() if drafts.tokens is not None else [[] for _ in rows]
    counts, tokens = [], []
    for i, s in enumerate(rows):
        K = drafts.depths[i]
        if targets[i] is not None:
            m, token = accept_greedy(draft_lists[i][:K], targets[i].tolist())
        elif K > 0:
            m, token = rejection_sample(drafts.tokens[i, :K], p[i][: K + 1], drafts.q[i], s.rng)
        else:
            m, token = 0, choose(p[i][:1], s.params, s.rng).item()
        counts.append(m)
        tokens.append(draft_lists[i][:m] + [token])
    return Accepted(verified, counts, tokens)


# ---------------------------------------------------------------- 4. commit


def commit(batch: Batch, accepted: Accepted) -> None:
    """Row i keeps GatedDeltaNet state after m_i + 1 window positions, drops its last
    W - m_i - 1 KV entries, and owes the head the pairs of what it emitted; the head's
    entries for its chained drafts (on its own hidden) are dropped for every row."""
    verified = accepted.verified
    W = verified.drafts.width
    drafts = verified.drafts
    if W > 1:
        keep_verified(batch.cache, [m + 1 for m in accepted.counts], W)
    if drafts.head_steps > 0 and batch.head_cache is not None:  # (a pipeline stage without the head has none)
        batch.head_cache.trim(drafts.head_steps)
    for i, s in enumerate(batch.rows):
        m, emitted = accepted.counts[i], accepted.tokens[i]
        if s.grammar is not None:  # keep the accepted drafts it consumed, then take the rest
            start = verified.drafts.grammar_start[i]
            kept = min(m, s.grammar.consumed - start)
            s.grammar.rollback_to(start + kept)
            s.grammar.consume(emitted[kept:])
        hidden = verified.hidden[i : i + 1, : m + 1]
        if drafts.absorbed:
            s.owed = OwedPairs(hidden, emitted)
        elif s.tracks_head:
            s.owed.append(hidden, emitted)
        s.primary = emitted[-1]
        s.stats.backbone_passes += 1
        source = drafts.sources[i] if drafts.sources is not None else ""
        if source:
            s.stats.record_certain(source, drafts.depths[i], m)
            if source == "copy":
                s.copy_cap.observe(s.copy_order, drafts.depths[i], m)
        else:
            s.stats.record_round(drafts.depths[i], m)
