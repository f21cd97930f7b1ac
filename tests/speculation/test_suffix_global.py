"""The cross-request pool: finished responses, bounded, evicted whole, used by the bias rule."""

import numpy as np
import pytest

from replicas.speculation.suffix import SuffixAutomatonPool


def _extend(pool, request_id, tokens, draft_len=4):
    tokens = list(tokens)
    accepted = np.array([tokens or [0]], np.int32)
    match_len, draft = pool.extend(
        np.array([request_id], np.int64), accepted, np.array([len(tokens)], np.int32), draft_len
    )
    return int(match_len[0]), draft[0].tolist()


def _finish(pool, request_id, prompt, response, keep=True):
    """Run one request to completion: its response is what the pool may keep."""
    pool.add_request(request_id, prompt)
    _extend(pool, request_id, response)
    pool.remove_request(request_id, keep_in_global_pool=keep)


def test_responses_not_prompts_are_kept():
    pool = SuffixAutomatonPool(2, 100, global_pool_tokens=100)
    _finish(pool, 1, prompt=[1, 2, 3], response=[])
    assert pool.global_pool_tokens_used == 0
    _finish(pool, 1, prompt=[1, 2, 3], response=[4, 5], keep=False)
    assert pool.global_pool_tokens_used == 0
    _finish(pool, 1, prompt=[1, 2, 3], response=[4, 5])
    assert pool.global_pool_tokens_used == 3  # two tokens and a separator


def test_new_request_drafts_from_a_finished_response():
    pool = SuffixAutomatonPool(2, 100, global_pool_tokens=100, global_bias=2)
    response = list(range(100, 130))
    _finish(pool, 1, prompt=[7], response=response)
    pool.add_request(2, [5, 6] + response[:10])
    # Own text has no repeat; the pool's match (10) beats 0 + bias.
    assert _extend(pool, 2, []) == (10, response[10:14])
    # The draft stops at the end of the response it came from.
    pool.remove_request(2, keep_in_global_pool=False)
    pool.add_request(3, response[-4:])
    assert _extend(pool, 3, []) == (4, [-1, -1, -1, -1])


def test_live_request_picks_up_new_responses_from_its_next_tokens():
    pool = SuffixAutomatonPool(2, 100, global_pool_tokens=100, global_bias=0)
    pool.add_request(1, [50, 51, 52])
    assert _extend(pool, 1, [])[0] == 0
    _finish(pool, 2, prompt=[9], response=[50, 51, 52, 53, 54, 55, 56])
    # Not retroactive: the cursor is one token long after the next token, then grows.
    assert _extend(pool, 1, [53]) == (1, [54, 55, 56, -1])
    assert _extend(pool, 1, [54]) == (2, [55, 56, -1, -1])


@pytest.mark.parametrize(
    "global_len,local_len,bias,use_global",
    [
        (10, 3, 4, True),
        (8, 3, 4, True),
        (7, 3, 4, False),  # 7 > 3 + 4 is false: ties go to the request's own text
        (4, 3, 0, True),
        (3, 3, 0, False),
        (12, 0, 11, True),
        (12, 0, 12, False),
    ],
)
def test_bias_rule(global_len, local_len, bias, use_global):
    shared = list(range(100, 100 + global_len))
    pool = SuffixAutomatonPool(2, 200, global_pool_tokens=200, global_bias=bias)
    _finish(pool, 1, prompt=[1], response=[500, 501] + shared + [900, 901, 902])
    # The request's own repeat is the last local_len tokens of `shared`, followed by 800.
    own = shared[len(shared) - local_len :] if local_len else []
    pool.add_request(2, own + [800, 801, 802] + shared)
    match_len, draft = _extend(pool, 2, [], draft_len=2)
    if use_global:
        assert (match_len, draft) == (global_len, [900, 901])
    elif local_len:
        assert (match_len, draft) == (local_len, [800, 801])
    else:
        assert (match_len, draft) == (0, [-1, -1])


def test_eviction_drops_the_oldest_generation_whole():
    # 100 tokens: two generations of 50; each response takes 20 + 1 separator.
    pool = SuffixAutomatonPool(2, 100, global_pool_tokens=100, global_bias=0)
    responses = [list(range(1000 * (i + 1), 1000 * (i + 1) + 20)) for i in range(5)]
    for i, response in enumerate(responses):
        _finish(pool, i, prompt=[1], response=response)
        assert pool.global_pool_tokens_used <= 100
    # Generation 1 (responses 0, 1) was cleared to make room for response 4.
    for i, response in enumerate(responses):
        pool.add_request(99, response[:6])
        match_len, draft = _extend(pool, 99, [], draft_len=3)
        pool.remove_request(99, keep_in_global_pool=False)
        if i < 2:
            assert (match_len, draft) == (0, [-1, -1, -1]), f"response {i} was not forgotten"
        else:
            assert (match_len, draft) == (6, response[6:9])
    assert pool.global_pool_tokens_used == 3 * 21


def test_live_cursor_into_an_evicted_generation_is_dropped():
    pool = SuffixAutomatonPool(3, 100, global_pool_tokens=40, global_bias=0)
    old = list(range(300, 318))  # 18 + 1 fills generation 1 (20 tokens) almost whole
    _finish(pool, 1, prompt=[1], response=old)
    pool.add_request(2, old[:5])
    assert _extend(pool, 2, [])[0] == 5
    _finish(pool, 3, prompt=[1], response=list(range(600, 618)))  # generation 2
    assert _extend(pool, 2, [])[0] == 5  # still there
    _finish(pool, 3, prompt=[1], response=list(range(700, 718)))  # clears generation 1
    assert _extend(pool, 2, []) == (0, [-1, -1, -1, -1])
    assert _extend(pool, 2, [old[5]]) == (0, [-1, -1, -1, -1])


def test_response_longer_than_a_generation_keeps_its_tail():
    pool = SuffixAutomatonPool(2, 1000, global_pool_tokens=40, global_bias=0)
    response = list(range(2000, 2100))
    _finish(pool, 1, prompt=[1], response=response)
    assert pool.global_pool_tokens_used == 20
    pool.add_request(2, response[81:85])  # inside the kept tail (last 19 tokens)
    assert _extend(pool, 2, []) == (4, response[85:89])
    pool.remove_request(2, keep_in_global_pool=False)
    pool.add_request(3, response[10:14])  # evicted head
    assert _extend(pool, 3, [])[0] == 0


def test_bound_holds_over_ten_thousand_requests():
    rng = np.random.default_rng(2)
    budget = 1000
    pool = SuffixAutomatonPool(4, 800, global_pool_tokens=budget, global_bias=1)
    seen_max = 0
    for request_id in range(10_000):
        prompt = rng.integers(0, 40, size=int(rng.integers(1, 30))).astype(np.int32)
        pool.add_request(request_id, prompt)
        n = int(rng.integers(0, 700 if request_id % 100 == 0 else 60))
        accepted = rng.integers(0, 40, size=(1, max(n, 1))).astype(np.int32)
        pool.extend(np.array([request_id], np.int64), accepted, np.array([n], np.int32), 4)
        pool.remove_request(request_id, keep_in_global_pool=True)
        used = pool.global_pool_tokens_used
        assert used <= budget
        seen_max = max(seen_max, used)
    assert seen_max > budget // 2  # the pool was actually filled, not trivially empty
    assert pool.num_active == 0


def _longest_suffix_inside(text, docs):
    """Brute force: the longest suffix of text that is a substring of one of docs."""
    best = 0
    for length in range(1, len(text) + 1):
        suffix = text[len(text) - length :]
        if not any(
            doc[i : i + length] == suffix for doc in docs for i in range(len(doc) - length + 1)
        ):
            break
        best = length
    return best


def test_global_match_is_the_longest_suffix_found_in_any_response():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from replicas.speculation.sa_reference import brute_force_longest_repeated_suffix

    symbols = st.integers(0, 3)

    @settings(max_examples=80, deadline=None)
    @given(
        st.lists(st.lists(symbols, min_size=1, max_size=25), min_size=1, max_size=4),
        st.lists(symbols, max_size=10),
        st.lists(symbols, min_size=1, max_size=15),
    )
    def check(responses, prompt, generated):
        pool = SuffixAutomatonPool(2, 200, global_pool_tokens=400, global_bias=0)
        for i, response in enumerate(responses):
            _finish(pool, 1000 + i, prompt=[3], response=response)
        pool.add_request(1, prompt)
        text = list(prompt)
        for token in generated:
            text.append(token)
            match_len, _ = _extend(pool, 1, [token])
            local = brute_force_longest_repeated_suffix(text)[0]
            assert match_len == max(local, _longest_suffix_inside(text, responses))

    check()


def _occurs_followed_by(docs, pattern, continuation):
    """True when pattern occurs in one doc and the real tokens of continuation follow it."""
    real = [t for t in continuation if t >= 0]
    for doc in docs:
        for i in range(len(doc) - len(pattern) + 1):
            if doc[i : i + len(pattern)] == pattern:
                after = doc[i + len(pattern) : i + len(pattern) + len(continuation)]
                if after == real:
                    return True
    return False


def test_global_drafts_stay_sound_while_responses_arrive_mid_request():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from replicas.speculation.sa_reference import brute_force_longest_repeated_suffix

    symbols = st.integers(0, 3)
    step = st.tuples(st.booleans(), st.lists(symbols, min_size=1, max_size=12))

    @settings(max_examples=80, deadline=None)
    @given(st.lists(symbols, max_size=8), st.lists(step, min_size=1, max_size=20))
    def check(prompt, steps):
        pool = SuffixAutomatonPool(2, 400, global_pool_tokens=1000, global_bias=0)
        pool.add_request(1, prompt)
        text, docs = list(prompt), []
        for finish_one, tokens in steps:
            if finish_one:  # another request finishes under our live one
                _finish(pool, 2, prompt=[0], response=tokens)
                docs.append(tokens)
                continue
            text += tokens
            match_len, draft = _extend(pool, 1, tokens, draft_len=3)
            local = brute_force_longest_repeated_suffix(text)[0]
            best_global = _longest_suffix_inside(text, docs)
            assert match_len <= max(local, best_global)  # never overclaims
            if match_len > local:  # the draft came from the pool: it must be real
                assert _occurs_followed_by(docs, text[len(text) - match_len :], draft)

    check()
