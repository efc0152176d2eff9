"""Cheap drafts, chosen by measurement: the head's precision and the draft vocabulary.

Beside a quantized body a draft from the unquantized head over the whole vocabulary
costs a third of a plain step at Qwen3.5-0.8B's shapes (the tied LM head over 248k
tokens, then the head's decoder layer), so MTP cannot pay whatever the acceptance.
Cheaper drafts change only acceptance, never the output (the verify pass decides
every token), so `mtp-tune` measures it: greedy decoding of its prompts at a fixed
depth, drafts from the head alone, once with the unquantized head over the whole
vocabulary (the reference), then the settings below cheapest first; the first whose
acceptance keeps at least (1 - MARGIN) of the reference's is the model's choice
(`draft_head_bits`, `draft_vocab_size` in its mtp_serve.json).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

MARGIN = 0.05  # a cheaper setting keeps at least 95% of the reference's acceptance
VOCABS = (16384, 32768)  # draft vocabularies tried, smallest (cheapest) first


@dataclass(frozen=True)
class DraftSetting:
    head_bits: int  # 0: the head as stored (unquantized)
    vocab: int  # 0: the whole vocabulary

    def describe(self) -> str:
        head = f"{self.head_bits}-bit head" if self.head_bits else "unquantized head"
        return f"{head}, {f'{self.vocab} most frequent tokens' if self.vocab else 'whole vocabulary'}"


REFERENCE = DraftSetting(0, 0)


def ladder(body_bits: int, vocab_size: int, fixed_vocab: Optional[int] = None) -> List[DraftSetting]:
    """Settings to try, cheapest draft first: the head at the body's bits, then 8 bits,
    then unquantized; the smaller draft vocabulary before the larger, then the whole
    one. A vocabulary at least the model's is the whole one; `fixed_vocab` (the user's
    --draft-vocab) is the only vocabulary tried."""
    bits = list(dict.fromkeys(b for b in (body_bits, 8) if b in (4, 8))) + [0]
    vocabs = [fixed_vocab] if fixed_vocab is not None else [*VOCABS, 0]
    vocabs = list(dict.fromkeys(v if 0 < v < vocab_size else 0 for v in vocabs))
    settings = [DraftSetting(b, v) for v in vocabs for b in bits]
    return [s for s in settings if s != REFERENCE]


def within_margin(acceptance: float, reference: float, margin: float = MARGIN) -> bool:
    return acceptance >= (1.0 - margin) * reference


@dataclass
class DraftChoice:
    setting: DraftSetting
    reference: float  # acceptance of the unquantized head over the whole vocabulary
    measured: List[Tuple[DraftSetting, float]] = field(default_factory=list)  # in the order tried

    def as_dict(self) -> dict:
        return {"chosen": self.setting.describe(), "margin": MARGIN, "reference_acceptance": round(self.reference, 3),
                "acceptance": {s.describe(): round(a, 3) for s, a in self.measured}}


def choose(reference: float, settings: Iterable[DraftSetting], measure: Callable[[DraftSetting], float]) -> DraftChoice:
    """Measure `settings` in order and stop at the first within the margin of `reference`
    (none: the reference itself)."""
    choice = DraftChoice(REFERENCE, reference)
    for s in settings:
        a = measure(s)
        choice.measured.append((s, a))
        if within_margin(a, reference):
            choice.setting = s
            break
    return choice


def acceptance(lm, prompts: List[List[int]], depth: int, tokens: int) -> float:
    """Accepted / drafted over greedy decoding of `prompts` at fixed `depth`, drafts from the head only."""
    from mtp_serve.engine.generator import generate
    from mtp_serve.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    drafted = accepted = 0
    for prompt in prompts:
        stats = list(generate(lm.model, lm.tokenizer, prompt, params, depth, copy_max=0))[-1].stats
        drafted += sum(stats.drafted)  # per draft position
        accepted += sum(stats.accepted)
    return accepted / drafted if drafted else 0.0


class DraftSwitch:
    """Puts a setting into a loaded model: a quantized copy of its unquantized head
    (made once per bits) and the first N ids of `ids`."""

    def __init__(self, lm, ids: List[int], group_size: int):
        self.lm, self.ids, self.group_size = lm, ids, group_size
        self.heads: Dict[int, object] = {0: lm.model.head}

    def apply(self, s: DraftSetting) -> None:
        from mtp_serve.models.draft_head import quantized_head

        if s.head_bits not in self.heads:
            self.heads[s.head_bits] = quantized_head(self.heads[0], s.head_bits, self.group_size)
        self.lm.model.head = self.heads[s.head_bits]
        self.lm.model.use_draft_vocab(self.ids[: s.vocab] if s.vocab else None)


def choose_drafts(lm, ids: List[int], prompts: List[List[int]], depth: int, tokens: int, body_bits: int,
                  group_size: int, fixed_vocab: Optional[int] = None,
                  out: Callable[[str], None] = print) -> DraftChoice:
    """Measure the reference and the ladder on `lm` (loaded with its head unquantized),
    leave the chosen setting in place and return the choice."""
    switch = DraftSwitch(lm, ids, group_size)

    def measure(s: DraftSetting) -> float:
        switch.apply(s)
        a = acceptance(lm, prompts, depth, tokens)
        out(f"  drafts from the {s.describe()}: acceptance {a:.3f}")
        return a

    reference = measure(REFERENCE)
    choice = choose(reference, ladder(body_bits, lm.model.vocab_size, fixed_vocab), measure)
    switch.apply(choice.setting)
    return choice
