"""`deploy/responses.py` without a server: Responses input items as the chat they mean, and the
output items (and stream events) made from a model's text."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError

from deploy import response_store
from deploy.errors import ApiError
from deploy.response_store import KeptResponses, ResponseStore, input_item_list
from deploy.response_items import OutputItems, input_items, response_body
from deploy.responses import (
    ResponsesRequest, chat_request, continued, conversation, fitted, references, repeated_id, unmatched_call,
    with_items,
)
from tests.polling import async_wait_until

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


class _GoneStore:
    """A fake handle to the ResponseStore deployment whose replica cannot be reached."""

    def __getattr__(self, method: str):
        async def remote(*args):
            raise DeploymentUnavailableError(DeploymentID(name="ResponseStore", app_name="agent"))
        return SimpleNamespace(remote=remote)


@pytest.mark.parametrize("call", ["get", "delete"])
def test_an_unreachable_store_is_a_503_that_names_the_store(call):
    with pytest.raises(ApiError) as info:
        asyncio.run(getattr(KeptResponses(_GoneStore(), 4), call)("resp_1"))
    assert info.value.status == 503 and "response store" in info.value.message
    asyncio.run(KeptResponses(_GoneStore(), 4).put({"id": "resp_1"}, [], []))  # the answer is made: logged, not failed


def test_referenced_items_are_the_stored_ones_and_go_with_their_response():
    """`item_reference` input names an output item of a kept response: it reads as that item
    sent whole, and is gone once its response is evicted or deleted."""
    store = ResponseStore(capacity=2)
    answer = {"id": "msg_a", "type": "message", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]}
    call = {"id": "fc_a", "type": "function_call", "status": "completed", "call_id": "c1", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}
    asyncio.run(store.put({"id": "resp_a", "output": [answer, call]}, [], []))
    ask, result = {"role": "user", "content": "Weather in Paris?"}, {"type": "function_call_output",
                                                                    "call_id": "c1", "output": "18 C"}
    by_ref = ResponsesRequest(model="m", input=[ask, {"type": "item_reference", "id": "msg_a"},
                                                {"type": "item_reference", "id": "fc_a"}, result])
    whole = ResponsesRequest(model="m", input=[ask, answer, call, result])
    assert references(by_ref) == {"input[1].id": "msg_a", "input[2].id": "fc_a"} and references(whole) == {}
    kept = KeptResponses(SimpleNamespace(items=SimpleNamespace(remote=store.items)), 2)
    resolved = with_items(by_ref, asyncio.run(kept.items(references(by_ref))))
    assert conversation(resolved, []) == conversation(whole, [])
    for evicting in ("resp_b", "resp_c"):
        asyncio.run(store.put({"id": evicting, "output": [{**answer, "id": f"msg_{evicting}"}]}, [], []))
    assert asyncio.run(store.items(["msg_a", "fc_a", "msg_resp_b"])) == {"msg_resp_b": {**answer, "id": "msg_resp_b"}}
    assert asyncio.run(store.delete("resp_b")) and asyncio.run(store.items(["msg_resp_b"])) == {}
    with pytest.raises(ApiError) as info:
        asyncio.run(kept.items({"input[1].id": "msg_a"}))
    assert (info.value.status, info.value.param, info.value.code) == (400, "input[1].id", "item_not_found")


def test_input_items_are_listed_as_the_sdk_types_them_page_by_page():
    from openai.types.responses import ResponseItemList

    body = ResponsesRequest(model="m", input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "async": False},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"role": "assistant", "content": "18 C in Paris."}])  # listed as an output_text part (annotations and all)
    items = input_items(body)
    assert [i["type"] for i in items] == ["message", "message", "function_call", "function_call_output", "message"]
    assert items[1]["id"] == "msg_1" and len({i["id"] for i in items}) == 5  # its own id kept, the others new
    assert items[2]["async"] is False  # as the API spells it, not async_
    assert items[0]["content"] == [{"type": "input_text", "text": "Weather in Paris?"}]
    newest_first = ResponseItemList.model_validate(input_item_list(items))  # every field the SDK's type requires
    assert [i.id for i in newest_first.data] == [i["id"] for i in reversed(items)] and not newest_first.has_more
    pages, after = [], None
    while True:
        page = input_item_list(items, limit=3, order="asc", after=after)
        pages.append([i["id"] for i in page["data"]])
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert pages == [[i["id"] for i in items[:3]], [i["id"] for i in items[3:]]]
    assert input_items(ResponsesRequest(model="m", input="Hi"))[0]["content"] == [{"type": "input_text", "text": "Hi"}]
    for bad, param in ((dict(limit=0), "limit"), (dict(order="up"), "order"), (dict(after="msg_none"), "after")):
        with pytest.raises(ApiError) as info:
            input_item_list(items, **bad)
        assert (info.value.status, info.value.param) == (400, param)


def test_a_reference_lives_as_long_as_a_kept_response_holds_its_item():
    """A conversation that sends its earlier answers back by reference (the Vercel AI SDK's way)
    holds them in each follow-up's input items: they outlive the response that made them."""
    store = ResponseStore(capacity=2)
    answer = {"id": "msg_a", "type": "message", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hi.", "annotations": []}]}
    asyncio.run(store.put({"id": "resp_1", "output": [answer]}, [], []))
    follow_up = ResponsesRequest(model="m", input=[{"role": "user", "content": "Hello"}, {"id": "msg_a"},
                                                   {"role": "user", "content": "And?"}])  # `type` is optional
    assert references(follow_up) == {"input[1].id": "msg_a"}
    resolved = with_items(follow_up, asyncio.run(store.items(["msg_a"])))
    asyncio.run(store.put({"id": "resp_2", "output": []}, [], input_items(resolved)))
    asyncio.run(store.put({"id": "resp_other", "output": []}, [], []))  # resp_1 evicted
    assert asyncio.run(store.get("resp_1")) is None and asyncio.run(store.items(["msg_a"])) == {"msg_a": answer}
    asyncio.run(store.delete("resp_2"))
    assert asyncio.run(store.items(["msg_a"])) == {}
    # a client's id may name other text in another response: a reference reads the newest
    # holder's, and a deleted response's text is gone with it
    for rid, text in (("resp_x", "secret"), ("resp_y", "public")):
        asyncio.run(store.put({"id": rid, "output": []}, [], [{"id": "shared", "type": "message", "text": text}]))
    assert asyncio.run(store.items(["shared"]))["shared"]["text"] == "public"
    asyncio.run(store.delete("resp_x"))
    assert asyncio.run(store.items(["shared"]))["shared"]["text"] == "public"
    asyncio.run(store.delete("resp_y"))
    assert asyncio.run(store.items(["shared"])) == {}
    assert references(ResponsesRequest(model="m", input=[{"type": None, "id": "msg_a"}])) == {"input[0].id": "msg_a"}


def test_a_store_that_does_not_answer_is_a_503_in_time(monkeypatch):
    """Serve queues a call while the store's replica restarts: a lookup waits a bounded time, a
    put (the answer made) is logged."""
    monkeypatch.setattr(response_store, "STORE_TIMEOUT_S", 0.05)

    async def never(*args):
        await asyncio.Event().wait()

    silent = SimpleNamespace(**{m: SimpleNamespace(remote=never) for m in ("get", "items", "put", "delete")})
    with pytest.raises(ApiError) as info:
        asyncio.run(KeptResponses(silent, 4).get("resp_1"))
    assert info.value.status == 503 and "did not answer" in info.value.message
    asyncio.run(KeptResponses(silent, 4).put({"id": "resp_1"}, [], []))


def test_an_engine_refusing_logprobs_names_the_field_a_responses_client_sent():
    from deploy.responses import FIELDS  # TensorRT-LLM refuses logprobs as RequestError("logprobs")

    assert ApiError(400, "logprobs: not supported", "logprobs").renamed(FIELDS).param == "include"


def test_an_items_own_status_is_listed():
    cut = {"type": "message", "role": "assistant", "id": "msg_1", "status": "incomplete",
           "content": [{"type": "output_text", "text": "Par"}]}
    assert [i["status"] for i in input_items(ResponsesRequest(model="m", input=[cut, {"role": "user", "content": "?"}]))] \
        == ["incomplete", "completed"]


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


class _Handle:
    """A ResponseStore called as a deployment handle calls it (`handle.method.remote(...)`)."""

    def __init__(self, store: ResponseStore) -> None:
        self._store = store

    def __getattr__(self, method: str):
        return SimpleNamespace(remote=getattr(self._store, method))


def test_a_cancelled_or_deleted_background_response_stays_so_whatever_its_run_puts_later():
    store = ResponseStore(capacity=3)
    run = asyncio.run
    for rid in ("resp_c", "resp_d", "resp_e"):
        run(store.put({"id": rid, "output": [], "status": "queued"}, [], []))
    run(store.put({"id": "resp_c", "output": [], "status": "in_progress"}, [], []))
    assert run(store.cancel("resp_c"))["status"] == "cancelled" and run(store.stopped(["resp_c", "resp_e"])) == ["resp_c"]
    run(store.put({"id": "resp_c", "output": [], "status": "completed"}, [], []))  # the run's last put, too late
    assert run(store.get("resp_c"))[0]["status"] == "cancelled"
    assert run(store.cancel("resp_c"))["status"] == "cancelled"  # again: as it is
    assert run(store.delete("resp_d")) and run(store.stopped(["resp_d"])) == ["resp_d"]
    run(store.put({"id": "resp_d", "output": [], "status": "completed"}, [], []))
    assert run(store.get("resp_d")) is None
    # newer responses evict the oldest that have ended, not one still running (its poll would 404)
    for rid in ("resp_f", "resp_g", "resp_h"):
        run(store.put({"id": rid, "output": [], "status": "completed"}, [], []))
    assert [rid for rid in ("resp_c", "resp_e", "resp_f", "resp_g", "resp_h") if run(store.get(rid))] == \
        ["resp_e", "resp_g", "resp_h"]
    run(store.put({"id": "resp_e", "output": [], "status": "completed"}, [], []))  # it ends: then it may go
    run(store.put({"id": "resp_i", "output": [], "status": "completed"}, [], []))
    assert run(store.get("resp_g")) is None and run(store.get("resp_e"))[0]["status"] == "completed"
    assert run(store.cancel("resp_h"))["status"] == "completed" and run(store.cancel("resp_none")) is None


def test_a_running_background_response_its_replica_stopped_asking_about_is_failed(monkeypatch):
    """A killed Ingress replica's runs would stay in_progress (and in the store) for ever: the
    store fails one no replica has asked about for ORPHANED_S; a replica's polls keep its own."""
    now = [0.0]
    monkeypatch.setattr(response_store, "time", SimpleNamespace(monotonic=lambda: now[0]))
    store, run = ResponseStore(capacity=4), asyncio.run
    for rid in ("resp_alive", "resp_orphan"):
        run(store.put({"id": rid, "output": [], "status": "in_progress", "error": None}, [], []))
    for _ in range(3):  # the replica running resp_alive asks every second; nobody asks about resp_orphan
        now[0] += response_store.ORPHANED_S / 2
        assert run(store.stopped(["resp_alive"])) == []
    alive, orphan = (run(store.get(rid))[0] for rid in ("resp_alive", "resp_orphan"))
    assert alive["status"] == "in_progress"
    assert orphan["status"] == "failed" and "was lost" in orphan["error"]["message"]
    run(store.put({"id": "resp_alive", "output": [], "status": "completed", "error": None}, [], []))
    now[0] += 10 * response_store.ORPHANED_S  # an ended one is not failed later
    assert run(store.get("resp_alive"))[0]["status"] == "completed"


# Python's own finalizer calls the coroutine destructor too, and drops it (as Serve's wrapper's)
@pytest.mark.filterwarnings("ignore:coroutine 'HttpIngress.__del__' was never awaited")
def test_an_ingress_that_stops_stops_its_background_runs_and_keeps_them_as_failed():
    """Its background runs die with it: its graceful stop cancels them (in the engine too) and
    keeps them as failed, so a client polling one is not left waiting on `in_progress`. Serve's
    ingress wrapper awaits the destructor only if it is a coroutine function."""
    import inspect

    from deploy.config import IngressConfig
    from deploy.routes import HttpIngress
    from tests.deploy.fakes import fake_args

    assert inspect.iscoroutinefunction(HttpIngress.__del__)
    store = ResponseStore(capacity=4)
    ingress = HttpIngress(SimpleNamespace(options=lambda **_: None), _Handle(store),
                          IngressConfig.from_args(fake_args()))
    started = []

    async def scenario():
        async def generate(begun):
            started.append(asyncio.current_task())
            await begun()
            await asyncio.sleep(3600)  # an answer far from done

        for rid in ("resp_run", "resp_new_store"):
            queued = {"id": rid, "output": [], "status": "queued", "error": None, "background": True}
            await ingress.background.start(queued, [{"id": "msg_in"}], generate)
        assert await async_wait_until(lambda: store._status("resp_new_store") == "in_progress", 5)
        store._forget("resp_new_store")  # as a redeploy that started the store anew before this replica's stop
        await ingress.__del__()

    asyncio.run(scenario())
    for rid in ("resp_run", "resp_new_store"):
        failed, kept_inputs = asyncio.run(store.get(rid))[0::2]
        assert failed["status"] == "failed" and "stopped" in failed["error"]["message"]
        assert kept_inputs == [{"id": "msg_in"}]
    assert all(task.cancelled() for task in started)  # their generations (the engine streams with them) stopped
