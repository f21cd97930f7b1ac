"""The batch-size gate: speculation pays at small batch and costs at large batch.

A pure function over plain data, shared by the engine (per step) and the router (per
replica). Standard library only: the router imports it on a CPU-only head.
"""


def speculate_this_step(batch_size: int, batch_gate: int) -> bool:
    """True when a step over `batch_size` running requests should draft and verify."""
    return batch_size <= batch_gate
