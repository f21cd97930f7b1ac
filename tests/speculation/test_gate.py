"""The batch-size gate, as a table."""

from __future__ import annotations

import ast
import inspect

import pytest

from replicas.speculation import gate
from replicas.speculation.gate import speculate_this_step


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
    # The router imports it in KubeRay's dashboard process, where torch may be absent.
    tree = ast.parse(inspect.getsource(gate))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    } | {node.module.split(".")[0] for node in ast.walk(tree)
         if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"torch", "numpy", "ray", "replicas"}
