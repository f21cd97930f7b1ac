"""When each HTTP request reached the Ingress, for the time to its first output as a client
sees it: `ReplicaStreams.open` records it (`ray_ingress_ttft_seconds`), tokenizing, Serve's
queue, a router's gate hold and the prefill included, where the Replica's own
`ray_request_ttft_seconds` starts as its engine takes the request. An ASGI middleware,
outermost."""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional


@dataclass
class _Clock:
    arrived_s: float
    told: bool = False  # its first output came: a request's other choices, a resume, are not it


_CLOCK: ContextVar[Optional[_Clock]] = ContextVar("arrival", default=None)


class Arrival:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            _CLOCK.set(_Clock(time.monotonic()))  # one object the request's tasks share (n > 1)
        await self.app(scope, receive, send)


def first_output_s() -> Optional[float]:
    """Seconds since this HTTP request arrived, the first time it is asked (as its first
    output comes); None after that, and outside a request."""
    clock = _CLOCK.get()
    if clock is None or clock.told:
        return None
    clock.told = True
    return time.monotonic() - clock.arrived_s
