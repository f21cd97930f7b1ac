"""Streaming tool calls: `parse_tool_calls` done incrementally, so `delta.tool_calls`
fragments go out while the model writes them (deploy/tool_calls.py has the format)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from deploy.tool_calls import (
    CALL_HEADER, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, find_close, header_atoms, json_string,
)

_NAMED = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')  # a cut call's `{"name": "..."`
_HEADER_PREFIX = re.compile(functools.reduce(
    lambda inner, atom: f"{atom}(?:{inner})?", reversed(header_atoms(r'(?:[^"\\]|\\.)*\\?')), ""))


@dataclass(frozen=True)
class StreamEvent:
    """Plain text (`content` is not None) or a fragment of call `index`: `name` on its first
    fragment, then pieces of its arguments JSON text; `unfinished`: the call, whose fragments
    went out, turned out malformed or was left unclosed, and ends here (not a whole call)."""

    content: str | None = None
    index: int = -1
    name: str | None = None
    arguments: str = ""
    unfinished: bool = False


def _partial_tag_len(text: str, tag: str = TOOL_CALL_OPEN) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallStream:
    """Incremental `parse_tool_calls` for streaming; increments may split anywhere.

    Content is held back while it could be the start of an open tag or is whitespace that
    may precede one. A call's name is sent once `{"name": "...", "arguments": ` is complete,
    then its arguments stream as the raw text the model writes, holding back the last `}`
    and what follows it (it may close the outer object) until the close tag shows it.

    Exactly: a call's fragments concatenate to its raw arguments text (from after
    `"arguments": ` to before the outer `}`, right-stripped), the text `parse_tool_calls`
    returns. Arguments written as a JSON string, or keys not in `name, arguments` order, are
    sent whole, re-serialised, at the close tag, as `parse_tool_calls` gives them.
    Content equals `parse_tool_calls`' for well-formed output. A block found malformed
    before any of it was sent passes through as content; otherwise `ok` turns False. With
    `one_call`, as `parse_tool_calls`', the output ends at its first call's close tag;
    `continues` (the output continues a prefilled answer), its leading whitespace is content.
    """

    def __init__(self, one_call: bool = False, continues: bool = False) -> None:
        self._one_call = one_call
        self._ended = False  # one_call: the first call closed; the rest is dropped
        self._pending = ""  # content mode: held whitespace and a possible partial open tag
        self._block: str | None = None  # call mode: the text after the open tag
        self._pre_ws = ""  # whitespace right before the open tag, dropped if it is a call
        self._name: str | None = None  # the call's name once sent
        self._args_start: int | None = None  # where raw arguments begin in _block, if streamed
        self._args_sent = 0
        self._scan_from = 0  # close tags before this cannot end the body
        self._started = continues  # some content sent (or a prefill's): later leading whitespace is content
        self._failed = False
        self._num_calls = 0
        self._cut = False

    @property
    def ok(self) -> bool:
        """Every open tag so far began a well-formed call (after `finish`: the output is what
        `parse_tool_calls` accepts)."""
        return not self._failed and self._block is None

    @property
    def cut(self) -> bool:
        """`finish(cut=True)` ended the output inside a call whose name had been sent."""
        return self._cut

    @property
    def num_calls(self) -> int:
        """Calls whose name has been sent (the next call's index)."""
        return self._num_calls

    def feed(self, text: str) -> list[StreamEvent]:
        """The events the output so far makes certain, given its next increment."""
        if self._ended:
            return []
        if self._failed:
            return self._content(text)
        if self._block is not None:
            self._block += text
            return self._feed_call()
        self._pending += text
        return self._feed_content()

    def finish(self, cut: bool = False) -> list[StreamEvent]:
        """Flush held-back content. An unclosed call that sent no fragment is content, unless
        `cut` (max_tokens ended the output inside it: `_cut_call`)."""
        if self._failed or self._ended:
            return []
        if self._block is not None:
            if cut:
                return self._cut_call()
            if self._name is None:
                return self._fail(self._pre_ws + TOOL_CALL_OPEN + self._block)
            return self._fail("")
        held, self._pending = self._pending, ""
        if cut:  # an open tag begun: a call cut before its name
            held = held[:len(held) - _partial_tag_len(held)]
        return self._content(held) if held.strip() else []

    def _cut_call(self) -> list[StreamEvent]:
        """The call max_tokens cut: one short of only its close tag is a call; one whose name
        is written sends the rest of its arguments as written (`cut` turns True), its name
        first if it had not gone out (the cut came before its arguments); one cut before its
        name is dropped."""
        block = self._block.rstrip()
        body = block[:len(block) - _partial_tag_len(block, TOOL_CALL_CLOSE)]
        found = find_close(body + TOOL_CALL_CLOSE, len(body))
        if found is not None and found[1] is not None:
            return self._close(*found) + self.finish(cut=True)
        self._block, events = None, []
        if self._name is None:
            named = _NAMED.match(block)
            self._name = json_string(named.group(1)) if named else None
            if self._name is None:
                return []
            events.append(StreamEvent(index=self._num_calls, name=self._name))
            self._num_calls += 1
        self._cut = True
        rest = block[self._args_start + self._args_sent:] if self._args_start is not None else ""
        return events + ([StreamEvent(index=self._num_calls - 1, arguments=rest)] if rest else [])

    def _content(self, text: str) -> list[StreamEvent]:
        if not self._started:
            text = text.lstrip()  # parse_tool_calls strips content; leading space never shows
        if not text:
            return []
        self._started = True
        return [StreamEvent(content=text)]

    def _fail(self, held: str) -> list[StreamEvent]:
        """The block is malformed: from here everything is content; a call it began is unfinished."""
        unfinished = [StreamEvent(index=self._num_calls - 1, unfinished=True)] if self._name is not None else []
        self._failed, self._block, self._name = True, None, None
        return unfinished + self._content(held)

    def _feed_content(self) -> list[StreamEvent]:
        buf = self._pending
        i = buf.find(TOOL_CALL_OPEN)
        if i < 0:
            keep_from = len(buf[:len(buf) - _partial_tag_len(buf)].rstrip())
            self._pending = buf[keep_from:]
            return self._content(buf[:keep_from])
        before = buf[:i].rstrip()
        events = self._content(before)
        self._pre_ws, self._block, self._pending = buf[len(before):i], buf[i + len(TOOL_CALL_OPEN):], ""
        self._name, self._args_start, self._args_sent, self._scan_from = None, None, 0, 0
        return events + self._feed_call()

    def _feed_call(self) -> list[StreamEvent]:
        block, events = self._block, []
        found = find_close(block, self._scan_from)
        if found is not None:
            return self._close(*found)
        self._scan_from = max(0, len(block) - len(TOOL_CALL_CLOSE) + 1)
        if self._name is None:
            m = CALL_HEADER.match(block)
            name = json_string(m.group(1)) if m and m.end() < len(block) else None
            if name is not None:  # a char follows the header, so its whitespace is all in
                self._name = name
                self._args_start = m.end() if block[m.end()] == "{" else None
                events.append(StreamEvent(index=self._num_calls, name=self._name))
                self._num_calls += 1
            elif not m and not block.lstrip().startswith("{") and not _HEADER_PREFIX.fullmatch(block):
                return self._fail(self._pre_ws + TOOL_CALL_OPEN + block)  # prose naming the tag
        if self._args_start is not None:
            sent = self._args_start + self._args_sent
            brace = block.rfind("}", sent)
            piece = block[sent:brace if brace >= 0 else len(block)].rstrip()
            if piece:
                self._args_sent += len(piece)
                events.append(StreamEvent(index=self._num_calls - 1, arguments=piece))
        return events

    def _close(self, end: int, call: ToolCall | None) -> list[StreamEvent]:
        block = self._block
        if call is None or (self._name is not None and call.name != self._name):
            # Fragments sent cannot be taken back; an unsent block is content, like prose.
            sent = self._name is not None
            return self._fail(block[end + len(TOOL_CALL_CLOSE):] if sent else self._pre_ws + TOOL_CALL_OPEN + block)
        events = []
        if self._name is None:
            events.append(StreamEvent(index=self._num_calls, name=call.name))
            self._num_calls += 1
        if self._args_start is None:
            rest = call.arguments
        else:  # raw text up to the outer "}", which is the last non-space before the close
            rest = block[self._args_start:end].rstrip()[:-1].rstrip()[self._args_sent:]
        if rest:
            events.append(StreamEvent(index=self._num_calls - 1, arguments=rest))
        self._block, self._pending = None, block[end + len(TOOL_CALL_CLOSE):]
        if self._one_call:
            self._ended, self._pending = True, ""
            return events
        return events + self._feed_content()


def parse_cut_output(text: str, one_call: bool = False, continues: bool = False) -> tuple[str | None, list[ToolCall]]:
    """`parse_tool_calls` for an output that max_tokens cut: what its stream sends with
    `finish(cut=True)`, so the answer is the same streamed or not. The calls made before the
    cut, then the call being written when the cut came, if its name was: its arguments as far
    as written (not valid JSON); a call cut before its name is dropped."""
    stream = ToolCallStream(one_call, continues)
    events = stream.feed(text) + stream.finish(cut=True)
    names: list[str] = []
    arguments: list[str] = []
    for e in events:
        if e.content is None:
            if e.name is not None:
                names.append(e.name)
                arguments.append("")
            arguments[e.index] += e.arguments
    calls = [ToolCall(name, args) for name, args in zip(names, arguments)]
    return "".join(e.content for e in events if e.content is not None) or None, calls
