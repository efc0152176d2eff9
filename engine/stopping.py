"""Stop conditions: EOS ids, stop strings, max tokens; and incremental text."""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

from mtp_serve.models.mlx_lm_compat import streaming_detokenizer

from .sampling import SamplingParams


class StopChecker:
    """Feeds tokens through a streaming detokenizer and decides when to stop.

    Text that could still turn into a stop string is held back, so a stop
    string never reaches the client, not even in part.
    """

    def __init__(self, tokenizer, params: SamplingParams):
        self.params = params
        self.detok = streaming_detokenizer(tokenizer)
        self.eos = set() if params.ignore_eos else set(tokenizer.eos_token_ids)
        self.eos |= set(params.stop_token_ids)
        self.stops = [s for s in params.stop if s]
        self.n_tokens = 0
        self.emitted_chars = 0
        self.finish_reason: Optional[str] = None
        self._final_text: Optional[str] = None

    def feed(self, tokens: Iterable[int]) -> Tuple[list, str]:
        """Returns (tokens kept, text delta). Sets `finish_reason` when done."""
        kept = []
        for t in tokens:
            if self.finish_reason:
                break
            kept.append(t)
            self.n_tokens += 1
            if t in self.eos:
                self.finish_reason = "stop"
                break
            self.detok.add_token(t)
            if self.stops and self._hit_stop():
                break
            if self.n_tokens >= self.params.max_tokens:
                self.finish_reason = "length"
        return kept, self._text_delta()

    def _hit_stop(self) -> bool:
        text = self.detok.text
        window = max(len(s) for s in self.stops) + 16
        start = max(0, len(text) - window)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if not hits:
            return False
        self.finish_reason = "stop"
        self._final_text = text[: min(hits)]
        return True

    def _text_delta(self) -> str:
        if self._final_text is not None:
            text = self._final_text
        elif self.finish_reason:
            self.detok.finalize()
            text = self.detok.text
        else:
            text = self.detok.text
            text = text[: len(text) - self._holdback(text)]
        delta = text[self.emitted_chars :]
        self.emitted_chars = max(self.emitted_chars, len(text))
        return delta

    def _holdback(self, text: str) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best
