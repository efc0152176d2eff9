"""Grammar-constrained decoding: one llguidance matcher per constrained request.

    compiler = GrammarCompiler(hf_tokenizer, vocab_size, eos_token_ids)
    compiler.check(constraint)                  # GrammarError naming the problem, before any work
    grammar = compiler.matcher(constraint)      # a row's own matcher, at the start of its output
    allowed = grammar.mask()                    # [V] bool: tokens the grammar allows next
    grammar.consume([t]); grammar.rollback_to(n)  # advance through tokens; back to the state after n

Constraints are compiled by llguidance (JSON Schema, regular expressions, and
its Lark dialect with `%json {...}` and special tokens such as `</think>`);
no JSON-schema matching is written here. The speculative round masks each
drafted position with the state after the drafted prefix and rolls the
matcher back over rejected drafts, so a constrained MTP run emits exactly
what a constrained plain run would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional, Sequence

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask


class GrammarError(ValueError):
    """A constraint that cannot be compiled or is not supported; the message names why."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. `kind`: "json_schema" (source: the schema
    as JSON text), "regex", "lark" (llguidance's Lark dialect), or "llguidance" (its
    grammar-list JSON, for grammars built from parts)."""

    kind: str
    source: str

    @staticmethod
    def json_schema(schema: dict) -> "Constraint":
        return Constraint("json_schema", json.dumps(schema))

    @staticmethod
    def choice(options: Sequence[str]) -> "Constraint":
        return Constraint("lark", "start: " + " | ".join(json.dumps(o) for o in options))


ANY_JSON_OBJECT = {"type": "object"}
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: what models write, and fewer tokens to mask


def json_schema_error(source: str) -> Optional[str]:
    """Why llguidance cannot compile this JSON schema (its message), or None; needs no
    tokenizer, so schemas can be checked and rewritten before a request reaches the engine."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
    except (ValueError, RuntimeError) as e:
        return str(e)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    return "; ".join(messages) if is_error else None


class GrammarCompiler:
    """The tokenizer as llguidance sees it (built once per model) and grammar compilation."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        eos = list(eos_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos[0] if eos else None)
        self.vocab_size = vocab_size
        self.eos = eos

    def grammar(self, c: Constraint) -> str:
        """The constraint as an llguidance grammar; GrammarError when it does not compile."""
        try:
            if c.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(c.source, defaults=JSON_OPTIONS)
            elif c.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(c.source)
            elif c.kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(c.source)
            elif c.kind == "llguidance":
                grammar = c.source
            else:
                raise GrammarError(f"unknown constraint kind {c.kind!r}")
        except (ValueError, RuntimeError) as e:
            raise GrammarError(f"invalid {c.kind.replace('_', ' ')}: {e}") from e
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(f"invalid {c.kind.replace('_', ' ')}: {'; '.join(messages)}")
        return grammar

    def check(self, c: Constraint) -> None:
        self.grammar(c)

    def matcher(self, c: Constraint) -> "RowGrammar":
        m = llguidance.LLMatcher(self.tokenizer, self.grammar(c))
        if m.is_error():
            raise GrammarError(f"invalid {c.kind.replace('_', ' ')}: {m.get_error()}")
        return RowGrammar(m, self)


class RowGrammar:
    """One row's matcher. Its state is the output so far, plus any drafts consumed
    since; `consumed` counts the tokens it holds (a token after the grammar ended,
    such as an end-of-output token, is not recorded), so a round can go back to
    any earlier count."""

    def __init__(self, matcher: "llguidance.LLMatcher", compiler: GrammarCompiler):
        self._m = matcher
        self._compiler = compiler
        self._bits = allocate_token_bitmask(1, compiler.tokenizer.vocab_size)
        self.consumed = 0

    @property
    def finished(self) -> bool:
        """The grammar is complete: only the end of output may follow."""
        return self._m.is_stopped()

    def mask(self) -> mx.array:
        """[V] bool of the tokens allowed next (past the grammar's end: end of output)."""
        fill_next_token_bitmask(self._m, self._bits, 0)
        allowed = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[: self._compiler.vocab_size].astype(bool)
        if not allowed.any():  # an error state: let the row end rather than sample from nothing
            allowed[self._compiler.eos] = True
        return mx.array(allowed)

    def consume(self, tokens: List[int]) -> None:
        """Advance through tokens the masks allowed."""
        for t in tokens:
            if self._m.is_stopped():
                return
            if not self._m.consume_token(t):
                raise GrammarError(f"token {t} violates the grammar: {self._m.get_error()}")
            self.consumed += 1

    def rollback_to(self, consumed: int) -> None:
        """Back to the state after the first `consumed` tokens."""
        if consumed < self.consumed:
            self._m.rollback(self.consumed - consumed)
            self.consumed = consumed


def apply_mask(logits: mx.array, allowed: Optional[mx.array]) -> mx.array:
    """Disallowed tokens get -inf: the grammar filters before the sampling pipeline."""
    if allowed is None:
        return logits
    return mx.where(allowed, logits, -mx.inf)
