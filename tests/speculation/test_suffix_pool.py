"""Pool behaviour: batched extend equals one-by-one, ids map to slots and are reusable."""

import numpy as np
import pytest

from replicas.speculation.sa_reference import ReferenceSuffixAutomaton
from replicas.speculation.suffix import SuffixAutomatonPool


def _read(pool, request_id, draft_len=4):
    """The current (match_len, draft) of one request, feeding nothing."""
    match_len, draft = pool.extend(
        np.array([request_id], np.int64), np.zeros((1, 0), np.int32), np.zeros(1, np.int32),
        draft_len,
    )
    return int(match_len[0]), draft[0].tolist()


@pytest.mark.parametrize("global_pool_tokens", [0, 2000])
def test_batched_extend_equals_one_by_one(global_pool_tokens):
    rng = np.random.default_rng(11)
    batched = SuffixAutomatonPool(8, 600, global_pool_tokens=global_pool_tokens, global_bias=1)
    single = SuffixAutomatonPool(8, 600, global_pool_tokens=global_pool_tokens, global_bias=1)
    live: list[int] = []
    next_id = 10**12  # ids are arbitrary int64s, not slot numbers
    for step in range(400):
        if len(live) < 8 and rng.random() < 0.3:
            prompt = rng.integers(0, 6, size=int(rng.integers(0, 40))).astype(np.int32)
            for pool in (batched, single):
                pool.add_request(next_id, prompt)
            live.append(next_id)
            next_id += 7
        if live and rng.random() < 0.1:
            gone = live.pop(int(rng.integers(len(live))))
            for pool in (batched, single):
                pool.remove_request(gone, keep_in_global_pool=True)
        if not live:
            continue
        rows = rng.permutation(live)[: int(rng.integers(1, len(live) + 1))]
        room = [600 - batched.request_length(int(r)) for r in rows]
        width = 5
        accepted = rng.integers(0, 6, size=(len(rows), width)).astype(np.int32)
        lens = np.array([min(int(rng.integers(0, width + 1)), r) for r in room], np.int32)
        ids = np.asarray(rows, np.int64)
        got_match, got_draft = batched.extend(ids, accepted, lens, 6)
        for b, rid in enumerate(rows):
            m, d = single.extend(ids[b : b + 1], accepted[b : b + 1], lens[b : b + 1], 6)
            assert got_match[b] == m[0]
            assert got_draft[b].tolist() == d[0].tolist()
    assert batched.global_pool_tokens_used == single.global_pool_tokens_used
    if global_pool_tokens:
        assert batched.global_pool_tokens_used > 0


def test_batch_order_and_independence():
    pool = SuffixAutomatonPool(3, 100)
    pool.add_request(1, [1, 2, 3, 1, 2])
    pool.add_request(2, [4, 5, 4])
    ids = np.array([2, 1], np.int64)
    accepted = np.array([[5, 0], [3, 0]], np.int32)
    match_len, draft = pool.extend(ids, accepted, np.array([1, 1], np.int32), 3)
    assert match_len.tolist() == [2, 3]  # "4 5" repeats; "1 2 3" repeats
    assert draft.tolist() == [[4, 5, -1], [1, 2, 3]]
    assert (pool.request_length(1), pool.request_length(2)) == (6, 4)


def test_ids_reused_after_removal_start_fresh():
    pool = SuffixAutomatonPool(1, 50)
    pool.add_request(7, [1, 2, 3, 1, 2, 3, 1])
    assert _read(pool, 7)[0] == 4
    pool.remove_request(7, keep_in_global_pool=False)
    assert not pool.has_request(7) and pool.num_active == 0
    # Same id, same (only) slot: nothing of the old text may leak into the new automaton.
    prompt = [3, 1, 9, 3]
    pool.add_request(7, prompt)
    oracle = ReferenceSuffixAutomaton(prompt)
    assert _read(pool, 7) == (oracle.longest_repeated_suffix()[0], oracle.draft(4))
    assert pool.request_length(7) == 4
    pool.remove_request(7)
    pool.add_request(8, [2, 3, 1, 2])  # tokens that repeated in the first text
    assert _read(pool, 8) == (1, [3, 1, 2, -1])


def test_empty_batch_and_zero_draft_len():
    pool = SuffixAutomatonPool(2, 10)
    match_len, draft = pool.extend(
        np.zeros(0, np.int64), np.zeros((0, 3), np.int32), np.zeros(0, np.int32), 4
    )
    assert match_len.shape == (0,) and draft.shape == (0, 4)
    pool.add_request(1, [5, 5])
    match_len, draft = pool.extend(
        np.array([1], np.int64), np.array([[5]], np.int32), np.ones(1, np.int32), 0
    )
    assert match_len.tolist() == [2] and draft.shape == (1, 0)
    assert match_len.dtype == np.int32 and draft.dtype == np.int32


def test_counters_and_memory_figure():
    pool = SuffixAutomatonPool(4, 1000)
    assert (pool.max_slots, pool.max_seq_len, pool.num_active) == (4, 1000, 0)
    for i in range(4):
        pool.add_request(i, np.arange(i, dtype=np.int32))
    assert pool.num_active == 4 and [pool.request_length(i) for i in range(4)] == [0, 1, 2, 3]
    # States, edge table and text: about 100 bytes per token of capacity.
    assert 60 * 1000 <= pool.slot_bytes <= 160 * 1000


def test_missing_native_module_says_how_to_build_it():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['replicas.speculation._sa_native'] = None\n"
        "try:\n    import replicas.speculation.suffix\n"
        "except ImportError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=__file__.rsplit("/tests/", 1)[0])
    assert "make native" in done.stdout, done.stdout + done.stderr
