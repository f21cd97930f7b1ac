"""One fixed native forward, written to a file: what test_emulated_cpu.py runs on this machine
and under an emulated CPU, to compare the bits the two compute.

    python -m tests.torch_engine.forward_probe OUT.npz

The packaged model prefills an 8-token prompt, verifies 5 more tokens in one step, then
decodes the same 5 one at a time on the same cache. OUT holds the kernel path, torch's CPU
capability and the logits of both.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from replicas.torch_engine.loader import packaged_gguf_path
from replicas.torch_engine.native_model import NativeLlamaModel
from tests.torch_engine.test_native_model import random_ids, verify_and_decodes

PROMPT_LEN, VERIFY_ROWS = 8, 5


def main(out: str) -> None:
    model = NativeLlamaModel.load(packaged_gguf_path(), num_threads=2)
    verify, decodes = verify_and_decodes(model, random_ids(7, PROMPT_LEN + VERIFY_ROWS), PROMPT_LEN, max_seq_len=64)
    np.savez(out, isa=model.isa, torch_capability=torch.backends.cpu.get_cpu_capability(),
             verify=verify.numpy(), decodes=decodes.numpy())


if __name__ == "__main__":
    main(sys.argv[1])
