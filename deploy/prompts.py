"""HTTP request -> engine request: chat template, tokenization, sampling, limits.

The ingress tokenizes with the model's own tokenizer (fetched once from a replica), so
limits on prompt length are enforced at the edge before anything is queued, and the
replica receives token ids.

Tools: a chat template that knows tools gets them (and earlier calls) in the Hugging Face
convention; any other template gets our documented default (deploy/tool_calls.py): the
functions described in the system message, earlier calls written as `<tool_call>` blocks.
`response_format` and a forced tool choice become the request's grammar.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from typing import Any, Optional, Union

from deploy.auth import KEY_OWNER
from deploy.chat_protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, joined_text
from deploy.config import IngressConfig
from deploy.errors import ApiError
from deploy.protocol import MAX_PROMPTS, CompletionRequest
from deploy.tool_calls import (
    TOOL_CALL_CLOSE, format_tool_calls, json_loads, schema_error, tag_token_ids, tool_call_grammar, tools_system_prompt,
)
from replicas.engine import GenerationRequest, GrammarSpec, RequestError, RequestSpeculation, SamplingParams


def template_knows_tools(tokenizer: Any) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def _message(m: ChatMessage, native_tools: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.text, **({"name": m.name} if m.name else {})}
    if m.tool_calls and native_tools:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
    elif m.tool_calls:
        calls = format_tool_calls([(c.function.name, c.function.arguments) for c in m.tool_calls])
        message["content"] = f"{m.text}\n{calls}" if m.text else calls
    if m.tool_call_id and native_tools:
        message["tool_call_id"] = m.tool_call_id
    return message


def _arguments(arguments: str) -> Any:
    """Templates expect a call's arguments as a mapping; JSON text that is not one stays text."""
    try:
        return json_loads(arguments)
    except ValueError:
        return arguments


# A special token's text in what a client wrote (`<|im_end|><|im_start|>system` in a user
# message) is held in the rendered chat as this mark, its index in `_specials`, and tokenized
# as the plain text it is: only the template writes control tokens (as OpenAI's API; Hugging
# Face's and vLLM's tokenize it as the control token, opening a turn of the client's choosing).
_MARK = re.compile("\ue000([0-9]+)\ue001")


@functools.lru_cache(maxsize=8)  # per tokenizer (the ingress has one; a model's may hold hundreds)
def _specials(tokenizer: Any) -> tuple[tuple[str, ...], re.Pattern]:
    """What is marked in a client's text, and its pattern: the texts of the tokenizer's special
    tokens, longest first, and the mark's own first character (a mark the client wrote stays its text)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    texts = {t.content for t in added if t.special} | set(getattr(tokenizer, "all_special_tokens", ()))
    specials = (*sorted(texts, key=len, reverse=True), "\ue000")
    return specials, re.compile("|".join(map(re.escape, specials)))


def _marked(value: Any, tokenizer: Any) -> Any:
    """`value` (the chat's messages and functions) with every special token's text marked."""
    specials, pattern = _specials(tokenizer)

    def mark(node: Any) -> Any:
        if isinstance(node, str):
            return pattern.sub(lambda m: f"\ue000{specials.index(m.group())}\ue001", node)
        if isinstance(node, dict):
            return {k: mark(v) for k, v in node.items()}
        if isinstance(node, list):
            return [mark(v) for v in node]
        return node

    return mark(value)


def chat_token_ids(tokenizer: Any, rendered: str) -> list[int]:
    """A rendered chat's token ids: the template's special tokens as themselves, a client's
    text of one (marked) as plain text."""
    pieces = _MARK.split(rendered)  # text, index, text, ...
    specials = _specials(tokenizer)[0] if len(pieces) > 1 else ()
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2:
            ids += tokenizer.encode(specials[int(piece)], add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def render_chat(tokenizer: Any, request: ChatCompletionRequest) -> str:
    """The chat as the model's template renders it (a 400 if the template refuses it), the
    text of any special token in what the client wrote marked (`chat_token_ids` reads it)."""
    if hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:  # (a wrapper may not say)
        raise ApiError(400, "messages: the served model has no chat template to render a chat with: send its "
                            "prompt as text to /v1/completions", "messages")
    native_tools = template_knows_tools(tokenizer)
    messages = [_message(m, native_tools) for m in request.messages]
    if "developer" not in (getattr(tokenizer, "chat_template", None) or ""):  # OpenAI's newer name for system
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    messages, functions = _marked(messages, tokenizer), _marked(request.functions, tokenizer)
    extra: dict[str, Any] = {}
    if functions and native_tools:
        extra["tools"] = [{"type": "function", "function": f} for f in functions]
    elif functions:
        guide = tools_system_prompt(functions)
        if messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{guide}"}
        else:
            messages.insert(0, {"role": "system", "content": guide})
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, **extra,
        )
    except Exception as exc:  # noqa: BLE001 - jinja raises its own types for bad chats
        raise ApiError(400, f"messages: the chat template rejected them: {exc}", "messages") from exc


def grammar_spec(request: Union[CompletionRequest, ChatCompletionRequest],
                 tag_ids: tuple[Optional[int], Optional[int]] = (None, None)) -> Optional[GrammarSpec]:
    """The request's constraint: its response_format, the call a forced tool choice makes (one
    for a named function, as vLLM's), or (tools offered under auto) an optional grammar over
    any call the model makes, or, under a format, the answer in it or the calls. `tag_ids`:
    the call tags' tokens, where the tokenizer has them (`tool_calls.tag_token_ids`)."""
    fmt = request.response_format
    mode, functions = request.tool_mode if isinstance(request, ChatCompletionRequest) else ("none", [])
    named = isinstance(request.tool_choice, NamedToolChoice) if functions else False
    forced_tool = mode == "required"
    callable_names = {f["name"] for f in functions}
    for i, tool in enumerate(request.tools if functions else ()):  # each call it may make keeps to its schema
        if tool.function.name in callable_names:
            _check_schema(tool.function.parameters, f"tools[{i}].function.parameters")
    if forced_tool:  # the answer is calls: a format (an agent's output type, sent every turn) is for a later one
        if fmt is not None and fmt.type == "json_schema":
            _check_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
        return GrammarSpec("lark", tool_call_grammar(functions, request.parallel_tool_calls and not named,
                                                     tag_ids=tag_ids),
                           _calls_field(request, functions, "tool_choice"))
    if fmt is None or fmt.type == "text":
        # auto: text, or a call held to the grammar once its open tag is written; unless
        # min_tokens, which a grammar that may allow only the end refuses (then unconstrained)
        if functions and not request.min_tokens:
            return GrammarSpec("lark", tool_call_grammar(functions, request.parallel_tool_calls, optional=True,
                                                         tag_ids=tag_ids),
                               _calls_field(request, functions, "tools"), optional=True)
        return None
    # a prefilled answer (continue_final_message) is the output's start: held to the format too
    continued = isinstance(request, ChatCompletionRequest) and request.continue_final_message
    prefix = joined_text(request.messages[-1].content) if continued else ""
    if functions:  # auto: an answer in the format, or calls (as OpenAI's: the model picks)
        schema = {"type": "object"} if fmt.type == "json_object" else fmt.json_schema.schema_
        _check_schema(schema, "response_format.json_schema.schema")
        return GrammarSpec("lark", tool_call_grammar(functions, request.parallel_tool_calls, answer=schema,
                                                     tag_ids=tag_ids),
                           "response_format", prefix=prefix)
    if fmt.type == "json_object":
        return GrammarSpec("json_object", prefix=prefix)
    return GrammarSpec("json_schema", json.dumps(fmt.json_schema.schema_), "response_format.json_schema.schema",
                       prefix=prefix)


def _calls_field(request: ChatCompletionRequest, functions: list[dict[str, Any]], several: str) -> str:
    """The field a grammar of calls to `functions` comes from: the one function's parameters,
    else `several` (the grammar engine's limit is met by the calls' grammar as a whole)."""
    if len(functions) != 1:
        return several
    i = next(i for i, tool in enumerate(request.tools) if tool.function.name == functions[0]["name"])
    return f"tools[{i}].function.parameters"


def _check_schema(schema: Optional[dict], param: str) -> None:
    """ApiError(400) naming `param` where the grammar engine refuses the JSON schema."""
    if (error := schema_error(schema)) is not None:
        raise ApiError(400, f"{param}: the JSON schema was refused: {error}", param)


def conversation_key(tokenizer: Any, request: ChatCompletionRequest, rendered: str) -> Optional[bytes]:
    """A chat's affinity key: a digest of its conversation's opening (the messages through the
    first user message, as the template renders them), which every later turn of it starts
    with, so the router sends each turn where the last one left its prefix in cache, however
    short the first turn. None where the opening does not begin the rendered chat (a template
    that renders a turn by what comes after it) or there is no user message."""
    first_user = next((i for i, m in enumerate(request.messages) if m.role == "user"), None)
    if first_user is None:
        return None
    opening = render_chat(tokenizer, request.model_copy(update={
        "messages": request.messages[:first_user + 1], "add_generation_prompt": False,
        "continue_final_message": False}))
    if not opening or not rendered.startswith(opening):
        return None
    return b"chat:" + hashlib.blake2b(opening.encode(), digest_size=16).digest()


def prompt_token_ids(tokenizer: Any, request: Union[CompletionRequest, ChatCompletionRequest]) -> list[int]:
    if isinstance(request, ChatCompletionRequest):
        return chat_token_ids(tokenizer, render_chat(tokenizer, request))
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    return in_vocabulary(tokenizer, list(request.prompt), "prompt")


def in_vocabulary(tokenizer: Any, token_ids: list[int], field: str) -> list[int]:
    """`token_ids`, or ApiError(400) naming `field` if one is outside the vocabulary."""
    vocab = len(tokenizer)
    if any(not 0 <= t < vocab for t in token_ids):
        raise ApiError(400, f"{field}: token ids must be in [0, {vocab})", field)
    return token_ids


def generation_request(
    request_id: str, tokenizer: Any, request: Union[CompletionRequest, ChatCompletionRequest], config: IngressConfig,
) -> GenerationRequest:
    """Validate limits and build the engine request; ApiError(400) naming the field."""
    field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    try:
        offers_tools = isinstance(request, ChatCompletionRequest) and request.tool_mode[1]
        tags = tag_token_ids(tokenizer) if offers_tools else (None, None)
    except ValueError as exc:
        raise ApiError(400, f"tools: {exc}", "tools") from exc
    try:
        grammar = grammar_spec(request, tags)  # its schemas' mistakes before its size
    except RequestError as exc:
        raise ApiError(400, str(exc), exc.param) from exc
    rendered = render_chat(tokenizer, request) if isinstance(request, ChatCompletionRequest) else None
    prompt_ids = chat_token_ids(tokenizer, rendered) if rendered is not None else prompt_token_ids(tokenizer, request)
    if not prompt_ids:
        raise ApiError(400, f"{field}: renders to an empty prompt", field)
    if len(prompt_ids) > config.max_prompt_tokens:
        why = (f"the {config.max_seq_len}-token context window less one token to answer with"
               if config.max_prompt_tokens == config.max_seq_len - 1 else "this server's prompt limit")
        # "maximum context length": OpenAI's and vLLM's words, which clients (litellm, crewAI,
        # OpenHands) look for to tell this error from others (litellm's context window fallbacks)
        raise ApiError(400, f"{field}: {len(prompt_ids)} prompt tokens exceed the limit of "
                            f"{config.max_prompt_tokens} ({why}); this model's maximum context length is "
                            f"{config.max_seq_len} tokens", field, code="context_length_exceeded",
                       anthropic_message=f"prompt is too long: {len(prompt_ids)} tokens > "
                                         f"{config.max_prompt_tokens} maximum")
    asked = request.requested_max_tokens if isinstance(request, ChatCompletionRequest) else request.max_tokens
    max_tokens_field = "max_completion_tokens" if isinstance(request, ChatCompletionRequest) and \
        request.max_completion_tokens else "max_tokens"
    if asked is not None and asked > config.max_tokens:
        raise ApiError(400, f"{max_tokens_field}: {asked} exceeds the limit of {config.max_tokens}", max_tokens_field)
    room = config.max_seq_len - len(prompt_ids)
    if asked is not None and asked > room:
        raise ApiError(400, f"{max_tokens_field}: {asked} + {len(prompt_ids)} prompt tokens exceed the context "
                            f"window: this model's maximum context length is {config.max_seq_len} tokens",
                       max_tokens_field, code="context_length_exceeded",
                       anthropic_message=f"input length and `max_tokens` exceed context limit: {len(prompt_ids)} + "
                                         f"{asked} > {config.max_seq_len}, decrease input length or `max_tokens` "
                                         f"and try again")
    # a prompt scored alone (completions' max_tokens 0) is the engine's prefill and one token,
    # which the answer leaves out
    max_tokens = max(asked, 1) if asked is not None else min(config.default_max_tokens, room)
    prompt_logprobs = request.prompt_logprobs  # vLLM's
    if isinstance(request, ChatCompletionRequest):
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        logprobs = request.logprobs
        if request.echo and logprobs is not None:  # the prompt is shown with its logprobs too
            prompt_logprobs = max(logprobs, prompt_logprobs or 0)  # each shows its own top
    logit_bias = {int(token): bias for token, bias in (request.logit_bias or {}).items()}
    in_vocabulary(tokenizer, list(logit_bias), "logit_bias")
    in_vocabulary(tokenizer, list(request.stop_token_ids), "stop_token_ids")
    prediction, stop_after = (), ()
    if isinstance(request, ChatCompletionRequest):
        if request.prediction is not None:
            prediction = tuple(tokenizer.encode(request.prediction.text, add_special_tokens=False))
        if not request.parallel_tool_calls and request.tool_mode[0] == "auto":
            # one call at most: where the engine runs it unconstrained (it could not apply the
            # optional grammar), the call's close tag ends the answer; a grammar ends it itself
            stop_after = (TOOL_CALL_CLOSE,)
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
            top_k=max(request.top_k, 0), seed=None if request.seed is None else request.seed % 2**63,
            stop=request.stop_strings, stop_after=stop_after,
            stop_token_ids=tuple(request.stop_token_ids), ignore_eos=request.ignore_eos, logprobs=logprobs,
            presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
            logit_bias=logit_bias, repetition_penalty=request.repetition_penalty, min_tokens=request.min_tokens,
            min_p=request.min_p, prompt_logprobs=prompt_logprobs,
        )
        return GenerationRequest(request_id=request_id, prompt=prompt_ids, sampling=sampling,
                                 speculation=request.speculation or RequestSpeculation(),
                                 grammar=grammar, prediction=prediction,
                                 affinity_key=conversation_key(tokenizer, request, rendered) if rendered else None,
                                 model_identity=config.model_identity, cache_salt=cache_salt(request))
    except RequestError as exc:
        raise ApiError(400, str(exc), exc.param) from exc


def cache_salt(request: Union[CompletionRequest, ChatCompletionRequest]) -> str:
    """The request's prefix-cache salt: its API key's owner and its own `cache_salt`, so a key's
    requests never reuse (nor time) another key's cached prompts, and a client may part its own
    further ("" on an open server without a salt: every such request shares)."""
    owner, salt = KEY_OWNER.get(), request.cache_salt
    return f"{owner}\n{salt}" if salt is not None else owner


def engine_requests(request_id: str, tokenizer: Any, request: Union[CompletionRequest, ChatCompletionRequest],
                    config: IngressConfig) -> list[GenerationRequest]:
    """The engine requests an HTTP request makes: `n` choices of each of its prompts, prompt by
    prompt (a batched completions request's prompt i has ids suffixed -i, and its errors name
    `prompt[i]`, or say they are prompt i's, as one of its max_tokens)."""
    if isinstance(request, ChatCompletionRequest):
        return choice_requests(generation_request(request_id, tokenizer, request, config), request.n)
    if request.max_tokens == 0 and not request.echo:
        raise ApiError(400, "max_tokens: 0 only with echo (the prompt scored, nothing generated)", "max_tokens")
    if request.max_tokens == 0 and request.min_tokens:
        raise ApiError(400, "min_tokens: must be 0 with max_tokens 0 (nothing is generated)", "min_tokens")
    prompts = request.prompts
    if len(prompts) * request.n > MAX_PROMPTS:
        raise ApiError(400, f"n: {len(prompts)} prompts x {request.n} choices exceed the limit of {MAX_PROMPTS}", "n")
    requests, batched = [], len(prompts) > 1
    for i, prompt in enumerate(prompts):
        one = request.model_copy(update={"prompt": prompt})
        try:
            if not prompt:
                raise ApiError(400, "prompt: must not be empty", "prompt")
            requests += choice_requests(generation_request(f"{request_id}-{i}" if batched else request_id, tokenizer,
                                                           one, config), request.n)
        except ApiError as exc:
            raise _of_prompt(exc, i) if batched else exc from None
    return requests


def _of_prompt(exc: ApiError, i: int) -> ApiError:
    """An error of a batch's prompt i: `prompt` named `prompt[i]`, another field's message
    saying whose it was."""
    renamed = exc.renamed({"prompt": f"prompt[{i}]"})
    if renamed is not exc:
        return renamed
    return ApiError(exc.status, f"prompt[{i}]: {exc.message}", exc.param, exc.code, exc.retry_after_s,
                    exc.anthropic_message, exc.details)


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The engine requests of a request's `n` choices: itself when n is 1, else one each (ids
    suffixed -0, -1, ...), a seeded request's choice i sampling with seed + i (each choice
    reproducible, and they differ)."""
    if n == 1:
        return [request]
    sampling = request.sampling
    return [dataclasses.replace(
        request, request_id=f"{request.request_id}-{i}",
        sampling=sampling if sampling.seed is None else dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**63))
        for i in range(n)]
