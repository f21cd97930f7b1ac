"""`deploy/responses.py` without a server: Responses input items as the chat they mean, and the
output items (and stream events) made from a model's text."""

from __future__ import annotations

import pytest

from deploy.errors import ApiError
from deploy.response_items import OutputItems, input_items, response_body
from deploy.responses import (
    ResponsesRequest, chat_request, continued, conversation, fitted, repeated_id, unmatched_call, with_items,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_calls_after_an_answer_join_its_assistant_message_and_outputs_become_tool_messages():
    """(A message's parts are joined by a newline, as vLLM's, TensorRT-LLM's and llama.cpp's
    servers join them.)"""
    body = ResponsesRequest(model="m", instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                    "text": "Paris and Rome?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "21 C"}]},
    ])
    messages = conversation(body, [])
    assert [(m.role, m.text) for m in messages] == [
        ("user", "Weather in \nParis and Rome?"), ("assistant", "Let me look."), ("tool", "18 C"), ("tool", "21 C")]
    assert [(c.id, c.function.arguments) for c in messages[1].tool_calls] == [
        ("c1", '{"city": "Paris"}'), ("c2", '{"city": "Rome"}')]
    assert [m.tool_call_id for m in messages[2:]] == ["c1", "c2"]
    chat = chat_request(body, messages)
    assert chat.messages[0].role == "system" and chat.messages[0].text == "Be brief." and chat.messages[1:] == messages


def _call(call_id: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def _output(call_id: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": "18"}


def test_each_call_output_answers_an_open_call_of_the_conversation():
    """What the ingress checks (the 400s are in test_http_edges): an output answers a call not
    yet answered, before it here or in the previous response's conversation; a call_id may be
    given again once answered, and a message may come between a call and its output."""
    user = {"role": "user", "content": "x"}

    def check(items, history=()):
        return unmatched_call(ResponsesRequest(model="m", input=items).items, list(history))

    assert check([user, _call("a"), _call("b"), _output("b"), user, _output("a"), _call("a"), _output("a")]) is None
    earlier = conversation(ResponsesRequest(model="m", input=[user, _call("a"), _call("b"), _output("b")]), [])
    assert check([_output("a")], earlier) is None
    assert check([_output("b")], earlier) == ("input[0].call_id", "no function_call with call_id 'b' comes before "
                                                                  "it, or it was answered already")
    assert check([_call("a")], earlier) == ("input[0].call_id", "'a' is the call_id of an earlier call not answered yet")
    assert check([_output("c")]) is not None and check([_call("a"), _output("a"), _output("a")]) is not None
    # a call of the input left with no output (OpenAI's "No tool output found"; QA found it
    # answered); a stored one may be (one max_output_tokens cut has nothing to run)
    missing = "no function_call_output found for the function_call with call_id 'c'"
    assert check([user, _call("c"), user]) == ("input[1]", missing)
    assert check([user], earlier) is None


@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_items_and_events_do_not_depend_on_how_the_text_arrives(piece):
    text = f"Checking.\n{CALL}\nDone."
    items = OutputItems(tools=True)
    events = []
    for i in range(0, len(text), piece):
        events += items.feed(text[i:i + piece], None)
    events += items.feed("", "stop")
    without_ids = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items.parts]
    assert without_ids == [
        {"type": "message", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "status": "completed", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "message", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "\nDone.", "annotations": []}]}]  # as the model wrote it
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == '{"city": "Paris"}'
    # what previous_response_id continues is the chat of the same items sent back whole
    question = {"role": "user", "content": "Weather in Paris?"}
    asked = conversation(ResponsesRequest(model="m", input=[question]), [])
    assert continued(asked, items.parts) == conversation(ResponsesRequest(model="m", input=[question, *items.parts]), [])
    assert [(m.role, m.text, len(m.tool_calls or [])) for m in continued(asked, items.parts)] == [
        ("user", "Weather in Paris?", 0), ("assistant", "Checking.", 1), ("assistant", "\nDone.", 0)]


def test_a_call_the_output_leaves_unclosed_is_an_incomplete_item_streamed_or_not():
    """Unconstrained output (TensorRT-LLM's `auto`) may end inside a call whose name went out:
    it was a `completed` function_call with arguments that are no JSON (found by QA)."""
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    whole, streamed = OutputItems(tools=True), OutputItems(tools=True)
    whole.feed(text, "stop")
    events = [e for i in range(0, len(text), 5) for e in streamed.feed(text[i:i + 5], None)] + streamed.feed("", "stop")
    for items in (whole, streamed):
        assert [(i["type"], i["status"]) for i in items.parts] == [("message", "completed"),
                                                                    ("function_call", "incomplete")]
    assert events[-1]["type"] == "response.output_item.done" and events[-1]["item"]["status"] == "incomplete"


def test_the_response_echoes_what_the_request_set():
    """As OpenAI's object: the SDK's Response type has these fields (found by QA: not echoed)."""
    body = ResponsesRequest(model="m", input="hi", top_logprobs=2, max_tool_calls=3, service_tier="auto",
                            safety_identifier="u1", prompt_cache_key="k", prompt_cache_retention="24h",
                            reasoning={"effort": "low"})
    echoed = response_body(body, "resp_1", 0, "m")
    assert {k: echoed[k] for k in ("top_logprobs", "max_tool_calls", "background", "service_tier", "safety_identifier",
                                   "prompt_cache_key", "prompt_cache_retention")} == {
        "top_logprobs": 2, "max_tool_calls": 3, "background": False, "service_tier": "default",
        "safety_identifier": "u1", "prompt_cache_key": "k", "prompt_cache_retention": "24h"}
    assert echoed["reasoning"]["effort"] == "low"
    assert response_body(ResponsesRequest(model="m", input="hi"), "resp_2", 0, "m")["reasoning"] == {
        "effort": None, "summary": None}


def test_an_answer_cut_short_leaves_its_item_incomplete():
    items = OutputItems(tools=False)
    items.feed("Once upon", None)
    events = items.feed(" a time", "length")
    assert items.parts[0]["status"] == "incomplete" and items.parts[0]["content"][0]["text"] == "Once upon a time"
    assert events[-1]["type"] == "response.output_item.done" and events[-1]["item"]["status"] == "incomplete"


def _turns(*turns: str) -> list[dict]:
    """Input items: per turn, a user question and the assistant's answer, both `turn` repeated."""
    items = []
    for turn in turns:
        items += [{"role": "user", "content": f"{turn}?"},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": turn}]}]
    return items


def _window(limit: int):
    """A stand-in for the chat pipeline: the chat's text, or the context-length error the pipeline
    raises when it is over `limit` characters."""
    def build(chat):
        text = "|".join(m.text for m in chat.messages)
        if len(text) > limit:
            raise ApiError(400, "messages: too long", "messages", code="context_length_exceeded")
        return text
    return build


@pytest.mark.parametrize("limit, kept", [(100, "abc"), (99, "bc"), (73, "bc"), (72, "c"), (46, "c"), (45, ""),
                                         (19, "")])
def test_auto_truncation_keeps_the_latest_whole_turns_that_fit_and_the_system_messages(limit, kept):
    items = [{"role": "developer", "content": "rules"}, *_turns("a" * 12, "b" * 12, "c" * 12),
             {"role": "user", "content": "now"}]
    body = ResponsesRequest(model="m", instructions="Be brief.", truncation="auto", input=items)
    messages = conversation(body, [])
    text, kept_messages = fitted(body, chat_request(body, messages), messages, _window(limit))
    assert "|".join(m.text for m in chat_request(body, kept_messages).messages) == text
    # each turn is 27 characters of the 100 the whole chat has, the instructions, rules and "now" 19
    assert text == "|".join(["Be brief.", "rules", *(f"{t * 12}?|{t * 12}" for t in kept), "now"])


def test_a_chat_too_long_without_auto_truncation_or_even_its_last_turn_is_the_error():
    body = ResponsesRequest(model="m", input=_turns("aaaa", "bbbb"))
    messages = conversation(body, [])
    with pytest.raises(ApiError, match="too long"):
        fitted(body, chat_request(body, messages), messages, _window(12))
    auto = body.model_copy(update={"truncation": "auto"})
    assert fitted(auto, chat_request(auto, messages), messages, _window(12))[0] == "bbbb?|bbbb"
    with pytest.raises(ApiError, match="too long"):
        fitted(auto, chat_request(auto, messages), messages, _window(5))


def test_auto_truncation_of_a_long_chat_renders_little_more_than_what_fits():
    """Past the whole chat, no chat tried is over twice the turns of the one kept (bisecting from
    the whole chat rendered half of it first: 10 s of the Ingress for 20,000 messages)."""
    body = ResponsesRequest(model="m", truncation="auto", input=_turns(*(f"{i:03d}" for i in range(300))))
    messages, tried = conversation(body, []), []
    window = _window(60)

    def build(chat):
        tried.append(len(chat.messages))
        return window(chat)

    _, kept = fitted(body, chat_request(body, messages), messages, build)
    assert len(kept) == 12 and tried[0] == len(messages) == 600  # 6 turns of "294?|294", joined by "|"
    assert max(tried[1:]) <= 2 * len(kept) and len(tried) < 12


def test_an_engine_refusing_logprobs_names_the_field_a_responses_client_sent():
    from deploy.responses import FIELDS  # TensorRT-LLM refuses logprobs as RequestError("logprobs")

    assert ApiError(400, "logprobs: not supported", "logprobs").renamed(FIELDS).param == "include"


def test_an_error_names_every_field_by_a_path_as_the_client_sent_it():
    """Fields a message names beside its own, by a path, are the other API's too (a review:
    `min_tokens` beside a format named chat's `response_format.json_schema.schema`)."""
    from deploy import messages, responses

    beside = ApiError(400, "min_tokens: not with a constrained output (tools[2].function.parameters); see e.g. "
                           "response_format.json_schema.schema", "min_tokens")
    assert beside.renamed(responses.FIELDS).message == (
        "min_tokens: not with a constrained output (tools[2].parameters); see e.g. text.format.schema")
    assert beside.renamed(messages.FIELDS).message == (
        "min_tokens: not with a constrained output (tools[2].input_schema); see e.g. output_config.format.schema")
    own = ApiError(400, "tools[1].function.parameters: refused", "tools[1].function.parameters").renamed(messages.FIELDS)
    assert (own.param, own.message) == ("tools[1].input_schema", "tools[1].input_schema: refused")


def test_an_items_own_status_is_listed():
    cut = {"type": "message", "role": "assistant", "id": "msg_1", "status": "incomplete",
           "content": [{"type": "output_text", "text": "Par"}]}
    assert [i["status"] for i in input_items(ResponsesRequest(model="m", input=[cut, {"role": "user", "content": "?"}]))] \
        == ["incomplete", "completed"]


def test_the_items_a_request_references_may_hold_no_more_than_a_body():
    """A request of 1 KB naming ten stored messages of 1 MB each had the Ingress tokenize 10 MB
    (15 s of its CPU, 2 GB of its memory: QA); what the references bring is held to the body
    limit, as if sent whole."""
    big = {"type": "message", "role": "user", "id": "msg_big", "content": "x" * 600}
    small = {**big, "id": "msg_small", "content": "hi"}
    body = ResponsesRequest(model="m", input=[{"type": "item_reference", "id": i} for i in ("msg_big", "msg_small")])
    stored = {"msg_big": big, "msg_small": small}
    assert [i.text for i in with_items(body, stored, max_bytes=1024).items] == ["x" * 600, "hi"]
    twice = ResponsesRequest(model="m", input=[{"type": "item_reference", "id": "msg_big"}, {"id": "msg_big"}])
    with pytest.raises(ApiError) as refused:
        with_items(twice, stored, max_bytes=1024)
    assert (refused.value.status, refused.value.param) == (413, "input")
    assert "the items it references come to" in refused.value.message


def test_an_id_names_one_item_in_the_conversation_references_resolved():
    said = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
            "content": [{"type": "output_text", "text": "Hi.", "annotations": []}]}
    body = ResponsesRequest(model="m", input=[{"type": "item_reference", "id": "msg_1"}, said])
    assert repeated_id(body.items) is None  # a reference names an item, not a second one
    assert repeated_id(with_items(body, {"msg_1": said}).items) == ("input[1].id", "'msg_1' is input[0]'s id too")
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "c1", "output": "18 C"}
    assert repeated_id(ResponsesRequest(model="m", input=[call, result]).items, ["fc_1"]) == (
        "input[0].id", "'fc_1' is the id of an item of the previous_response_id response")
    assert repeated_id(ResponsesRequest(model="m", input=[result]).items, ["fc_1"]) is None


def test_vllms_length_settings_reach_the_chat_a_responses_or_messages_request_means():
    """What load generators send to every API (guidellm, aiperf: each was a 400 here): vLLM's
    `ignore_eos` and `min_tokens`, a Responses request's `stop` (null from guidellm) and chat's
    `stream_options.include_usage` (the usage is in the last event anyway)."""
    import pydantic

    from deploy.messages import MessagesRequest
    from deploy.messages import chat_request as messages_chat

    body = ResponsesRequest(model="m", input="hi", ignore_eos=True, min_tokens=3, stop=["\n\n"], stream=True,
                            stream_options={"include_usage": True})
    chat = chat_request(body, conversation(body, []))
    assert (chat.ignore_eos, chat.min_tokens, chat.stop) == (True, 3, ["\n\n"])
    plain = ResponsesRequest(model="m", input="hi", stop=None)
    assert chat_request(plain, conversation(plain, [])).stop is None
    for stop, says in ((["a", "b", "c", "d", "e"], "at most 4 stop strings"), ("", "must not be empty")):
        with pytest.raises(pydantic.ValidationError, match=says):  # a 400 naming `stop` (was a 500)
            ResponsesRequest(model="m", input="hi", stop=stop)
    chat = messages_chat(MessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                         ignore_eos=True, min_tokens=3))
    assert (chat.ignore_eos, chat.min_tokens) == (True, 3)


def test_what_codex_sends_is_taken_or_refused_by_name():
    """Codex CLI sends `client_metadata` (its session's ids) with every request: taken (was a
    400 before the model ran, found by QA); a hosted tool (its `web_search`) is refused saying
    so, not as a literal mismatch."""
    import pydantic

    from deploy.errors import param_from_loc

    ResponsesRequest(model="m", input="hi", client_metadata={"session_id": "s", "turn_id": "t"})
    for tools, at in (([{"type": "function", "name": "f"}, {"type": "web_search", "external_web_access": False}],
                       "tools[1].type"),
                      ([{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}],
                       "tools[0].tools[0].type")):
        with pytest.raises(pydantic.ValidationError) as info:
            ResponsesRequest(model="m", input="hi", tools=tools)
        error = info.value.errors()[0]  # (the 400's: the first)
        assert param_from_loc(error["loc"]) == at
        assert "'web_search' tools are not served here" in error["msg"]


def test_a_namespaces_functions_are_offered_by_their_own_names_and_their_calls_name_it():
    """Codex's multi-agent tools come as a `namespace` of functions (a 400 before): the chat
    offers each function, a call of one names its namespace, and an error in one names its
    path in the request; a name is one function's among all namespaces."""
    import pydantic

    from deploy.responses import fields

    spawn = {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}
    agents = {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents",
              "tools": [spawn, {**spawn, "name": "close_agent"}]}
    body = ResponsesRequest(model="m", input="hi", tools=[agents, {"type": "function", "name": "exec_command"}],
                            tool_choice={"type": "function", "name": "close_agent"})
    chat = chat_request(body, conversation(body, []))
    assert [t.function.name for t in chat.tools] == ["spawn_agent", "close_agent", "exec_command"]
    assert [t.function.description for t in chat.tools] == ["sub-agents", "sub-agents", None]
    assert chat.tool_choice.function.name == "close_agent"
    assert response_body(body, "resp_1", 0, "m")["tools"][0]["tools"][1]["name"] == "close_agent"
    items = OutputItems(True, namespaces=body.namespaces)
    assert [items.call_part(n).get("namespace") for n in ("close_agent", "exec_command")] == ["multi_agent_v1", None]
    bad = ApiError(400, "tools[2].function.parameters: refused", "tools[2].function.parameters").renamed(fields(body))
    assert bad.param == "tools[1].parameters"
    bad = ApiError(400, "tools[1].function.parameters: refused", "tools[1].function.parameters").renamed(fields(body))
    assert (bad.param, bad.message) == ("tools[0].tools[1].parameters", "tools[0].tools[1].parameters: refused")
    for tools in ([agents, {**spawn, "type": "function"}], [agents, {**agents, "name": "other"}]):
        with pytest.raises(pydantic.ValidationError, match="repeated: close_agent, spawn_agent|repeated: spawn_agent"):
            ResponsesRequest(model="m", input="hi", tools=tools)
    with pytest.raises(pydantic.ValidationError, match="'nope', which is not among the tools"):
        ResponsesRequest(model="m", input="hi", tools=[agents], tool_choice={"type": "function", "name": "nope"})
