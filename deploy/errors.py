"""OpenAI-style errors: one exception type, one body shape, every failure mapped to it.

The body is `{"error": {"message", "type", "param", "code"}}`, the shape the official
`openai` client parses into `APIError.message` / `.param` / `.code`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, Optional, Sequence

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
    503: "service_unavailable", 504: "timeout",
}
# Anthropic's types where they differ (its SDK's ErrorType; Claude Code retries an overloaded_error)
_ANTHROPIC_TYPES = {413: "request_too_large", 500: "api_error", 503: "overloaded_error", 504: "timeout_error"}
# and its statuses: an overloaded_error is a 529 (its SDK's OverloadedError; retried like a 503)
_ANTHROPIC_STATUSES = {503: 529}
RETRY_AFTER_S = 1.0  # what a 503 asks a client to wait


class ApiError(Exception):
    """An HTTP failure with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, retry_after_s: Optional[float] = None,
                 anthropic_message: Optional[str] = None, details: Optional[dict[str, Any]] = None) -> None:
        """`anthropic_message`: the words of Anthropic's API for the same failure, for its
        clients that look for them ("prompt is too long: ..."); `details`: the error's
        `details` object, which a client reads to recover (Anthropic's)."""
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s, self.anthropic_message, self.details = retry_after_s, anthropic_message, details

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    @property
    def anthropic_type(self) -> str:
        return _ANTHROPIC_TYPES.get(self.status) or ("api_error" if self.status >= 500 else self.type)

    def body(self, anthropic: bool = False) -> dict[str, Any]:
        """OpenAI's error body; `anthropic`: with Anthropic's type and words, where they differ."""
        message = (self.anthropic_message or self.message) if anthropic else self.message
        details = {"details": self.details} if self.details is not None else {}
        return {"error": {"message": message, "type": self.anthropic_type if anthropic else self.type,
                          "param": self.param, "code": self.code, **details}}

    def renamed(self, fields: dict[str, str]) -> "ApiError":
        """This error with its field named as another API names it (`fields`: ours -> theirs;
        "[]" in a name stands for any list index, kept), and so the other fields its message
        names by a path (`(response_format.json_schema.schema)`, a field beside it)."""
        def theirs(name: str) -> Optional[str]:
            field = fields.get(name) or fields.get(re.sub(r"\[\d+\]", "[]", name))
            if field is None:
                return None
            indices = iter(re.findall(r"\[\d+\]", name))
            return re.sub(r"\[\]", lambda _: next(indices), field)

        param = self.param or ""
        field = theirs(param) or self.param
        message = self.message
        if param and message.startswith(param):
            message = field + message[len(param):]
        message = re.sub(r"(?<![\w.\]])\w+(?:\[\d+\])?(?:\.\w+(?:\[\d+\])?)+",
                         lambda m: theirs(m.group()) or m.group(), message)
        if field == self.param and message == self.message:
            return self
        return ApiError(self.status, message, field, self.code, self.retry_after_s, self.anthropic_message,
                        self.details)

    def response(self, path: str = "") -> JSONResponse:
        """The HTTP answer; to Anthropic's API (`path` under /v1/messages) the body says `"type": "error"`
        too, as Anthropic's do (its `error` has their `type` and `message`, and ours besides), with
        Anthropic's status where it differs (529 for an overloaded server)."""
        headers = {"Retry-After": str(max(1, round(self.retry_after_s)))} if self.retry_after_s else None
        if path.startswith("/v1/messages"):
            return JSONResponse({"type": "error", **self.body(anthropic=True)},
                                status_code=_ANTHROPIC_STATUSES.get(self.status, self.status), headers=headers)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def app_path(scope: dict[str, Any]) -> str:
    """An ASGI request's path under the app's route prefix (`root_path`)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def replica_lost(exc: BaseException) -> bool:
    """The replica holding the request died or became unreachable (not the request's fault)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    lost = (ActorDiedError, ActorUnavailableError, RayActorError)
    return isinstance(exc, lost) or isinstance(getattr(exc, "cause", None), lost)


def server_error(exc: BaseException, what: str = "engine") -> ApiError:
    """Map a failure from a Serve handle to `what` (or the stream) to an HTTP error."""
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    cause = getattr(exc, "cause", None)
    for candidate in (exc, cause):
        if isinstance(candidate, BackPressureError):
            return ApiError(503, "server overloaded: too many queued requests, retry later",
                            code="overloaded", retry_after_s=RETRY_AFTER_S)
        if isinstance(candidate, DeploymentUnavailableError):
            return ApiError(503, f"no {what} replica is available yet, retry later", retry_after_s=RETRY_AFTER_S)
    if replica_lost(exc):  # and no live one took the request over in time: the server's state, not a bug
        return ApiError(503, f"the {what} replica serving the request was lost and none took it over in time, "
                             "retry later", retry_after_s=RETRY_AFTER_S)
    if isinstance(exc, asyncio.TimeoutError):
        return ApiError(504, "the engine produced no token within the idle timeout")
    summary = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    return ApiError(500, f"{what} failure: {type(exc).__name__}: {summary}"[:500])


def param_from_loc(loc: Sequence[Any]) -> Optional[str]:
    """`("body", "messages", 0, "role")` -> `"messages[0].role"`; union branches (type tags,
    model class names) dropped."""
    name = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query") else loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif (isinstance(part, str) and part.isidentifier() and not part[0].isupper()
              and part not in ("str", "int", "list", "bool")):
            name += f".{part}" if name else part
    return name or None


def validation_error(exc: RequestValidationError, content_type: str = "application/json") -> ApiError:
    """FastAPI's validation failure -> a 400 naming the first offending field (a body sent as
    another content type than JSON is not read as JSON: said so)."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    # Each branch of a union reports its own failure (content as text, then as a list of parts):
    # of the first field's errors, the deepest is the branch the value was meant for.
    field = tuple(first.get("loc", ()))[:2]
    first = max((e for e in errors if tuple(e.get("loc", ()))[:2] == field), key=lambda e: len(e.get("loc", ())))
    param = param_from_loc(first.get("loc", ()))
    message = first["msg"].removeprefix("Value error, ")
    if first.get("type") == "union_tag_invalid":  # our tags read "type=..."
        ctx = first.get("ctx", {})
        expected = ctx.get("expected_tags", "").replace("'type=", "'")
        message = f"type {ctx.get('tag', '').removeprefix('type=')!r} is not one of {expected}"
    elif first.get("type") == "union_tag_not_found":  # no tag to read: not an object, or no "type" in it
        message = f"must be an object with a \"type\", got {json.dumps(first.get('input'), default=str)[:80]}"
    if param is None:  # the body itself: missing, not JSON, or not an object
        media_type = content_type.split(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            return ApiError(400, f"request body must be JSON sent as Content-Type: application/json, "
                                 f"got {content_type or 'none'}")
        return ApiError(400, f"request body must be a JSON object ({message})")
    return ApiError(400, f"{param}: {message}", param)


def http_error(exc: StarletteHTTPException) -> ApiError:
    if exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI's, past json's errors
        return ApiError(400, "malformed JSON body: not readable as JSON (not UTF-8, nested too deep, an integer "
                             "of over 4,300 digits, or compressed: no Content-Encoding is decoded)")
    return ApiError(exc.status_code, str(exc.detail))


def logged(error: ApiError, where: str) -> ApiError:
    """`error`, logged with what the client is told (Serve's log line adds the request id): a
    refusal at INFO, a failure of ours at WARNING. The access log has only the status."""
    logger.log(logging.WARNING if error.status >= 500 else logging.INFO, "%s: %d %s: %s", where, error.status,
               error.code or error.type, error.message)
    return error


def answer(error: ApiError, scope) -> JSONResponse:
    """`error` as the answer to the HTTP request of `scope` (Anthropic's shape under its
    routes), logged with its method and path: the error handlers' and the middleware's."""
    path = app_path(scope)
    return logged(error, f"{scope.get('method')} {path}").response(path)


def install_error_handlers(app) -> None:
    """Every error the app can raise leaves as an OpenAI error body (Anthropic's, to its API,
    whatever route prefix the app is served under), logged."""

    async def on_api_error(request, exc: ApiError):
        return answer(exc, request.scope)

    async def on_validation(request, exc: RequestValidationError):
        return answer(validation_error(exc, request.headers.get("content-type", "")), request.scope)

    async def on_http(request, exc: StarletteHTTPException):
        return answer(http_error(exc), request.scope)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
