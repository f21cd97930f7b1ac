"""The CUDA forward: every row computes the same bits whatever else the step holds.

The kernels' argument checks run wherever the module was built (nvcc present); everything
that runs on a device is marked `gpu`. Equality is `torch.equal`, never a tolerance, except
against the stock SDPA forward, which only has to agree to rounding (it is not row-invariant).
"""

from __future__ import annotations

import pytest
import torch

from replicas.torch_engine.model import SeqSpan

cuda_forward = pytest.importorskip("replicas.torch_engine._cuda_forward", reason="built without nvcc")

PROMPT = [1, 504, 3458, 282, 253, 2424, 30, 14, 3180, 8415, 1675, 28, 3016, 314, 2118, 30] * 3  # 48 tokens


def attention_args(**changes):
    args = dict(q=1, q_row_stride=576, k_cache=1, v_cache=1, out=1, row_slot=1, row_pos=1, rows=4, heads=9,
                kv_heads=3, head_dim=64, slots=2, max_seq_len=128, scale=0.125, stream=0)
    return {**args, **changes}


@pytest.mark.parametrize("changes, field", [
    (dict(head_dim=48), "head_dim"),
    (dict(head_dim=512), "head_dim"),
    (dict(kv_heads=2), "kv_heads"),
    (dict(q_row_stride=100), "q_row_stride"),
    (dict(rows=-1), "rows"),
    (dict(out=0), "null device pointer"),
])
def test_attention_rejects_bad_arguments_before_touching_the_device(changes, field):
    with pytest.raises(ValueError, match=field):
        cuda_forward.attention(**attention_args(**changes))


@pytest.mark.parametrize("changes, field", [
    (dict(head_dim=48), "head_dim"),
    (dict(v_row_stride=10), "v_row_stride"),
    (dict(slots=0), "slots"),
    (dict(k_cache=0), "null device pointer"),
])
def test_write_kv_rejects_bad_arguments_before_touching_the_device(changes, field):
    args = dict(k=1, k_row_stride=768, v=1, v_row_stride=1152, k_cache=1, v_cache=1, row_slot=1, row_pos=1, rows=4,
                kv_heads=3, head_dim=64, slots=2, max_seq_len=128, stream=0)
    with pytest.raises(ValueError, match=field):
        cuda_forward.write_kv(**{**args, **changes})


@pytest.fixture(scope="module")
def model():
    from replicas.torch_engine.cuda_model import CudaLlamaModel
    from replicas.torch_engine.loader import resolve_model_dir

    return CudaLlamaModel.from_pretrained(resolve_model_dir(), device="cuda")


def run(model, cache, steps):
    """Run `steps` [(slot, tokens)] packed into one forward: (hidden [N, d], logits [N, V]) per slot."""
    ids = torch.tensor([t for _, tokens in steps for t in tokens], device=model.device)
    spans = [SeqSpan(slot, cache.lengths[slot], len(tokens)) for slot, tokens in steps]
    hidden = model(ids, spans, cache)
    logits = model.logits(hidden)
    out, row = {}, 0
    for slot, tokens in steps:
        out[slot] = (hidden[row: row + len(tokens)], logits[row: row + len(tokens)])
        row += len(tokens)
    return out


def fresh(model, slots=3):
    cache = model.make_cache(slots, 256)
    for _ in range(slots):
        cache.allocate()
    return cache


@pytest.mark.gpu
def test_verify_rows_equal_one_row_decodes_and_a_busy_batch(model):
    draft = PROMPT[5:13]
    cache = fresh(model)
    run(model, cache, [(0, PROMPT), (1, PROMPT), (2, PROMPT[:20])])
    verify = run(model, cache, [(0, draft)])[0]
    busy = run(model, cache, [(2, PROMPT[20:31]), (1, draft)])[1]  # another sequence first, other length
    assert torch.equal(busy[0], verify[0]) and torch.equal(busy[1], verify[1])
    cache2 = fresh(model, 1)
    run(model, cache2, [(0, PROMPT)])
    for i, token in enumerate(draft):
        hidden, logits = run(model, cache2, [(0, [token])])[0]
        assert torch.equal(hidden[0], verify[0][i]) and torch.equal(logits[0], verify[1][i]), f"row {i}"


@pytest.mark.gpu
def test_prefill_in_chunks_equals_one_prefill(model):
    long = PROMPT * 3  # 144 tokens: three row blocks
    cache = fresh(model, 2)
    whole = run(model, cache, [(0, long)])[0][0]
    parts = [run(model, cache, [(1, long[a:b])])[1][0] for a, b in ((0, 1), (1, 70), (70, 144))]
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(cache.k[:, 1, :, :144], cache.k[:, 0, :, :144])
    assert torch.equal(cache.v[:, 1, :, :144], cache.v[:, 0, :, :144])


@pytest.mark.gpu
def test_agrees_with_the_stock_sdpa_forward(model):
    """Same weights through `LlamaModel` (cuBLAS at the step's shape, SDPA): equal to rounding."""
    from replicas.torch_engine.model import LlamaModel
    from replicas.torch_engine.loader import resolve_model_dir

    stock = LlamaModel.from_pretrained(resolve_model_dir(), device="cuda")
    ours, theirs = fresh(model, 1), stock.make_cache(1, 256)
    theirs.allocate()
    for tokens in (PROMPT, PROMPT[3:9], [PROMPT[9]]):
        got = run(model, ours, [(0, tokens)])[0][1]
        want = run(stock, theirs, [(0, tokens)])[0][1]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
