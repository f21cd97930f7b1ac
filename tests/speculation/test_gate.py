"""The batch-size gate, as a table."""

from __future__ import annotations

import ast
import inspect

import pytest

from replicas import stats
from replicas.speculation import gate
from replicas.speculation.gate import gate_open, gates_by_batch, speculate_this_step
from replicas.stats import NOT_GATED


@pytest.mark.parametrize(
    "batch_size, batch_gate, speculate",
    [
        (0, 0, True),  # an idle replica counts as open
        (1, 0, False),  # gate 0: never speculate with anyone running
        (1, 1, True),
        (2, 1, False),
        (4, 4, True),  # the gate is inclusive
        (5, 4, False),
        (1, 4, True),
        (64, 4, False),
        (64, 64, True),
    ],
)
def test_gate_table(batch_size, batch_gate, speculate):
    assert speculate_this_step(batch_size, batch_gate) is speculate


def test_gate_is_monotone_in_batch_size():
    for batch_gate in range(6):
        verdicts = [speculate_this_step(b, batch_gate) for b in range(10)]
        assert verdicts == sorted(verdicts, reverse=True)  # open, then closed for good


def test_gate_module_imports_only_the_standard_library():
    # The router imports it in KubeRay's dashboard process, where torch may be absent; of
    # ours only replicas.stats (standard library only itself), for the NOT_GATED sentinel.
    def imports(module):
        tree = ast.parse(inspect.getsource(module))
        return {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}

    ours = imports(gate)
    assert {name for name in ours if name.split(".")[0] == "replicas"} <= {"replicas.stats"}
    every = ours | imports(stats)
    assert not {name.split(".")[0] for name in every} & {"torch", "numpy", "ray"}
    assert {name for name in imports(stats) if name.split(".")[0] == "replicas"} == set()


# The reported gate's sentinel (EngineStats.batch_gate) and what the gauge makes of it.
@pytest.mark.parametrize("batch_size, reported_gate, speculating, gated, opened", [
    (0, 4, 1, True, True),
    (3, 4, 1, True, True),  # the 4th request still fits under the gate
    (4, 4, 1, True, False),  # a 5th would close it
    (4, 4, 0, True, False),
    (40, NOT_GATED, 1, False, True),  # drafts at every batch size (a TensorRT-LLM SA mode)
    (0, NOT_GATED, 0, False, False),  # speculation off: no batch size opens it
])
def test_gate_open_reads_the_engines_own_gate(batch_size, reported_gate, speculating, gated, opened):
    assert gates_by_batch(reported_gate) is gated
    assert gate_open(batch_size, reported_gate, speculating) is opened
