"""Property tests: the native pool against the Python oracle and brute force, on random
token strings over small and large alphabets, fed in random chunks."""

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.speculation.sa_reference import (
    ReferenceSuffixAutomaton,
    brute_force_longest_repeated_suffix,
    z_longest_repeated_suffix,
)
from replicas.speculation.suffix import SuffixAutomatonPool, longest_repeated_suffix


@st.composite
def texts(draw, max_len=200):
    alphabet = draw(st.integers(2, 50))
    # Offsetting the alphabet exercises large token ids in the hash.
    offset = draw(st.sampled_from([0, 1000, 2**31 - 64]))
    symbols = st.integers(offset, offset + alphabet - 1)
    return draw(st.lists(symbols, min_size=0, max_size=max_len))


def _draft_after(text, pos, length, k):
    out = text[pos : pos + k] if length else []
    return out + [-1] * (k - len(out))


@settings(max_examples=150, deadline=None)
@given(texts())
def test_oracles_agree_with_brute_force(text):
    want = brute_force_longest_repeated_suffix(text)
    assert ReferenceSuffixAutomaton(text).longest_repeated_suffix() == want
    assert z_longest_repeated_suffix(text) == want
    if text:
        assert longest_repeated_suffix(text) == want


@settings(max_examples=150, deadline=None)
@given(texts(), st.integers(0, 6), st.randoms(use_true_random=False), st.integers(0, 8))
def test_chunked_pool_matches_reference(text, prompt_len, rnd, draft_len):
    prompt, rest = text[:prompt_len], text[prompt_len:]
    pool = SuffixAutomatonPool(max_slots=2, max_seq_len=max(len(text), 1))
    pool.add_request(-5, prompt)
    oracle = ReferenceSuffixAutomaton(prompt)
    ids = np.array([-5], np.int64)
    while True:
        width = rnd.randint(1, 5)
        chunk = rest[:width]
        rest = rest[width:]
        accepted = np.full((1, width), 99, np.int32)  # junk past accepted_lens is ignored
        accepted[0, : len(chunk)] = chunk
        match_len, draft = pool.extend(ids, accepted, np.array([len(chunk)], np.int32), draft_len)
        for token in chunk:
            oracle.extend(token)
        length, pos = oracle.longest_repeated_suffix()
        assert match_len.tolist() == [length]
        assert draft.tolist() == [oracle.draft(draft_len)]
        assert draft.tolist() == [_draft_after(oracle.text, pos, length, draft_len)]
        if not chunk:
            break
    assert pool.request_length(-5) == len(text)


def test_hundred_thousand_tokens_small_alphabet():
    rng = random.Random(3)
    text = [rng.randrange(2) for _ in range(100_000)]
    pool = SuffixAutomatonPool(max_slots=1, max_seq_len=len(text))
    pool.add_request(1, text[:50_000])
    ids = np.array([1], np.int64)
    for start in range(50_000, len(text), 1000):
        chunk = np.array([text[start : start + 1000]], np.int32)
        match_len, draft = pool.extend(ids, chunk, np.array([1000], np.int32), 8)
    length, pos = z_longest_repeated_suffix(text)
    assert match_len.tolist() == [length]
    assert draft.tolist() == [_draft_after(text, pos, length, 8)]


def test_hundred_thousand_tokens_code_like():
    # A long "file" repeated with one edit: the match must run across the whole copy.
    rng = random.Random(4)
    block = [rng.randrange(50_000) for _ in range(40_000)]
    edited = block[:20_000] + [7] + block[20_001:]
    text = block + edited[:30_000]
    assert len(text) == 70_000
    pool = SuffixAutomatonPool(max_slots=1, max_seq_len=len(text))
    pool.add_request(1, text)
    match_len, draft = pool.extend(
        np.array([1], np.int64), np.zeros((1, 0), np.int32), np.zeros(1, np.int32), 5
    )
    assert match_len.tolist() == [9_999]  # since the edit at 20_000
    assert draft.tolist() == [block[30_000:30_005]]
    assert (match_len[0], 30_000) == z_longest_repeated_suffix(text)


def test_long_random_texts_step_by_step():
    rng = np.random.default_rng(5)
    for alphabet in (2, 3, 5, 50, 250_000):
        text = rng.integers(0, alphabet, size=3000).tolist()
        pool = SuffixAutomatonPool(max_slots=1, max_seq_len=len(text))
        pool.add_request(0, text[:10])
        oracle = ReferenceSuffixAutomaton(text[:10])
        pos = 10
        while pos < len(text):
            width = int(rng.integers(1, 9))
            chunk = text[pos : pos + width]
            pos += len(chunk)
            match_len, draft = pool.extend(
                np.array([0], np.int64),
                np.array([chunk], np.int32),
                np.array([len(chunk)], np.int32),
                6,
            )
            for token in chunk:
                oracle.extend(token)
            assert match_len[0] == oracle.longest_repeated_suffix()[0]
            assert draft[0].tolist() == oracle.draft(6)
