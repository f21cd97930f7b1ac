"""The engine's suffix automata, fed once per step: on the host, and (gpu) on the device,
where every draft must equal the host pool's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from replicas.speculation.suffix import CUDA_COMPILED, SuffixAutomatonPool
from replicas.torch_engine.suffix_drafts import (
    PREDICTION_ANCHOR, DeviceSuffixDrafts, HostSuffixDrafts, prediction_prefix, suffix_drafts,
)


def seq(sa_id):
    return SimpleNamespace(sa_id=sa_id, sa_match_len=-7, sa_draft=[-7])


def test_one_batched_feed_equals_one_extend_per_request():
    rng = np.random.default_rng(3)
    drafts, reference = HostSuffixDrafts(4, 500, 0), SuffixAutomatonPool(4, 500)
    seqs = [seq(i) for i in range(4)]
    for s in seqs:
        prompt = rng.integers(0, 5, size=40).tolist()
        drafts.add(s.sa_id, prompt)
        reference.add_request(s.sa_id, prompt)
    for _ in range(20):
        fed = [(s, rng.integers(0, 5, size=int(rng.integers(1, 6))).tolist()) for s in seqs]
        drafts.feed(fed, 6)
        drafts.settle()
        for s, tokens in fed:
            match_len, draft = reference.extend(np.asarray([s.sa_id]), np.asarray([tokens], dtype=np.int32),
                                                np.asarray([len(tokens)], dtype=np.int32), 6)
            assert (s.sa_match_len, s.sa_draft) == (int(match_len[0]), [int(t) for t in draft[0] if t >= 0])
    drafts.remove(0)
    assert not drafts.has(0) and drafts.has(1)


def test_a_prediction_is_drafted_from_the_first_output_token_and_after_a_detour():
    prompt = list(range(100, 130))  # nothing in it repeats
    prediction = list(range(200, 260))
    drafts, s = HostSuffixDrafts(1, 500, 0), seq(0)
    drafts.add(0, prediction_prefix(prompt, prediction, 500 - len(prompt) - 100) + prompt)
    drafts.feed([(s, [200])], 8)  # the first output token follows the prediction
    assert s.sa_match_len == PREDICTION_ANCHOR + 1 and s.sa_draft == list(range(201, 209))
    drafts.feed([(s, [201, 202, 7, 8, 9, 230, 231])], 8)  # departs, and meets it again further on
    assert s.sa_draft == list(range(232, 240))


def test_a_prediction_is_cut_to_the_room_left():
    prompt, prediction = list(range(20)), list(range(50, 90))
    assert prediction_prefix(prompt, prediction, 1000) == prompt[-PREDICTION_ANCHOR:] + prediction
    assert prediction_prefix(prompt, prediction, 30) == (prompt[-PREDICTION_ANCHOR:] + prediction)[:30]
    assert prediction_prefix(prompt, prediction, PREDICTION_ANCHOR) == []  # no room for a token of it
    assert prediction_prefix(prompt, [], 1000) == []


def test_a_cpu_engine_keeps_its_automata_on_the_host():
    assert isinstance(suffix_drafts(torch.device("cpu"), 2, 100, 1000), HostSuffixDrafts)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_COMPILED, reason="module built without nvcc")
def test_device_automata_draft_what_the_host_pool_drafts():
    rng = np.random.default_rng(11)
    device = suffix_drafts(torch.device("cuda"), 8, 2000, 0)
    host = HostSuffixDrafts(8, 2000, 0)
    assert isinstance(device, DeviceSuffixDrafts)
    live, next_id = [], 0
    for step in range(200):
        if len(live) < 8 and rng.random() < 0.3:  # requests come and go, slots are reused
            prompt = rng.integers(0, 6, size=int(rng.integers(0, 200))).tolist()
            device.add(next_id, prompt)
            host.add(next_id, prompt)
            live.append((seq(next_id), seq(next_id)))
            next_id += 1
        if live and rng.random() < 0.1:
            gone = live.pop(int(rng.integers(len(live))))
            device.remove(gone[0].sa_id)
            host.remove(gone[1].sa_id)
        stepping = [pair for pair in live if rng.random() < 0.8]
        tokens = [rng.integers(0, 6, size=int(rng.integers(1, 10))).tolist() for _ in stepping]
        draft_len = int(rng.integers(1, 9))
        device.feed([(d, t) for (d, _), t in zip(stepping, tokens)], draft_len)
        host.feed([(h, t) for (_, h), t in zip(stepping, tokens)], draft_len)
        device.settle()
        for d, h in stepping:
            assert (d.sa_match_len, d.sa_draft) == (h.sa_match_len, h.sa_draft), f"step {step}"
