"""Tests for the streaming output parsers (server/parsers). Pure Python, fast."""

from __future__ import annotations

import json
import random

import pytest

from mtp_serve.server.parsers import (
    ContentDelta,
    OutputParser,
    ReasoningDelta,
    ReasoningParser,
    ToolCallArgsDelta,
    ToolCallStart,
    collect,
    convert_param_value,
    detect_tool_parser,
    make_tool_parser,
    prompt_opens_reasoning,
)

# ------------------------------------------------------------------ helpers


def chunkings(text: str, n_random: int = 12, seed: int = 1234):
    """Whole, one char at a time, every two-way split (short texts), random chunkings."""
    yield [text]
    yield list(text)
    if len(text) <= 400:
        for i in range(1, len(text)):
            yield [text[:i], text[i:]]
    rng = random.Random(seed + len(text))
    for _ in range(n_random):
        chunks, i = [], 0
        while i < len(text):
            j = i + rng.randint(1, 12)
            chunks.append(text[i:j])
            i = j
        yield chunks


def run_tools(parser, chunks):
    events = []
    for c in chunks:
        events += parser.feed(c)
    events += parser.finish()
    return events


def check_events(events):
    """Well-formed stream: no empty deltas, start before args, args are one JSON object."""
    started, args = {}, {}
    for ev in events:
        if isinstance(ev, (ContentDelta, ReasoningDelta)):
            assert ev.text, ev
        elif isinstance(ev, ToolCallStart):
            assert ev.index not in started
            assert ev.index == len(started)
            assert ev.id.startswith("call_") and len(ev.id) > 10
            started[ev.index] = ev.name
            args[ev.index] = ""
        elif isinstance(ev, ToolCallArgsDelta):
            assert ev.index in started and ev.text
            args[ev.index] += ev.text
    for i, a in args.items():
        assert isinstance(json.loads(a), dict), a
    return started, args


def summary(events):
    """(content, [(name, arguments dict)]), ids left out."""
    started, args = check_events(events)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, [(started[i], json.loads(args[i])) for i in sorted(started)]


def calls_summary(calls):
    out = []
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        out.append((c["function"]["name"], json.loads(c["function"]["arguments"])))
    return out


def assert_stream_equivalent(fmt, tools, text):
    """Every chunking gives what the whole text fed at once gives (the non-streamed result)."""
    whole = make_tool_parser(fmt, tools)
    expected = summary(run_tools(whole, [text]))
    assert whole.has_tool_calls == bool(expected[1])
    for chunks in chunkings(text):
        p = make_tool_parser(fmt, tools)
        assert summary(run_tools(p, chunks)) == expected, chunks
        assert p.has_tool_calls == bool(expected[1])
    return expected


def reasoning_stream(chunks, **kw):
    p = ReasoningParser(**kw)
    r, c = [], []
    for ch in chunks:
        a, b = p.feed(ch)
        r.append(a)
        c.append(b)
    a, b = p.finish()
    r.append(a)
    c.append(b)
    return "".join(r), "".join(c)


def assert_reasoning_equivalent(text, **kw):
    r, c = reasoning_stream([text], **kw)
    expected = (r or None, c)
    for chunks in chunkings(text):
        r, c = reasoning_stream(chunks, **kw)
        assert ((r or None), c) == expected, chunks
    return expected


# ------------------------------------------------------------------ reasoning


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Let me think.\nStep 2.\n</think>\n\nThe answer is 4.", ("Let me think.\nStep 2.", "The answer is 4.")),
        ("<think>\nLet me think.\n</think>\n\nThe answer.", ("Let me think.", "The answer.")),
        ("\n<think>\nx\n</think>\n\ny", ("x", "y")),
        ("\n\nfoo\n\n</think>\n\n\nbar\n", ("foo", "bar\n")),
        ("</think>\n\nJust content.", (None, "Just content.")),
        ("still thinking, cut off", ("still thinking, cut off", "")),
        ("a < b and </thinking> is not the tag</think>ok", ("a < b and </thinking> is not the tag", "ok")),
        ("r</think>c</think>d", ("r", "c</think>d")),
        ("<thinker> is a word</think>c", ("<thinker> is a word", "c")),
        ("partial </thi", ("partial </thi", "")),
        ("", (None, "")),
    ],
)
def test_reasoning_split(text, expected):
    assert assert_reasoning_equivalent(text) == expected


def test_reasoning_tool_call_ends_reasoning():
    text = "I should call the tool.\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    assert assert_reasoning_equivalent(text) == (
        "I should call the tool.",
        "<tool_call>\n<function=f>\n</function>\n</tool_call>",
    )


def test_reasoning_thinking_off_is_all_content():
    for text in ["Hello\n", "<think>\nx\n</think>\n\ny", "a</think>b", "\n\nlead"]:
        assert assert_reasoning_equivalent(text, starts_in_reasoning=False) == (None, text)


def test_reasoning_holds_partial_tags():
    p = ReasoningParser(starts_in_reasoning=True)
    assert p.feed("abc</thi") == ("abc", "")
    assert p.in_reasoning
    assert p.feed("nk>\n") == ("", "")
    assert not p.in_reasoning
    assert p.feed("\nHi") == ("", "Hi")
    assert p.finish() == ("", "")

    p = ReasoningParser()
    assert p.feed("<thi") == ("", "")
    assert p.feed("nk>\nreason\n") == ("reason", "")  # trailing newline held
    assert p.feed("more<tool_") == ("\nmore", "")
    assert p.feed("call>") == ("", "<tool_call>")

    p = ReasoningParser()
    assert p.feed("x</thi") == ("x", "")
    assert p.finish() == ("</thi", "")  # never completed: it was text


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


# ------------------------------------------------------------------ qwen3_coder

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "typed",
            "parameters": {
                "type": "object",
                "properties": {
                    "i": {"type": "integer"},
                    "n": {"type": "number"},
                    "b": {"type": "boolean"},
                    "o": {"type": "object"},
                    "a": {"type": "array"},
                    "s": {"type": "string"},
                    "z": {"type": "null"},
                    "opt": {"type": ["integer", "null"]},
                    "any": {"anyOf": [{"type": "number"}, {"type": "string"}]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]


def xml_call(name, params=()):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_xml_single_call():
    text = xml_call("get_weather", [("city", "Paris"), ("days", "3")])
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text) == (
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    )


def test_xml_content_around_calls_and_whitespace():
    text = (
        "Let me check the weather.\n\n"
        + xml_call("get_weather", [("city", "Paris")])
        + "\n\n  \n"
        + xml_call("get_weather", [("city", "Rome"), ("unit", "c")])
        + "\n\nI asked for both.\n"
    )
    content, calls = assert_stream_equivalent("qwen3_coder", TOOLS, text)
    assert content == "Let me check the weather.I asked for both."
    assert calls == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome", "unit": "c"}),
    ]
    # Trailing whitespace after the last call is dropped, nothing else emitted.
    text2 = xml_call("ping") + "\n\n"
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text2) == ("", [("ping", {})])


def test_xml_multiline_values():
    code = "def f(a, b):\n    if a < b:\n        return '<div>' + \"q\\\\\"\n\n    return b\n"
    text = xml_call("write_file", [("path", "/tmp/x.py"), ("content", code)])
    content, calls = assert_stream_equivalent("qwen3_coder", TOOLS, text)
    assert content == ""
    assert calls == [("write_file", {"path": "/tmp/x.py", "content": code})]
    # Only one newline is stripped at each end.
    text = "<tool_call>\n<function=write_file>\n<parameter=content>\n\n  x\n\n\n</parameter>\n</function>\n</tool_call>"
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text)[1] == [("write_file", {"content": "\n  x\n\n"})]
    # Unicode and JSON-special characters.
    val = 'héllo "wörld" \\ \t 日本 😀 </para'
    text = xml_call("write_file", [("content", val)])
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text)[1] == [("write_file", {"content": val})]


def test_xml_type_conversion():
    params = [
        ("i", "42"),
        ("n", "2.5"),
        ("b", "true"),
        ("o", '{"k": [1, 2], "s": "x"}'),
        ("a", "[1, \"two\", null]"),
        ("s", "123"),
        ("z", "null"),
        ("opt", "None"),
        ("any", "7"),
        ("extra", "99"),
    ]
    text = xml_call("typed", params)
    _, calls = assert_stream_equivalent("qwen3_coder", TOOLS, text)
    assert calls == [
        (
            "typed",
            {
                "i": 42,
                "n": 2.5,
                "b": True,
                "o": {"k": [1, 2], "s": "x"},
                "a": [1, "two", None],
                "s": "123",
                "z": None,
                "opt": None,
                "any": 7,
                "extra": "99",  # not in the schema: stays a string
            },
        )
    ]
    # Python literals, fallbacks, multi-line JSON.
    params = [
        ("o", "{'a': True, 'b': (1, 2)}"),
        ("a", "(1, 2)"),
        ("b", "False"),
        ("i", "not a number"),
        ("n", "1e3"),
        ("any", "hello"),
        ("o", "{\n  \"deep\": {\"x\": 1}\n}"),
    ]
    _, calls = assert_stream_equivalent("qwen3_coder", TOOLS, xml_call("typed", params))
    assert calls == [
        ("typed", {"o": {"deep": {"x": 1}}, "a": [1, 2], "b": False, "i": "not a number", "n": 1000.0, "any": "hello"})
    ]


def test_convert_param_value_unit():
    assert convert_param_value("5", []) == "5"
    assert convert_param_value("5", ["string"]) == "5"
    assert convert_param_value(" 5 ", ["integer"]) == 5
    assert convert_param_value("5.0", ["integer"]) == 5
    assert convert_param_value("5.5", ["integer"]) == "5.5"
    assert convert_param_value("-3", ["number"]) == -3
    assert convert_param_value("nan", ["number"]) == "nan"
    assert convert_param_value("TRUE", ["boolean"]) is True
    assert convert_param_value("yes", ["boolean"]) == "yes"
    assert convert_param_value("null", ["object"]) is None
    assert convert_param_value("null", ["string"]) == "null"
    assert convert_param_value("[1,", ["array"]) == "[1,"
    assert convert_param_value("{'a': 1}", ["object"]) == {"a": 1}
    assert convert_param_value("[1]", ["object"]) == "[1]"  # wrong container type
    assert convert_param_value("7", ["string", "integer"]) == 7


def test_xml_two_functions_in_one_block_and_no_params():
    text = (
        "<tool_call>\n<function=ping>\n</function>\n"
        "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    )
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text)[1] == [
        ("ping", {}),
        ("get_weather", {"city": "Oslo"}),
    ]
    # A bad second function in a block is skipped, the first call survives.
    text = "<tool_call>\n<function=ping>\n</function>\n<function=nope>\n</function>\n</tool_call>"
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text) == ("", [("ping", {})])


def test_xml_lenient_missing_end_tags():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "<parameter=days>\n2\n</function>\n</tool_call>"
    )
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text)[1] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text)[1] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "text",
    [
        # unknown function
        "<tool_call>\n<function=launch_rockets>\n<parameter=n>\n1\n</parameter>\n</function>\n</tool_call>",
        # no <function=
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
        # the tag mentioned in prose
        "Wrap calls in <tool_call> tags, like <tool_call>this</tool_call>.",
        # partial tag at the very end
        "Some text <tool_c",
        # bad function header
        "<tool_call>\n<function=get weather\n>\n</tool_call>",
        "<tool_call>\n<function=" + "x" * 300 + ">\n</tool_call>",
    ],
)
def test_xml_malformed_is_verbatim_content(text):
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text) == (text, [])


def test_xml_unclosed_block():
    # Cut off (max_tokens) inside a call: the call with its arguments so far, streamed or not.
    text = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text) == ("Checking.", [("get_weather", {"city": "Par"})])
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n1"
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text) == ("", [("get_weather", {"city": "Paris", "days": 1})])
    text = "<tool_call>\n<function=get_weather>\n<parameter=ci"
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text) == ("", [("get_weather", {})])
    # Cut off before the function name: no call, and no markup as content.
    for cut in ("<tool_call>", "<tool_call>\n<func", "<tool_call>\n<function=get_wea"):
        assert assert_stream_equivalent("qwen3_coder", TOOLS, "Checking.\n" + cut) == ("Checking.", [])


def test_xml_call_without_tool_call_wrapper():
    """`<function=...>` alone (the model left out `<tool_call>`), as vLLM accepts it: a call
    when the function is a declared tool, streamed in any chunks."""
    bare = "<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>"
    assert assert_stream_equivalent("qwen3_coder", TOOLS, bare) == ("", [("get_weather", {"city": "Dallas", "days": 2})])
    text = "Let me check.\n" + bare + "\n</tool_call>\n" + xml_call("ping") + "\nDone."
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text) == (
        "Let me check.Done.", [("get_weather", {"city": "Dallas", "days": 2}), ("ping", {})])
    # Not a declared tool, no tools declared, or never closed: text.
    unknown = "See <function=launch>\n<parameter=n>\n1\n</parameter>\n</function> here"
    assert assert_stream_equivalent("qwen3_coder", TOOLS, unknown) == (unknown, [])
    assert assert_stream_equivalent("qwen3_coder", None, bare) == (bare, [])
    # Cut off: the call so far.
    assert assert_stream_equivalent("qwen3_coder", TOOLS, bare[:-len("</function>")]) == (
        "", [("get_weather", {"city": "Dallas", "days": 2})])


def test_xml_malformed_then_valid():
    bad = "<tool_call>\n<function=nope>\n</function>\n</tool_call>"
    good = xml_call("get_weather", [("city", "Lima")])
    text = "Intro " + bad + "\n" + good
    assert assert_stream_equivalent("qwen3_coder", TOOLS, text) == (
        "Intro " + bad,
        [("get_weather", {"city": "Lima"})],
    )


def test_xml_no_tools_accepts_any_name():
    text = xml_call("anything", [("x", "1")])
    assert assert_stream_equivalent("qwen3_coder", None, text)[1] == [("anything", {"x": "1"})]


def test_xml_call_streams_name_then_arguments():
    """The name goes out as soon as it is read, then the arguments as they are written."""
    p = make_tool_parser("qwen3_coder", TOOLS)
    assert p.feed("Hi\n<tool_call>\n<function=write_fi") == [ContentDelta("Hi")]
    (start,) = p.feed("le>\n")
    assert isinstance(start, ToolCallStart) and start.name == "write_file" and p.has_tool_calls
    pieces = []
    for delta in ("<parameter=content>\nab", "c\nde", "f\n</parameter>\n", "</function>\n</tool_call>"):
        evs = p.feed(delta)
        assert all(isinstance(e, ToolCallArgsDelta) for e in evs)
        pieces.append("".join(e.text for e in evs))
    assert pieces[0] == '{"content": "ab' and pieces[1] == "c\\nde"  # each piece as soon as it is safe
    assert json.loads("".join(pieces)) == {"content": "abc\ndef"} and p.finish() == []


# ------------------------------------------------------------------ hermes


def hermes_call(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_hermes_calls():
    text = (
        "Sure.\n\n"
        + hermes_call("get_weather", {"city": "Paris", "days": 2})
        + "\n"
        + hermes_call("ping", {})
        + "\n"
    )
    assert assert_stream_equivalent("hermes", TOOLS, text) == (
        "Sure.",
        [("get_weather", {"city": "Paris", "days": 2}), ("ping", {})],
    )
    # Arguments written as a JSON string, or missing.
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>'
    assert assert_stream_equivalent("hermes", TOOLS, text)[1] == [("get_weather", {"city": "Rome"})]
    text = '<tool_call>{"name": "ping"}</tool_call>'
    assert assert_stream_equivalent("hermes", TOOLS, text)[1] == [("ping", {})]
    # Nested values and unicode survive.
    args = {"city": "Zürich", "nested": {"a": [1, {"b": "</x>"}]}}
    assert assert_stream_equivalent("hermes", TOOLS, hermes_call("get_weather", args))[1] == [("get_weather", args)]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather" "arguments": {"city": "Paris"}}\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',  # unknown name
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "ping", "arguments": [1]}\n</tool_call>',  # arguments not an object
        "Text <tool_call",
    ],
)
def test_hermes_malformed_is_verbatim_content(text):
    assert assert_stream_equivalent("hermes", TOOLS, text) == (text, [])


def test_hermes_streams_and_closes_a_cut_off_call():
    p = make_tool_parser("hermes", TOOLS)
    assert p.feed('Sure.\n<tool_call>\n{"name": "get_wea') == [ContentDelta("Sure.")]
    assert p.feed('ther", "arguments": ') == []  # the name goes out with the arguments' first brace
    start, args = p.feed('{"ci')
    assert start.name == "get_weather" and args == ToolCallArgsDelta(0, '{"ci')
    assert p.feed('ty": "Pa') == [ToolCallArgsDelta(0, 'ty": "Pa')]
    assert p.finish() == [ToolCallArgsDelta(0, '"}')]
    for cut, args in [('{"city": "Pa', {"city": "Pa"}), ('{"city": "Paris", "days": 2', {"city": "Paris", "days": 2}),
                      ('{"city": "Paris", "days": tr', {"city": "Paris", "days": True}), ('{"ci', {"ci": None}),
                      ('{"city": "Paris"', {"city": "Paris"}), ("{", {})]:
        text = '<tool_call>\n{"name": "get_weather", "arguments": ' + cut
        assert assert_stream_equivalent("hermes", TOOLS, text) == ("", [("get_weather", args)]), cut
    text = '<tool_call>\n{"name": "get_weather", "argum'
    assert assert_stream_equivalent("hermes", TOOLS, text) == ("", [("get_weather", {})])
    for cut in ("<tool_call>", '<tool_call>\n{"na', '<tool_call>\n{"name": "get_we'):
        assert assert_stream_equivalent("hermes", TOOLS, "Sure. " + cut) == ("Sure.", [])


def test_hermes_malformed_then_valid():
    bad = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    text = bad + "\n" + hermes_call("ping", {})
    assert assert_stream_equivalent("hermes", TOOLS, text) == (bad, [("ping", {})])


# ------------------------------------------------------------------ factory, detection


def test_no_tool_parser_passthrough():
    text = "a <tool_call>\n<function=ping>\n</function>\n</tool_call>\n"
    p, events = run_output(lambda: OutputParser(None, None), list(text))
    assert output_summary(events) == (None, text, []) and not p.has_tool_calls
    with pytest.raises(ValueError):
        make_tool_parser("bogus")


def test_detect_tool_parser():
    qwen35 = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    qwen3_next = '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    qwen3_next_json = 'return a json object: <tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args>}'
    assert detect_tool_parser(qwen35) == "qwen3_coder"
    assert detect_tool_parser(qwen3_next) == "hermes"
    assert detect_tool_parser(qwen3_next_json) == "hermes"
    assert detect_tool_parser("{{ messages }}") == "none"
    assert detect_tool_parser(None) == "none"


# ------------------------------------------------------------------ combined output parser


def run_output(make, chunks):
    p = make()
    events = []
    for c in chunks:
        events += p.feed(c)
    events += p.finish()
    check_events(events)
    return p, events


def output_summary(events):
    res = collect(events)
    return res.reasoning, res.content, calls_summary(res.tool_calls)


@pytest.mark.parametrize("fmt", ["qwen3_coder", "hermes"])
def test_output_parser_reasoning_then_tools(fmt):
    call = xml_call("get_weather", [("city", "Paris")]) if fmt == "qwen3_coder" else hermes_call(
        "get_weather", {"city": "Paris"}
    )
    cases = [
        # thinking on, explicit end
        (True, "Need weather.\n</think>\n\nChecking.\n" + call, ("Need weather.", "Checking.")),
        # thinking on, <tool_call> ends reasoning implicitly
        (True, "Need weather.\n" + call, ("Need weather.", None)),
        # output that opens its own <think>
        (True, "<think>\nHm.\n</think>\n\n" + call + "\n", ("Hm.", None)),
        # thinking off
        (False, "Checking.\n\n" + call, (None, "Checking.")),
    ]
    for thinking, text, (reasoning, content) in cases:

        def make():
            return OutputParser(ReasoningParser(thinking), make_tool_parser(fmt, TOOLS))

        expected = (reasoning, content, [("get_weather", {"city": "Paris"})])
        for chunks in chunkings(text, n_random=6):
            p, events = run_output(make, chunks)
            assert output_summary(events) == expected, chunks
            assert p.has_tool_calls


def test_output_parser_without_components():
    text = "<think>x</think>y"
    p, events = run_output(lambda: OutputParser(None, None), list(text))
    assert output_summary(events) == (None, text, [])
    p, events = run_output(lambda: OutputParser(ReasoningParser(True), None), list(text))
    assert output_summary(events) == ("x", "y", [])
    assert not p.has_tool_calls


def test_output_parser_unclosed_call_is_a_call():
    text = "Think.\n</think>\n\nAnswer.\n<tool_call>\n<function=ping>\n"
    for chunks in chunkings(text, n_random=4):
        p, events = run_output(lambda: OutputParser(ReasoningParser(True), make_tool_parser("qwen3_coder", TOOLS)), chunks)
        # Unclosed call (cut off): the call so far.
        assert output_summary(events) == ("Think.", "Answer.", [("ping", {})])
