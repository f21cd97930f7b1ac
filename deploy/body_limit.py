"""An ASGI middleware that refuses request bodies over a byte limit with a 413, and bodies that
take too long to arrive with a 408.

It reads the body itself (declared length first, then counted bytes, for chunked
uploads), so the application never buffers more than the limit, and replays it. A body
must arrive within `body_timeout_s`: each request waiting for its body holds one of the
Ingress's request slots, and a client that sent a byte of each of a thousand bodies held them
all, `/health` too, for as long as it kept the connections open (found by QA).
"""

from __future__ import annotations

import asyncio
from typing import Optional

from ray.exceptions import TaskCancelledError

from deploy.errors import ApiError, answer


class BodyLimit:
    def __init__(self, app, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            body, error = None, self._too_large()
        else:
            body, error = await self._read(receive)
        if error is not None:
            await answer(error, scope)(scope, receive, send)
        if body is None:
            return
        replayed = False

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

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body exceeds {self.max_body_bytes} bytes")

    async def _read(self, receive) -> tuple[Optional[bytes], Optional[ApiError]]:
        """(the body, None), or (None, the error it is answered with), or (None, None) where
        the client left."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None, None
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_body_bytes:
                        return None, self._too_large()
                    if not message.get("more_body", False):
                        return b"".join(chunks), None
        except TaskCancelledError:  # the client left before its body was in (as `replay` says below)
            return None, None
        except TimeoutError:
            return None, ApiError(408, f"request body not received within {self.body_timeout_s:g} s "
                                       f"({size} bytes came)")
