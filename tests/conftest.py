"""Skip `gpu`-marked tests on machines without a usable CUDA device."""

import pytest


def _cuda_available() -> bool:
    try:
        import torch  # imported only when a gpu-marked test was collected
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in gpu_items:
            item.add_marker(skip)
