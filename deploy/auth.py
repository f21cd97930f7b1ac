"""Optional API keys, read once from an environment variable.

When the variable is unset or empty the server is open; when it holds comma-separated
keys, every route but `/healthz` (and `/health`, `/ping`) needs one: `Authorization: Bearer <key>`
(OpenAI's clients) or `x-api-key: <key>` (Anthropic's).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import os
from typing import Mapping, Optional

from deploy.errors import ApiError, answer, app_path

OPEN_PATHS = frozenset({"/healthz", "/health", "/ping"})  # probes
# The owner of what the request being served stores: its key's digest (never the key itself,
# which would reach the store's replica, its logs and its memory), "" where no key is needed.
KEY_OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("key_owner", default="")


def load_keys(env_var: str, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    return tuple(key.strip() for key in environ.get(env_var, "").split(",") if key.strip())


def key_owner(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def check_key(keys: tuple[str, ...], path: str, authorization: Optional[str], api_key: Optional[str] = None) -> str:
    """The key the request passes with ("" where it needs none); a 401 ApiError where it may
    not pass (`api_key`: its x-api-key header)."""
    if not keys or path in OPEN_PATHS:
        return ""
    scheme, _, bearer = (authorization or "").partition(" ")
    # either header may carry the key (a client can send both: an OAuth token beside an API key)
    tokens = [t for t in ((bearer if scheme.lower() == "bearer" else "").strip(), (api_key or "").strip()) if t]
    if not tokens:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                       code="invalid_api_key")
    # compare against every key so timing does not reveal which prefix matched
    matched = [key for token in tokens for key in keys if hmac.compare_digest(token.encode(), key.encode())]
    if not matched:
        raise ApiError(401, "incorrect API key", code="invalid_api_key")
    if len(set(matched)) > 1:  # whose would what it stores be?
        raise ApiError(401, "two different API keys: send one, in 'Authorization' or in 'x-api-key'",
                       code="invalid_api_key")
    return matched[0]


class BearerAuth:
    """ASGI middleware applying `check_key` to every HTTP request, and setting `KEY_OWNER` for it."""

    def __init__(self, app, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.keys:
            headers = dict(scope.get("headers") or [])
            authorization = headers.get(b"authorization", b"").decode("latin-1") or None
            api_key = headers.get(b"x-api-key", b"").decode("latin-1") or None
            path = app_path(scope)
            try:
                key = check_key(self.keys, path, authorization, api_key)
            except ApiError as exc:
                await answer(exc, scope)(scope, receive, send)  # to /v1/messages in Anthropic's shape
                return
            if key:
                owner = KEY_OWNER.set(key_owner(key))
                try:
                    return await self.app(scope, receive, send)
                finally:
                    KEY_OWNER.reset(owner)
        await self.app(scope, receive, send)
