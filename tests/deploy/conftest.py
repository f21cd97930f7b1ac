"""One real Serve cluster per test module, on 127.0.0.1, HTTP included.

A module sets `SERVE_ENV = {...}` to give the cluster's workers extra environment
variables (e.g. API keys); the cluster is torn down at the end of the module.
"""

from __future__ import annotations

import pytest

from tests.serve_support import local_serve


@pytest.fixture(scope="module")
def serve_url(request):
    with local_serve(getattr(request.module, "SERVE_ENV", {})) as url:
        yield url
