"""The responses `/v1/responses` keeps (`store: true`, the default, as OpenAI's) for
`previous_response_id`, `item_reference` input, `GET`/`DELETE /v1/responses/{id}` and `GET
/v1/responses/{id}/input_items` (`input_item_list`: a page of them), and a background
response's status as it runs (`POST /v1/responses/{id}/cancel` stops it).

`ResponseStore` is a Serve deployment of its own: one replica per application, on the head
node beside Serve's controller (`deploy/app.py`), so a follow-up finds its response whichever
Ingress replica it reaches, and an Ingress replica that restarts loses nothing. It holds the
last `limits.stored_responses` in memory, oldest out first: they go with the head node or a
redeploy. Each belongs to the API key that made it (`auth.KEY_OWNER`): a request with another
key finds neither it nor its items, as if it were not kept. `KeptResponses` is an Ingress's
side of it: a missing response as the API's error.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, List, Optional

from deploy.auth import KEY_OWNER
from deploy.chat_protocol import ChatMessage
from deploy.errors import RETRY_AFTER_S, ApiError, server_error
from deploy.response_items import failed
from replicas.replica import DEPLOYMENT_NAME, LastSettings

logger = logging.getLogger(__name__)
# the response body, its conversation as chat messages, its input items (`response_items.input_items`)
Kept = tuple[dict[str, Any], List[ChatMessage], List[dict[str, Any]]]
RUNNING = ("queued", "in_progress")  # a background response's statuses before it ends
# A running background response its Ingress replica has not asked about for this long (it asks
# every second) is failed: that replica was lost. A store that itself heard from no one for
# STORE_PAUSE_S (its loop stalled) does not count that time against the replicas.
ORPHANED_S = 30.0
STORE_PAUSE_S = 5.0
# Longest an Ingress waits on the store: Serve queues a call while the store's one replica
# restarts, and a request waited as long, its answer made, for its put.
STORE_TIMEOUT_S = 10.0


class ResponseStore:
    """The last `capacity` stored responses, each with its conversation (input and output as
    chat messages, instructions left out) and its owner (`auth.KEY_OWNER`'s value as it was
    made; "" an open server's), which every read names. Its methods run on the replica's event
    loop, one at a time."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._engine_settings = LastSettings(DEPLOYMENT_NAME)  # the Replicas', forgotten with the app here too
        self._kept: collections.OrderedDict[str, Kept] = collections.OrderedDict()
        self._owners: dict[str, str] = {}  # response id -> its owner
        # item id -> {response id: the item as it holds it}, oldest first: the kept responses'
        # output items and input items, where a conversation's follow-ups hold its earlier
        # answers (sent back, or by reference), so a reference lives as long as the newest
        # response holding it, and reads as that one holds it (a client's id may name other
        # text in another response; a deleted response's is gone with it; another owner's is none)
        self._items: dict[str, dict[str, dict[str, Any]]] = {}
        # background responses ended here while they ran (cancelled, deleted, failed for a lost
        # replica; the latest `capacity`): their runs stop at their next poll, what they put is dropped
        self._stopped_runs: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._seen: dict[str, float] = {}  # running background responses: when their replica last asked
        self._last_call = time.monotonic()

    def __del__(self):
        """Serve's graceful stop awaits what this returns (`LastSettings.on_stop`): a Replica's
        own may never come (killed with a long stream at the end of its graceful timeout)."""
        settings = getattr(self, "_engine_settings", None)  # (an __init__ that raised)
        return settings.on_stop() if settings is not None else None

    async def put(self, body: dict[str, Any], messages: List[ChatMessage], inputs: List[dict[str, Any]],
                  owner: str = "") -> None:
        self._reap()
        if self.capacity <= 0 or body["id"] in self._stopped_runs:  # its run was ended here: it stays so
            return
        self._forget(body["id"])
        self._kept[body["id"]] = (body, messages, inputs)
        self._owners[body["id"]] = owner
        if body.get("status") in RUNNING:
            self._seen[body["id"]] = time.monotonic()
        for item in (*body["output"], *inputs):
            self._items.setdefault(item["id"], {})[body["id"]] = item
        while len(self._kept) > self.capacity:  # the oldest out, a background one only once it has ended
            oldest = next((rid for rid, kept in self._kept.items() if kept[0].get("status") not in RUNNING), None)
            if oldest is None:
                break
            self._forget(oldest)

    async def get(self, response_id: str, owner: str = "") -> Optional[Kept]:
        self._reap()
        return self._kept[response_id] if self._owned(response_id, owner) else None

    async def items(self, item_ids: List[str], owner: str = "") -> dict[str, dict[str, Any]]:
        """The kept items among `item_ids` that `owner`'s responses hold, by id (as the newest holds it)."""
        found = {}
        for item_id in item_ids:
            held = [item for rid, item in self._items.get(item_id, {}).items() if self._owners[rid] == owner]
            if held:
                found[item_id] = held[-1]
        return found

    async def delete(self, response_id: str, owner: str = "") -> bool:
        if not self._owned(response_id, owner):
            return False
        if self._status(response_id) in RUNNING:
            self._stop_run(response_id)
        return self._forget(response_id)

    async def fail_if_running(self, body: dict[str, Any], inputs: List[dict[str, Any]], owner: str = "") -> None:
        """`body` (failed) kept where its response still runs, or is not kept (a store started
        anew); one that ended first stays as it ended."""
        self._reap()
        if self._status(body["id"]) in (*RUNNING, None):
            await self.put(body, [], inputs, owner)

    async def cancel(self, response_id: str, owner: str = "") -> Optional[dict[str, Any]]:
        """The response, cancelled if it was running (None: not kept, or not `owner`'s)."""
        self._reap()
        kept = self._kept[response_id] if self._owned(response_id, owner) else None
        if kept is not None and kept[0].get("status") in RUNNING:
            self._ended(response_id, {**kept[0], "status": "cancelled"})
        return None if kept is None else self._kept[response_id][0]

    async def stopped(self, response_ids: List[str]) -> List[str]:
        """An Ingress replica's poll of the background responses it runs: those ended here
        (cancelled, deleted, failed for a lost replica): their runs stop. The others were seen now."""
        self._reap()
        now = time.monotonic()
        for rid in response_ids:
            if rid in self._seen:
                self._seen[rid] = now
        return [rid for rid in response_ids if rid in self._stopped_runs]

    def _reap(self) -> None:
        """Fail the running background responses whose replica stopped asking about them (a
        pause of the store's own not counted)."""
        now = time.monotonic()
        if now - self._last_call > STORE_PAUSE_S:
            for rid in self._seen:
                self._seen[rid] += now - self._last_call
        self._last_call = now
        lost = ApiError(503, "the Ingress replica that ran it was lost: create it again")
        for rid in [rid for rid, seen in self._seen.items() if now - seen > ORPHANED_S]:
            self._ended(rid, failed(self._kept[rid][0], lost))

    def _ended(self, response_id: str, body: dict[str, Any]) -> None:
        """A running background response ended here (cancelled, or its replica lost)."""
        self._kept[response_id] = (body, *self._kept[response_id][1:])
        self._seen.pop(response_id, None)
        self._stop_run(response_id)

    def _stop_run(self, response_id: str) -> None:
        self._stopped_runs[response_id] = None
        while len(self._stopped_runs) > self.capacity:
            self._stopped_runs.popitem(last=False)

    def _owned(self, response_id: str, owner: str) -> bool:
        return response_id in self._kept and self._owners[response_id] == owner

    def _status(self, response_id: str) -> Optional[str]:
        kept = self._kept.get(response_id)
        return None if kept is None else kept[0].get("status")

    def _forget(self, response_id: str) -> bool:
        self._seen.pop(response_id, None)
        kept = self._kept.pop(response_id, None)
        self._owners.pop(response_id, None)
        for item in (*kept[0]["output"], *kept[2]) if kept else ():
            holders = self._items.get(item["id"], {})
            holders.pop(response_id, None)
            if not holders:
                self._items.pop(item["id"], None)
        return kept is not None


class KeptResponses:
    """The store as the Ingress asks it, through `store` (a handle to the deployment), for the
    request being served: as its key's (`auth.KEY_OWNER`)."""

    def __init__(self, store: Any, capacity: int) -> None:
        self._store, self._capacity = store, capacity

    async def get(self, response_id: str, param: Optional[str] = None) -> Kept:
        """The kept response; a 404 (or, for a request's `param`, a 400) when there is none."""
        kept = await self._call("get", response_id)
        if kept is None:
            self._missing(response_id, param)
        return kept

    async def items(self, references: dict[str, str]) -> dict[str, dict[str, Any]]:
        """The kept output items `references` names (param -> item id), by id; a 400 naming the
        param of the first that is not kept."""
        found = await self._call("items", list(references.values()))
        for param, item_id in references.items():
            if item_id not in found:
                raise ApiError(400, f"{param}: no item {item_id!r} in a stored response (this server keeps the items "
                                    f"of the last {self._capacity} responses made with store=true)", param,
                               code="item_not_found")
        return found

    async def put(self, body: dict[str, Any], messages: List[ChatMessage], inputs: List[dict[str, Any]],
                  attempts: int = 1) -> None:
        """Keep a response (in `attempts` tries, a second apart). The answer has been made: a
        store that cannot take it is logged, not the request's failure."""
        for attempt in range(attempts):
            try:
                async with asyncio.timeout(STORE_TIMEOUT_S):  # (keeps a cancel, as wait_for may not: _following)
                    await self._store.put.remote(body, messages, inputs, KEY_OWNER.get())
                return
            except Exception as exc:  # noqa: BLE001
                if attempt + 1 == attempts:
                    logger.error("response %s was not stored: %r", body["id"], exc)
                else:
                    await asyncio.sleep(1.0)

    async def start(self, body: dict[str, Any], inputs: List[dict[str, Any]]) -> None:
        """Keep a background response as it is queued: before the client has its id (a 503 if
        the store cannot take it)."""
        await self._call("put", body, [], inputs)

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """The response, cancelled if it ran (a 404 if it is not kept)."""
        body = await self._call("cancel", response_id)
        if body is None:
            self._missing(response_id, None)
        return body

    async def stopped(self, response_ids: List[str]) -> List[str]:
        return await self._call("stopped", response_ids, owned=False)

    async def fail_if_running(self, body: dict[str, Any], inputs: List[dict[str, Any]]) -> None:
        await self._call("fail_if_running", body, inputs)

    async def delete(self, response_id: str) -> None:
        if not await self._call("delete", response_id):
            self._missing(response_id, None)

    async def _call(self, method: str, *args: Any, owned: bool = True) -> Any:
        """The store's `method(*args)`, `owned`: as this request's key's (its owner passed last)."""
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):
                return await getattr(self._store, method).remote(*args, *((KEY_OWNER.get(),) if owned else ()))
        except asyncio.TimeoutError:
            raise ApiError(503, f"the response store did not answer within {STORE_TIMEOUT_S:g} s, retry later",
                           retry_after_s=RETRY_AFTER_S) from None
        except Exception as exc:  # noqa: BLE001
            raise server_error(exc, "response store") from exc

    def _missing(self, response_id: str, param: Optional[str]) -> None:
        """A 404; a 400 with OpenAI's code for `previous_response_id`, which clients read to send
        the whole conversation again instead."""
        kept = f"(this server keeps the last {self._capacity} responses made with store=true)"
        if param is None:
            raise ApiError(404, f"no stored response {response_id!r} {kept}", None, code="response_not_found")
        raise ApiError(400, f"{param}: previous response with id {response_id!r} not found {kept}", param,
                       code="previous_response_not_found")


def input_item_list(items: list[dict[str, Any]], limit: int = 20, order: str = "desc",
                    after: Optional[str] = None) -> dict[str, Any]:
    """One page of a kept response's input items, as OpenAI lists them: `limit` (1-100) in
    `order` (asc or desc, the default), from the one after `after`."""
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit: must be in [1, 100], got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: must be 'asc' or 'desc', got {order!r}", "order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        start = next((i + 1 for i, item in enumerate(ordered) if item["id"] == after), None)
        if start is None:
            raise ApiError(400, f"after: no input item {after!r} in this response", "after")
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}
