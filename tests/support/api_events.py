"""Readers and checkers of the Anthropic and Responses event streams (raw SSE over httpx),
shared by tests/test_messages_api.py and tests/test_responses_api.py. No tests here."""

from __future__ import annotations

import json

import httpx


def sse_events(response: httpx.Response) -> list:
    """(event name, data dict) per SSE event, comments skipped."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
            name = None
    return events


def check_anthropic_order(events: list) -> list:
    """The documented Messages stream: message_start, blocks (start, deltas, stop) with
    indexes from 0, message_delta, message_stop; ping anywhere; event name == data type.
    Returns the events without pings."""
    assert all(name == data["type"] for name, data in events), [(n, d["type"]) for n, d in events]
    kinds = [d for n, d in events if n != "ping"]
    assert kinds[0]["type"] == "message_start" and kinds[-2]["type"] == "message_delta" and kinds[-1]["type"] == "message_stop"
    open_, next_index = None, 0
    for d in kinds[1:-2]:
        if d["type"] == "content_block_start":
            assert open_ is None and d["index"] == next_index
            open_, next_index = d["index"], next_index + 1
        elif d["type"] == "content_block_delta":
            assert d["index"] == open_
            want = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}
            block = next(x for x in kinds if x["type"] == "content_block_start" and x["index"] == open_)["content_block"]
            assert d["delta"]["type"] == want[block["type"]], (block, d)
        else:
            assert d["type"] == "content_block_stop" and d["index"] == open_, d
            open_ = None
    assert open_ is None
    return kinds


def anthropic_blocks(kinds: list) -> list:
    """The content blocks a stream built, as a non-streamed response holds them."""
    blocks = []
    for d in kinds:
        if d["type"] == "content_block_start":
            blocks.append(dict(d["content_block"]))
            if blocks[-1]["type"] == "tool_use":
                blocks[-1]["input"] = ""
        elif d["type"] == "content_block_delta":
            b, delta = blocks[d["index"]], d["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "input"}[delta["type"]]
            b[field] += delta["partial_json" if field == "input" else field]
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b["input"] or "{}")
    return blocks


def check_responses_order(events: list) -> dict:
    """The documented Responses stream: sequence numbers 0..n-1, created, in_progress, per
    item added -> its events -> done (output indexes from 0), completed / incomplete last
    (then the last item is incomplete too). Returns the final response."""
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(name == d["type"] for name, d in events)
    types = [d["type"] for _, d in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    item, index = None, 0
    per_item = {
        "reasoning": ["response.content_part.added", "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done"],
        "message": ["response.content_part.added", "response.output_text.delta", "response.output_text.done", "response.content_part.done"],
        "function_call": ["response.function_call_arguments.delta", "response.function_call_arguments.done"],
    }
    seen = []
    for _, d in events[2:-1]:
        if d["type"] == "response.output_item.added":
            assert item is None and d["output_index"] == index
            item, seen = d["item"], []
        elif d["type"] == "response.output_item.done":
            last = d["output_index"] == len(events[-1][1]["response"]["output"]) - 1
            status = "incomplete" if last and types[-1] == "response.incomplete" else "completed"
            assert d["output_index"] == index and d["item"]["id"] == item["id"] and d["item"]["status"] == status
            order = per_item[item["type"]]
            assert [order.index(t) for t in seen] == sorted(order.index(t) for t in seen), seen
            assert all(t in seen for t in order if not t.endswith(".delta")), (item["type"], seen)
            item, index = None, index + 1
        else:
            assert item is not None and d["output_index"] == index, d
            assert d["type"] in per_item[item["type"]], (item["type"], d["type"])
            seen.append(d["type"])
    assert item is None
    final = events[-1][1]["response"]
    assert len(final["output"]) == index
    return final
