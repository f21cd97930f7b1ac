"""Skip `gpu`-marked tests on machines without a usable CUDA device; leave a process that ran
several Ray clusters without its C++ exit handlers."""

import os
import sys

import pytest

_SESSION = pytest.StashKey[pytest.Session]()


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


def pytest_sessionstart(session):
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Ray 2.60 shuts down only the first cluster's metric exporter in a driver process: after
    a second `ray.init()` in the same process, the exporter's thread outlives `ray.shutdown()`,
    logs a failed export every second, and can log while the process's exit is destroying
    spdlog's registry: a segfault after every test has passed (2 of 9 full runs here). So once
    pytest has reported, a process that loaded Ray ends without running exit handlers."""
    session = config.stash.get(_SESSION, None)
    if session is None or "ray._raylet" not in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))
