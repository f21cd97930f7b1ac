"""Our default text format for OpenAI tool calls: Hermes/Qwen `<tool_call>` blocks.

Used when the model's chat template has no tool support (the embedded SmolLM2's is plain
ChatML). One call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and parallel calls are such blocks joined by "\\n". The JSON is written with the separators
", " and ": " everywhere (prompt, grammar, parsed arguments), so what the model reads, what
the grammar forces and what clients receive are the same text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from replicas.engine import JSON_LAYOUT
from replicas.speculation.schema_depth import too_deep

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def header_atoms(name: str) -> list[str]:
    """`{"name": "...", "arguments": ` as one regex atom per character (or whitespace run), so
    the same list gives the full match and, nested, a matcher for every prefix of it."""
    ws = r"\s*"
    return [ws, r"\{", ws, *map(re.escape, '"name"'), ws, ":", ws, '"', name, '"', ws, ",", ws,
            *map(re.escape, '"arguments"'), ws, ":", ws]


CALL_HEADER = re.compile("".join(header_atoms(r'((?:[^"\\]|\\.)*)')))  # group 1: the name as written


def json_loads(text: str, **kwargs: object) -> object:
    """json.loads, whose RecursionError (text nested ~1,000 deep, which a client's arguments
    string or a model's output may be) is a ValueError like any text that is no JSON."""
    try:
        return json.loads(text, **kwargs)
    except RecursionError:
        raise ValueError("nested too deep to read") from None


def json_string(body: str) -> str | None:
    """The string a JSON string literal's body (between its quotes) spells, or None."""
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return None


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(", ", ": "), ensure_ascii=False)


def tools_system_prompt(functions: list[dict]) -> str:
    """The system text offering `functions` (OpenAI function definitions) to the model."""
    if not functions:
        raise ValueError("tools_system_prompt needs at least one function")
    lines = [_dumps({k: f[k] for k in ("name", "description", "parameters") if k in f}) for f in functions]
    first = functions[0]
    example = format_tool_calls([(first["name"], _dumps(_example_arguments(first.get("parameters") or {})))])
    return ("You can call functions to answer. The functions:\n" + "\n".join(lines) + "\n"
            f"To call one, reply with its name and arguments as JSON between {TOOL_CALL_OPEN} and "
            f"{TOOL_CALL_CLOSE} tags, one block per call, like this:\n{example}\n"
            "The result comes back to you in a tool message.")


_PLACEHOLDERS = {"integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}


def _example_arguments(parameters: dict) -> dict:
    """A concrete example beats a described one for a 135M model (it calls more under auto), but
    a string it can copy is copied: a string argument's value is its name in angle brackets
    (with "value" for each, Oslo's weather asked for "value": 3 of 6 cities right, 6 of 6 so,
    the calls under auto as many; found by QA); another type's a placeholder of its type, from
    whatever the schema says (a nullable `["integer", "null"]` type, or a shape no schema has:
    a property of any type is a string's)."""
    props = parameters.get("properties")
    props = props if isinstance(props, dict) else {}
    required = parameters.get("required")
    names = [n for n in required if isinstance(n, str)] if isinstance(required, list) and required else list(props)

    def placeholder(name: str, schema: object) -> object:
        kind = schema.get("type") if isinstance(schema, dict) else None
        kinds = kind if isinstance(kind, list) else [kind]
        return next((_PLACEHOLDERS[k] for k in kinds if isinstance(k, str) and k in _PLACEHOLDERS), f"<{name}>")

    return {n: placeholder(n, props.get(n)) for n in names}


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[^\s",:\[\]{}]+|[,:\[\]{}]')


def json_layout(text: str) -> str:
    """JSON `text` in our layout (`_dumps`'s spacing), every string and number as written:
    the model's own arguments come back to it as it wrote them (`1.50`, `1E5`, `"\\u00e9"`), so
    the next turn's prompt repeats its tokens and the prefix cache holds. A ValueError if
    `text` is not JSON (Python's: `NaN` and `Infinity` pass, and stay as written)."""
    json_loads(text)
    return "".join(t + " " if t in (",", ":") else t for t in _JSON_TOKEN.findall(text))


def format_tool_calls(calls: list[tuple[str, str]]) -> str:
    """An assistant message's tool calls, (name, arguments JSON text), as prompt text."""
    blocks = []
    for name, arguments in calls:
        try:
            arguments = json_layout(arguments or "{}")
        except ValueError:
            pass  # the client's text, verbatim: the model should see what was really sent
        blocks.append(f'{TOOL_CALL_OPEN}\n{{"name": {_dumps(name)}, "arguments": {arguments}}}\n{TOOL_CALL_CLOSE}')
    return "\n".join(blocks)


def tag_token_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """The open and close tags' token ids where the tokenizer has each as one token (Qwen2.5's
    and Hermes' added tokens), else None. A grammar names such a tag by its id: llguidance
    takes an added token for a special one, which a quoted tag never matches (a Qwen2.5's
    forced call was a 400 and its calls under auto were masked: QA). ValueError where the
    tokenizer marks a tag special: the output's text leaves it out, and a call could not be
    read back (it came back as plain text: QA)."""
    special = set(getattr(tokenizer, "all_special_ids", ())) | {
        i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    ids = []
    for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) == 1 and encoded[0] in special:
            raise ValueError(f"this model's tokenizer marks {tag} a special token, which the output's text leaves "
                             f"out: tool calls in its {TOOL_CALL_OPEN} format cannot be read back")
        ids.append(encoded[0] if len(encoded) == 1 else None)
    return tuple(ids)


def tool_call_grammar(functions: list[dict], parallel: bool, optional: bool = False,
                      answer: dict | None = None, tag_ids: tuple[int | None, int | None] = (None, None)) -> str:
    """An llguidance Lark grammar admitting exactly one call (or, if `parallel`, calls joined
    by "\\n") to one of `functions`. Fixed whitespace makes every fixed part a forced token.

    `optional` (tool_choice auto): any text, until the model writes an open tag; from there
    the call is held to the grammar (the text before it is a lazy lexeme, ended by the first
    open tag; where the tag is a token of its own, `tag_ids`, text that never spells the tag
    out, which the answer's parser would take for a call the grammar never held: QA), so a
    call made is well-formed and its arguments match their schema. One call ends the answer;
    parallel calls may have text between and after them.

    `answer` (tool_choice auto under a response format): the answer is JSON valid against this
    schema, or the calls."""
    if not functions:
        raise ValueError("tool_call_grammar needs at least one function")
    # A call is its fixed text around its arguments, a JSON document of their own: the schema's
    # refs, anchors and "$id"s resolve in it alone, as they do in a response format (nested
    # under one call object, local refs pointed at the wrong place; across functions in one
    # document, two functions' anchors or ids were one another's).
    body = f"body: {' | '.join(f'fn{i}' for i in range(len(functions)))}\n" + "".join(
        f"fn{i}: {json.dumps(_call_head(f['name']))} %json {json.dumps(_arguments_schema(f))} \"}}\"\n"
        for i, f in enumerate(functions))
    # Lark strings are JSON strings; <[id]> is a token
    open_tag, close_tag = (json.dumps(tag) if i is None else f"<[{i}]>"
                           for i, tag in zip(tag_ids, (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)))
    call = f'call: open "\\n" body "\\n" {close_tag}\n{body}'
    if optional:
        start = "start: call* TEXT" if parallel else "start: TEXT | call"
        if tag_ids[0] is None:
            text = "TEXT: /(.|\\n)*/\nopen[lazy]: TEXT"
        else:  # (llguidance's regexes take & and ~: intersection and complement)
            text = f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{re.escape(TOOL_CALL_OPEN)}(.|\\n)*/\nopen: TEXT"
        return f"{start}\n{text} {open_tag}\n{call}"
    calls = 'call ("\\n" call)*' if parallel else "call"
    rules = f"open: {open_tag}\n{call}"
    if answer is not None:
        return f"start: answer | {calls}\nanswer: %json {json.dumps({**answer, 'x-guidance': JSON_LAYOUT})}\n{rules}"
    return f"start: {calls}\n{rules}"


def object_schema(schema: dict) -> dict:
    """A function's parameters schema, if of type object (OpenAI's and Anthropic's rule: a call's
    arguments are an object; a schema of another type made a forced call write a string, which
    the finished answer read as text and its stream as a call)."""
    kind = schema.get("type", "object")
    if kind not in ("object", ["object"]):
        raise ValueError(f'a function\'s parameters must be a JSON schema of type "object", not {json.dumps(kind)}')
    return schema


def schema_error(parameters: dict | None) -> str | None:
    """Why the grammar engine refuses a function's parameters schema (None: it takes it)."""
    from llguidance import LLMatcher

    if parameters is None:
        return None
    if (reason := too_deep(parameters)) is not None:  # given to llguidance, it could kill the process
        return reason
    try:
        return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(parameters, defaults=JSON_LAYOUT)) or None
    except ValueError as exc:
        return str(exc)


def _call_head(name: str) -> str:
    """A call's text up to its arguments (what `_dumps` writes)."""
    return f'{{"name": {_dumps(name)}, "arguments": '


def _arguments_schema(function: dict) -> dict:
    # OpenAI's rule: a function without parameters takes none (was any object: sampled, `{"": ""}`);
    # a schema of {} is JSON Schema's any value, so any object here
    parameters = function.get("parameters")
    no_parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    return {**(no_parameters if parameters is None else parameters), "x-guidance": JSON_LAYOUT}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object: as written, or re-serialised (see _as_call)


def _as_call(obj: object, body: str) -> ToolCall | None:
    """The call a block's parsed JSON `obj` (its text `body`) holds. Its arguments are the
    text the model wrote, where it wrote `{"name": ..., "arguments": {...}}` in that order:
    what a stream sends as it goes (ToolCallStream), numbers spelt as written (json.dumps
    would make `1e999` Infinity, which is no JSON, and `1.50` 1.5). Else re-serialised."""
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"} or not isinstance(obj["name"], str):
        return None
    arguments = obj["arguments"]
    if isinstance(arguments, str):  # some models write the OpenAI wire form: a JSON string
        try:
            arguments = json_loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    header = CALL_HEADER.match(body)
    if header and body[header.end():header.end() + 1] == "{":  # the outer "}" is the body's last character
        written = body[header.end():].rstrip()[:-1].rstrip()
        try:
            if json_string(header.group(1)) == obj["name"] and json_loads(written) == arguments:
                return ToolCall(obj["name"], written)
        except ValueError:
            pass
    return ToolCall(obj["name"], _dumps(arguments))


def find_close(block: str, start: int = 0) -> tuple[int, ToolCall | None] | None:
    """In `block` (the text after an open tag): the first close tag at or after `start` that
    ends a complete JSON body, with the call it holds (None: JSON, but not a call). A close
    tag whose body is not yet valid JSON is taken to sit inside a string and skipped."""
    j = block.find(TOOL_CALL_CLOSE, start)
    while j >= 0:
        try:
            return j, _as_call(json_loads(block[:j]), block[:j])
        except ValueError:
            j = block.find(TOOL_CALL_CLOSE, j + 1)
    return None


def parse_tool_calls(text: str, one_call: bool = False, continues: bool = False) -> tuple[str | None, list[ToolCall]]:
    """A finished output as (content, calls). Content is the text outside the calls' blocks,
    each piece right-stripped, then left-stripped as a whole unless the output `continues` a
    prefilled answer (None if empty): what a stream of the output sends (`ToolCallStream`),
    whose calls' fragments went out as each closed.
    Any malformed or unclosed block makes the whole output plain content: `(text, [])`,
    verbatim. With `one_call` (parallel calls not allowed) the output ends at its first
    call: what follows a well-formed first block is dropped."""
    i = text.find(TOOL_CALL_OPEN)
    if i < 0:
        return (text.rstrip() if continues else text.strip()) or None, []
    if one_call:
        found = find_close(text[i + len(TOOL_CALL_OPEN):])
        if found is not None and found[1] is not None:
            text = text[:i + len(TOOL_CALL_OPEN) + found[0] + len(TOOL_CALL_CLOSE)]
    pieces, calls, rest = [text[:i]], [], text[i:]
    while rest:
        block = rest[len(TOOL_CALL_OPEN):]
        found = find_close(block)
        if found is None or found[1] is None:
            return text, []
        calls.append(found[1])
        rest = block[found[0] + len(TOOL_CALL_CLOSE):]
        j = rest.find(TOOL_CALL_OPEN)
        pieces.append(rest if j < 0 else rest[:j])
        rest = "" if j < 0 else rest[j:]
    content = "".join(p.rstrip() for p in pieces)
    return (content if continues else content.lstrip()) or None, calls
