"""Golden vectors: the same table through the native core, the pool, both oracles and the
C++ test executable."""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from replicas.speculation.sa_reference import (
    ReferenceSuffixAutomaton,
    brute_force_longest_repeated_suffix,
    z_longest_repeated_suffix,
)
from replicas.speculation.suffix import SuffixAutomatonPool, longest_repeated_suffix

# text -> (position after the first earlier occurrence, match length); (-1, 0): no match
GOLDEN = [
    ("aaa", 2, 2),
    ("ababa", 3, 3),
    ("abcab", 2, 2),
    ("abcdabc", 3, 3),
    ("racecar", 1, 1),
    ("abcab123456abc12", 7, 2),
    ("abcdef", -1, 0),
]


def _tokens(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.mark.parametrize("text,next_pos,length", GOLDEN)
def test_native_core(text, next_pos, length):
    assert longest_repeated_suffix(_tokens(text)) == (length, next_pos)


@pytest.mark.parametrize("text,next_pos,length", GOLDEN)
def test_oracles(text, next_pos, length):
    tokens = _tokens(text)
    assert ReferenceSuffixAutomaton(tokens).longest_repeated_suffix() == (length, next_pos)
    assert brute_force_longest_repeated_suffix(tokens) == (length, next_pos)
    assert z_longest_repeated_suffix(tokens) == (length, next_pos)


@pytest.mark.parametrize("text,next_pos,length", GOLDEN)
def test_pool_draft_continues_first_occurrence(text, next_pos, length):
    tokens = _tokens(text)
    pool = SuffixAutomatonPool(max_slots=1, max_seq_len=len(tokens))
    pool.add_request(42, tokens)
    k = 4
    match_len, draft = pool.extend(
        np.array([42], np.int64), np.zeros((1, 0), np.int32), np.zeros(1, np.int32), k
    )
    want = tokens[next_pos : next_pos + k] if length else []
    assert match_len.tolist() == [length]
    assert draft.tolist() == [want + [-1] * (k - len(want))]


def test_hundred_thousand_identical_tokens():
    tokens = np.full(100_000, 7, np.int32)
    assert longest_repeated_suffix(tokens) == (99_999, 99_999)
    pool = SuffixAutomatonPool(max_slots=1, max_seq_len=100_001)
    pool.add_request(0, tokens)
    match_len, draft = pool.extend(
        np.array([0], np.int64), np.array([[7]], np.int32), np.ones(1, np.int32), 3
    )
    # One more 'a': the suffix of 100k repeats; what followed it is the single last token.
    assert match_len.tolist() == [100_000]
    assert draft.tolist() == [[7, -1, -1]]


SA_TEST = Path(__file__).resolve().parents[2] / "build" / "native" / "sa_test"


@pytest.mark.skipif(not os.access(SA_TEST, os.X_OK), reason="run `make native` first")
def test_cpp_test_executable_passes():
    done = subprocess.run([str(SA_TEST)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
