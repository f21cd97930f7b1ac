"""Constrained decoding: a request's grammar as a mask on the target distribution, and the
tokens it forces as free drafts.

The grammar is part of the target distribution: at every output position the target may
only emit tokens the grammar admits after the output so far. A verify step therefore masks
row i with the matcher state after `draft[:i]`; the matcher consumes only what was
emitted, so a rejected draft leaves no trace. With masks taken from the same states, a
speculative step computes exactly what plain decoding would.

Built on llguidance (the grammar engine llama.cpp uses): no dependencies, a ~3 MB wheel,
masks in tens of microseconds on CPU, `validate_tokens` to cut a draft at its first
forbidden token, `rollback`, and `compute_ff_tokens` for the forced continuation
(benchmarks/grammar_libs.py compares it with xgrammar).
"""

from __future__ import annotations

import json
import re
from typing import Iterable, Iterator, Sequence

import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher
from llguidance.numpy import fill_next_token_bitmask
from torch import Tensor

from replicas.engine import JSON_LAYOUT, GrammarSpec, RequestError
from replicas.speculation.schema_depth import too_deep

# mask_ writes forbidden tokens by index where fewer than 1 in this many mask words forbid one
SPARSE_MASK_WORDS = 8
_JSON_RULE = re.compile(r"%json\s*")


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for a spec; RequestError naming `spec.param` if it is malformed,
    or holds a schema llguidance must not be given (`too_deep`)."""
    if spec.kind == "lark":
        for schema in _json_schemas(spec.text):
            if (reason := too_deep(schema)) is not None:
                raise RequestError(spec.param, f"a JSON schema in the grammar is {reason}")
        return LLMatcher.grammar_from_lark(spec.text)
    schema = spec.schema()  # (a RequestError naming the field itself)
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except ValueError as exc:
        raise RequestError(spec.param, f"the JSON schema was refused: {exc}") from None


def _json_schemas(lark: str) -> Iterator[object]:
    """The JSON schemas a Lark grammar holds (`%json {...}`: how tool calls' arguments are
    held) that read as JSON; llguidance refuses the others itself."""
    decoder = json.JSONDecoder()
    for found in _JSON_RULE.finditer(lark):
        try:
            yield decoder.raw_decode(lark, found.end())[0]
        except (ValueError, RecursionError):
            continue


class GrammarCompiler:
    """One per engine: the tokenizer as the grammar engine sees it (about 1 s to build)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self._eos_ids = set(eos_ids)
        self._hf_tokenizer = hf_tokenizer
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                       eos_token=sorted(self._eos_ids))

    def compile(self, spec: GrammarSpec) -> Constraint:
        """A fresh matcher for one request; RequestError naming `spec.param` if the grammar is bad."""
        matcher = LLMatcher(self._tokenizer, grammar_text(spec), log_level=0)  # a rejected draft is no warning
        if matcher.is_error():
            raise RequestError(spec.param, f"the grammar is invalid: {_reason(matcher)}")
        matcher.compute_bitmask()  # a grammar that admits no output (a schema that is only a
        if matcher.is_error():     # reference to itself) fails here, not at its build: "" came out
            raise RequestError(spec.param, f"the grammar admits no output at all ({_reason(matcher)})")
        # the prefix as text, a special token's text included (as the prompt holds it: deploy/prompts.py)
        prefix = self._hf_tokenizer.encode(spec.prefix, add_special_tokens=False, split_special_tokens=True) \
            if spec.prefix else []
        for token in prefix:
            if matcher.is_stopped() or not matcher.consume_token(token):  # stopped: text past a whole output
                layout = (" (JSON written with ', ' and ': ', no other whitespace, and no \\u or \\/ escapes)"
                          if spec.kind != "lark" or "%json" in spec.text else "")
                raise RequestError(spec.param, f"the prefilled answer {spec.prefix!r} does not begin an output "
                                               f"this format admits{layout}")
        self._first_step(matcher, spec.param)
        return Constraint(matcher, self.vocab_size, spec.param)

    def _first_step(self, matcher, param: str) -> None:
        """Take the output's first admitted token (the lowest id but EOS) and step back: a
        grammar past the engine's limits at its start fails there, as a 400 before the answer
        starts rather than a failure in its first step (a schema with no finite instance,
        `{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}`, forces
        `{"a": ` without end; an object of 1,000 optional properties fills a parser row). One
        that meets a limit only down another path fails when the answer takes it."""
        if matcher.is_stopped():
            return
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        token = next((int(t) for t in np.flatnonzero(bits[: self.vocab_size]) if t not in self._eos_ids), None)
        if matcher.is_error() or token is not None and not matcher.consume_token(token):
            raise RequestError(param, f"the grammar engine cannot follow this format ({_reason(matcher)})")
        if token is not None:
            matcher.rollback(1)


def _reason(matcher) -> str:
    """llguidance's error without the parser state it dumps after its first line."""
    return (matcher.get_error().splitlines() or [""])[0]


class Constraint:
    """One request's grammar state, advanced by the tokens it emits."""

    def __init__(self, matcher, vocab_size: int, param: str | None = None) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._param = param  # the request's field that gave the grammar
        self._num_words = (vocab_size + 31) // 32  # 32 tokens per mask word

    def valid_prefix(self, draft: Sequence[int]) -> list[int]:
        """The longest prefix of a draft the grammar admits: the target could never emit a
        forbidden token, so verifying past it would only cost rows."""
        if not draft:
            return []
        return list(draft[: self._matcher.validate_tokens(list(draft))])

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next (possibly none): a draft that costs nothing."""
        return self._matcher.compute_ff_tokens()

    def allowed(self, draft: Sequence[int]) -> Tensor:
        """`[K+1, V]` bool: row i holds the tokens admitted after `draft[:i]` (a valid draft)."""
        return torch.from_numpy(self._bits(self._words(draft)).view(np.bool_))

    def mask_(self, logits: Tensor, draft: Sequence[int]) -> Tensor:
        """Mask `logits [K+1, V]` in place: forbidden tokens get -inf. Where the rows admit
        nearly everything (free text under an optional grammar: only special tokens are
        forbidden), the few forbidden tokens are written by index; otherwise the whole mask
        goes, on the CPU, through numpy (a tenth of torch's masked_fill over a 49k vocabulary)."""
        words = self._words(draft)
        partial = words != -1  # the words that forbid a token
        if np.count_nonzero(partial) * SPARSE_MASK_WORDS < partial.size:
            rows, cols = np.nonzero(partial)
            bits = np.unpackbits(words[rows, cols].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
            at, bit = np.nonzero(bits == 0)
            rows, tokens = rows[at], cols[at] * 32 + bit
            inside = tokens < self._vocab_size  # the last word's bits past the vocabulary
            rows, tokens = rows[inside], tokens[inside]
            if logits.device.type == "cpu":
                logits.numpy()[rows, tokens] = -np.inf
            else:
                logits[torch.from_numpy(rows).to(logits.device), torch.from_numpy(tokens).to(logits.device)] = -np.inf
            return logits
        forbidden = self._bits(words) == 0
        if logits.device.type == "cpu":
            np.putmask(logits.numpy(), forbidden, np.float32(-np.inf))
            return logits
        return logits.masked_fill_(torch.from_numpy(forbidden).to(logits.device), float("-inf"))

    def _words(self, draft: Sequence[int]) -> np.ndarray:
        """`[K+1, ceil(V / 32)]` int32: row i the matcher's bitmask after `draft[:i]` (bit j of
        word w admits token 32 w + j); the matcher ends where it began."""
        words = np.empty((len(draft) + 1, self._num_words), dtype=np.int32)
        consumed = 0
        try:
            for i in range(len(draft) + 1):
                fill_next_token_bitmask(self._matcher, words, i)
                if i < len(draft):
                    # EOS after a complete grammar is admitted but not recorded: not rolled back
                    stopped = self._matcher.is_stopped()
                    if not self._matcher.consume_token(int(draft[i])):
                        if self._matcher.is_error():  # admitted (`valid_prefix`), past the parser's limits
                            raise self._gave_up(draft[i])
                        raise ValueError(f"draft token {draft[i]} is not admitted by the grammar")
                    consumed += not stopped
        finally:
            self._matcher.rollback(consumed)
        return words

    def _bits(self, words: np.ndarray) -> np.ndarray:
        """The `[K+1, V]` uint8 0/1 rows of `allowed` from `_words`."""
        return np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, : self._vocab_size]

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume emitted tokens (each was sampled from a masked row, so each is admitted).

        A complete grammar stops the matcher; the only token it then admits is EOS, which
        ends the request, so it is not consumed."""
        for token in tokens:
            if self._matcher.is_stopped():
                return
            if not self._matcher.consume_token(int(token)):  # past its limits (admitted tokens all)
                raise self._gave_up(token)

    def _gave_up(self, token: int) -> RequestError:
        return RequestError(self._param, f"the grammar engine gave up on this format at output token {token} "
                                         f"({_reason(self._matcher)})")
