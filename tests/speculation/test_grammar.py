"""The grammar as a mask: row i of a verify step is what plain decoding would mask after draft[:i],
and the matcher is left exactly where the emitted tokens put it. The oracle is a fresh matcher
fed the same prefix one token at a time."""

from __future__ import annotations

import json

import pytest
import torch

from replicas.engine import GrammarSpec, RequestError
from replicas.speculation import grammar as grammar_module
from replicas.speculation.grammar import GrammarCompiler
from replicas.speculation.sampling import token_logprobs
from tests.speculation.test_schema_depth import chain

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
DOCUMENT = '{"city": "Paris", "days": 3}'
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from replicas.torch_engine.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [EOS])


def spec() -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(SCHEMA))


def oracle_rows(compiler, prefix, draft):
    """Masks from fresh constraints, each fed prefix + draft[:i] token by token."""
    rows = []
    for i in range(len(draft) + 1):
        fresh = compiler.compile(spec())
        for token in prefix + draft[:i]:
            fresh.advance([token])
        rows.append(fresh.allowed([])[0])
    return torch.stack(rows)


@pytest.mark.parametrize("split", [0, 1, 4, 9])
def test_verify_rows_equal_step_by_step_masks_and_leave_no_trace(compiler, tokenizer, split):
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    prefix, draft = ids[:split], ids[split:]
    constraint = compiler.compile(spec())
    constraint.advance(prefix)
    assert torch.equal(constraint.allowed(draft), oracle_rows(compiler, prefix, draft))
    # rolled back: the next mask is still the one after the prefix
    assert torch.equal(constraint.allowed([])[0], oracle_rows(compiler, prefix, [])[0])


@pytest.mark.parametrize("grammar, text", [
    (spec(), DOCUMENT),  # a complete schema stops the matcher: EOS is admitted, not recorded
    (GrammarSpec("lark", 'start: "ab" ("," "ab")*'), "ab,ab"),  # accepting, could go on: EOS ends it
])
def test_a_draft_running_into_eos_leaves_no_trace(compiler, tokenizer, grammar, text):
    """The SA copies an earlier answer up to its end of turn: the draft ends in EOS."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    for split in range(len(ids)):
        constraint = compiler.compile(grammar)
        constraint.advance(ids[:split])
        draft = ids[split:] + [EOS]
        assert constraint.valid_prefix(draft) == draft
        rows = constraint.allowed(draft)
        assert rows[-2][EOS]
        fresh = compiler.compile(grammar)
        fresh.advance(ids[:split])
        assert torch.equal(constraint.allowed([])[0], fresh.allowed([])[0])  # rolled back exactly
        constraint.advance(draft[:1])  # and it still takes what plain decoding emits next


def test_the_mask_admits_each_next_token_of_a_valid_document(compiler, tokenizer):
    """Mask and matcher read the tokenizer alike. A tokenizer converted by transformers 5.17
    (a ByteFallback decoder chain) broke this: after `":` the mask offered only ':', which the
    matcher then refused."""
    constraint = compiler.compile(spec())
    for token in tokenizer.encode(DOCUMENT, add_special_tokens=False):
        assert constraint.allowed([])[0][token], repr(tokenizer.decode([token]))
        constraint.advance([token])


def test_valid_prefix_cuts_at_the_first_forbidden_token(compiler, tokenizer):
    good = tokenizer.encode('{"city": "Rome"', add_special_tokens=False)
    bad = tokenizer.encode(', "weeks"', add_special_tokens=False)
    constraint = compiler.compile(spec())
    cut = constraint.valid_prefix(good + bad)
    assert cut[: len(good)] == good and len(cut) < len(good + bad)
    assert constraint.valid_prefix([]) == []
    assert constraint.valid_prefix(tokenizer.encode("hello", add_special_tokens=False)) == []


def test_forced_tokens_spell_the_fixed_start(compiler, tokenizer):
    forced = compiler.compile(spec()).forced_tokens()
    assert tokenizer.decode(forced).startswith('{"city":')


def test_complete_output_admits_only_eos_and_stops(compiler, tokenizer):
    constraint = compiler.compile(spec())
    constraint.advance(tokenizer.encode(DOCUMENT, add_special_tokens=False))
    allowed = constraint.allowed([])[0]
    assert allowed.nonzero().flatten().tolist() == [EOS]
    constraint.advance([EOS])  # the request ends here; nothing left to consume, no error


def test_masked_rows_give_forbidden_tokens_no_probability(compiler, tokenizer):
    constraint = compiler.compile(spec())
    logits = torch.randn(1, len(tokenizer), generator=torch.Generator().manual_seed(0))
    constraint.mask_(logits, [])
    allowed = constraint.allowed([])[0]
    assert torch.isinf(logits[0, ~allowed]).all() and torch.isfinite(logits[0, allowed]).all()
    (entry,) = token_logprobs(logits, [int(logits.argmax())], num_top=20)
    assert all(allowed[token_id] for token_id, _ in entry.top)  # forbidden tokens are never listed


@pytest.mark.parametrize("grammar, text", [
    (GrammarSpec("json_schema", json.dumps(SCHEMA)), DOCUMENT),  # most tokens forbidden
    (GrammarSpec("lark", "start: /(.|\\n)*/"), "Free text, where only special tokens are forbidden."),
], ids=["json", "free-text"])
def test_forbidden_tokens_written_by_index_or_through_the_whole_mask_alike(compiler, tokenizer, monkeypatch,
                                                                          grammar, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    constraint = compiler.compile(grammar)
    constraint.advance(ids[:2])
    logits = torch.randn(len(ids) - 1, len(tokenizer), generator=torch.Generator().manual_seed(1))
    masked = {}
    for sparse_words in (0, 1 << 30):  # every row by index; every row through the mask
        monkeypatch.setattr(grammar_module, "SPARSE_MASK_WORDS", sparse_words)
        masked[sparse_words] = constraint.mask_(logits.clone(), ids[2:])
    assert torch.equal(masked[0], masked[1 << 30])
    assert torch.equal(torch.isfinite(masked[0]), constraint.allowed(ids[2:]))


def test_logprobs_of_a_row_do_not_depend_on_the_other_rows():
    logits = torch.randn(9, 1000, generator=torch.Generator().manual_seed(1))
    tokens = logits.argmax(dim=-1).tolist()
    together = token_logprobs(logits, tokens, num_top=5)
    alone = [token_logprobs(logits[i : i + 1], [tokens[i]], num_top=5)[0] for i in range(9)]
    assert together == alone


def test_a_tokens_rank_counts_the_tokens_strictly_likelier():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, float("-inf")], [3.0, 1.0, 2.0, 0.0, 1.0]])
    entries = token_logprobs(logits, [1, 4], num_top=2)
    assert [e.rank for e in entries] == [1, 3]  # a tie shares the rank; -inf never ranks above
    assert [i for i, _ in entries[1].top] == [0, 2]
    ranks = [token_logprobs(logits[1:], [t], num_top=0)[0].rank for t in range(5)]
    assert ranks == [1, 3, 2, 5, 3]


@pytest.mark.parametrize("bad, message", [
    (GrammarSpec("json_schema", "{"), "not valid JSON"),
    (GrammarSpec("json_schema", "[1, 2]"), "must be an object"),
    (GrammarSpec("json_schema", json.dumps({"type": "nonsense"})), "invalid"),
    (GrammarSpec("lark", "start: missing", param="tool_choice"), "invalid"),
    # flat JSON, but llguidance recursed through 2,000 $refs on the native stack: a segfault
    (GrammarSpec("json_schema", json.dumps(chain(2000))), "nested too deep"),
    (GrammarSpec("json_schema", '{"items": ' + "[" * 5000 + "]" * 5000 + "}"), "nested too deep"),  # RecursionError
    # a tool's schema, in the grammar of its calls (the replica compiles it under tool_choice auto)
    (GrammarSpec("lark", f"start: %json {json.dumps(chain(2000))}", "tools", optional=True), "nested too deep"),
])
def test_bad_grammars_raise_request_errors_naming_the_field(compiler, bad, message):
    with pytest.raises(RequestError, match=message) as info:
        compiler.compile(bad)
    assert info.value.param == bad.param
    assert str(info.value).count(f"{bad.param}:") == 1  # named once (a schema too deep was twice)


_SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
_OPTIONAL_1000 = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)},
                  "additionalProperties": False}


@pytest.mark.parametrize("schema", [
    _SELF,  # no finite instance: `{"a": ` forced without end
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    _OPTIONAL_1000,  # valid, and finite, but a parser row over llguidance's limit
    {"type": "object", "properties": {"x": _OPTIONAL_1000}, "required": ["x"]},
])
def test_a_grammar_past_the_engines_limits_is_refused_before_its_first_token(compiler, schema):
    """These compiled, and the request failed in its first step: a 500 carrying llguidance's
    whole parser state and grammar."""
    with pytest.raises(RequestError, match="the grammar engine cannot follow this format") as info:
        compiler.compile(GrammarSpec("json_schema", json.dumps(schema), "text.format"))
    assert info.value.param == "text.format" and "\n" not in str(info.value)


def test_a_grammar_that_fails_later_names_the_field_and_leaves_no_parser_dump(compiler, tokenizer):
    """Where the limit is met only on the way (this schema's second branch), advancing raises the
    request's error: the engine fails the request as a 400 naming the field."""
    either = {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"x": _OPTIONAL_1000}}]}
    constraint = compiler.compile(GrammarSpec("json_schema", json.dumps(either), "response_format"))
    with pytest.raises(RequestError, match="gave up on this format") as info:
        constraint.advance(tokenizer.encode('{"x": {"p', add_special_tokens=False))
    assert info.value.param == "response_format" and "\n" not in str(info.value)
