"""Bad input: each call raises a clear error and leaves the pool exactly as it was."""

import re

import numpy as np
import pytest

from replicas.speculation.suffix import SuffixAutomatonPool

MAX_SEQ_LEN = 16
LIVE = {1: [1, 2, 3, 1, 2], 2: [5, 6, 5], 3: []}


def _pool():
    pool = SuffixAutomatonPool(4, MAX_SEQ_LEN, global_pool_tokens=64, global_bias=0)
    pool.add_request(9, [8])
    pool.extend(np.array([9], np.int64), np.array([[5, 6, 7]], np.int32),
                np.array([3], np.int32), 2)
    pool.remove_request(9)  # leaves "5 6 7" in the global pool
    for request_id, prompt in LIVE.items():
        pool.add_request(request_id, prompt)
    return pool


def _snapshot(pool):
    """Everything observable: membership, lengths, global use and each request's draft."""
    drafts = {}
    for request_id in LIVE:
        if pool.has_request(request_id):
            m, d = pool.extend(np.array([request_id], np.int64), np.zeros((1, 0), np.int32),
                               np.zeros(1, np.int32), 4)
            drafts[request_id] = (int(m[0]), d.tolist(), pool.request_length(request_id))
    return (pool.num_active, pool.global_pool_tokens_used, drafts,
            [pool.has_request(i) for i in range(-1, 12)])


def _ids(*ids):
    return np.array(ids, np.int64)


def _acc(*rows):
    return np.array(rows, np.int32)


def _lens(*lens):
    return np.array(lens, np.int32)


CASES = [
    ("unknown id remove", KeyError, "unknown request id",
     lambda p: p.remove_request(4)),
    ("unknown id length", KeyError, "unknown request id",
     lambda p: p.request_length(4)),
    ("unknown id in batch", KeyError, "unknown request id",
     lambda p: p.extend(_ids(1, 4), _acc([1], [1]), _lens(1, 1), 2)),
    ("live id added again", ValueError, "already active",
     lambda p: p.add_request(2, [1])),
    ("negative prompt token", ValueError, "outside [0, 2^31)",
     lambda p: p.add_request(4, [1, -1])),
    ("prompt token above int32", ValueError, "outside [0, 2^31)",
     lambda p: p.add_request(4, [2**31])),
    ("uint64 token above int32", ValueError, "outside [0, 2^31)",
     lambda p: p.add_request(4, np.array([2**63], np.uint64))),
    ("float prompt", ValueError, "integers",
     lambda p: p.add_request(4, [1.5])),
    ("2-D prompt", ValueError, "1-D",
     lambda p: p.add_request(4, [[1, 2]])),
    ("prompt longer than max_seq_len", ValueError, "max_seq_len",
     lambda p: p.add_request(4, [1] * (MAX_SEQ_LEN + 1))),
    ("request_ids int32", ValueError, "request_ids must have dtype int64",
     lambda p: p.extend(np.array([1], np.int32), _acc([1]), _lens(1), 2)),
    ("request_ids a list", ValueError, "request_ids must be a numpy",
     lambda p: p.extend([1], _acc([1]), _lens(1), 2)),
    ("accepted int64", ValueError, "accepted must have dtype int32",
     lambda p: p.extend(_ids(1), np.array([[1]], np.int64), _lens(1), 2)),
    ("accepted 1-D", ValueError, "accepted must be 2-D",
     lambda p: p.extend(_ids(1), np.array([1], np.int32), _lens(1), 2)),
    ("accepted not C-contiguous", ValueError, "C-contiguous",
     lambda p: p.extend(_ids(1, 2), np.asfortranarray(_acc([1, 2], [3, 4])), _lens(2, 2), 2)),
    ("accepted_lens int64", ValueError, "accepted_lens must have dtype int32",
     lambda p: p.extend(_ids(1), _acc([1]), np.array([1], np.int64), 2)),
    ("batch sizes differ", ValueError, "batch sizes differ",
     lambda p: p.extend(_ids(1, 2), _acc([1]), _lens(1, 1), 2)),
    ("accepted_lens above row width", ValueError, "row width",
     lambda p: p.extend(_ids(1, 2), _acc([1, 2], [3, 4]), _lens(2, 3), 2)),
    ("negative accepted_lens", ValueError, "outside [0, 2]",
     lambda p: p.extend(_ids(1, 2), _acc([1, 2], [3, 4]), _lens(1, -1), 2)),
    ("negative accepted token", ValueError, "non-negative",
     lambda p: p.extend(_ids(1, 2), _acc([1, 2], [3, -4]), _lens(2, 2), 2)),
    ("text past max_seq_len in row 2", ValueError, "max_seq_len",
     lambda p: p.extend(_ids(1, 2), _acc([1] * MAX_SEQ_LEN, [2] * MAX_SEQ_LEN),
                        _lens(2, MAX_SEQ_LEN - len(LIVE[2]) + 1), 2)),
    ("duplicate id in batch", ValueError, "twice",
     lambda p: p.extend(_ids(1, 1), _acc([1], [1]), _lens(1, 1), 2)),
    ("negative draft_len", ValueError, "draft_len",
     lambda p: p.extend(_ids(1), _acc([1]), _lens(1), -1)),
    # the draft array was allocated before draft_len was checked: a MemoryError
    ("draft_len 2^62", ValueError, "draft_len must be in [0, 2^28]",
     lambda p: p.extend(_ids(1), _acc([1]), _lens(1), 2**62)),
    ("request_ids big-endian", ValueError, "request_ids must have dtype int64",
     lambda p: p.extend(np.array([1], ">i8"), _acc([1]), _lens(1), 2)),
]


@pytest.mark.parametrize("name,error,message,call", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_changes_nothing(name, error, message, call):
    pool = _pool()
    before = _snapshot(pool)
    with pytest.raises(error, match=re.escape(message)):
        call(pool)
    assert _snapshot(pool) == before
    # The pool still works afterwards.
    m, _ = pool.extend(_ids(1), _acc([3]), _lens(1), 2)
    assert m[0] == 3  # "1 2 3" occurred before


def test_arrays_of_an_equivalent_dtype_are_accepted():
    """numpy's longlong is an int64 other than its long (and intc an int32 other than int32
    on some platforms): they were refused as "must have dtype int64, got int64"."""
    pool = _pool()
    m, d = pool.extend(np.array([1], np.longlong), np.array([[3]], np.intc), np.array([1], np.intc), 2)
    assert m[0] == 3 and d.tolist() == [[1, 2]]  # "1 2 3" occurred before, then "1 2"


def test_more_requests_than_slots():
    pool = _pool()
    pool.add_request(4, [1])
    before = _snapshot(pool)
    with pytest.raises(ValueError, match="all 4 slots are in use"):
        pool.add_request(5, [1])
    assert _snapshot(pool) == before and not pool.has_request(5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_slots=0, max_seq_len=10), "max_slots"),
        (dict(max_slots=-1, max_seq_len=10), "max_slots"),
        (dict(max_slots=1, max_seq_len=0), "max_seq_len"),
        (dict(max_slots=1, max_seq_len=-5), "max_seq_len"),
        (dict(max_slots=1, max_seq_len=2**29), "max_seq_len"),
        (dict(max_slots=1, max_seq_len=10, global_pool_tokens=-1), "global_pool_tokens"),
        (dict(max_slots=1, max_seq_len=10, global_pool_tokens=3), "global_pool_tokens"),
        (dict(max_slots=1, max_seq_len=10, global_bias=-1), "global_bias"),
    ],
)
def test_bad_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SuffixAutomatonPool(**kwargs)
