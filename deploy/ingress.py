"""The OpenAI-compatible HTTP ingress (FastAPI on Serve's ingress).

`/v1/completions`, `/v1/chat/completions`, `/v1/responses` and Anthropic's `/v1/messages`
(SSE when `stream`, JSON otherwise; `deploy/responses.py` and `deploy/messages.py` have the
last two), `/v1/models`, vLLM's `/tokenize` and `/detokenize`, `/healthz` (or `/health`).
The ingress validates and tokenizes at the edge, streams the request (each of its `n`
choices an engine request of its own) from a Replica through the speculation-gate router,
and turns every failure into an error: before the first token as an HTTP status, after it as
an SSE error event (then `data: [DONE]`, or `response.failed`), so a client never hangs.
When the client goes away, the replica streams are cancelled, which aborts the requests in
the engine (`deploy/replica_streams.py`). The Responses API's kept responses live in a
deployment of their own (`deploy/response_store.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import functools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Union

from fastapi.responses import JSONResponse, StreamingResponse

from deploy import message_blocks, messages, openai_format as fmt, response_items, responses, tokenizing
from deploy.auth import load_keys
from deploy.background import FINAL_PUT_ATTEMPTS, BackgroundResponses
from deploy.chat_protocol import ChatCompletionRequest, ChatMessage, misplaced_tool_message
from deploy.config import IngressConfig
from deploy.errors import RETRY_AFTER_S, ApiError, logged, server_error
from deploy.messages import CountTokensRequest, MessagesRequest
from deploy.output_parts import OutputParts
from deploy.prompts import engine_requests, generation_request, prompt_token_ids
from deploy.protocol import CompletionRequest, StreamOptions
from deploy.replica_streams import ReplicaStreams, all_choices, cancel, no_engine_replica
from deploy.response_bodies import ModelCard
from deploy.response_store import KeptResponses
from deploy.responses import InputTokensRequest, ResponsesRequest
from deploy.tokenizing import DetokenizeRequest, TokenizeChat, TokenizeCompletion
from replicas.engine import GenerationDelta, GenerationRequest
from replicas.replica import log_through_serve

logger = logging.getLogger(__name__)

HEALTH_MAX_AGE_S = 1.0  # a health probe takes the controller's answer of the last second (one call a second)


class Ingress:
    """What the HTTP API does; `deploy/routes.py` gives it its routes (`HttpIngress`, which
    `deploy/app.py` deploys with `serve.ingress()`)."""

    def __init__(self, replica: Any, store: Any, config: IngressConfig) -> None:
        """`replica` and `store`: handles to the Replica and ResponseStore deployments."""
        log_through_serve("deploy")
        self._replicas = ReplicaStreams(replica, config)
        self.config = config
        self.keys = load_keys(config.api_keys_env)
        if not self.keys:  # read in this worker: a shell's variable does not reach a running cluster's
            logger.warning("no API keys in $%s here: every route is open (set it in the application's "
                           "runtime_env.env_vars)", config.api_keys_env)
        self._tokenizer = None
        self._created = int(time.time())
        self.stored = KeptResponses(store, config.stored_responses)
        self.background = BackgroundResponses(self.stored)
        # Prompts are rendered and tokenized here, off the event loop: a 1 MB chat takes the
        # better part of a second, which on the loop held every other client's stream.
        self._prompts = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prompts")

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the prompts' threads, in this request's context (its key owner: auth.KEY_OWNER)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._prompts, call)

    # -- tokenizer, fetched lazily from a replica ---------------------------------------------
    async def tokenizer(self) -> Any:
        if self._tokenizer is None:  # one of this deployment's model, never one rolled out before or after
            self._tokenizer = await self._replicas.tokenizer(self.config.model_identity)
        return self._tokenizer

    async def check_engine_replicas(self) -> None:
        """ApiError(503) unless Serve's controller counts an engine replica running: the ingress
        answering alone is no server that can generate (a failed deploy, every replica lost)."""
        try:
            running = await self._replicas.engine_running(max_age_s=HEALTH_MAX_AGE_S)
        except Exception as exc:  # noqa: BLE001 - the controller unreachable: nothing can be said to serve
            raise ApiError(503, f"cannot tell whether an engine replica runs: {type(exc).__name__}",
                           retry_after_s=RETRY_AFTER_S) from exc
        if not running:
            raise no_engine_replica()

    # -- generation -----------------------------------------------------------------------------
    def _served(self, model: str) -> None:
        if model != self.config.model_name:
            raise ApiError(404, f"model: {model!r} is not served here; try {self.config.model_name!r}",
                           "model", code="model_not_found")

    async def handle(self, kind: fmt.Kind, body: Union[CompletionRequest, ChatCompletionRequest]):
        self._served(body.model)
        if kind == "chat" and (misplaced := misplaced_tool_message(body.messages)):
            raise ApiError(400, ": ".join(misplaced), misplaced[0])
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        tokenizer = await self.tokenizer()
        requests = await self._off_loop(engine_requests, request_id, tokenizer, body, self.config)
        chat = isinstance(body, ChatCompletionRequest)
        num_top = requests[0].sampling.logprobs
        output = fmt.Output(kind, num_top is not None, chat and bool(body.functions),
                            fmt.TokenTexts.for_tokenizer(tokenizer), chat and not body.parallel_tool_calls,
                            body.prompt_logprobs, chat and body.continue_final_message)
        echoes, prompt_only = [None] * len(requests), not chat and body.echo and body.max_tokens == 0
        if not chat and body.echo:  # each choice's prompt: prompt-major, n choices each
            echoes = [fmt.Echo(p if isinstance(p, str) else tokenizer.decode(p), r.prompt[0], num_top or 0)
                      for r, p in zip(requests, (p for p in body.prompts for _ in range(body.n)))]
        # Serve gives every handle call made for one HTTP request that request's internal id, and
        # its router indexes the calls it is placing by that id: of two placed at once, one was
        # never placed (Ray 2.60; n=3 hung). So a request's choices are routed one at a time,
        # their retries and resumptions too (the later ones then find the prompt's prefix cached).
        routing = asyncio.Lock()
        opened = []
        try:
            for r in requests:
                opened.append(await self._replicas.open(r, routing))
        except BaseException as exc:
            for stream, _ in opened:
                cancel(stream)
            if isinstance(exc, ApiError) and body.prompt_logprobs is None:  # echo asked an engine that
                raise exc.renamed({"prompt_logprobs": "echo"}) from None  # cannot score a prompt
            raise
        created = int(time.time())
        if body.stream:
            options = body.stream_options or StreamOptions()
            return StreamingResponse(self._sse(output, request_id, requests, echoes, created, opened, routing,
                                               options, body.n, prompt_only),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        accs = await all_choices([self._replicas.collect(r, *o, routing, prompt_only)
                                  for r, o in zip(requests, opened)])
        choices = [fmt.full_choice(kind, i, acc, output,
                                   fmt.answer_tool_calls(acc, output) if output.tools else None, echoes[i])
                   for i, acc in enumerate(accs)]
        return JSONResponse(fmt.full_response(kind, request_id, created, self.config.model_name, choices, accs, output,
                                              body.n))

    async def respond(self, body: ResponsesRequest):
        """`POST /v1/responses`: the chat request it means, generated as `handle` would, its output
        as Responses items; kept in `self.stored` when `store`."""
        self._served(body.model)
        body, conversation = await self._conversation(body)
        chat, named = responses.chat_request(body, conversation), responses.fields(body)

        def fit(build: Callable[[ChatCompletionRequest], GenerationRequest]) -> GenerationRequest:
            nonlocal conversation  # what the model is sent: all of it, or with truncation its tail
            fitted, conversation = responses.fitted(body, chat, conversation, build)
            return fitted

        request = await self._build(chat, f"resp_{uuid.uuid4().hex}", named, fit)
        created, model = int(time.time()), self.config.model_name
        texts = fmt.TokenTexts.for_tokenizer(await self.tokenizer()) if body.logprobs else None
        items = response_items.OutputItems(bool(chat.functions), texts, not chat.parallel_tool_calls,
                                           body.namespaces)

        async def finished(acc: fmt.Accumulated) -> dict[str, Any]:
            done = response_items.response_body(body, request.request_id, created, model, items, acc)
            if body.store:  # kept before the client can see it done and ask for it (its poll, in background)
                await self.stored.put(done, responses.continued(conversation, done["output"]),
                                      response_items.input_items(body), FINAL_PUT_ATTEMPTS if body.background else 1)
            return done

        if body.background:
            if self.config.stored_responses <= 0:
                raise ApiError(400, "background: needs stored responses (limits.stored_responses is 0 here)",
                               "background")

            async def generate(begun: Callable[[], Awaitable[None]]) -> None:
                routing = asyncio.Lock()
                opened = await self._open(request, routing, named)
                try:
                    await begun()
                    acc = await self._collect(request, opened, routing, named)
                except BaseException:  # cancelled before the stream was read: stopped in the engine too
                    cancel(opened[0])
                    raise
                items.feed(acc.text, acc.finish_reason, acc.logprobs, acc.cut)
                await finished(acc)

            queued = {**response_items.response_body(body, request.request_id, created, model), "status": "queued"}
            await self.background.start(queued, response_items.input_items(body), generate)
            return JSONResponse(queued)
        routing = asyncio.Lock()
        opened = await self._open(request, routing, named)
        if body.stream:
            begun = response_items.response_body(body, request.request_id, created, model)

            async def completed(acc: fmt.Accumulated) -> list[dict[str, Any]]:
                done = await finished(acc)
                return [items.event(f"response.{done['status']}", response=done)]

            def failed(err: ApiError) -> list[dict[str, Any]]:
                return [items.event("error", code=err.code or err.type, message=err.message, param=err.param),
                        items.event("response.failed", response=response_items.failed(begun, err))]

            opening = [items.event("response.created", response=begun),
                       items.event("response.in_progress", response=begun)]
            return self._typed_events(request, opened, routing, named, items, opening, completed, failed)
        acc = await self._collect(request, opened, routing, named)
        items.feed(acc.text, acc.finish_reason, acc.logprobs, acc.cut)
        return JSONResponse(await finished(acc))

    async def _conversation(self, body: ResponsesRequest) -> tuple[ResponsesRequest, list[ChatMessage]]:
        """`body` with the items it references, and the conversation it continues (`previous_response_id`'s,
        then its input); a 400 naming an item the conversation cannot take."""
        if referenced := responses.references(body):
            body = responses.with_items(body, await self.stored.items(referenced), self.config.max_body_bytes)
        previous = await self.stored.get(body.previous_response_id, "previous_response_id") \
            if body.previous_response_id else None
        if previous and previous[0]["status"] not in ("completed", "incomplete"):
            raise ApiError(400, f"previous_response_id: response {body.previous_response_id!r} is "
                                f"{previous[0]['status']}: only a completed or incomplete one can be continued",
                           "previous_response_id")
        taken = [item["id"] for item in (*previous[0]["output"], *previous[2])] if previous else []
        if repeated := responses.repeated_id(body.items, taken) or responses.unmatched_call(
                body.items, previous[1] if previous else []):
            raise ApiError(400, ": ".join(repeated), repeated[0])
        return body, responses.conversation(body, previous[1] if previous else [])

    async def count_input_tokens(self, body: InputTokensRequest) -> dict[str, Any]:
        """`POST /v1/responses/input_tokens` (OpenAI's): the tokens of the prompt `respond` would
        send for these fields; with `truncation: "auto"`, of the turns it would keep. The
        prompt is counted whatever its length (a client counts to see whether it fits)."""
        if body.model is not None:
            self._served(body.model)
        body, conversation = await self._conversation(body.model_copy(update={"model": self.config.model_name}))
        if not conversation and not body.instructions:
            raise ApiError(400, "input: nothing to count: give input, instructions or a previous_response_id", "input")
        chat, named = responses.chat_request(body, conversation), responses.fields(body)
        tokenizer = await self.tokenizer()
        try:
            if body.truncation == "auto":
                request, _ = await self._off_loop(responses.fitted, body, chat, conversation, functools.partial(
                    generation_request, "count", tokenizer, config=self.config))
                count = len(request.prompt)
            else:
                count = len(await self._off_loop(prompt_token_ids, tokenizer, chat))
        except ApiError as exc:
            raise exc.renamed(named) from None
        return {"object": "response.input_tokens", "input_tokens": count}

    async def message(self, body: MessagesRequest):
        """`POST /v1/messages` (Anthropic's): the chat request it means, generated as `handle`
        would, its answer as content blocks."""
        self._served(body.model)
        if body.thread is not None:
            raise messages.threads_refused()
        chat = messages.chat_request(body)
        request, routing = await self._build(chat, f"msg_{uuid.uuid4().hex}", messages.FIELDS), asyncio.Lock()
        opened = await self._open(request, routing, messages.FIELDS)
        model = self.config.model_name
        blocks = message_blocks.ContentBlocks(bool(chat.functions), not chat.parallel_tool_calls,
                                              chat.continue_final_message)
        if body.stream:
            begun = message_blocks.message_body(request.request_id, model, blocks, first=opened[1])

            async def closing(acc: fmt.Accumulated) -> list[dict[str, Any]]:
                return [{"type": "message_delta", "usage": message_blocks.usage(acc),
                         "delta": {"stop_reason": blocks.stop_reason(acc), "stop_sequence": acc.stop_string}},
                        {"type": "message_stop"}]

            return self._typed_events(
                request, opened, routing, messages.FIELDS, blocks, [{"type": "message_start", "message": begun}],
                closing, lambda err: [{"type": "error", **err.body(anthropic=True)}])
        acc = await self._collect(request, opened, routing, messages.FIELDS)
        blocks.feed(acc.text, acc.finish_reason, cut=acc.cut)
        return message_blocks.MessageResponse(message_blocks.message_body(request.request_id, model, blocks, acc))

    async def tokenize(self, body: Union[TokenizeCompletion, TokenizeChat]) -> dict[str, Any]:
        """vLLM's `POST /tokenize`: a prompt or a chat as its completion would tokenize it."""
        if body.model is not None:
            self._served(body.model)
        return await self._off_loop(tokenizing.tokenize, await self.tokenizer(), body, self.config.model_name,
                                    self.config.max_seq_len)

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        if body.model is not None:
            self._served(body.model)
        return tokenizing.detokenize(await self.tokenizer(), body)

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """`POST /v1/messages/count_tokens`: the prompt's tokens, as `message` would render them."""
        self._served(body.model)
        try:
            ids = await self._off_loop(prompt_token_ids, await self.tokenizer(), messages.chat_request(body))
            return {"input_tokens": len(ids)}
        except ApiError as exc:
            raise exc.renamed(messages.FIELDS) from None

    async def _build(self, chat: ChatCompletionRequest, request_id: str, fields: dict[str, str],
                     fit: Optional[Callable[[Callable[[ChatCompletionRequest], GenerationRequest]],
                                            GenerationRequest]] = None) -> GenerationRequest:
        """The engine request for another API's request that means `chat` (or the chat `fit`
        picks, given how a chat becomes an engine request); an error names the field as `fields` say."""
        try:
            tokenizer = await self.tokenizer()

            def build(c: ChatCompletionRequest) -> GenerationRequest:
                return generation_request(request_id, tokenizer, c, self.config)

            return await (self._off_loop(build, chat) if fit is None else self._off_loop(fit, build))
        except ApiError as exc:
            raise exc.renamed(fields) from None

    async def _open(self, request: GenerationRequest, routing: asyncio.Lock,
                    fields: dict[str, str]) -> tuple[Any, GenerationDelta]:
        """The request's stream, opened on a replica; the engine's refusal named as `fields` say."""
        try:
            return await self._replicas.open(request, routing)
        except ApiError as exc:
            raise exc.renamed(fields) from None

    async def _collect(self, request: GenerationRequest, opened: tuple[Any, GenerationDelta], routing: asyncio.Lock,
                       fields: dict[str, str]) -> fmt.Accumulated:
        """Another API's request run to its end; an error the request's own field caused named
        as that API names it (`fields`)."""
        try:
            return await self._replicas.collect(request, *opened, routing)
        except ApiError as exc:
            raise exc.renamed(fields) from None

    def _typed_events(self, request: GenerationRequest, opened: tuple[Any, GenerationDelta], routing: asyncio.Lock,
                      fields: dict[str, str], parts: OutputParts, opening: list[dict[str, Any]],
                      closing: Callable[[fmt.Accumulated], Awaitable[list[dict[str, Any]]]],
                      failing: Callable[[ApiError], list[dict[str, Any]]]) -> StreamingResponse:
        """A Responses or Messages stream: `opening`, the events of `parts` as the deltas come, then
        `closing`'s; a failure after the first event ends it with `failing`'s (its field named as
        `fields` say), so it never hangs."""

        async def events() -> AsyncIterator[str]:
            for event in opening:
                yield fmt.typed_sse(event)
            acc = fmt.Accumulated.of(request)
            try:
                async with contextlib.aclosing(self._replicas.deltas(request, *opened, acc, routing)) as deltas:
                    async for delta in deltas:
                        for event in parts.feed(delta.text, delta.finish_reason, delta.logprobs, acc.cut):
                            yield fmt.typed_sse(event)
                last = await closing(acc)
            except Exception as exc:  # noqa: BLE001 - a failed replica ends the stream, never hangs it
                if not isinstance(exc, ApiError):
                    logger.warning("stream %s failed: %r", request.request_id, exc)
                error = (exc if isinstance(exc, ApiError) else server_error(exc)).renamed(fields)
                last = failing(logged(error, f"stream {request.request_id}"))
            for event in last:
                yield fmt.typed_sse(event)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _sse(self, output: fmt.Output, response_id: str, requests: list[GenerationRequest],
                   echoes: list[Optional[fmt.Echo]], created: int, opened: list[tuple[Any, GenerationDelta]],
                   routing: asyncio.Lock, options: StreamOptions, n: int, prompt_only: bool) -> AsyncIterator[str]:
        """The response's SSE: each choice's chunks as its replica stream delivers them (one
        task per choice), each choice's last chunk as it finishes, then the usage and [DONE].
        With `include_usage` every chunk but the last has usage null (OpenAI's), or, with
        `continuous_usage_stats`, its choice's usage as it was when the chunk was made (vLLM's;
        the last chunk's is the whole request's)."""
        kind, model = output.kind, self.config.model_name
        accs = [fmt.Accumulated.of(r, prompt_only) for r in requests]
        events: asyncio.Queue = asyncio.Queue()  # a chunk, None (a choice finished) or an error
        include_usage = options.include_usage
        continuous = include_usage and options.continuous_usage_stats

        def counted(chunk: dict, index: int) -> dict:
            return {**chunk, "usage": fmt.running_usage(requests[index].prompt, accs[index])} if continuous else chunk

        async def choice(index: int) -> None:
            pieces = fmt.StreamPieces(output, echoes[index])
            try:
                async with contextlib.aclosing(self._replicas.deltas(requests[index], *opened[index], accs[index],
                                                                     routing)) as deltas:
                    async for delta in deltas:
                        text, tool_calls, logprobs = pieces.of(delta, accs[index].cut)
                        if text or tool_calls or logprobs:
                            events.put_nowait(counted(fmt.chunk(kind, response_id, created, model, text,
                                                                logprobs=logprobs, tool_calls=tool_calls, index=index),
                                                      index))
                        if delta.finish_reason is not None:
                            events.put_nowait(counted(fmt.chunk(kind, response_id, created, model,
                                                                None if kind == "chat" else "",
                                                                pieces.finish_reason(accs[index]), index=index,
                                                                stop_reason=accs[index].stop_reason), index))
                            events.put_nowait(None)
            except Exception as exc:  # noqa: BLE001 - the response ends with it, never hangs
                events.put_nowait(exc)

        def sse(chunk: dict) -> str:
            return fmt.sse({**chunk, "usage": chunk.get("usage")} if include_usage else chunk)

        tasks = [asyncio.ensure_future(choice(i)) for i in range(len(requests))]
        try:
            try:
                if kind == "chat":  # content null where the answer may be calls alone, as OpenAI's
                    opening = None if output.tools else ""
                    for i in range(len(requests)):
                        yield sse(counted(fmt.chunk(kind, response_id, created, model, opening, role=True, index=i), i))
                finished = 0
                while finished < len(requests):
                    event = await events.get()
                    if isinstance(event, Exception):
                        raise event
                    if event is None:
                        finished += 1
                    else:
                        yield sse(event)
                if include_usage:
                    yield fmt.sse(fmt.usage_chunk(kind, response_id, created, model, accs, n))
            except ApiError as exc:  # the body a non-stream failure has (its code a string or null)
                yield fmt.sse(logged(exc, f"stream {response_id}").body())
            except Exception as exc:  # noqa: BLE001 - a failed replica ends the stream, never hangs it
                logger.warning("stream %s failed: %r", response_id, exc)
                yield fmt.sse(server_error(exc).body())
            yield fmt.DONE
        finally:
            for task in tasks:
                task.cancel()

    # -- models ---------------------------------------------------------------------------------
    def model_card(self) -> dict[str, Any]:
        created_at = datetime.datetime.fromtimestamp(self._created, datetime.timezone.utc)
        return ModelCard(id=self.config.model_name, created=self._created, display_name=self.config.model_name,
                         created_at=created_at.isoformat().replace("+00:00", "Z"),
                         max_model_len=self.config.max_seq_len).model_dump()

