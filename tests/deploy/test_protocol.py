"""The request models of the HTTP edge (deploy/protocol.py, deploy/chat_protocol.py), without a
cluster: what a body means, and which field a bad one names."""

from __future__ import annotations

import pydantic
import pytest

from deploy.chat_protocol import ChatCompletionRequest, misplaced_tool_message

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("max_tokens,max_completion_tokens,limit", [
    (None, 5, 5), (5, None, 5), (5, 5, 5), (None, None, None),
])
def test_max_completion_tokens_is_the_newer_max_tokens(max_tokens, max_completion_tokens, limit):
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "max_tokens": max_tokens,
                                                 "max_completion_tokens": max_completion_tokens})
    assert body.requested_max_tokens == limit


def test_max_tokens_and_max_completion_tokens_that_disagree_are_a_400_naming_one():
    """OpenAI refuses the two together; one must not silently win over the other (the newer did)."""
    with pytest.raises(pydantic.ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "max_tokens": 5,
                                              "max_completion_tokens": 2})
    (error,) = info.value.errors()
    assert error["loc"] == ("max_completion_tokens",)
    assert "max_tokens" in error["msg"]


def test_tool_messages_answer_the_calls_of_the_assistant_message_before_them():
    """What the ingress checks (the 400s are in test_http_edges): each of a run of tool messages
    answers one call of the assistant message it follows, in any order; a call id may come back
    in a later turn."""
    def messages(*turns):
        return ChatCompletionRequest(model="m", messages=list(turns)).messages

    def called(*ids):
        return {"role": "assistant", "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]}

    def result(call_id):
        return {"role": "tool", "content": "18", "tool_call_id": call_id}

    user = {"role": "user", "content": "x"}
    assert misplaced_tool_message(messages(user, called("a", "b"), result("b"), result("a"), user, called("a"),
                                           result("a"), {"role": "assistant", "content": "done"})) is None
    assert misplaced_tool_message(messages(user, called("a", "b"), result("a"), user)) is None  # b left unanswered
    assert misplaced_tool_message(messages(user, called("a"), result("a"), result("a")))[0] == "messages[3].tool_call_id"
    assert misplaced_tool_message(messages(user, called("a"), user, result("a")))[0] == "messages[3].tool_call_id"
    assert misplaced_tool_message(messages(user, called("a", "a")))[0] == "messages[1].tool_calls[1].id"



def test_a_text_part_takes_the_keys_an_sdk_carries_back_in_it():
    """The Agents SDK (JavaScript, chat completions) sends an earlier answer back with its other
    fields inside its text part: taken and not read, the text the same."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    part = {"type": "text", "text": "Hello", "role": "assistant", "tool_calls": [call], "annotations": []}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [part], "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    assert body.messages[1].text == "Hello" and body.messages[1].content[0].model_dump() == {"type": "text",
                                                                                            "text": "Hello"}
