"""Qwen3 reasoning parser: split model output into reasoning and content.

Qwen3.5/3.6 (and Qwen3-Next Thinking) prompts already end with `<think>\\n`
when thinking is on, so the output holds only the closing `</think>`: the text
before it is reasoning, the text after it is content. An output that starts
with `<think>` anyway has the tag stripped. A `<tool_call>` before `</think>`
ends the reasoning implicitly (as in vLLM's qwen3 reasoning parser); the
`<tool_call>` itself goes to the content, for the tool parser.

Newlines are trimmed as the Qwen template writes them
(`<think>\\n{reasoning}\\n</think>\\n\\n{content}`): reasoning loses its
leading and trailing newlines, content its leading newlines.

With `starts_in_reasoning=False` (thinking off: the prompt ended with an
empty think block) every character is content, unchanged.
"""

from __future__ import annotations

from .events import find_first, partial_suffix_len

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"

_START, _REASONING, _CONTENT = range(3)


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when a rendered prompt ends inside an open think block (thinking on)."""
    return prompt.rstrip().endswith(THINK_START)


class ReasoningParser:
    """Streaming splitter. `feed(delta)` and `finish()` return (reasoning_delta, content_delta)."""

    _ends = (THINK_END, TOOL_CALL_START)

    def __init__(self, starts_in_reasoning: bool = True):
        self._buf = ""
        self._state = _START if starts_in_reasoning else _CONTENT
        self._lstrip = False  # drop leading newlines of the section just entered

    @property
    def in_reasoning(self) -> bool:
        """True until the reasoning has ended (always False with thinking off)."""
        return self._state != _CONTENT

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        """Flush held-back text at the end of the output."""
        return self._run(final=True)

    def _enter(self, state: int) -> None:
        self._state = state
        self._lstrip = True

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == _START:
                # Decide whether the output opens with its own <think> tag.
                s = self._buf.lstrip()
                if s.startswith(THINK_START):
                    self._buf = s[len(THINK_START):]
                    self._enter(_REASONING)
                elif final or (s and not THINK_START.startswith(s)):
                    self._enter(_REASONING)
                else:
                    break
            elif self._state == _REASONING:
                if self._lstrip:
                    self._buf = self._buf.lstrip("\n")
                    if not self._buf:
                        break
                    self._lstrip = False
                buf = self._buf
                i, tag = find_first(buf, self._ends)
                if i >= 0:
                    reasoning.append(buf[:i].rstrip("\n"))
                    # </think> is dropped; <tool_call> stays for the tool parser.
                    self._buf = buf[i + len(tag):] if tag == THINK_END else buf[i:]
                    self._enter(_CONTENT)
                    continue
                if final:
                    reasoning.append(buf.rstrip("\n"))
                    self._buf = ""
                    break
                # Hold back a possible partial tag and the newlines before it.
                keep = len(buf) - partial_suffix_len(buf, self._ends)
                keep = len(buf[:keep].rstrip("\n"))
                reasoning.append(buf[:keep])
                self._buf = buf[keep:]
                break
            else:
                if self._lstrip:
                    self._buf = self._buf.lstrip("\n")
                    if not self._buf:
                        break
                    self._lstrip = False
                content.append(self._buf)
                self._buf = ""
                break
        return "".join(reasoning), "".join(content)

