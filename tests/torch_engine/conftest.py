"""One real engine per test module and device (the real model, the real native SA, the shipped MTP).

Every engine test runs on the CPU (the native forward, host automata) and, marked `gpu`, on
CUDA (the row-invariant torch forward, automata on the device): the same assertions, the
same bitwise exactness.
"""

from __future__ import annotations

import asyncio

import pytest

from replicas.engine import SpeculationConfig
from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request, loop):
    engine = TorchEngine(TorchEngineConfig(max_batch_size=8, max_seq_len=2048, device=request.param,
                                           speculation=SpeculationConfig(batch_gate=8)))
    loop.run_until_complete(engine.start())
    yield engine
    loop.run_until_complete(engine.shutdown())
