"""One real Serve cluster per test module, on 127.0.0.1, HTTP included.

A module sets `SERVE_ENV = {...}` to give the cluster's workers extra environment
variables (e.g. API keys); the cluster is torn down at the end of the module.
"""

from __future__ import annotations

import openai
import pytest

from tests.serve_support import APP, deploy_config, embedded_config, local_serve


@pytest.fixture(scope="module")
def chatml():
    """The embedded model's tokenizer (its ChatML template)."""
    from replicas.torch_engine.loader import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir())


@pytest.fixture(scope="module")
def serve_url(request):
    with local_serve(getattr(request.module, "SERVE_ENV", {})) as url:
        yield url


@pytest.fixture(scope="module")
def agent_url(serve_url):
    """The real application (the embedded model, MTP on, batch gate 8, two Ingress replicas) for
    what agent clients send."""
    document = embedded_config(batch_gate=8, mtp_weights="default")
    document["applications"][0]["args"]["ingress_replicas"] = 2
    deploy_config(document, APP, timeout_s=240)
    return serve_url


@pytest.fixture(scope="module")
def agent_client(agent_url):
    return openai.OpenAI(base_url=f"{agent_url}/v1", api_key="unused", max_retries=0, timeout=300)
