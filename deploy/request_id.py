"""Anthropic's `request-id` response header on its API's routes (`/v1/messages...`): the
anthropic SDK reads it into a message's `_request_id` and its errors' messages (Serve's proxy
sets only `x-request-id`). It is `req_` and Serve's request id, the `x-request-id` the client
sent or the proxy made, which Serve's logs carry: an id a user quotes from an SDK error is in
them. An ASGI middleware, outermost, so refusals carry it too."""

from __future__ import annotations

import uuid

from ray.serve.context import _get_serve_request_context

from deploy.errors import app_path


class RequestIdHeader:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not app_path(scope).startswith("/v1/messages"):
            await self.app(scope, receive, send)
            return
        request_id = _get_serve_request_context().request_id or uuid.uuid4().hex  # (none outside Serve)
        header = (b"request-id", f"req_{request_id}".encode())

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_header)
