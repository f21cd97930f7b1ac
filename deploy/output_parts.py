"""A model's output as the parts an API shows: text, and (with tools offered) each function call.

`OutputParts` splits the text as the engine's deltas come (`ToolCallStream`): a text part is
opened at its first text, a call part at its name, and the part in hand is closed when the next
one opens or the output ends. What a part and each step of it look like is the API's: the
Responses API's items and events (`deploy/responses.py`), Anthropic's content blocks
(`deploy/messages.py`). A subclass makes the parts and returns the events of each step; a
non-streamed answer feeds its whole output at once and takes `parts`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from deploy.openai_format import TokenTexts, logprobs_body
from deploy.tool_call_stream import StreamEvent, ToolCallStream
from replicas.engine import TokenLogprob

Part = dict[str, Any]
Event = dict[str, Any]


class OutputParts:
    def __init__(self, tools: bool, logprobs: Optional[TokenTexts] = None, one_call: bool = False,
                 continues: bool = False) -> None:
        """`logprobs`, given when the request asks for them (never beside tools): what they show;
        `one_call`: parallel calls are not allowed, so the output ends at its first call;
        `continues`: it continues a prefilled answer, its leading whitespace is text."""
        self.parts: list[Part] = []
        self._calls = ToolCallStream(one_call, continues) if tools else None
        self._token_texts = logprobs
        self._open: Optional[Part] = None  # the part being written
        self._open_is_text = False

    def feed(self, text: str, finish_reason: Optional[str], logprobs: Sequence[TokenLogprob] = (),
             cut: bool = False) -> list[Event]:
        """The events of the output's next delta (`finish_reason` set: its last; `cut`: something
        other than the model ended it there, `Accumulated.cut`)."""
        if self._calls is None:
            pieces = [StreamEvent(content=text)] if text or logprobs else []
        else:
            pieces = self._calls.feed(text)
            if finish_reason:
                pieces += self._calls.finish(cut=cut)
        events: list[Event] = []
        for piece in pieces:
            if piece.content is not None:
                if not self._open_is_text:
                    events += self._start(self.text_part(), True)
                entries = logprobs_body("chat", logprobs, self._token_texts)["content"] if self._token_texts else None
                events += self.on_text(self._open, piece.content, entries)
            elif piece.name is not None:  # a call's first fragment
                events += self._start(self.call_part(piece.name), False)
            elif piece.unfinished:
                events += self._close("length")
            if piece.arguments:
                events += self.on_arguments(self._open, piece.arguments)
        if finish_reason is not None:  # a call the cut did not fall in is whole
            call_cut = self._calls is not None and self._calls.cut
            events += self._close(finish_reason if self._open_is_text else "length" if call_cut else "stop")
        return events

    @property
    def index(self) -> int:
        """The open part's place in `parts`."""
        return len(self.parts) - 1

    def _start(self, part: Part, is_text: bool) -> list[Event]:
        events = self._close()
        self.parts.append(part)
        self._open, self._open_is_text = part, is_text
        return events + self.on_open(part)

    def _close(self, finish_reason: str = "stop") -> list[Event]:
        part, self._open, self._open_is_text = self._open, None, False
        return [] if part is None else self.on_close(part, finish_reason)

    # -- what the API shows ------------------------------------------------------------------
    def text_part(self) -> Part:
        raise NotImplementedError

    def call_part(self, name: str) -> Part:
        raise NotImplementedError

    def on_open(self, part: Part) -> list[Event]:
        raise NotImplementedError

    def on_text(self, part: Part, text: str, logprobs: Optional[list[dict[str, Any]]]) -> list[Event]:
        raise NotImplementedError

    def on_arguments(self, part: Part, arguments: str) -> list[Event]:
        raise NotImplementedError

    def on_close(self, part: Part, finish_reason: str) -> list[Event]:
        """`finish_reason`: "length" where the part is unfinished (the output was cut in it, or,
        unconstrained, a call's block turned out malformed or unclosed after its name went
        out), else "stop"."""
        raise NotImplementedError
