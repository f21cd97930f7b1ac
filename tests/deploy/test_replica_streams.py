"""`ReplicaStreams.answered` on its own (no Serve): a call given up, because the client left,
ends without asyncio logging an outcome nobody read."""

from __future__ import annotations

import asyncio
import contextlib
import gc

from deploy.config import AppArgs, IngressConfig
from deploy.replica_streams import ReplicaStreams


class _Replica:  # what ReplicaStreams reads of a deployment handle before a call
    def options(self, **_):
        return self


def test_a_call_given_up_leaves_no_unread_outcome():
    """A client gone while its call waited: the call is cancelled, and the error it ends with
    (Serve's RequestCancelledError) is read. It once went to asyncio's "Task exception was
    never retrieved" log on every early disconnect (found by QA)."""
    config = IngressConfig.from_args(AppArgs())
    unread = []

    async def go():
        asyncio.get_running_loop().set_exception_handler(lambda _, context: unread.append(context))
        started = asyncio.Event()

        async def call():
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                raise RuntimeError("cancelled, as Serve's call raises it") from None

        waiting = asyncio.ensure_future(ReplicaStreams(_Replica(), config).answered(call()))
        await started.wait()
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()

    asyncio.run(go())
    assert unread == []
