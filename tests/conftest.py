"""Skip `gpu`-marked tests on machines without a usable CUDA device."""

import pytest


def _cuda_available() -> bool:
    try:
        import torch  # imported only when a gpu-marked test was collected
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    # by marker, not keyword: a test or parameter merely named "gpu" must still run
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in gpu_items:
            item.add_marker(skip)
