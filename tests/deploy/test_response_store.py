"""`deploy/response_store.py` and `deploy/background.py` without a server: what the store
keeps (references, input items, background responses' statuses), the Ingress's side of it
(timeouts, an unreachable store), and an Ingress replica's stop with background runs."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError

from deploy import response_store
from deploy.auth import KEY_OWNER
from deploy.errors import ApiError
from deploy.response_items import input_items
from deploy.response_store import KeptResponses, ResponseStore, input_item_list
from deploy.responses import ResponsesRequest, conversation, references, with_items
from tests.polling import async_wait_until


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


def test_a_response_and_its_items_are_found_by_their_owners_requests_alone():
    """With API keys, what one key stored another key's requests cannot read, continue, cancel
    or delete, nor reach by an item id it repeats: to them it is not kept."""
    store, run = ResponseStore(capacity=4), asyncio.run
    item = {"id": "msg_shared", "type": "message", "text": "alice's"}
    run(store.put({"id": "resp_a", "output": [item], "status": "in_progress"}, [], [], "alice"))
    run(store.put({"id": "resp_b", "output": [], "status": "completed"}, [], [{**item, "text": "bob's"}], "bob"))
    assert run(store.get("resp_a", "bob")) is None and run(store.get("resp_a", "")) is None
    assert run(store.get("resp_a", "alice"))[0]["id"] == "resp_a"
    # the newest holder of an id is bob's, yet alice reads her own
    assert run(store.items(["msg_shared"], "alice"))["msg_shared"]["text"] == "alice's"
    assert run(store.items(["msg_shared"], "bob"))["msg_shared"]["text"] == "bob's"
    assert run(store.items(["msg_shared"], "carol")) == {}
    assert run(store.cancel("resp_a", "bob")) is None and not run(store.delete("resp_a", "bob"))
    assert run(store.get("resp_a", "alice"))[0]["status"] == "in_progress" and run(store.stopped(["resp_a"])) == []
    assert run(store.delete("resp_a", "alice")) and run(store.items(["msg_shared"], "alice")) == {}


@pytest.mark.filterwarnings("ignore:coroutine 'HttpIngress.__del__' was never awaited")
def test_the_ingress_asks_the_store_as_its_requests_key():
    """`KeptResponses` names the owner `auth.KEY_OWNER` holds for the request being served, in a
    background run too (a context of its own) and in the failed status its replica's stop keeps."""
    store = ResponseStore(capacity=4)
    kept, ingress = KeptResponses(_Handle(store), 4), _ingress(store)
    started = []

    async def scenario():
        await _as_owner("alice", kept.put({"id": "resp_a", "output": []}, [], []))
        await _as_owner("alice", ingress.background.start(_queued("resp_run"), [], _long_run(started)))
        assert await async_wait_until(lambda: store._status("resp_run") == "in_progress", 5)
        for rid in ("resp_a", "resp_run"):
            with pytest.raises(ApiError) as info:
                await _as_owner("bob", kept.get(rid))
            assert info.value.status == 404
        await ingress.__del__()
        return await _as_owner("alice", kept.get("resp_run"))

    assert asyncio.run(scenario())[0]["status"] == "failed"
    gc.collect()  # the ingress, in a cycle through its runs' contexts: finalized under this test's filter


@pytest.mark.filterwarnings("ignore:coroutine 'HttpIngress.__del__' was never awaited")
def test_another_keys_delete_stops_no_run():
    """The replica running a background response stopped it at another key's DELETE before the
    store answered that key 404 (the run then failed as lost, 30 s later: QA)."""
    store = ResponseStore(capacity=4)
    ingress = _ingress(store)
    started = []

    async def scenario():
        await _as_owner("alice", ingress.background.start(_queued("resp_run"), [], _long_run(started)))
        assert await async_wait_until(lambda: store._status("resp_run") == "in_progress", 5)
        with pytest.raises(ApiError) as info:
            await _as_owner("bob", ingress.background.delete("resp_run"))
        assert info.value.status == 404
        await asyncio.sleep(0.1)
        assert not started[0].done() and store._status("resp_run") == "in_progress"
        await _as_owner("alice", ingress.background.delete("resp_run"))
        assert await async_wait_until(lambda: started[0].done(), 5)
        await ingress.__del__()

    asyncio.run(scenario())
    assert started[0].cancelled()
    gc.collect()  # as above


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


def _long_run(started: list):
    """A background run's generation, far from done: begun, then an hour's wait; each run's
    task in `started`."""
    async def generate(begun):
        started.append(asyncio.current_task())
        await begun()
        await asyncio.sleep(3600)

    return generate


async def _as_owner(owner: str, step):
    """`step` awaited as a request of `owner`'s key: in a task of its own whose auth.KEY_OWNER is it."""
    async def run():
        KEY_OWNER.set(owner)
        return await step

    return await asyncio.create_task(run())


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
    store fails one no replica has asked about for ORPHANED_S; a replica's polls keep its own.
    Failed so, it stays failed: a run still alive is stopped at its next poll and what it puts
    is dropped, deleted or not. A pause of the store's own (no call at all) counts for no one."""
    now = [0.0]
    monkeypatch.setattr(response_store, "time", SimpleNamespace(monotonic=lambda: now[0]))
    store, run = ResponseStore(capacity=4), asyncio.run
    running = {"output": [], "status": "in_progress", "error": None}
    for rid in ("resp_alive", "resp_orphan"):
        run(store.put({"id": rid, **running}, [], []))
    for _ in range(int(response_store.ORPHANED_S) + 2):  # resp_alive's replica asks every second
        now[0] += 1.0
        assert run(store.stopped(["resp_alive"])) == []
    alive, orphan = (run(store.get(rid))[0] for rid in ("resp_alive", "resp_orphan"))
    assert alive["status"] == "in_progress"
    assert orphan["status"] == "failed" and "was lost" in orphan["error"]["message"]
    for late in ({**running}, {**running, "status": "completed"}):  # its run was alive after all
        run(store.put({"id": "resp_orphan", **late}, [], []))
        assert run(store.get("resp_orphan"))[0] == orphan
    assert run(store.stopped(["resp_orphan", "resp_alive"])) == ["resp_orphan"]
    assert run(store.delete("resp_orphan"))
    run(store.put({"id": "resp_orphan", **running, "status": "completed"}, [], []))
    assert run(store.get("resp_orphan")) is None
    now[0] += 10 * response_store.ORPHANED_S  # the store heard from no one meanwhile (stalled)
    assert run(store.get("resp_alive"))[0]["status"] == "in_progress"
    run(store.put({"id": "resp_alive", "output": [], "status": "completed", "error": None}, [], []))
    assert run(store.get("resp_alive"))[0]["status"] == "completed"


# Python's own finalizer calls the coroutine destructor too, and drops it (as Serve's wrapper's)
@pytest.mark.filterwarnings("ignore:coroutine 'HttpIngress.__del__' was never awaited")
def test_an_ingress_that_stops_stops_its_background_runs_and_keeps_them_as_failed():
    """Its background runs die with it: its graceful stop cancels them (in the engine too) and
    keeps them as failed, so a client polling one is not left waiting on `in_progress`. Serve's
    ingress wrapper awaits the destructor only if it is a coroutine function."""
    import inspect

    from deploy.routes import HttpIngress

    assert inspect.iscoroutinefunction(HttpIngress.__del__)
    store = ResponseStore(capacity=4)
    ingress = _ingress(store)
    started = []

    async def scenario():
        for rid in ("resp_run", "resp_new_store", "resp_done"):
            await ingress.background.start(_queued(rid), [{"id": "msg_in"}], _long_run(started))
        assert await async_wait_until(lambda: store._status("resp_new_store") == "in_progress", 5)
        store._forget("resp_new_store")  # as a redeploy that started the store anew before this replica's stop
        await store.put({**_queued("resp_done"), "status": "completed"}, [], [])  # its last put landed first
        await ingress.__del__()

    asyncio.run(scenario())
    for rid in ("resp_run", "resp_new_store"):
        failed, kept_inputs = asyncio.run(store.get(rid))[0::2]
        assert failed["status"] == "failed" and "stopped" in failed["error"]["message"]
        assert kept_inputs == [{"id": "msg_in"}]
    assert asyncio.run(store.get("resp_done"))[0]["status"] == "completed"
    assert all(task.cancelled() for task in started)  # their generations (the engine streams with them) stopped


def _ingress(store: ResponseStore):
    from deploy.config import IngressConfig
    from deploy.routes import HttpIngress
    from tests.deploy.fakes import fake_args

    return HttpIngress(SimpleNamespace(options=lambda **_: None), _Handle(store), IngressConfig.from_args(fake_args()))


def _queued(response_id: str) -> dict:
    return {"id": response_id, "output": [], "status": "queued", "error": None, "background": True}


@pytest.mark.filterwarnings("ignore:coroutine 'HttpIngress.__del__' was never awaited")
@pytest.mark.parametrize("stop", ["cancel made in the store", "delete through this replica"])
def test_a_run_stops_at_its_replicas_next_poll_or_at_once_on_its_own_replica(monkeypatch, stop):
    """A cancel made through another replica reaches the run through the store (the replica's
    poll); a delete through its own replica stops it before any poll."""
    from deploy import background

    polls = []
    monkeypatch.setattr(background, "BACKGROUND_POLL_S", 0.01 if stop.startswith("cancel") else 3600.0)
    store = ResponseStore(capacity=4)
    handle = _Handle(store)
    ingress = _ingress(store)
    ingress.background._stored._store = SimpleNamespace(**{
        m: getattr(handle, m) for m in ("put", "get", "cancel", "delete", "fail_if_running")},
        stopped=SimpleNamespace(remote=lambda ids: polls.append(ids) or store.stopped(ids)))
    started = []

    async def scenario():
        await ingress.background.start(_queued("resp_x"), [], _long_run(started))
        assert await async_wait_until(lambda: store._status("resp_x") == "in_progress", 5)
        if stop.startswith("cancel"):
            await store.cancel("resp_x")
        else:
            await ingress.background.delete("resp_x")
        assert await async_wait_until(lambda: started[0].done(), 5)

    asyncio.run(scenario())
    assert started[0].cancelled() and bool(polls) == stop.startswith("cancel")
