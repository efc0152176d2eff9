"""Per-request decoding statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class DecodeStats:
    depth: int = 0  # drafts per round; 0 = plain decoding
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose state came from the prompt cache
    generated_tokens: int = 0
    backbone_passes: int = 0  # decode-time backbone forwards (prefill excluded)
    drafted: List[int] = field(default_factory=list)  # per draft position
    accepted: List[int] = field(default_factory=list)  # per draft position
    copy_drafted: int = 0  # tokens drafted by copying from the context (engine/context_drafts.py)
    copy_accepted: int = 0
    forced_drafted: int = 0  # tokens drafted because the output's grammar admits nothing else
    forced_accepted: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def record_round(self, depth: int, accepted: int) -> None:
        if len(self.drafted) < depth:
            self.drafted += [0] * (depth - len(self.drafted))
            self.accepted += [0] * (depth - len(self.accepted))
        for j in range(depth):
            self.drafted[j] += 1
            if j < accepted:
                self.accepted[j] += 1

    def record_certain(self, source: str, drafted: int, accepted: int) -> None:
        """A round whose drafts were copied ("copy") or forced by the grammar ("forced")."""
        setattr(self, source + "_drafted", getattr(self, source + "_drafted") + drafted)
        setattr(self, source + "_accepted", getattr(self, source + "_accepted") + accepted)

    @property
    def acceptance_rate(self) -> float:
        return sum(self.accepted) / sum(self.drafted) if sum(self.drafted) else 0.0

    @property
    def tokens_per_pass(self) -> float:
        # The first token comes from prefill, not from a decode pass.
        return (self.generated_tokens - 1) / self.backbone_passes if self.backbone_passes else 0.0

    def as_dict(self) -> dict:
        prefilled = self.prompt_tokens - self.cached_tokens
        return {
            "depth": self.depth,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "backbone_passes": self.backbone_passes,
            "drafted": sum(self.drafted),
            "accepted": sum(self.accepted),
            "drafted_per_position": list(self.drafted),
            "accepted_per_position": list(self.accepted),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_per_position": [round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted, self.drafted)],
            "copy_drafted": self.copy_drafted,
            "copy_accepted": self.copy_accepted,
            "forced_drafted": self.forced_drafted,
            "forced_accepted": self.forced_accepted,
            "tokens_per_pass": round(self.tokens_per_pass, 4),
            "prefill_tok_s": round(prefilled / self.prefill_s, 2) if self.prefill_s else 0.0,
            "decode_tok_s": round(self.generated_tokens / self.decode_s, 2) if self.decode_s else 0.0,
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
        }
