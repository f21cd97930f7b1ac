"""Wait for a condition instead of sleeping a fixed time and hoping it holds.

Both return whether `predicate` came true within `timeout_s`, so the caller asserts with its
own message: `assert wait_until(lambda: idle(engine), 10), "resources still held"`. The
predicate is tried once more at the deadline, so a slow machine fails only on a real hang.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll `predicate` every `interval_s` (blocking sleeps) until it is true or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


async def async_wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.01) -> bool:
    """`wait_until` for code on an event loop: sleeps with asyncio, so the loop keeps running."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval_s)
    return True
