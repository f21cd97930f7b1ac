"""`ReplicaStreams` on its own (no Serve): a call given up, because the client left, ends
without asyncio logging an outcome nobody read; a redeploy's status is read, never a KeyError."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from types import SimpleNamespace

from deploy.config import AppArgs, IngressConfig
from deploy.replica_streams import ReplicaStreams


class _Replica:  # what ReplicaStreams reads of a deployment handle before a call
    app_name, deployment_name = "specserve", "Replica"

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


def test_a_redeploy_that_lists_no_replica_yet_is_none_running(monkeypatch):
    """Serve's status during a redeploy that replaces the application lists its deployments
    empty for a moment: that is no replica running (the health check said "cannot tell ...:
    KeyError"; found by QA), and one listed RUNNING is."""
    from ray import serve

    def status(deployments):
        return SimpleNamespace(applications={"specserve": SimpleNamespace(deployments=deployments)})

    streams = ReplicaStreams(_Replica(), IngressConfig.from_args(AppArgs()))
    for listed, running in (({}, False), ({"Replica": SimpleNamespace(replica_states={"STARTING": 1})}, False),
                            ({"Replica": SimpleNamespace(replica_states={"RUNNING": 1})}, True)):
        monkeypatch.setattr(serve, "status", lambda: status(listed))
        assert asyncio.run(streams.engine_running()) is running
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={}))
    assert asyncio.run(streams.engine_running()) is False
