"""The CUDA path: device-resident slots and the batched kernel, against the CPU pool."""

import numpy as np
import pytest

from replicas.speculation import suffix
from replicas.speculation.suffix import SuffixAutomatonPool

native = suffix._sa_native


def test_module_imports_and_reports_devices_without_a_gpu():
    assert isinstance(native.cuda_device_count(), int)
    if suffix.CUDA_COMPILED and native.cuda_device_count() == 0:
        with pytest.raises(ValueError, match="no CUDA device"):
            native.DeviceSuffixAutomatonPool(2, 100)


@pytest.mark.gpu
@pytest.mark.skipif(not suffix.CUDA_COMPILED, reason="module built without nvcc")
def test_device_kernel_matches_cpu_pool():
    import torch

    rng = np.random.default_rng(9)
    batch, width, draft_len, max_seq_len = 16, 5, 6, 2000
    cpu = SuffixAutomatonPool(batch, max_seq_len)
    gpu = native.DeviceSuffixAutomatonPool(batch, max_seq_len)
    stream = torch.cuda.current_stream()
    ids = np.arange(100, 100 + batch, dtype=np.int64)
    slots = []
    for request_id in ids:
        prompt = rng.integers(0, 4, size=int(rng.integers(0, 300))).astype(np.int32)
        cpu.add_request(int(request_id), prompt)
        slots.append(gpu.add_request(int(request_id), prompt, stream.cuda_stream))
    slot_ids = torch.tensor(slots, dtype=torch.int32, device="cuda")
    match_dev = torch.empty(batch, dtype=torch.int32, device="cuda")
    draft_dev = torch.empty(batch, draft_len, dtype=torch.int32, device="cuda")
    for _ in range(50):
        accepted = rng.integers(0, 4, size=(batch, width)).astype(np.int32)
        lens = rng.integers(0, width + 1, size=batch).astype(np.int32)
        want_match, want_draft = cpu.extend(ids, accepted, lens, draft_len)
        acc_dev = torch.from_numpy(accepted).cuda()
        lens_dev = torch.from_numpy(lens).cuda()
        gpu.extend(slot_ids.data_ptr(), acc_dev.data_ptr(), width, lens_dev.data_ptr(), batch,
                   draft_len, match_dev.data_ptr(), draft_dev.data_ptr(), stream.cuda_stream)
        stream.synchronize()
        assert match_dev.cpu().numpy().tolist() == want_match.tolist()
        assert draft_dev.cpu().numpy().tolist() == want_draft.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not suffix.CUDA_COMPILED, reason="module built without nvcc")
def test_device_kernel_bad_slot_gives_no_match_and_slot_reuse_is_clean():
    import torch

    gpu = native.DeviceSuffixAutomatonPool(1, 64)
    stream = torch.cuda.current_stream().cuda_stream
    gpu.add_request(1, [1, 2, 3, 1, 2], stream)
    gpu.remove_request(1)
    slot = gpu.add_request(2, [7, 8, 7], stream)
    slot_ids = torch.tensor([slot, 5], dtype=torch.int32, device="cuda")
    accepted = torch.tensor([[8], [1]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([1, 1], dtype=torch.int32, device="cuda")
    match_len = torch.empty(2, dtype=torch.int32, device="cuda")
    draft = torch.empty(2, 3, dtype=torch.int32, device="cuda")
    gpu.extend(slot_ids.data_ptr(), accepted.data_ptr(), 1, lens.data_ptr(), 2, 3,
               match_len.data_ptr(), draft.data_ptr(), stream)
    torch.cuda.synchronize()
    assert match_len.tolist() == [2, -1]  # "7 8" repeats; slot 5 does not exist
    assert draft.tolist() == [[7, 8, -1], [-1, -1, -1]]
