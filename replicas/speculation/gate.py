"""The batch-size gate: speculation pays at small batch and costs at large batch.

Pure functions over plain data, shared by the engine (per step), the replica's gauge, the
router (per replica) and the autoscaler. Standard library only (replicas.stats is too):
the router imports it on a CPU-only head.
"""

from replicas.stats import NOT_GATED


def speculate_this_step(batch_size: int, batch_gate: int) -> bool:
    """True when a step over `batch_size` running requests should draft and verify."""
    return batch_size <= batch_gate


def gates_by_batch(reported_gate: int) -> bool:
    """Does an engine reporting this `EngineStats.batch_gate` stop speculating above it?

    False for NOT_GATED: its batch size never turns speculation on or off, so keeping it
    under a gate buys nothing (and its `speculating` is what it does at any batch size).
    """
    return reported_gate != NOT_GATED


def gate_open(batch_size: int, reported_gate: int, speculating: int) -> bool:
    """Would a request added now run in a speculating step (the `spec_gate_open` gauge)?
    `batch_size`: the requests ahead of it, running and waiting."""
    if not gates_by_batch(reported_gate):
        return bool(speculating)
    return speculate_this_step(batch_size + 1, reported_gate)
