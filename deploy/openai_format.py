"""Engine deltas -> OpenAI response bodies and SSE chunks. Pure functions over plain data.

Completions and chat differ only in the choice shape (`text` vs `delta`/`message`) and in
their logprobs shape (the legacy parallel lists vs a list of objects), so each builder takes
the endpoint `kind` and stays in one place.
"""

from __future__ import annotations

import difflib
import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Optional, Sequence, Union

from deploy.tool_call_stream import ToolCallStream, parse_cut_output
from deploy.tool_calls import ToolCall, parse_tool_calls
from replicas.engine import GenerationDelta, GenerationRequest, TokenLogprob
from replicas.token_bytes import token_bytes

Kind = Literal["completion", "chat"]
DONE = "data: [DONE]\n\n"


@dataclass
class Accumulated:
    """A request's output so far: text and the last delta's figures."""

    text: str = ""
    finish_reason: Optional[str] = None
    stop_string: Optional[str] = None  # the client's stop string that ended it, if one did
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    speculation: dict[str, float] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked for (echo, vLLM's)
    token_ids: list[int] = field(default_factory=list)  # what a resumed attempt continues after
    prediction: Sequence[int] = ()  # the request's predicted output (token ids), if any
    stops: Sequence[str] = ()  # the request's stop strings and stop ids: what stop_reason may name
    stop_token_ids: Sequence[int] = ()
    prompt_only: bool = False  # completions' `max_tokens: 0` with echo: the token generated is left out

    @classmethod
    def of(cls, request: GenerationRequest, prompt_only: bool = False) -> "Accumulated":
        sampling = request.sampling
        return cls(prediction=request.prediction, stops=sampling.stop, stop_token_ids=sampling.stop_token_ids,
                   prompt_only=prompt_only)

    @property
    def stop_reason(self) -> Union[str, int, None]:
        """vLLM's: the stop string or stop token id that ended the output; None when EOS or
        the length did."""
        if self.stop_string is not None:
            return self.stop_string
        if self.finish_reason == "stop" and self.token_ids and self.token_ids[-1] in self.stop_token_ids:
            return self.token_ids[-1]
        return None

    @property
    def cut(self) -> bool:
        """Did something other than the model end the output (max_tokens, or the client's stop
        string or stop token)? A call it ended inside is cut short, not malformed."""
        return self.finish_reason == "length" or self.stop_reason is not None

    def add(self, delta: GenerationDelta) -> GenerationDelta:
        """Take in `delta`; returns it as the response shows it."""
        if self.prompt_only:  # the prompt's logprobs alone, ended by the length asked for (0)
            delta = replace(delta, token_ids=(), text="", logprobs=(), completion_tokens=0, stop_string=None,
                            finish_reason=delta.finish_reason and "length")
        self.text += delta.text
        self.logprobs += delta.logprobs
        self.prompt_logprobs += delta.prompt_logprobs
        self.token_ids += delta.token_ids
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_string = delta.stop_string if delta.stop_string in self.stops else None  # not ours (stop_after)
            self.prompt_tokens = delta.prompt_tokens
            self.completion_tokens = delta.completion_tokens
            self.cached_tokens = delta.cached_tokens
            self.speculation = dict(delta.speculation)
        return delta


def usage(accs: Sequence[Accumulated], n: int = 1) -> dict[str, Any]:
    """The request's usage over its choices (`n` a prompt, each prompt's together): each prompt
    once, their outputs, their drafts (acceptance length over all their verify steps) and their
    predictions' counts added up."""
    first, specs = accs[0], [acc.speculation for acc in accs]
    prompt_tokens = sum(acc.prompt_tokens for acc in accs[::n])
    completion = sum(acc.completion_tokens for acc in accs)
    spec = {key: sum(int(s.get(key, 0)) for s in specs) for key in ("draft_tokens", "accepted_tokens", "steps")}
    weighted = sum(float(s.get("acceptance_length", 0.0)) * int(s.get("steps", 0)) for s in specs)
    spec["acceptance_length"] = round(weighted / spec["steps"], 4) if spec["steps"] else 0.0
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(acc.cached_tokens for acc in accs[::n])},  # prefix cache
        "speculation": spec,
    }
    if first.prediction:
        counts = [prediction_details(acc.prediction, acc.token_ids) for acc in accs]
        body["completion_tokens_details"] = {key: sum(c[key] for c in counts) for key in counts[0]}
    return body


def running_usage(prompt: Sequence[int], acc: Accumulated) -> dict[str, int]:
    """vLLM's `continuous_usage_stats`: a chunk's usage so far, of its own choice (its prompt,
    its output: the tokens as counted once finished, as made before)."""
    completion = acc.completion_tokens if acc.finish_reason else len(acc.token_ids)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


def prediction_details(prediction: Sequence[int], output: Sequence[int]) -> dict[str, int]:
    """OpenAI's counts for a prediction: its tokens the output has too, in order (difflib's
    matching blocks, whose heuristic keeps a token over 1% of a long prediction from starting a
    match: fast on any input, a lower count only on very repetitive ones), and the rest."""
    blocks = difflib.SequenceMatcher(None, output, prediction).get_matching_blocks()
    accepted = sum(block.size for block in blocks)
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": len(prediction) - accepted}


class TokenTexts:
    """Token id -> its text (each token decoded alone), cached: what logprobs entries show; and
    its bytes (`raw`: the token's own, where the tokenizer tells them; else its text's UTF-8);
    and its width in the answer's text (`hidden`: special tokens, which the text leaves out)."""

    def __init__(self, decode: Callable[[list[int]], str],
                 raw: Callable[[int], Optional[bytes]] = lambda _: None, hidden: frozenset[int] = frozenset()) -> None:
        self._decode, self._raw, self._hidden = decode, raw, hidden
        self._texts: dict[int, str] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> TokenTexts:
        return cls(tokenizer.decode, token_bytes(tokenizer) or (lambda _: None),
                   frozenset(getattr(tokenizer, "all_special_ids", ())))

    def width(self, token_id: int) -> int:
        """Characters the token takes in the text (a BOS, a special token the model wrote: none;
        completions' text_offset counted them, past the text they index: QA)."""
        return 0 if token_id in self._hidden else len(self(token_id))

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        """Chat logprobs' `bytes`: a token that holds part of a character (its text U+FFFD)
        shows its own bytes, which joined with its neighbours' make the character."""
        raw = self._raw(token_id)
        return list(raw if raw is not None else self(token_id).encode("utf-8"))


def logprobs_body(kind: Kind, entries: Sequence[TokenLogprob], token_text: TokenTexts,
                  text_offset: int = 0, unscored: Sequence[int] = ()) -> dict[str, Any]:
    """A choice's `logprobs`: chat's list of objects, or completions' parallel lists whose
    `text_offset` counts characters from `text_offset` (where this chunk's text starts), led
    by the `unscored` tokens' (an echoed prompt's first: its logprob and top are null).
    Completions' `top_logprobs` also holds the token itself where it is not one of the k
    likeliest (up to k + 1 entries, as OpenAI's legacy API and vLLM)."""
    if kind == "chat":
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": token_text.bytes(token_id)}

        return {"content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top]}
                            for e in entries]}
    tokens = [token_text(t) for t in unscored] + [token_text(e.token_id) for e in entries]
    offsets = []
    for token_id in (*unscored, *(e.token_id for e in entries)):
        offsets.append(text_offset)
        text_offset += token_text.width(token_id)
    none = [None] * len(unscored)
    return {"tokens": tokens, "token_logprobs": none + [e.logprob for e in entries],
            "top_logprobs": none + [completion_top(e, token_text) for e in entries], "text_offset": offsets}


def completion_top(entry: TokenLogprob, token_text: TokenTexts) -> dict[str, float]:
    """Text -> logprob; a text two tokens share (byte tokens' "\ufffd") keeps the likelier's."""
    top: dict[str, float] = {}
    for i, lp in (*entry.top, (entry.token_id, entry.logprob)):
        top.setdefault(token_text(i), lp)
    return top


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Echo:
    """Completions' `echo`: a choice's prompt shown before its output, `text` and, with
    logprobs, its `first_token` (unscored) and the prompt logprobs after it, each with the
    `num_top` alternatives the output's have (the engine may have scored more for vLLM's
    `prompt_logprobs`)."""

    text: str
    first_token: int
    num_top: int = 0


def shown_logprobs(echo: Optional[Echo], prompt_logprobs: Sequence[TokenLogprob],
                   logprobs: Sequence[TokenLogprob]) -> tuple[Sequence[TokenLogprob], tuple[int, ...]]:
    """(the logprob entries a choice shows, the unscored tokens leading them): the output's, or
    with `echo` the prompt's first token unscored, then the prompt's and the output's."""
    if echo is None:
        return logprobs, ()
    prompt = [e if len(e.top) <= echo.num_top else replace(e, top=e.top[:echo.num_top]) for e in prompt_logprobs]
    return [*prompt, *logprobs], (echo.first_token,)


def vllm_prompt_logprobs(entries: Sequence[TokenLogprob], num_top: int,
                         token_text: TokenTexts) -> list[Optional[dict[str, dict[str, Any]]]]:
    """vLLM's `prompt_logprobs`: null for the prompt's first token (nothing before it scores
    it), then per token {token id: {logprob, rank, decoded_token}}, the token's own first, then
    the `num_top` likeliest of its row (ranks 1 to num_top)."""
    def entry(token_id: int, logprob: float, rank: int) -> tuple[str, dict[str, Any]]:
        return str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}

    def row(e: TokenLogprob) -> dict[str, dict[str, Any]]:
        likeliest = (entry(i, lp, rank) for rank, (i, lp) in enumerate(e.top[:num_top], 1) if i != e.token_id)
        return dict([entry(e.token_id, e.logprob, e.rank), *likeliest])

    return [None, *map(row, entries)]


def full_choice(kind: Kind, index: int, acc: Accumulated, output: Output,
                tool_calls: tuple[Optional[str], list[ToolCall]] | None = None,
                echo: Optional[Echo] = None) -> dict[str, Any]:
    """One choice of a non-streaming body; `tool_calls` is (content, calls) when the output made calls."""
    finish_reason, stop_reason = acc.finish_reason, acc.stop_reason
    logprobs = None
    if output.logprobs:
        entries, unscored = shown_logprobs(echo, acc.prompt_logprobs, acc.logprobs)
        logprobs = logprobs_body(kind, entries, output.token_texts, unscored=unscored)
    if kind != "chat":
        choice = {"index": index, "text": (echo.text if echo else "") + acc.text, "logprobs": logprobs,
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        if output.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(acc.prompt_logprobs, output.prompt_logprobs,
                                                             output.token_texts)
        return choice
    # with tools offered, the content as their parse (and the stream) gives it, calls made or not
    message: dict[str, Any] = {"role": "assistant", "content": acc.text if tool_calls is None else tool_calls[0]}
    if tool_calls is not None and tool_calls[1]:
        message["tool_calls"] = [{"id": tool_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in tool_calls[1]]
        if not acc.cut:  # a cut answer says so, whatever calls it holds (as OpenAI's)
            finish_reason = "tool_calls"
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def answer_tool_calls(acc: Accumulated, output: Output) -> tuple[Optional[str], list[ToolCall]]:
    """A finished chat answer as (content, calls); a cut one (`Accumulated.cut`) as its stream sent it."""
    return (parse_cut_output if acc.cut else parse_tool_calls)(acc.text, output.one_call, output.continues)


def full_response(kind: Kind, response_id: str, created: int, model: str, choices: list[dict[str, Any]],
                  accs: Sequence[Accumulated], output: Output, n: int = 1) -> dict[str, Any]:
    """The non-streaming body: its choices (`full_choice`) and the usage of their outputs; a
    chat's vLLM `prompt_logprobs` are the response's (one prompt), a completion's each choice's."""
    body = {"id": response_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": usage(accs, n)}
    if kind == "chat" and output.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(accs[0].prompt_logprobs, output.prompt_logprobs,
                                                       output.token_texts)
    return body


def chunk(kind: Kind, response_id: str, created: int, model: str, text: Optional[str],
          finish_reason: Optional[str] = None, role: bool = False, logprobs: Optional[dict[str, Any]] = None,
          tool_calls: Optional[list[dict[str, Any]]] = None, index: int = 0,
          stop_reason: Union[str, int, None] = None) -> dict[str, Any]:
    """One streamed chunk of choice `index`; for chat, `role=True` opens the assistant message
    and `tool_calls` carries `delta.tool_calls` fragments; the last one (`finish_reason` set)
    says `stop_reason` too."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: Kind, response_id: str, created: int, model: str, accs: Sequence[Accumulated],
                n: int = 1) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(accs, n)}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def typed_sse(event: dict[str, Any]) -> str:
    """An event of the Responses or Anthropic Messages API: its `type` named on the `event:` line too."""
    return f"event: {event['type']}\n{sse(event)}"


@dataclass(frozen=True)
class Output:
    """What a response shows besides text: logprobs (when asked), tool calls (chat with tools;
    `one_call` when parallel calls are not allowed: the output ends at its first; `continues`
    when it continues a prefilled answer: its leading whitespace is content), vLLM's
    `prompt_logprobs` with this many alternatives (when asked)."""

    kind: Kind
    logprobs: bool
    tools: bool
    token_texts: TokenTexts
    one_call: bool = False
    prompt_logprobs: Optional[int] = None
    continues: bool = False


class StreamPieces:
    """A stream's deltas as chunk parts: text (tool calls split out), tool-call fragments, logprobs."""

    def __init__(self, output: Output, echo: Optional[Echo] = None) -> None:
        self._output = output
        self._echo = echo  # goes out with the first delta
        self._tools = ToolCallStream(output.one_call, output.continues) if output.tools else None
        self._call_ids: list[str] = []
        self._text_offset = 0  # completions: characters of token text so far

    def of(self, delta: GenerationDelta, cut: bool = False
           ) -> tuple[Optional[str], list[dict[str, Any]], Optional[dict[str, Any]]]:
        """The delta's (text, tool-call fragments, logprobs); `cut`: the output ends here, cut (`Accumulated.cut`)."""
        out, echo, self._echo = self._output, self._echo, None
        logprobs, text = None, delta.text if echo is None else echo.text + delta.text
        entries, unscored = shown_logprobs(echo, delta.prompt_logprobs, delta.logprobs)
        if out.logprobs and (entries or unscored):
            logprobs = logprobs_body(out.kind, entries, out.token_texts, self._text_offset, unscored)
            self._text_offset += sum(out.token_texts.width(t) for t in (*unscored, *(e.token_id for e in entries)))
        if self._tools is None:
            return text, [], logprobs
        events = self._tools.feed(delta.text)
        if delta.finish_reason:
            events += self._tools.finish(cut=cut)
        text = "".join(e.content for e in events if e.content is not None)
        fragments: list[dict[str, Any]] = []  # one per call in a chunk (OpenAI's): a call's pieces joined
        for e in events:
            if e.content is not None or e.unfinished:  # chat has no word for a call that went wrong
                continue
            if e.index == len(self._call_ids):  # a new call: its id, type and name come first
                self._call_ids.append(tool_call_id())
                fragments.append({"index": e.index, "id": self._call_ids[e.index], "type": "function",
                                  "function": {"name": e.name, "arguments": e.arguments}})
            elif fragments and fragments[-1]["index"] == e.index:
                fragments[-1]["function"]["arguments"] += e.arguments
            else:
                fragments.append({"index": e.index, "function": {"arguments": e.arguments}})
        return text or None, fragments, logprobs

    def finish_reason(self, acc: Accumulated) -> str:
        tools = self._tools
        return "tool_calls" if tools is not None and tools.ok and tools.num_calls and not acc.cut else acc.finish_reason
