"""Grammar-constrained decoding: one llguidance matcher per constrained request.

    compiler = GrammarCompiler(hf_tokenizer, vocab_size, eos_token_ids)
    compiler.check(constraint)                  # any thread: compiled, first mask computed, probed (GrammarError
                                                # naming the problem or the budget); the result rides on `constraint`
    grammar = compiler.matcher(constraint)      # engine thread: a copy of the prepared matcher (no compiling)
    allowed = grammar.mask()                    # [V] bool: tokens the grammar allows next
    grammar.consume([t]); grammar.rollback_to(n)  # advance through tokens; back to the state after n

Constraints are compiled by llguidance (JSON Schema, regular expressions, and
its Lark dialect with `%json {...}` and special tokens such as `</think>`);
no JSON-schema matching is written here. The speculative round masks each
drafted position with the state after the drafted prefix and rolls the
matcher back over rejected drafts, so a constrained MTP run emits exactly
what a constrained plain run would.

Compiling happens off the engine thread (`check`, on the server's tokenizer
pool; llguidance drops the GIL while it builds a matcher), within a budget
(`GrammarBudget`: source size, llguidance's parser and lexer limits, seconds),
and the first steps are probed there, so a grammar that would hit one of
llguidance's limits a few tokens in (an unbounded forced sequence, a lexer that
explodes) is refused up front. A row whose matcher still fails later ends alone
(`RowGrammar.error`), never the round it ran in.

Text that is also a special token (`</tool_call>`, `<|im_end|>`, `<think>`)
inside a constraint is text: the tokenizer llguidance sees spells forced bytes
with ordinary tokens, never with a special token (which only a grammar's
`<name>` reference matches).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
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
        """Exactly one of `options`: one regular expression (a trie of the options), so any
        number of them stays one lexeme (as Lark alternatives, 2,000 would be llguidance's
        row limit, and tens of thousands take seconds to compile)."""
        return Constraint("regex", choice_regex(options))

    def prepared(self) -> Optional["Prepared"]:
        """What `GrammarCompiler.check` compiled for this object (None before)."""
        return self.__dict__.get("_prepared")

    def carry(self, other: "Constraint") -> "Constraint":
        """`other`'s prepared matcher, on this object too (same kind and source); returns self."""
        p = other.prepared() if isinstance(other, Constraint) else None
        if p is not None and (self.kind, self.source) == (other.kind, other.source):
            object.__setattr__(self, "_prepared", p)
        return self


def _escape(ch: str) -> str:
    return ch if ch.isalnum() else f"\\x{{{ord(ch):x}}}"


def choice_regex(options: Sequence[str]) -> str:
    """A regular expression matching exactly the strings in `options`, shared prefixes factored."""
    trie: dict = {}
    for o in options:
        node = trie
        for ch in o:
            node = node.setdefault(ch, {})
        node[""] = {}

    def rx(node: dict) -> str:
        alts = []
        for ch, child in node.items():
            if not ch:
                continue
            chain = _escape(ch)
            while len(child) == 1 and "" not in child:  # a run without branches: no recursion
                (ch, child), = child.items()
                chain += _escape(ch)
            alts.append(chain + rx(child))
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    try:
        return rx(trie)
    except RecursionError:
        raise GrammarError(f"a choice of {len(options)} options nests too deeply (options that are prefixes of each other)") from None


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


@dataclass(frozen=True)
class GrammarBudget:
    """What compiling one constraint may cost (off the engine thread); over it, a 400 naming it.
    The llguidance limits also bound every later mask step (its lexer fuel and items per step)."""

    max_source_bytes: int = 4 << 20  # the constraint's text (schema, regex, grammar)
    max_seconds: float = 5.0  # compiling, the first mask and the probe together
    probe_steps: int = 4  # tokens the probe takes (each the first the mask allows)

    def limits(self) -> "llguidance.LLParserLimits":
        return llguidance.LLParserLimits(verbose_errors=False)  # llguidance's defaults, short messages


class Prepared:
    """A compiled constraint: a matcher at the start of the output with its first mask computed.
    Each row takes a copy (`LLMatcher.deep_copy` shares the compiled grammar and lexer: instant)."""

    def __init__(self, matcher: "llguidance.LLMatcher", seconds: float):
        self.matcher = matcher
        self.seconds = seconds
        self._lock = threading.Lock()

    def copy(self) -> "llguidance.LLMatcher":
        with self._lock:
            return self.matcher.deep_copy()


def _message(kind: str, error: str) -> str:
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    return f"invalid {kind.replace('_', ' ')}: {first}"


class _TextTokenizer:
    """The model's vocabulary for llguidance, with a tokenizer that spells text as text: a
    special token's text (`</tool_call>`, `<|im_end|>`) in forced bytes becomes ordinary
    tokens (llguidance's own path would pick the special token, which its grammar then
    refuses: "forced bytes ... applying 'ÿ'"). Special tokens keep their ids and `<name>` references."""

    def __init__(self, hf_tokenizer, reference: "llguidance.LLTokenizer", eos: int):
        from tokenizers import Tokenizer

        data = json.loads(hf_tokenizer.backend_tokenizer.to_str())
        data["added_tokens"] = []  # the model's merges alone: no added token is ever produced
        data["truncation"] = data["padding"] = None
        self._text = Tokenizer.from_str(json.dumps(data))
        n = reference.vocab_size  # the model's rows (past the tokenizer's: llguidance's `<[id]>` placeholders)
        self.tokens = [reference.decode_bytes([i]) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if reference.is_special_token(i)]
        self.eos_token_id = eos
        self.bos_token_id = None
        self.is_tokenizer_wrapper = True

    def __call__(self, s) -> List[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", "surrogateescape")
        return self._text.encode_batch([s], add_special_tokens=False)[0].ids  # (the batch call drops the GIL)


class GrammarCompiler:
    """The tokenizer as llguidance sees it (built once per model) and grammar compilation."""

    CACHE = 32  # prepared constraints kept by (kind, source): agents resend the same forced tool call

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int], budget: Optional[GrammarBudget] = None):
        eos = sorted(eos_token_ids)
        first = eos[0] if eos else None
        reference = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=first)
        try:
            self.tokenizer = llguidance.LLTokenizer(_TextTokenizer(hf_tokenizer, reference, first), n_vocab=vocab_size,
                                                   eos_token=first)
        except Exception:  # noqa: BLE001 - a tokenizer this cannot rebuild: llguidance's own (special text stays special)
            self.tokenizer = reference
        self.vocab_size = vocab_size
        self.eos = eos
        self.budget = budget or GrammarBudget()
        self._limits = self.budget.limits()
        self._cache: "OrderedDict[tuple, Prepared]" = OrderedDict()
        self._cache_lock = threading.Lock()

    def grammar(self, c: Constraint) -> str:
        """The constraint as an llguidance grammar; GrammarError when it does not convert."""
        if len(c.source.encode("utf-8", "surrogatepass")) > self.budget.max_source_bytes:
            raise GrammarError(f"the {c.kind.replace('_', ' ')} is {len(c.source.encode('utf-8', 'surrogatepass'))} bytes; "
                               f"the limit is {self.budget.max_source_bytes} bytes")
        try:
            if c.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(c.source, defaults=JSON_OPTIONS)
            if c.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(c.source)
            if c.kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(c.source)
            if c.kind == "llguidance":
                return c.source
        except (ValueError, RuntimeError) as e:
            raise GrammarError(_message(c.kind, str(e))) from e
        raise GrammarError(f"unknown constraint kind {c.kind!r}")

    def prepare(self, c: Constraint) -> Prepared:
        """Compile `c`, compute its first mask and probe its first steps, within the budget; any
        thread (llguidance drops the GIL while it compiles and masks). GrammarError names the
        problem or the limit."""
        key = (c.kind, c.source)
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(self.tokenizer, self.grammar(c), log_level=0, limits=self._limits)
        if m.is_error():
            raise GrammarError(_message(c.kind, m.get_error()))
        bits = allocate_token_bitmask(1, self.tokenizer.vocab_size)
        fill_next_token_bitmask(m, bits, 0)  # the first mask: computed here, shared by every copy
        if m.is_error():
            raise GrammarError(_message(c.kind, m.get_error()))
        self._probe(c, m.deep_copy(), bits)
        seconds = time.perf_counter() - t0
        if seconds > self.budget.max_seconds:
            raise GrammarError(f"the {c.kind.replace('_', ' ')} took {seconds:.1f}s to compile; the limit is "
                               f"{self.budget.max_seconds:g}s (simplify it: fewer alternatives, bounded repetition)")
        p = Prepared(m, seconds)
        with self._cache_lock:
            self._cache[key] = p
            while len(self._cache) > self.CACHE:
                self._cache.popitem(last=False)
        return p

    def _probe(self, c: Constraint, m: "llguidance.LLMatcher", bits) -> None:
        """The first steps as the engine would take them (a mask, then one allowed token), where
        llguidance's limits show up (an unbounded forced sequence: "Too many items ... ff_tokens";
        a lexer that explodes: "too many expressions constructed"). A failure is the
        constraint's, refused before the request runs."""
        for step in range(self.budget.probe_steps):
            if m.is_stopped():
                return
            if step:
                fill_next_token_bitmask(m, bits, 0)
            allowed = np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")[: self.vocab_size])
            token = next((t for t in allowed.tolist() if t not in self.eos), None)
            if m.is_error() or (token is not None and not m.consume_token(token)) or m.is_error():
                raise GrammarError(_message(c.kind, m.get_error()))
            if token is None:
                return

    def check(self, c: Constraint) -> None:
        """Prepare `c` and keep the result on it for the engine (`matcher`)."""
        object.__setattr__(c, "_prepared", self.prepare(c))

    def matcher(self, c: Constraint) -> "RowGrammar":
        """A row's matcher: a copy of what `check` prepared (compiled here only when nothing was)."""
        p = c.prepared() or self.prepare(c)
        return RowGrammar(p.copy(), self)


class RowGrammar:
    """One row's matcher. Its state is the output so far, plus any drafts consumed
    since; `consumed` counts the tokens it holds (a token after the grammar ended,
    such as an end-of-output token, is not recorded), so a round can go back to
    any earlier count. A matcher that fails (one of llguidance's limits hit late)
    records `error` and allows only the end of output; the scheduler then fails this
    row alone."""

    def __init__(self, matcher: "llguidance.LLMatcher", compiler: GrammarCompiler):
        self._m = matcher
        self._compiler = compiler
        self._bits = allocate_token_bitmask(1, compiler.tokenizer.vocab_size)
        self.consumed = 0
        self.error: Optional[str] = None

    @property
    def finished(self) -> bool:
        """The grammar is complete: only the end of output may follow."""
        return self.error is not None or self._m.is_stopped()

    def mask(self) -> mx.array:
        """[V] bool of the tokens allowed next (past the grammar's end: end of output)."""
        allowed = np.zeros(self._compiler.vocab_size, dtype=bool)
        if self.error is None:
            fill_next_token_bitmask(self._m, self._bits, 0)
            if self._m.is_error():
                self._fail()
            else:
                allowed = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[: self._compiler.vocab_size].astype(bool)
        if not allowed.any():  # an error state: let the row end rather than sample from nothing
            allowed[self._compiler.eos] = True
        return mx.array(allowed)

    def consume(self, tokens: List[int]) -> None:
        """Advance through tokens the masks allowed."""
        for t in tokens:
            if self.error is not None or self._m.is_stopped():
                return
            if not self._m.consume_token(t):
                self._fail(f"token {t} violates the grammar: ")
                return
            self.consumed += 1

    def forced(self, limit: int) -> List[int]:
        """Up to `limit` tokens the grammar admits as the only continuation from here (JSON
        keys and punctuation, a forced tool call's scaffold)."""
        if self.error is not None or self._m.is_stopped() or limit <= 0:
            return []
        return list(self._m.compute_ff_tokens())[:limit]

    def rollback_to(self, consumed: int) -> None:
        """Back to the state after the first `consumed` tokens."""
        if consumed < self.consumed and self.error is None:
            self._m.rollback(self.consumed - consumed)
            self.consumed = consumed

    def _fail(self, prefix: str = "") -> None:
        err = self._m.get_error().strip()
        self.error = prefix + (err.splitlines()[0] if err else "the grammar engine failed")


def apply_mask(logits: mx.array, allowed: Optional[mx.array]) -> mx.array:
    """Disallowed tokens get -inf: the grammar filters before the sampling pipeline."""
    if allowed is None:
        return logits
    return mx.where(allowed, logits, -mx.inf)
