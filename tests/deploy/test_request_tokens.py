"""What the Ingress makes of a request for the engine beyond its prompt: the tokens a text
prompt gets (a BOS), the offsets its logprobs give in the text, the prefix-cache salt of its
key and its own, and a model without a chat template."""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

import pydantic
import pytest

from deploy.auth import KEY_OWNER
from deploy.chat_protocol import ChatCompletionRequest
from deploy.config import AppArgs, IngressConfig
from deploy.errors import ApiError
from deploy.ingress import Ingress
from deploy.openai_format import TokenTexts, logprobs_body
from deploy.prompts import generation_request, prompt_token_ids, render_chat
from deploy.protocol import CompletionRequest
from deploy.tokenizing import TokenizeCompletion, tokenize
from replicas.engine import TokenLogprob


def chat(messages, **kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=messages, **kwargs)


def test_a_requests_cache_salt_is_its_keys_and_its_own(chatml):
    """The prefix cache parts requests by API key, and within a key by the client's `cache_salt`
    (vLLM's field); on an open server an unsalted request shares with every other unsalted one.
    Built off the event loop in the Ingress's threads, which see the request's key."""
    config = IngressConfig.from_args(AppArgs())
    ingress = Ingress.__new__(Ingress)  # its prompt threads alone
    ingress._prompts = ThreadPoolExecutor(1)

    def salts(owner: str) -> list[str]:
        async def built():
            KEY_OWNER.set(owner)
            return [(await ingress._off_loop(generation_request, "r", chatml, body, config)).cache_salt
                    for body in (CompletionRequest(model="m", prompt="hi"),
                                 CompletionRequest(model="m", prompt="hi", cache_salt="team-a"),
                                 chat([{"role": "user", "content": "hi"}], cache_salt="team-a"))]
        return asyncio.run(built())

    assert salts("") == ["", "\nteam-a", "\nteam-a"]
    assert salts("k1") == ["k1", "k1\nteam-a", "k1\nteam-a"]
    with pytest.raises(pydantic.ValidationError, match="cache_salt"):
        CompletionRequest(model="m", prompt="hi", cache_salt="")


def test_a_model_without_a_chat_template_says_so_and_where_to_go(chatml):
    """It was "the chat template rejected them: Cannot use chat template functions ...", as if
    the client's messages were at fault (QA)."""
    plain = copy.deepcopy(chatml)
    plain.chat_template = None
    with pytest.raises(ApiError) as info:
        render_chat(plain, chat([{"role": "user", "content": "hi"}]))
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "no chat template" in info.value.message and "/v1/completions" in info.value.message


def test_a_completions_text_prompt_gets_the_tokenizers_bos_as_vllm_and_llama_cpp_give_it(chatml):
    """A Llama's tokenizer adds a BOS, which its completions went without (QA, on a GGUF whose
    tokenizer says add_bos_token). `add_special_tokens: false` leaves it out, as vLLM's."""
    from tokenizers.processors import TemplateProcessing

    bos = copy.deepcopy(chatml)
    bos._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    plain = chatml.encode("Once upon a time", add_special_tokens=False)
    assert prompt_token_ids(chatml, CompletionRequest(model="m", prompt="Once upon a time")) == plain  # SmolLM2's: none
    assert prompt_token_ids(bos, CompletionRequest(model="m", prompt="Once upon a time")) == [0, *plain]
    assert prompt_token_ids(bos, CompletionRequest(model="m", prompt="Once upon a time",
                                                   add_special_tokens=False)) == plain
    # /tokenize counts as completions take it
    assert tokenize(bos, TokenizeCompletion(prompt="Once upon a time"), "m", 100)["tokens"] == [0, *plain]


def test_text_offsets_index_the_text_a_special_token_is_left_out_of(chatml):
    """A BOS before an echoed prompt, a special token the model wrote: the text leaves them out,
    so they take no characters (each offset was past its token by the BOS's 12: QA)."""
    texts = TokenTexts.for_tokenizer(chatml)
    bos, hello, world = chatml.convert_tokens_to_ids("<|im_start|>"), *chatml.encode("Hello world")
    entries = [TokenLogprob(t, -1.0) for t in (hello, world, bos, hello)]
    body = logprobs_body("completion", entries, texts, unscored=(bos,))
    text = "Hello world" + "Hello"
    assert body["tokens"][:2] == ["<|im_start|>", "Hello"]
    assert [text[o:].startswith(t) for o, t in zip(body["text_offset"], body["tokens"]) if t != "<|im_start|>"] == \
        [True, True, True]
    assert body["text_offset"] == [0, 0, 5, 11, 11]
