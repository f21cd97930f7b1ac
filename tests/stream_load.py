"""A bounded streaming load against the HTTP API, run beside the main thread.

The fault tests and `benchmarks/faults.py` kill replicas and nodes from the main thread
(Ray adds and removes nodes only there) while these streams run on a background thread's
event loop, each recording when its tokens arrived and how it ended.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

from tests.polling import wait_until


@dataclass
class StreamRecord:
    """One streamed completion as the client saw it."""

    started_s: float  # time.monotonic() when the request was sent
    token_times_s: list[float] = field(default_factory=list)  # arrival of each token
    tokens: list[str] = field(default_factory=list)  # the streamed logprobs' token texts
    choice_tokens: dict[int, list[str]] = field(default_factory=dict)  # the same by choice (`n`)
    text: str = ""
    status: Optional[int] = None
    error: Optional[str] = None  # an error event, a non-200 body or a transport failure
    done: bool = False  # ended with data: [DONE]

    @property
    def lost(self) -> bool:
        """The client did not get a whole answer."""
        return self.status != 200 or self.error is not None or not self.done

    def largest_gap_s(self) -> float:
        """The longest wait between two tokens (or before the first): a resume's extra latency."""
        times = [self.started_s] + self.token_times_s
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)


class StreamLoad:
    """`bodies` streamed at once to `url`/v1/completions (each body gets `stream` and
    `logprobs: 1` so every token is seen); `start()`, then `wait_tokens()` and `join()`."""

    def __init__(self, url: str, bodies: list[dict[str, Any]], headers: Optional[dict[str, str]] = None,
                 timeout_s: float = 120.0) -> None:
        self._url, self._headers, self._timeout_s = url, headers or {}, timeout_s
        self._bodies = [{**body, "stream": True, "logprobs": 1} for body in bodies]
        self.records = [StreamRecord(started_s=0.0) for _ in bodies]
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> "StreamLoad":
        self._thread.start()
        return self

    def wait_tokens(self, count: int, timeout_s: float) -> bool:
        """Whether every stream received at least `count` tokens (or ended) within `timeout_s`."""
        return wait_until(lambda: all(len(r.tokens) >= count or r.done or r.error is not None
                                      for r in self.records), timeout_s)

    def join(self, timeout_s: float) -> list[StreamRecord]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"streams still running after {timeout_s:.0f} s")
        return self.records

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=len(self._bodies))
        async with httpx.AsyncClient(base_url=self._url, headers=self._headers, timeout=self._timeout_s,
                                     limits=limits) as client:
            await asyncio.gather(*[self._one(client, body, record) for body, record in zip(self._bodies, self.records)])

    @staticmethod
    async def _one(client: httpx.AsyncClient, body: dict[str, Any], record: StreamRecord) -> None:
        record.started_s = time.monotonic()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                record.status = response.status_code
                if response.status_code != 200:
                    record.error = (await response.aread()).decode(errors="replace")
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        record.done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        record.error = json.dumps(event["error"])
                        continue
                    for choice in event["choices"]:
                        record.text += choice["text"]
                        if choice.get("logprobs"):
                            now = time.monotonic()
                            for token in choice["logprobs"]["tokens"]:
                                record.tokens.append(token)
                                record.choice_tokens.setdefault(choice["index"], []).append(token)
                                record.token_times_s.append(now)
        except httpx.HTTPError as exc:  # a cut connection: lost, and counted as such
            record.error = f"{type(exc).__name__}: {exc}"
