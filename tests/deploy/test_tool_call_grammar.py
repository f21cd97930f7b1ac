"""The llguidance grammar of the `<tool_call>` format (`tool_call_grammar`): it admits exactly
the format, holds a call begun under `auto` to it, forces the fixed prefix; and the schemas
given to it (`schema_error`)."""

from __future__ import annotations

import json

import pytest

from deploy.tool_calls import format_tool_calls, schema_error, tag_token_ids, tool_call_grammar, tools_system_prompt
from tests.deploy.test_tool_calls import ADD, NOW, PARIS, SUM, WEATHER, _block
from tests.speculation.test_schema_depth import chain


def _tokenizer_and_matcher(added: list[str]):
    """The default tokenizer (with `added` tokens, not special) and a matcher of a grammar over it."""
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf
    transformers = pytest.importorskip("transformers")
    from replicas.torch_engine.loader import resolve_model_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir())
    tokenizer.add_tokens(added)
    llt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[2])

    def matcher(grammar):
        is_error, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(grammar), llt)
        assert not is_error and not warnings, warnings
        return llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    return tokenizer, matcher


@pytest.fixture(scope="module")
def lark():
    return _tokenizer_and_matcher([])


def _accepts(lark, grammar, text):
    tokenizer, matcher = lark
    m = matcher(grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


@pytest.mark.parametrize("functions,text,parallel,accepted", [
    ([WEATHER], PARIS, False, True),
    ([WEATHER], _block('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'), False, True),
    ([WEATHER, ADD, NOW], SUM, False, True),
    ([WEATHER, ADD, NOW], _block('{"name": "now", "arguments": {}}'), False, True),
    ([WEATHER, ADD, NOW], _block('{"name": "now", "arguments": {"any": [1, 2]}}'), False, False),  # takes none
    ([{"name": "any", "parameters": {}}], _block('{"name": "any", "arguments": {"x": 1}}'), False, True),  # any value
    ([WEATHER, ADD], format_tool_calls([("add", '{"a": -3, "b": 0.5}')]), False, True),
    ([WEATHER, {"name": 'say "hé"'}], _block('{"name": "say \\"hé\\"", "arguments": {}}'), False, True),
    ([WEATHER, ADD], _block('{"name": "get_time", "arguments": {"city": "Paris"}}'), False, False),  # unknown
    ([WEATHER, ADD], _block('{"name": "add", "arguments": {"a": 1}}'), False, False),  # missing "b"
    ([WEATHER], _block('{"name": "get_weather", "arguments": {}}'), False, False),  # missing "city"
    ([WEATHER], _block('{"name": "get_weather", "arguments": {"city":"Paris"}}'), False, False),  # spacing
    ([WEATHER], "Sure. " + PARIS, False, False),
    ([WEATHER, ADD], PARIS + "\n" + SUM, False, False),
    ([WEATHER, ADD], PARIS + "\n" + SUM, True, True),
    ([WEATHER, ADD], PARIS + "\n" + SUM + "\n" + PARIS, True, True),
    ([WEATHER, ADD], PARIS + "\n\n" + SUM, True, False),
    ([WEATHER, ADD], PARIS + SUM, True, False),
])
def test_grammar_admits_exactly_the_format(lark, functions, text, parallel, accepted):
    assert _accepts(lark, tool_call_grammar(functions, parallel), text) is accepted


IN_A_STRING = _block('{"name": "get_weather", "arguments": {"city": "a </tool_call> b"}}')


@pytest.mark.parametrize("text,one_call,parallel", [
    ("No call: the weather is fine. {\"a\": 1} <tool_ and <tool call> are text.", True, True),
    ("Let me check.\n" + PARIS, True, True),
    (IN_A_STRING, True, True),  # a close tag in an argument's string ends nothing
    ("Sure " + PARIS + "\n" + SUM, False, True),
    ("Sure " + PARIS + " and then " + SUM + " done.", False, True),  # text between and after calls
    ("Let me check.\n<tool_call>\nParis?", False, False),  # once the tag is written: a call
    (_block('{"name": "get_weather", "arguments": {}}'), False, False),  # missing "city"
    (_block('{"name": "get_time", "arguments": {"city": "Paris"}}'), False, False),  # unknown
    (PARIS + " with words after", False, True),
])
def test_an_optional_grammar_admits_any_text_and_holds_a_call_begun_to_the_format(lark, text, one_call, parallel):
    """tool_choice auto: the model may answer in text, but a call it makes is a valid call; one
    call ends the answer."""
    for allow_parallel, accepted in ((False, one_call), (True, parallel)):
        grammar = tool_call_grammar([WEATHER, ADD], allow_parallel, optional=True)
        assert _accepts(lark, grammar, text) is accepted, (allow_parallel, text)


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}


@pytest.mark.parametrize("text,one_call,parallel", [
    ('{"city": "Oslo"}', True, True),  # the answer, in the format
    (PARIS, True, True),
    (PARIS + "\n" + SUM, False, True),
    ('{"town": "Oslo"}', False, False),  # not the format
    ('{"city":"Oslo"}', False, False),  # nor its layout
    ("Oslo", False, False),  # no free text
    ("Sure " + PARIS, False, False),
    ('{"city": "Oslo"}' + PARIS, False, False),  # the answer, or calls
])
def test_under_a_format_auto_admits_the_answer_in_it_or_calls(lark, text, one_call, parallel):
    """tool_choice auto with a response format (an agent with tools and an output type): the
    model answers in the format or calls; the format alone once left it no call to make."""
    for allow_parallel, accepted in ((False, one_call), (True, parallel)):
        grammar = tool_call_grammar([WEATHER, ADD], allow_parallel, answer=CITY)
        assert _accepts(lark, grammar, text) is accepted, (allow_parallel, text)


@pytest.mark.parametrize("functions,at_least", [
    ([WEATHER], '<tool_call>\n{"name": "get_weather", "arguments":'),
    ([NOW], '<tool_call>\n{"name": "now", "arguments":'),
    ([WEATHER, ADD], '<tool_call>\n{"name": "'),
])
def test_grammar_forces_the_fixed_prefix(lark, functions, at_least):
    """Forced tokens stop a few bytes short of the forced text where the next token could
    still be one of several spellings (`": "` vs `": {"`); what they cover is fixed."""
    tokenizer, matcher = lark
    text = tokenizer.decode(matcher(tool_call_grammar(functions, parallel=False)).compute_ff_tokens())
    assert text.startswith(at_least)
    call = format_tool_calls([(functions[0]["name"], '{"city": "Paris"}' if functions[0] is WEATHER else "{}")])
    assert call.startswith(text)


def test_local_refs_of_parameters_resolve_in_them(lark):
    place = {"name": "place", "parameters": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}, "near": {"$ref": "#/$defs/Loc"}},
                          "required": ["city"], "additionalProperties": False}}}}
    good = _block('{"name": "place", "arguments": {"loc": {"city": "A", "near": {"city": "B"}}}}')
    for functions in ([place], [WEATHER, place]):
        grammar = tool_call_grammar(functions, parallel=False)
        assert _accepts(lark, grammar, good)
        assert not _accepts(lark, grammar, good.replace('"city": "B"', '"town": "B"'))


def test_a_schema_nested_too_deep_through_references_is_refused_unseen_by_the_grammar_engine():
    """Flat JSON, but llguidance recursed through the 2,000 $refs on the native stack and the
    ingress died checking a forced call's schema (a segfault)."""
    assert "nested too deep" in schema_error(chain(2000))


@pytest.mark.parametrize("parameters,good,bad", [
    ({"type": "object", "$defs": {"A": {"$anchor": "three", "enum": [3]}}, "properties": {"v": {"$ref": "#three"}},
      "required": ["v"], "additionalProperties": False}, {"v": 3}, {"v": 4}),
    ({"type": "object", "properties": {"x": {
        "$id": "https://example.com/inner", "type": "object", "$defs": {"B": {"enum": ["q"]}},
        "properties": {"y": {"$ref": "#/$defs/B"}}, "required": ["y"], "additionalProperties": False}},
      "required": ["x"], "additionalProperties": False}, {"x": {"y": "q"}}, {"x": {"y": "r"}}),
    ({"$id": "urn:example:n", "$ref": "#/$defs/N", "$defs": {"N": {
        "type": "object", "properties": {"kid": {"$ref": "#/$defs/N"}, "n": {"type": "integer"}},
        "required": ["n"], "additionalProperties": False}}}, {"kid": {"n": 2}, "n": 1}, {"kid": {"m": 2}, "n": 1}),
])
def test_parameters_with_anchors_and_ids_of_their_own_hold_calls_as_a_format_would(lark, parameters, good, bad):
    """An anchor ref ("#three") and the refs under a nested "$id" were rebased onto the call
    object as if JSON pointers into it, and a forced call's grammar failed to compile; and
    two functions' anchors or ids, in one document, were one another's."""
    fn = {"name": "f", "parameters": parameters}
    twin = {"name": "g", "parameters": json.loads(json.dumps(parameters).replace("3", "5").replace('"q"', '"r"'))}
    assert schema_error(parameters) is None
    for functions in ([fn], [WEATHER, fn], [twin, fn], [fn, twin]):
        grammar = tool_call_grammar(functions, parallel=False)
        assert _accepts(lark, grammar, _block(json.dumps({"name": "f", "arguments": good})))
        assert not _accepts(lark, grammar, _block(json.dumps({"name": "f", "arguments": bad})))


@pytest.fixture(scope="module")
def tagged():
    """The default tokenizer with the tags as added tokens of their own (Qwen2.5's, Hermes')."""
    return _tokenizer_and_matcher(["<tool_call>", "</tool_call>"])


def test_tags_that_are_tokens_of_their_own_are_named_by_id(lark, tagged):
    """llguidance takes an added token for a special one, which a quoted tag never matches: a
    Qwen2.5's forced call was a 400 (the forced tag token refused) and its calls under auto
    were masked (QA). Named by id, each grammar holds the call as with the tags as text."""
    tokenizer, matcher = tagged
    ids = tag_token_ids(tokenizer)
    assert ids == (49152, 49153) and tag_token_ids(lark[0]) == (None, None)  # the default's: text
    forced = matcher(tool_call_grammar([WEATHER], parallel=False, tag_ids=ids))
    assert forced.compute_ff_tokens()[0] == 49152
    call = tokenizer.encode(PARIS, add_special_tokens=False)
    assert 49152 in call and 49153 in call
    assert not matcher(tool_call_grammar([WEATHER], parallel=False)).consume_tokens(call[:1])  # quoted: refused
    cases = [(tool_call_grammar([WEATHER], False, tag_ids=ids), PARIS, True),
             (tool_call_grammar([WEATHER], False, tag_ids=ids), _block('{"name": "get_weather", "arguments": {}}'),
              False),
             (tool_call_grammar([WEATHER, ADD], True, tag_ids=ids), PARIS + "\n" + SUM, True),
             (tool_call_grammar([WEATHER, ADD], False, optional=True, tag_ids=ids), "Let me see. " + PARIS, True),
             (tool_call_grammar([WEATHER, ADD], False, optional=True, tag_ids=ids), "No call, just text.", True),
             (tool_call_grammar([WEATHER, ADD], False, optional=True, tag_ids=ids), PARIS + " more", False),
             (tool_call_grammar([WEATHER, ADD], True, optional=True, tag_ids=ids), "a " + PARIS + " b " + SUM + " c",
              True),
             (tool_call_grammar([WEATHER, ADD], True, optional=True, tag_ids=ids),
              "a " + _block('{"name": "add", "arguments": {"a": 1}}'), False),
             (tool_call_grammar([WEATHER, ADD], False, answer=CITY, tag_ids=ids), SUM, True)]
    for grammar, text, accepted in cases:
        assert _accepts(tagged, grammar, text) is accepted, text
    # The open tag spelled out in pieces of text is no call, and the text before a call cannot
    # hold it: the answer's parser reads tags from text and took it for a call the grammar
    # never held (an unoffered function, unchecked arguments: QA).
    spelled = [t for piece in ("<", "tool", "_call", ">") for t in tokenizer.encode(piece, add_special_tokens=False)]
    assert 49152 not in spelled and tokenizer.decode(spelled) == "<tool_call>"
    for parallel in (False, True):
        m = matcher(tool_call_grammar([WEATHER], parallel, optional=True, tag_ids=ids))
        prefix = tokenizer.encode("Sure " + (PARIS + " and " if parallel else ""), add_special_tokens=False)
        assert m.consume_tokens(prefix + spelled[:-1]) and m.validate_tokens(spelled[-1:]) == 0


def test_tags_a_tokenizer_marks_special_are_refused():
    """Its output's text leaves them out (skip_special_tokens): a forced call came back as
    plain text with no tool_calls (QA)."""
    transformers = pytest.importorskip("transformers")
    from replicas.torch_engine.loader import resolve_model_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir())
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=True)
    with pytest.raises(ValueError, match="marks <tool_call> a special token, which the output's text leaves out"):
        tag_token_ids(tokenizer)


def test_no_functions_is_an_error():
    with pytest.raises(ValueError):
        tool_call_grammar([], parallel=False)
    with pytest.raises(ValueError):
        tools_system_prompt([])
