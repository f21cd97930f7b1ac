"""HTTP request -> engine request: chat template, tokenization, sampling, limits.

The ingress tokenizes with the model's own tokenizer (fetched once from a replica), so
limits on prompt length are enforced at the edge before anything is queued, and the
replica receives token ids.
"""

from __future__ import annotations

from typing import Any, Union

from deploy.config import IngressConfig
from deploy.errors import ApiError
from deploy.protocol import ChatCompletionRequest, CompletionRequest
from replicas.engine import GenerationRequest, RequestError, RequestSpeculation, SamplingParams


def render_chat(tokenizer: Any, request: ChatCompletionRequest) -> str:
    """The chat as the model's template renders it (a 400 if the template refuses it)."""
    messages = [
        {"role": m.role, "content": m.text, **({"name": m.name} if m.name else {})}
        for m in request.messages
    ]
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
        )
    except Exception as exc:  # noqa: BLE001 - jinja raises its own types for bad chats
        raise ApiError(400, f"messages: the chat template rejected them: {exc}", "messages") from exc


def prompt_token_ids(tokenizer: Any, request: Union[CompletionRequest, ChatCompletionRequest]) -> list[int]:
    if isinstance(request, ChatCompletionRequest):
        return tokenizer.encode(render_chat(tokenizer, request), add_special_tokens=False)
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt, add_special_tokens=False)
    vocab = len(tokenizer)
    if any(t >= vocab for t in request.prompt):
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
    return list(request.prompt)


def generation_request(
    request_id: str, tokenizer: Any, request: Union[CompletionRequest, ChatCompletionRequest], config: IngressConfig,
) -> GenerationRequest:
    """Validate limits and build the engine request; ApiError(400) naming the field."""
    field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    prompt_ids = prompt_token_ids(tokenizer, request)
    if not prompt_ids:
        raise ApiError(400, f"{field}: renders to an empty prompt", field)
    if len(prompt_ids) > config.max_prompt_tokens:
        raise ApiError(400, f"{field}: {len(prompt_ids)} prompt tokens exceed the limit of "
                            f"{config.max_prompt_tokens}", field, code="context_length_exceeded")
    asked = request.requested_max_tokens if isinstance(request, ChatCompletionRequest) else request.max_tokens
    max_tokens_field = "max_completion_tokens" if isinstance(request, ChatCompletionRequest) and \
        request.max_completion_tokens else "max_tokens"
    if asked is not None and asked > config.max_tokens:
        raise ApiError(400, f"{max_tokens_field}: {asked} exceeds the limit of {config.max_tokens}", max_tokens_field)
    room = config.max_seq_len - len(prompt_ids)
    if asked is not None and asked > room:
        raise ApiError(400, f"{max_tokens_field}: {asked} + {len(prompt_ids)} prompt tokens exceed the context "
                            f"window of {config.max_seq_len}", max_tokens_field, code="context_length_exceeded")
    max_tokens = asked if asked is not None else min(config.default_max_tokens, room)
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
            top_k=max(request.top_k, 0), seed=request.seed, stop=request.stop_strings,
            ignore_eos=request.ignore_eos,
        )
    except RequestError as exc:
        raise ApiError(400, str(exc), exc.param) from exc
    return GenerationRequest(request_id=request_id, prompt=prompt_ids, sampling=sampling,
                             speculation=request.speculation or RequestSpeculation())
