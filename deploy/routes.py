"""The HTTP routes (FastAPI) of one `Ingress`: each validates its body's type and hands it
to the Ingress method that serves it; the middleware (auth, body limit, request-id header,
arrival clock) and the OpenAI-style error handlers wrap them all."""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI

from deploy import tokenizing
from deploy.arrival import Arrival
from deploy.auth import BearerAuth
from deploy.body_limit import BodyLimit
from deploy.chat_protocol import ChatCompletionRequest
from deploy.errors import ApiError, install_error_handlers
from deploy.ingress import Ingress
from deploy.messages import CountTokensRequest, MessagesRequest
from deploy.protocol import CompletionRequest
from deploy.request_id import RequestIdHeader
from deploy.response_bodies import ChatCompletionResponse, CompletionResponse, ErrorResponse, ModelCard, ModelList
from deploy.response_store import input_item_list
from deploy.responses import InputTokensRequest, ResponsesRequest
from deploy.tokenizing import DetokenizeRequest, TokenizeRequest


_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503)}
_STREAM_DOC = {"content": {"text/event-stream": {}}, "description": "SSE chunks ending with data: [DONE]"}


def build_api(ingress: Ingress) -> FastAPI:
    """The FastAPI app, its routes bound to one Ingress instance."""
    config = ingress.config
    app = FastAPI(title="specserve", version="0.1.0",
                  description="OpenAI-compatible LLM serving with hybrid speculative decoding")
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s)
    app.add_middleware(BearerAuth, keys=ingress.keys)  # auth before reading bodies
    app.add_middleware(RequestIdHeader)  # on every answer, refusals too
    app.add_middleware(Arrival)  # outermost: the time to first token counts from here

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_ERRORS, 200: _STREAM_DOC})
    async def completions(body: CompletionRequest):
        return await ingress.handle("completion", body)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, 200: _STREAM_DOC})
    async def chat_completions(body: ChatCompletionRequest):
        return await ingress.handle("chat", body)

    @app.post("/v1/responses", responses={**_ERRORS, 200: _STREAM_DOC})
    async def create_response(body: ResponsesRequest):
        return await ingress.respond(body)

    @app.post("/v1/messages", responses={**_ERRORS, 200: _STREAM_DOC})
    async def create_message(body: MessagesRequest):
        return await ingress.message(body)

    @app.post("/v1/messages/count_tokens", responses=_ERRORS)
    async def count_message_tokens(body: CountTokensRequest):
        return await ingress.count_tokens(body)

    @app.post("/v1/responses/input_tokens", responses=_ERRORS)
    async def count_response_input_tokens(body: InputTokensRequest):
        return await ingress.count_input_tokens(body)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def get_response(response_id: str, stream: bool = False):
        if stream:  # the SDK's retrieve(stream=True) would read a JSON answer as no events at all
            raise ApiError(400, "stream: a response's events are not kept here: GET it without stream", "stream")
        return (await ingress.stored.get(response_id))[0]

    @app.post("/v1/responses/{response_id}/cancel", responses=_ERRORS)
    async def cancel_response(response_id: str):
        return await ingress.background.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items", responses=_ERRORS)
    async def list_input_items(response_id: str, limit: int = 20, order: str = "desc", after: Optional[str] = None):
        # `include` asks for what an input item may add (an image's URL, ...): ours have nothing more
        return input_item_list((await ingress.stored.get(response_id))[2], limit, order, after)

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete_response(response_id: str):
        await ingress.background.delete(response_id)  # (a background one it runs stops at once)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models():
        card = ingress.model_card()
        return ModelList(data=[card], first_id=card["id"], last_id=card["id"]).model_dump()

    @app.get("/v1/models/{model}", response_model=ModelCard, responses=_ERRORS)
    async def model(model: str):
        if model != config.model_name:
            raise ApiError(404, f"model: {model!r} is not served here", "model", code="model_not_found")
        return ingress.model_card()

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest):
        return await ingress.tokenize(body)

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        return await ingress.detokenize(body)

    @app.get("/tokenizer_info", responses=_ERRORS)
    async def tokenizer_info():
        return tokenizing.tokenizer_info(await ingress.tokenizer(), config.max_seq_len)

    @app.get("/healthz", responses={503: {"model": ErrorResponse}})
    @app.get("/health")  # vLLM's name for it
    @app.get("/ping", include_in_schema=False)  # vLLM's and SageMaker's (GET or POST)
    @app.post("/ping", include_in_schema=False)
    @app.head("/healthz", include_in_schema=False)  # for probes that send HEAD (one route of two
    @app.head("/health", include_in_schema=False)   # methods named its operation by a set's order)
    async def healthz():
        await ingress.check_engine_replicas()
        return {"status": "ok"}

    @app.get("/version")  # vLLM's
    async def version():
        return {"version": app.version}

    return app


class HttpIngress(Ingress):
    """The Ingress as Serve deploys it: Serve builds its ASGI app with this hook."""

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self)

    async def __del__(self):
        """Serve's graceful stop awaits this (`serve.ingress`'s wrapper awaits a coroutine
        destructor only): the background responses this replica still runs stop and are kept
        as failed."""
        background = getattr(self, "background", None)  # (an __init__ that raised)
        if background is not None:
            await background.stop()
