"""Every error the app answers is in its log with what the client was told (the access log
has only the status): a refusal at INFO, a failure of ours at WARNING (found by QA: a 4xx's
reason, a 500's and a stream's error event were in no log)."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from deploy.errors import ApiError, install_error_handlers
from deploy.protocol import RequestModel


class Body(RequestModel):
    n: int


@pytest.fixture
def client():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/fails")
    async def fails():
        raise ApiError(500, "engine failure: boom")

    @app.post("/v1/messages")
    async def validated(body: Body):
        return {"n": body.n}

    return TestClient(app)


def test_a_refusal_and_a_failure_are_logged_with_what_the_client_was_told(client, caplog):
    caplog.set_level(logging.INFO, logger="deploy.errors")
    refused = client.post("/v1/messages", json={"n": "x"})
    failed = client.post("/v1/fails")
    assert (refused.status_code, failed.status_code) == (400, 500)
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "deploy.errors"]
    told = refused.json()["error"]["message"]  # Anthropic's shape, under /v1/messages
    assert logged == [(logging.INFO, f"POST /v1/messages: 400 invalid_request_error: {told}"),
                      (logging.WARNING, "POST /v1/fails: 500 server_error: engine failure: boom")]
