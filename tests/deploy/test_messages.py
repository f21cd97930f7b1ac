"""`deploy/messages.py` without a server: what Anthropic's clients send is taken as its API
takes it, and the stream's events rebuild the answer in the official SDK's accumulator."""

from __future__ import annotations

import json

import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event, build_events
from anthropic.types import RawMessageStreamEvent

from deploy.errors import ApiError
from deploy.message_blocks import ContentBlocks, MessageResponse, message_body
from deploy.messages import CountTokensRequest, MessagesRequest, chat_request
from deploy.openai_format import Accumulated

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)


def test_each_block_stop_names_the_block_it_closes_as_the_sdk_rebuilds_it():
    """Two text blocks alike: a stop must carry the closed block's index, not the first equal one's."""
    text = f"Ok{CALL}Ok{CALL}"
    streamed = ContentBlocks(tools=True)
    events = [event for piece in (text[:7], text[7:50], text[50:]) for event in streamed.feed(piece, None)]
    events += streamed.feed("", "stop")
    whole = ContentBlocks(tools=True)
    whole.feed(text, "stop")
    begun = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
    snapshot, bufs, opened, closed = None, {}, [], []
    for raw in [{"type": "message_start", "message": begun}, *events]:
        event = EVENT.validate_python(raw)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
        for fired in build_events(event=event, message_snapshot=snapshot):
            if fired.type == "content_block_stop":  # the SDK hands a client the block at the stop's index
                closed.append(fired.content_block.model_dump(exclude_none=True))
        if raw["type"] == "content_block_start":
            opened.append(raw["index"])
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == opened == [0, 1, 2, 3]
    parts = [{k: v for k, v in p.items() if k != "id"} for p in whole.parts]
    rebuilt = [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in snapshot.content]
    assert rebuilt == parts == [{k: v for k, v in b.items() if k != "id"} for b in closed]
    assert [p["type"] for p in parts] == ["text", "tool_use", "text", "tool_use"]


@pytest.mark.parametrize("arguments", ['{"x": 1e999, "y": 1.50}', '{"x": -1e400}', '{"x": 1.0e-400}',
                                       '{"n": ' + "9" * 5000 + "}"])
def test_a_tool_input_no_python_number_holds_is_written_as_the_model_wrote_it(arguments):
    """Anthropic's `input` is an object: one with 1e999 (inf to json.loads, which JSON cannot
    spell) was a 500; it is now the text the stream's input_json_delta carried."""
    blocks = ContentBlocks(tools=True)
    text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    streamed = "".join(e["delta"]["partial_json"] for e in blocks.feed(text, "stop")
                       if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    body = MessageResponse(message_body("msg_1", "m", blocks, Accumulated(finish_reason="stop"))).body.decode()
    assert streamed == arguments
    assert f'"input":{arguments}' in body
    [block] = json.loads(body, parse_int=str)["content"]  # (over 4,300 digits: no int for Python's json)
    assert (block["type"], block["name"]) == ("tool_use", "f")
    # a call whose numbers Python holds keeps its object as json.loads gives it
    plain = ContentBlocks(tools=True)
    plain.feed(CALL, "stop")
    assert json.loads(MessageResponse(message_body("msg_2", "m", plain, Accumulated(finish_reason="stop"))).body)[
        "content"][0]["input"] == {"city": "Paris"}


def test_a_call_the_output_leaves_unclosed_is_no_tool_use_stop():
    """Unconstrained output may end inside a call whose name went out: its block cannot be taken
    back, but the answer does not stop for a tool to run (it said `tool_use`; found by QA)."""
    blocks = ContentBlocks(tools=True)
    blocks.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "stop")
    assert [b["type"] for b in blocks.parts] == ["tool_use"]
    assert blocks.stop_reason(Accumulated(finish_reason="stop")) == "end_turn"
    whole = ContentBlocks(tools=True)
    whole.feed(CALL, "stop")
    assert whole.stop_reason(Accumulated(finish_reason="stop")) == "tool_use"


@pytest.mark.parametrize("arguments", ['{"x": NaN}', '{"x": -Infinity}'])
def test_a_tool_input_that_is_no_json_is_left_empty_not_a_500(arguments):
    """json.loads takes NaN and Infinity, which no JSON writer may write: such an input is
    as a call cut short, `{}` (the stream carried the text as written)."""
    blocks = ContentBlocks(tools=True)
    blocks.feed(f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>', "stop")
    body = json.loads(MessageResponse(message_body("msg_1", "m", blocks, Accumulated(finish_reason="stop"))).body)
    assert body["content"][0]["input"] == {}


TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        # tool search and programmatic calls (Claude Code's): taken, every tool offered
        "defer_loading": True, "input_examples": [{"city": "Paris"}],
        "allowed_callers": ["direct"]}


def _session(result_content) -> list[dict]:
    return [{"role": "user", "content": "Look at the chart."},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"},
                 "caller": {"type": "direct"}, "toolset_name": None}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "toolset_name": None,
                                          "content": result_content}]}]


def test_what_a_claude_code_session_sends_is_taken_and_a_tools_picture_reads_as_a_note():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    body = MessagesRequest(model="m", max_tokens=8, tools=[TOOL], messages=_session(
        [{"type": "text", "text": "Here it is: "}, image, pdf]))
    [*_, tool] = chat_request(body).messages
    assert (tool.role, tool.tool_call_id) == ("tool", "toolu_1")
    assert tool.text == ("Here it is: \n[image omitted: this model reads text only]\n"
                         "[document omitted: this model reads text only]")
    # count_tokens takes what a message takes
    CountTokensRequest(model="m", messages=_session("18 C"), tools=[TOOL], cache_control={"type": "ephemeral"},
                       output_config={"effort": "low"}, speed="standard", context_management={"edits": []})
    with pytest.raises(pydantic.ValidationError, match="messages.0.content"):  # a user's own picture: a 400
        MessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": [image]}])


def test_a_messages_text_blocks_are_lines_and_the_system_blocks_one_text():
    """As vLLM's Messages API reads them: a message's blocks are parts, each on its own line
    (chat's PART_SEPARATOR); the request's system blocks one text (Claude Code's begin with
    their own newline), its billing block dropped; a prefill's blocks are the answer's start."""
    body = MessagesRequest(model="m", max_tokens=8, tools=[TOOL], system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=2;"},
        {"type": "text", "text": "You are a CLI."}, {"type": "text", "text": "\nBe brief."}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Fix this:"}, {"type": "text", "text": "x = 1 +"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18 C"},
                                     {"type": "text", "text": "Thanks."}, {"type": "text", "text": "Now Rome?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Rome"}, {"type": "text", "text": "is"}]}])
    chat = chat_request(body)
    assert [(m.role, m.text) for m in chat.messages] == [
        ("system", "You are a CLI.\nBe brief."), ("user", "Fix this:\nx = 1 +"), ("assistant", "Let me look."),
        ("tool", "18 C"), ("user", "Thanks.\nNow Rome?"), ("assistant", "Rome\nis")]
    assert chat.continue_final_message


def test_consecutive_messages_of_a_role_are_one_turn():
    """As Anthropic's API combines them: a run of user (or assistant) messages is one message of
    their blocks, so results split over two user messages answer one assistant's calls, a
    thinking block (never rendered) before a prefill leaves it one, and an error names the
    client's message its block came from."""
    def use(id_):
        return {"type": "tool_use", "id": id_, "name": "get_weather", "input": {"city": id_}}

    def result(id_):
        return {"type": "tool_result", "tool_use_id": id_, "content": f"{id_}: 18 C"}

    body = MessagesRequest(model="m", max_tokens=8, tools=[TOOL], messages=[
        {"role": "user", "content": "Weather?"}, {"role": "user", "content": [{"type": "text", "text": "Both."}]},
        {"role": "assistant", "content": "Looking."}, {"role": "assistant", "content": [use("a"), use("b")]},
        {"role": "user", "content": [result("a")]}, {"role": "user", "content": [result("b")]},
        {"role": "assistant", "content": "Both"}, {"role": "assistant", "content": ""}])
    chat = chat_request(body)
    assert [(m.role, m.text) for m in chat.messages] == [
        ("user", "Weather?\nBoth."), ("assistant", "Looking."), ("tool", "a: 18 C"), ("tool", "b: 18 C"),
        ("assistant", "Both")]
    assert [c.id for c in chat.messages[1].tool_calls] == ["a", "b"] and chat.continue_final_message
    thought = {"type": "thinking", "thinking": "Hm.", "signature": "s"}
    for answer in ([{"role": "assistant", "content": [thought]}, {"role": "assistant", "content": "Both"}],
                   [{"role": "assistant", "content": [thought, {"type": "text", "text": "Both"}]}]):
        chat = chat_request(MessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": "Go"},
                                                                               *answer]))
        assert chat.continue_final_message and [(m.role, m.text) for m in chat.messages][-1] == ("assistant", "Both")
    asked = [{"role": "user", "content": "Weather?"}, {"role": "user", "content": "In Oslo."},
             {"role": "assistant", "content": "Looking."}, {"role": "assistant", "content": [use("a"), use("b")]}]
    for answers, error in (
            ([{"role": "user", "content": "Well?"}], r"messages\[3\]: tool_use ids were found without"),
            ([{"role": "user", "content": [result("a"), {"type": "text", "text": "x"}]},
              {"role": "user", "content": [result("b")]}], r"messages\[5\]: tool_result blocks must come first"),
            ([{"role": "user", "content": [result("a")]}, {"role": "user", "content": [result("a")]}],
             r"messages\[5\]: unexpected tool_use_id 'a'")):
        with pytest.raises(pydantic.ValidationError, match=error):
            MessagesRequest(model="m", max_tokens=8, tools=[TOOL], messages=asked + answers)


@pytest.mark.parametrize("status, anthropic_type", [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error"),
    (504, "timeout_error"),
])
def test_errors_to_messages_clients_carry_anthropics_types(status, anthropic_type):
    """The types of Anthropic's errors page; its SDK's models know all but request_too_large
    (Cloudflare's, in front of Anthropic's servers), which the SDK reads as any other 413."""
    import typing

    from anthropic.types.shared import ErrorResponse, ErrorType

    error = ApiError(status, "no")
    answer = error.response("/v1/messages")
    body = json.loads(answer.body)
    assert body["type"] == "error" and body["error"]["type"] == anthropic_type
    # an overloaded server is Anthropic's 529, which its SDK raises as OverloadedError
    assert answer.status_code == (529 if anthropic_type == "overloaded_error" else status)
    assert error.response("/v1/chat/completions").status_code == status
    if anthropic_type in typing.get_args(ErrorType):
        assert ErrorResponse.model_validate(body).error.type == anthropic_type
    assert json.loads(error.response("/v1/chat/completions").body)["error"]["type"] == error.type  # OpenAI's


def test_a_tool_use_input_nested_too_deep_to_write_back_is_a_validation_error():
    """FastAPI reads a body nested ~950 deep; writing such an input back as the call's arguments
    (a few frames deeper) ran out of Python's recursion limit: a 500."""
    deep: object = 0
    for _ in range(990):
        deep = [deep]
    body = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": deep}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}
    with pytest.raises(pydantic.ValidationError, match="nested too deep"):
        MessagesRequest.model_validate(body)
