"""One request inside the embedded engine: its tokens, cache slot, sampling state, output.

Text is produced here, incrementally: the output's token ids are decoded and the new suffix
is released, holding back an incomplete UTF-8 character and any tail that could still
grow into a stop string, so a stop string spanning token boundaries is never streamed.
Where the tokenizer allows it (`Detokenizer.joins`), only the tokens after the last settled
point are decoded again, so a long output costs the same per step as a short one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Optional

from replicas.engine import (
    FinishReason, GenerationDelta, RequestSpeculation, SamplingParams, TokenLogprob, find_stop, stop_prefix_end,
)
from replicas.speculation.draft_length import MtpYield, SaAcceptance
from replicas.stats import SpecCounters
from replicas.token_bytes import TokenBytes, ends_inside_character, token_bytes

if TYPE_CHECKING:
    from torch import Tensor

    from replicas.speculation.grammar import Constraint
    from replicas.torch_engine.prefix_cache import Block


@dataclass
class Sequence:
    request_id: str
    sa_id: int  # int64 id of this request in the suffix automaton pool
    prompt_ids: list[int]
    sampling: SamplingParams
    speculation: RequestSpeculation  # narrows the server's setting, re-read every step
    seed: int | None  # keys the sampling stream by output position; None when greedy
    eos_ids: frozenset[int]
    constraint: Constraint | None = None  # the request's grammar state, None if unconstrained
    over_gate: bool = False  # drafts as behind a closed gate, whatever the batch (GenerationRequest.over_gate)
    probe: bool = False  # a health probe: not in the prefix-cache figures nor kept there (GenerationRequest.probe)
    cache_salt: str = ""  # the prefix-cache blocks it shares: those of its salt (GenerationRequest.cache_salt)
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions whose KV is in the cache
    prefilling: bool = False  # admitted, its context not all in the cache yet (no token out)
    cached_tokens: int = 0  # of the prompt, positions whose KV came from the prefix cache (when first admitted)
    admitted: bool = False  # its prompt counted: a readmission (preempted) is not counted again
    prefix_blocks: list[Block] = field(default_factory=list)  # prefix-cache blocks held (PrefixCache)
    prefix_hidden: list[Tensor] = field(default_factory=list)  # hidden rows past them, not yet stored
    prefix_offered: int = 0  # whole blocks of the context offered to the cache so far
    sa_prefix: list[int] = field(default_factory=list)  # its automaton reads it before the prompt (a prediction)
    sa_match_len: int = 0  # from the last SA extend
    sa_draft: list[int] = field(default_factory=list)
    sa_acceptance: SaAcceptance = field(default_factory=SaAcceptance)  # its SA drafts', drafted or not
    shadow_draft: list[int] = field(default_factory=list)  # an SA draft held behind a closed gate (step_drafts)
    shadow_matched: int = 0  # of its tokens, those the request has emitted since
    mtp_fed: bool = False  # the MTP head sees its positions (its mode could draft with MTP when admitted)
    mtp_backoff: int = 0  # steps the last unfruitful MTP proposal set aside (hybrid.next_mtp_backoff)
    mtp_skip: int = 0  # of those, steps still to go without MTP
    mtp_probe_gap: int = 0  # steps a failed probe of the head sets aside (DraftPolicy.ask_mtp); 0: not probing
    mtp_yield: MtpYield = field(default_factory=MtpYield)  # what its asks of the head drafted and had accepted
    counters: SpecCounters = field(default_factory=SpecCounters)
    finish_reason: FinishReason | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did
    error: str | None = None
    error_param: str | None = None  # the request's field at fault, where its own input failed it
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked for; none for a final stop id
    resumed_tokens: int = 0  # output tokens a Resume brought (sent before, by another replica: no logprobs here)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked for, until sent
    # text streaming state
    text: str = ""  # decoded output, stop strings cut once finished
    settled_tokens: int = 0  # output tokens whose text is settled_text (Detokenizer.joins)
    settled_text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0

    @property
    def last_token(self) -> int:
        """The newest emitted token: sampled but not yet run through the model."""
        return self.output_ids[-1]

    @property
    def context(self) -> list[int]:
        """What (re)admission puts in the KV cache: the prompt and, for a resumed or preempted
        request, its output but the last token (that one goes in as its next step's input)."""
        return self.prompt_ids + self.output_ids[:-1]

    @property
    def tokens_left(self) -> int:
        return self.sampling.max_tokens - len(self.output_ids)

    def append(self, tokens: list[int]) -> None:
        """Append emitted tokens, stopping at EOS / stop ids / max_tokens (sets finish_reason)."""
        for token in tokens:
            if self.finish_reason is not None:
                return
            self.output_ids.append(token)
            if self.is_visible_stop(token):
                self.finish_reason = "stop"
            elif self.tokens_left <= 0:
                self.finish_reason = "length"

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        """The tokens that end the output (without being part of its text): stop ids and EOS."""
        return frozenset(self.sampling.stop_token_ids) | (frozenset() if self.sampling.ignore_eos else self.eos_ids)

    def is_visible_stop(self, token: int) -> bool:
        """EOS and stop ids end the output without being part of its text."""
        return token in self.stop_ids


SETTLE_TOKENS = 16  # decoded again at most ~2x this many tokens per step (Detokenizer.joins)


@dataclass(frozen=True)
class Detokenizer:
    """Token ids -> text (`decode`), and whether a split decodes to its parts' texts joined
    (`joins`): decode(a + b) == decode(a) + decode(b) whenever decode(a) ends on a whole
    character, i.e. not in U+FFFD. True of a byte-level decoder that does no space clean-up
    (its text is the UTF-8 of the kept tokens' bytes, joined); not of SentencePiece-style
    decoders, which drop the first token's leading space. `raw`: a token's bytes, where the
    tokenizer tells them (byte-level BPE)."""

    decode: Callable[[list[int]], str]
    joins: bool = False
    raw: Optional[TokenBytes] = None

    @classmethod
    def for_tokenizer(cls, tokenizer) -> Detokenizer:
        from tokenizers.decoders import ByteLevel

        backend = getattr(tokenizer, "backend_tokenizer", None)
        joins = (backend is not None and isinstance(backend.decoder, ByteLevel)
                 and not getattr(tokenizer, "clean_up_tokenization_spaces", True))
        return cls(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), joins, token_bytes(tokenizer))

    def whole_characters(self, text: str, ids: list[int], final: bool) -> str:
        """What a stop string may match in the text of output `ids`, and what may be sent: until
        the output ends (`final`), not the U+FFFD of a character still incomplete ("\ufffd"
        as a stop string fired on an emoji's first byte). Which one that is the tokens' bytes
        tell, where the tokenizer gives them (a U+FFFD the model wrote whole stays); else every
        trailing U+FFFD is taken for one."""
        if final or not text.endswith("\ufffd"):
            return text
        if self.raw is None:
            return text.rstrip("\ufffd")
        return text[:-1] if ends_inside_character(self.raw, ids) else text


def _stop_at_first_token(seq: Sequence, detokenizer: Detokenizer, ids: list[int],
                         kept: tuple[str, ...]) -> tuple[str, tuple[int, str]]:
    """The output ended at the first of its unsent tokens whose text holds a stop string, as
    one token a step would have found it: the tokens after it (accepted drafts of the same
    step, a final stop id) and their logprobs are dropped, so usage and logprobs do not depend
    on speculation. -> (the text cut at the stop, find_stop's hit). The search starts at the
    sent tokens themselves: an incomplete character they end with (its U+FFFD) is a stop only
    once the output is final (an EOS in the next step), and then the tokens after them go, as
    one step ending there cut them."""
    for n in range(max(1, seq.num_sent_tokens), len(ids) + 1):
        text = seq.settled_text + detokenizer.decode(ids[seq.settled_tokens:n])
        final = n == len(ids) and seq.finish_reason is not None
        found = find_stop(detokenizer.whole_characters(text, ids[:n], final), seq.num_sent_chars, seq.sampling.stop,
                          kept)
        if found is not None:
            del seq.output_ids[n:]
            del seq.logprobs[n - seq.resumed_tokens:]  # n >= num_sent_tokens >= resumed_tokens
            return text[: found[0]], found
    raise AssertionError("a stop string found in the text is in none of its prefixes")


def release_text(seq: Sequence, detokenizer: Detokenizer) -> GenerationDelta | None:
    """Decode the output so far and return the delta not yet sent (None if nothing new).

    Stop strings are searched in the whole text; a match finishes the request and cuts the
    text before the stop string (after it, for `stop_after`'s, matched only unconstrained).
    """
    ids = seq.output_ids
    if seq.finish_reason == "stop" and ids and seq.is_visible_stop(ids[-1]):
        ids = ids[:-1]
    tail = detokenizer.decode(ids[seq.settled_tokens:])
    text = seq.settled_text + tail
    stops = seq.sampling.stop
    kept = seq.sampling.stop_after if seq.constraint is None else ()  # a grammar ends the text itself
    found = find_stop(detokenizer.whole_characters(text, ids, seq.finish_reason is not None), seq.num_sent_chars,
                      stops, kept)
    if found is not None:
        text, found = _stop_at_first_token(seq, detokenizer, ids, kept)
        seq.finish_reason, seq.stop_string = "stop", found[1]
    elif detokenizer.joins and len(ids) - seq.settled_tokens >= SETTLE_TOKENS and not tail.endswith("\ufffd"):
        seq.settled_text, seq.settled_tokens = text, len(ids)
    # not an incomplete character: until the output ends, nor the one max_tokens cut it inside
    releasable = len(detokenizer.whole_characters(text, ids, seq.finish_reason not in (None, "length")))
    if seq.finish_reason is None:  # a tail that may be the start of a stop string is held back
        releasable = stop_prefix_end(text, releasable, stops)
    seq.text = text
    new_text = text[seq.num_sent_chars : releasable]
    new_tokens = tuple(seq.output_ids[seq.num_sent_tokens :])
    if not new_text and not new_tokens and seq.finish_reason is None:
        return None
    new_logprobs = tuple(seq.logprobs[seq.num_sent_logprobs :])
    prompt_logprobs, seq.prompt_logprobs = tuple(seq.prompt_logprobs), []
    seq.num_sent_chars = max(seq.num_sent_chars, releasable)
    seq.num_sent_tokens = len(seq.output_ids)
    seq.num_sent_logprobs = len(seq.logprobs)
    return GenerationDelta(
        request_id=seq.request_id,
        token_ids=new_tokens,
        text=new_text,
        finish_reason=seq.finish_reason,
        error=seq.error,
        prompt_tokens=len(seq.prompt_ids),
        completion_tokens=len(seq.output_ids),
        cached_tokens=seq.cached_tokens,
        speculation=seq.counters.usage(),
        logprobs=new_logprobs,
        stop_string=seq.stop_string,
        prompt_logprobs=prompt_logprobs,
    )
