"""The prefix cache parted by salt (`GenerationRequest.cache_salt`: an API key's, a client's
`cache_salt`): a request reuses only what requests with its salt stored, so no one learns from
a faster first token what another key's prompts held."""

from __future__ import annotations

import dataclasses
import random

import pytest

from replicas.engine import SpeculationConfig
from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig
from replicas.torch_engine.kv_cache import KVCache
from replicas.torch_engine.prefix_cache import PrefixCache
from tests.torch_engine.engine_util import collect_logprobs, request


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request, loop):
    engine = TorchEngine(TorchEngineConfig(device=request.param, max_batch_size=2, max_seq_len=1024,
                                           speculation=SpeculationConfig(batch_gate=8)))
    loop.run_until_complete(engine.start())
    yield engine
    loop.run_until_complete(engine.shutdown())


def _ids(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(count)]


def test_a_salt_reuses_only_what_its_own_requests_stored(engine, loop):
    """Each salt's first request prefills cold, its later ones reuse its blocks; every one
    computes the same bits (the first was a cold prefill)."""
    prompt = _ids(30, 150)

    def run(salt: str):
        salted = dataclasses.replace(request(prompt, max_tokens=8, logprobs=2), cache_salt=salt)
        tokens, _, logprobs, last = loop.run_until_complete(collect_logprobs(engine, salted))
        return (tokens, logprobs), last.cached_tokens

    runs = [run(salt) for salt in ("alice", "bob", "", "alice", "bob")]
    assert [cached for _, cached in runs] == [0, 0, 0, 149, 149]
    assert all(output == runs[0][0] for output, _ in runs)


def test_a_salts_tree_goes_with_its_last_block():
    cache = KVCache(1, 2, 128, 2, 8)
    prefix = PrefixCache(cache, 0, 1 << 20)
    tokens, slot, chain = _ids(951, 99), cache.allocate(), []
    cache.lengths[slot] = 98
    prefix.extend(chain, tokens, 98, slot, None, tail=True, salt="alice")
    later = cache.allocate()
    assert prefix.admit(tokens, later, "bob")[0] == [] and cache.lengths[later] == 0
    held, _ = prefix.admit(tokens, later, "alice")
    assert len(held) == 3 and cache.lengths[later] == 98
    prefix.release(held)
    prefix.release(chain)
    while prefix.cached_blocks:
        assert prefix.reclaim(1) == 1
    assert prefix._roots == {}  # a salt that keeps nothing takes no memory (clients may send many)
