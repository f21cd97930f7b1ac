"""The `<tool_call>` text format: prompt text, parsing and streaming (its grammar: test_tool_call_grammar.py).

The oracle: `ToolCallStream` fed any split of an output agrees with `parse_tool_calls` on it.
"""

from __future__ import annotations

import json
import random

import pytest

from deploy.tool_call_stream import StreamEvent, ToolCallStream, parse_cut_output
from deploy.tool_calls import (
    TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, format_tool_calls, json_layout, parse_tool_calls, tools_system_prompt,
)

WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                                     "required": ["a", "b"], "additionalProperties": False}}
NOW = {"name": "now"}  # no parameters: any object


def _block(body: str) -> str:
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


PARIS = _block('{"name": "get_weather", "arguments": {"city": "Paris"}}')
SUM = _block('{"name": "add", "arguments": {"a": 1, "b": 2.5}}')

# (output, content, [(name, arguments)]): well-formed outputs, with standard separators.
WELL_FORMED = [
    (PARIS, None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me check.\n" + PARIS, "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    ("  \n Sure  \n\n" + PARIS + "\n\n", "Sure", [("get_weather", '{"city": "Paris"}')]),
    (PARIS + "\n" + SUM, None, [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2.5}')]),
    (PARIS + SUM, None, [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2.5}')]),
    # Prose around calls is content, as the stream sends it once the call before it is out.
    (PARIS + "\nDone. \n", "Done.", [("get_weather", '{"city": "Paris"}')]),
    ("Checking. " + PARIS + "\nand\n" + SUM + " ok", "Checking.\nand ok",
     [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2.5}')]),
    (_block('{"name": "now", "arguments": {}}'), None, [("now", "{}")]),
    (_block('{"name": "f", "arguments": {"a": {"b": [1, {"c": "}"}]}, "s": "x}y{"}}'), None,
     [("f", '{"a": {"b": [1, {"c": "}"}]}, "s": "x}y{"}')]),
    (_block('{"name": "echo", "arguments": {"text": "write </tool_call> here"}}'), None,
     [("echo", '{"text": "write </tool_call> here"}')]),
    (_block('{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}'), None,
     [("get_weather", '{"city": "Zürich 東京"}')]),
    (_block('{"name": "say \\"hi\\"", "arguments": {"q": "a\\"b"}}'), None, [('say "hi"', '{"q": "a\\"b"}')]),
    # Arguments as written, as the stream sends them: numbers as spelt (json.dumps made 1e999
    # Infinity, no JSON, and 1.50 1.5), separators as written
    (_block('{"name": "f", "arguments": {"x": 1.50, "y": -0, "z": 1E2, "w": 1e999}}'), None,
     [("f", '{"x": 1.50, "y": -0, "z": 1E2, "w": 1e999}')]),
    (_block('{"name": "f", "arguments": {"a":1,"b" :[2]} }'), None, [("f", '{"a":1,"b" :[2]}')]),
    # Other spellings the parser accepts; the stream sends them normalised at the close tag.
    (_block('{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}'), None, [("add", '{"a": 1, "b": 2}')]),
    (_block('{"arguments": {"a": 1}, "name": "add"}'), None, [("add", '{"a": 1}')]),
    ("<tool_call>{\"name\":\"add\",\"arguments\":{\"a\": 1}}</tool_call>", None, [("add", '{"a": 1}')]),
    # No tags: all content.
    ("Hello world.", "Hello world.", []),
    ("  Hello <tool  ", "Hello <tool", []),
    ("a < b and <tool_c", "a < b and <tool_c", []),
    ("", None, []),
]

# Outputs that are plain content as a whole: (text, []).
MALFORMED = [
    "Use the <tool_call> tag to call a function.",
    "I could write <tool_call> here.\n" + PARIS,
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",  # unclosed
    "<tool_call>\n{\"name\": \"get_weather\", \"arg",  # cut off in the header
    _block('{"name": "get_weather", "arguments": {"city": }}'),  # bad JSON
    _block('{"name": "add", "arguments": 3}'),
    _block('{"name": "add", "arguments": "not json"}'),
    _block('{"name": "add", "arguments": "[1, 2]"}'),
    _block('{"arguments": {"a": 1}}'),
    _block('{"name": 7, "arguments": {}}'),
    _block('{"name": "add", "arguments": {"a": 1}, "id": "x"}'),
    PARIS + "\n<tool_call>",  # a second, unclosed block
]


@pytest.mark.parametrize("output,content,calls", WELL_FORMED)
def test_parse_well_formed(output, content, calls):
    assert parse_tool_calls(output) == (content, [ToolCall(n, a) for n, a in calls])


@pytest.mark.parametrize("output", MALFORMED)
def test_parse_malformed_is_plain_content(output):
    assert parse_tool_calls(output) == (output, [])


@pytest.mark.parametrize("calls", [
    [("get_weather", '{"city": "Paris"}')],
    [("get_weather", '{"city":"Paris","days":3}'), ("add", '{ "a" : 1, "b": 2 }')],
    [("now", ""), ("now", "{}")],
    [("f", '{"nested": {"list": [1, "}", {"x": null}]}, "uni": "é"}')],
])
def test_format_round_trips_through_parse(calls):
    text = format_tool_calls(calls)
    expected = [ToolCall(n, json.dumps(json.loads(a or "{}"), separators=(", ", ": "), ensure_ascii=False))
                for n, a in calls]
    assert parse_tool_calls(text) == (None, expected)


@pytest.mark.parametrize("arguments", [
    '{"price": 1.50, "big": 1E5, "tiny": 1e-400, "huge": -1e999, "city": "S\\u00e3o Paulo", "tab": "a\\tb"}',
    '{"n": 123456789012345678901234567890, "x": 0.1000, "list": [1.0, -0.0, 2e+3], "nested": {"k": NaN}}',
])
def test_the_models_own_call_comes_back_to_it_as_it_wrote_it(arguments):
    """A call the model wrote (in our layout, which the grammar forces), sent back by a client
    as the `arguments` it received, renders as the model's text: the next turn's prompt
    repeats its tokens (json.dumps would write 1.5, 100000.0, 0.0, -Infinity, "São")."""
    output = _block(f'{{"name": "quote", "arguments": {arguments}}}')
    content, calls = parse_tool_calls(output)
    assert content is None and calls == [ToolCall("quote", arguments)]
    assert format_tool_calls([(c.name, c.arguments) for c in calls]) == output


def _random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.choice(["scalar"] * 3 + (["list", "dict"] if depth < 3 else []))
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "dict":
        return {rng.choice(["a", "b c", "d,e", "f:g", '"q"', "é"]) + str(i): _random_json(rng, depth + 1)
                for i in range(rng.randrange(4))}
    return rng.choice([None, True, False, 0, -7, 2.5, 1e20, "", "x, y", "[1: 2]", "{}", "é\n\u2028"])


def _spaced(value: object, rng: random.Random) -> str:
    """`value` as JSON with random whitespace around every token."""
    ws = lambda: rng.choice(["", " ", "\n\t "])  # noqa: E731
    if isinstance(value, list):
        return f"[{ws()}" + ",".join(ws() + _spaced(v, rng) + ws() for v in value) + "]"
    if isinstance(value, dict):
        return ("{" + ws() + ",".join(f"{ws()}{_spaced(k, rng)}{ws()}:{ws()}{_spaced(v, rng)}{ws()}"
                                      for k, v in value.items()) + "}")
    return json.dumps(value, ensure_ascii=False)


def test_layout_is_json_dumps_spacing_under_any_whitespace():
    """Wherever json.dumps keeps every literal's spelling, json_layout gives exactly its text,
    whatever whitespace the client put between the tokens."""
    rng = random.Random(7)
    for _ in range(300):
        value = _random_json(rng)
        ours = json.dumps(value, separators=(", ", ": "), ensure_ascii=False)
        spaced = _spaced(value, rng)
        assert json.loads(spaced) == value
        assert json_layout(spaced) == ours
    with pytest.raises(ValueError):
        json_layout('{"a": 1,}')


def test_arguments_nested_too_deep_to_read_are_text_not_a_recursion_error():
    """A client's arguments string (or a model's output) nested 5,000 deep: json.loads' RecursionError
    was a 500; it is text that is no JSON, kept verbatim in the prompt and plain content as output."""
    arguments = '{"x": ' + "[" * 5000 + "]" * 5000 + "}"
    text = format_tool_calls([("f", arguments)])
    assert text == _block(f'{{"name": "f", "arguments": {arguments}}}')
    assert parse_tool_calls(text) == (text, [])


def test_format_exact_text_and_verbatim_non_json():
    assert format_tool_calls([("get_weather", '{"city":"Paris"}'), ("f", "not json")]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": not json}\n</tool_call>')


def test_system_prompt_lists_functions_and_shows_the_format():
    text = tools_system_prompt([WEATHER, NOW])
    assert json.dumps(WEATHER, separators=(", ", ": ")) in text.splitlines()
    assert '{"name": "now"}' in text.splitlines()
    example = _block('{"name": "get_weather", "arguments": {"city": "<city>"}}')  # no value to copy
    assert example in text and "tool message" in text
    assert parse_tool_calls(example)[1] == [ToolCall("get_weather", '{"city": "<city>"}')]


@pytest.mark.parametrize("parameters, example", [
    ({"type": "object", "properties": {"n": {"type": ["integer", "null"]}, "s": {"type": ["null", "string"]},
                                       "odd": "not a schema"}, "required": ["n", "s", "odd"]},
     {"n": 1, "s": "<s>", "odd": "<odd>"}),
    ({"type": "object", "properties": ["a"], "required": [["a"]]}, {}),  # shapes no schema has: no 500
    ({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": "a"}, {"a": True}),
])
def test_the_example_call_takes_whatever_the_parameters_say(parameters, example):
    """The system prompt's example call, from the first function's parameters (a nullable
    type, a list where a mapping goes, raised a TypeError there: a 500 for any tool_choice)."""
    text = tools_system_prompt([{"name": "f", "parameters": parameters}])
    assert _block(json.dumps({"name": "f", "arguments": example}, separators=(", ", ": "))) in text


# ---- streaming ---------------------------------------------------------------------------

def _stream(pieces, one_call=False, cut=False, continues=False):
    stream, events = ToolCallStream(one_call, continues), []
    for piece in pieces:
        events += stream.feed(piece)
    events += stream.finish(cut)
    content, calls = "", []
    for e in events:
        if e.content is not None:
            content += e.content
        elif e.name is not None:
            assert e.index == len(calls) and not e.arguments
            calls.append([e.name, ""])
        elif e.unfinished:  # the last call's end: after it, only content
            assert e.index == len(calls) - 1 and not e.arguments and not stream.ok
        else:
            assert e.index == len(calls) - 1 and e.arguments
            calls[-1][1] += e.arguments
    return content, [ToolCall(n, a) for n, a in calls], stream


def _splits(text):
    """Every two-piece split, one char at a time, and seeded random many-piece splits."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("output,content", [
    (" is sunny.", " is sunny."), (" is sunny.\n" + PARIS, " is sunny."), ("\n\n" + PARIS + " done", " done"),
])
def test_a_continued_answer_keeps_its_leading_whitespace_streamed_or_not(output, content):
    """The output continues a prefilled answer (`The weather in Paris` + ` is sunny.`): its
    leading whitespace is the answer's, where a fresh answer's is dropped (it was, found by QA)."""
    calls = [ToolCall("get_weather", '{"city": "Paris"}')] if PARIS in output else []
    assert parse_tool_calls(output, continues=True) == (content, calls)
    assert parse_tool_calls(output) == (content.lstrip(), calls)
    for pieces in list(_splits(output))[::5]:
        got_content, got_calls, _ = _stream(pieces, continues=True)
        assert (got_content, got_calls) == (content, calls), pieces


@pytest.mark.parametrize("output,content,calls", WELL_FORMED)
def test_stream_agrees_with_parse_at_every_split(output, content, calls):
    expected = parse_tool_calls(output)
    for pieces in _splits(output):
        got_content, got_calls, stream = _stream(pieces)
        assert (got_content or None, got_calls) == expected, pieces
        assert stream.ok and stream.num_calls == len(calls)


@pytest.mark.parametrize("output", MALFORMED)
def test_stream_flags_malformed_output(output):
    for pieces in _splits(output):
        assert not _stream(pieces)[2].ok, pieces


@pytest.mark.parametrize("output", [MALFORMED[i] for i in (2, 4, 5, 6, 7, 10)])
def test_stream_marks_a_sent_call_that_goes_wrong_unfinished(output):
    """Its fragments cannot be taken back: the call it began is flagged, so that an API showing
    parts does not show it as a whole call (a Responses item `incomplete`, found by QA)."""
    before, close, after = output.partition(TOOL_CALL_CLOSE)  # its name out before the close tag shows
    stream = ToolCallStream()
    events = stream.feed(before) + stream.feed(close + after) + stream.finish()
    assert len([e for e in events if e.name]) == 1
    assert [e.index for e in events if e.unfinished] == [0] and not stream.ok


@pytest.mark.parametrize("output", [MALFORMED[i] for i in (0, 1, 3, 8, 9)])
def test_stream_passes_an_unsent_malformed_block_through_as_content(output):
    for pieces in _splits(output):
        content, calls, _ = _stream(pieces)
        assert (content, calls) == (output, []), pieces


@pytest.mark.parametrize("one_call", [False, True])
def test_stream_never_disagrees_with_parse_on_mutated_outputs(one_call):
    """Property over seeded random edits of the tables: the stream never raises; it is ok
    with calls exactly when parse finds calls, and then agrees with it, arguments spelt as
    the model wrote them; with `one_call`, both stop at the first call."""
    rng = random.Random(0)
    pieces_of_format = list('<>/{}":, \n\\x') + [TOOL_CALL_OPEN, TOOL_CALL_CLOSE]
    outputs = [o for o, _, _ in WELL_FORMED] + MALFORMED
    for _ in range(3000):
        chars = list(rng.choice(outputs))
        for _ in range(rng.randint(1, 3)):
            at = rng.randint(0, len(chars))
            if rng.random() < 0.4 and at < len(chars):
                del chars[at]
            else:
                chars.insert(at, rng.choice(pieces_of_format))
        text = "".join(chars)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        content, calls, stream = _stream([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], one_call)
        parsed_content, parsed_calls = parse_tool_calls(text, one_call)
        assert len(parsed_calls) <= 1 or not one_call
        assert (stream.ok and stream.num_calls > 0) == bool(parsed_calls), text
        if parsed_calls:
            assert (content or None, calls) == (parsed_content, parsed_calls), text
        elif TOOL_CALL_OPEN not in text:
            assert (content or None) == parsed_content, text


# (output, content): parallel calls not allowed, the output ends at its first call, PARIS's
ONE_CALL = [
    (PARIS + "\n" + SUM, None),
    ("Checking.\n" + PARIS + "\nDone, and more.", "Checking."),
    (PARIS + SUM + SUM, None),
    (PARIS + "\n<tool_call> broken", None),
]


@pytest.mark.parametrize("output,content", ONE_CALL)
def test_one_call_ends_the_output_at_its_first_call_streamed_or_not(output, content):
    call = ToolCall("get_weather", '{"city": "Paris"}')
    assert parse_tool_calls(output, one_call=True) == (content, [call])
    for pieces in _splits(output):
        got_content, got_calls, stream = _stream(pieces, one_call=True)
        assert (got_content or None, got_calls) == (content, [call]), pieces
        assert stream.ok and stream.num_calls == 1


def test_stream_sends_the_name_and_arguments_before_the_close_tag():
    stream = ToolCallStream()
    assert stream.feed("Checking.\n<tool_") == [StreamEvent(content="Checking.")]
    assert stream.feed('call>\n{"name": "get_weather", "arguments": ') == []  # no char after the header yet
    events = stream.feed('{"city": "Pa')
    assert [(e.index, e.name, e.arguments) for e in events] == [(0, "get_weather", ""), (0, None, '{"city": "Pa')]
    assert [e.arguments for e in stream.feed('ris"}')] == ['ris"']  # the last "}" waits
    assert [e.arguments for e in stream.feed("}\n</tool_ca")] == ["}"]  # now the outer "}" waits
    assert stream.feed("ll>") == []
    assert stream.finish() == [] and stream.ok and stream.num_calls == 1


def test_an_output_cut_inside_a_call_keeps_the_calls_before_it_streamed_or_not():
    # max_tokens ends the output inside its second call: the first stands; the second is a
    # call once its JSON is whole, is kept cut (its arguments as far as written, none before
    # they begin) once its name is written, and is dropped before that; the same answer at
    # every split of the stream.
    output = "Checking.\n" + PARIS + "\n" + SUM
    start = output.index(SUM)
    name_end = start + len(TOOL_CALL_OPEN + '\n{"name": "add"')
    header_end = start + len(TOOL_CALL_OPEN + '\n{"name": "add", "arguments": ')
    whole = output.index("}}", start) + 2
    for end in range(start, len(output)):
        text = output[:end]
        content, calls = parse_cut_output(text)
        assert content == "Checking." and calls[0] == ToolCall("get_weather", '{"city": "Paris"}'), text
        if end >= whole:
            assert calls[1:] == [ToolCall("add", '{"a": 1, "b": 2.5}')], text
        elif end >= name_end:
            assert calls[1:] == [ToolCall("add", output[header_end:end].rstrip())], text
        else:
            assert len(calls) == 1, text
        for pieces in list(_splits(text))[::7]:
            got_content, got_calls, stream = _stream(pieces, cut=True)
            assert (got_content or None, got_calls) == (content, calls)
            assert stream.ok and stream.cut == (name_end <= end < whole), pieces
