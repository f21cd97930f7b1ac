"""The body-limit middleware as an ASGI app sees it: the body replayed whole, then what the
server's own receive says (a client gone)."""

from __future__ import annotations

import asyncio

from ray.exceptions import TaskCancelledError

from deploy.body_limit import BodyLimit

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [(b"content-type", b"json")]}


def serve(server_messages: list, limit: int = 1024, timeout_s: float = 30.0) -> tuple[list, list]:
    """Run an app that reads the body, then waits on receive once more (as a streaming
    response listens for the client leaving), behind BodyLimit. -> (what the app received,
    what was sent)."""
    pending = list(server_messages)
    received, sent = [], []

    async def receive():
        if not pending:  # a client that sends no more
            await asyncio.sleep(3600)
        message = pending.pop(0)
        if isinstance(message, BaseException):
            raise message
        return message

    async def send(message):
        sent.append(message)

    async def app(scope, app_receive, app_send):
        received.append(await app_receive())
        received.append(await app_receive())

    asyncio.run(BodyLimit(app, limit, timeout_s)(SCOPE, receive, send))
    return received, sent


def test_the_body_is_replayed_whole_then_the_disconnect_passes_through():
    received, _ = serve([{"type": "http.request", "body": b'{"a":', "more_body": True},
                         {"type": "http.request", "body": b" 1}", "more_body": False},
                         {"type": "http.disconnect"}])
    assert received == [{"type": "http.request", "body": b'{"a": 1}', "more_body": False}, {"type": "http.disconnect"}]


def test_a_request_serve_cancelled_reads_as_a_disconnect():
    """Serve's receive raises TaskCancelledError once its proxy cancels the request of a client
    that left; a streaming response waiting on it ended in a traceback Serve logged as "Future
    exception was never retrieved" for every client that left mid-stream, and so did a client
    that left before its body was in (QA)."""
    received, _ = serve([{"type": "http.request", "body": b"{}", "more_body": False}, TaskCancelledError()])
    assert received[1] == {"type": "http.disconnect"}
    received, sent = serve([{"type": "http.request", "body": b"{", "more_body": True}, TaskCancelledError()])
    assert received == [] and sent == []  # nothing to answer: the client is gone


def test_a_body_over_the_limit_is_a_413_and_never_reaches_the_app():
    received, sent = serve([{"type": "http.request", "body": b"x" * 2048, "more_body": False}])
    assert received == [] and sent[0]["status"] == 413


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_never_reaches_the_app():
    """Each request waiting for its body holds an Ingress request slot: a client that sent one
    byte of each of a thousand bodies held them all, /health too (found by QA)."""
    received, sent = serve([{"type": "http.request", "body": b"{", "more_body": True}], timeout_s=0.05)
    assert received == [] and sent[0]["status"] == 408
    assert b"not received within 0.05 s (1 bytes came)" in sent[1]["body"]
