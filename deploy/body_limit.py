"""An ASGI middleware that refuses request bodies over a byte limit with a 413.

It reads the body itself (declared length first, then counted bytes, for chunked
uploads), so the application never buffers more than the limit, and replays it.
"""

from __future__ import annotations

from ray.exceptions import TaskCancelledError

from deploy.errors import ApiError, app_path, logged


class BodyLimit:
    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_large = ApiError(413, f"request body exceeds {self.max_body_bytes} bytes")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await logged(too_large, f"{scope.get('method')} {app_path(scope)}").response(app_path(scope))(
                scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await logged(too_large, f"{scope.get('method')} {app_path(scope)}").response(app_path(scope))(
                    scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            try:
                return await receive()  # later calls: wait for the disconnect
            except TaskCancelledError:
                # Serve's receive raises this once its proxy cancels a request whose client went
                # away (it returns a disconnect only for some ways of going): a streaming
                # response that waits on it then ended in a traceback Serve logs as "Future
                # exception was never retrieved", for every client that left mid-stream.
                return {"type": "http.disconnect"}

        await self.app(scope, replay, send)
