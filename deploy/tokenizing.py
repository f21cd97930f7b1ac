"""vLLM's `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, for clients that
count or inspect tokens before they send a request (a context-window budget, a `logit_bias`
id, a `stop_token_ids` id), or tokenize on their side with the server's tokenizer
(lm-evaluation-harness's remote tokenizer uses all three).

`/tokenize` takes a `prompt` (tokenized as `/v1/completions` would: with the special tokens
the tokenizer adds, a Llama's BOS, unless `add_special_tokens: false`, as vLLM's) or chat
`messages` (rendered by the chat template as
`/v1/chat/completions` would, `tools` included) and answers `count`, `tokens`,
`max_model_len` and, with `return_token_strs`, each token's string; `/detokenize` turns token
ids back into text. `model` may be left out; given, it must be the served one.
`/tokenizer_info` answers the tokenizer's settings (its special tokens, ...), its class and
the chat template, as vLLM's does; file paths are left out.
"""

from __future__ import annotations

from typing import Annotated, Any, List, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag

from deploy.chat_protocol import ChatMessage, Tool, chat_meant
from deploy.prompts import in_vocabulary, prompt_token_ids
from deploy.protocol import RequestModel, Text


class TokenizeCompletion(RequestModel):
    model: Optional[str] = None
    prompt: Text
    add_special_tokens: bool = True  # as /v1/completions (and vLLM's /tokenize)
    return_token_strs: bool = False


class TokenizeChat(RequestModel):
    model: Optional[str] = None
    messages: List[ChatMessage] = Field(min_length=1)
    tools: Optional[List[Tool]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: Literal[False] = False  # as chat's: the template writes them
    return_token_strs: bool = False


def _form(body: Any) -> str:
    """A body with `messages` is a chat, any other a prompt (the tags are no field names, so an
    error's `param` leaves them out)."""
    chat = isinstance(body, dict) and "messages" in body or isinstance(body, TokenizeChat)
    return "form=chat" if chat else "form=prompt"


TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletion, Tag("form=prompt")],
                                  Annotated[TokenizeChat, Tag("form=chat")]], Discriminator(_form)]


class DetokenizeRequest(RequestModel):
    model: Optional[str] = None
    tokens: List[Annotated[int, Field(ge=0)]]


def tokenize(tokenizer: Any, body: Union[TokenizeCompletion, TokenizeChat], model: str,
             max_model_len: int) -> dict[str, Any]:
    if isinstance(body, TokenizeChat):
        # the chat's own checks (a continued final message must be the assistant's, ...)
        chat = chat_meant(dict(model=model, messages=body.messages, tools=body.tools,
                               add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message))
        ids = prompt_token_ids(tokenizer, chat)
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}


def detokenize(tokenizer: Any, body: DetokenizeRequest) -> dict[str, str]:
    return {"prompt": tokenizer.decode(in_vocabulary(tokenizer, list(body.tokens), "tokens"))}


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """The tokenizer's settings (its init kwargs, paths on this server left out), its special
    tokens, class and chat template, and the served context window as `model_max_length`."""
    info = {key: _plain(value) for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if not key.endswith("_file") and key != "name_or_path"}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = _plain(getattr(tokenizer, name, None))
    info.update(tokenizer_class=type(tokenizer).__name__, model_max_length=max_model_len,
                chat_template=getattr(tokenizer, "chat_template", None))
    return info


def _plain(value: Any) -> Any:
    """A JSON value for a tokenizer setting: an added token as its text, other objects as text."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(getattr(value, "content", value))
