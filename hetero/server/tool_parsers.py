"""Tool calls: parsers for the models' own call formats, and `tool_choice` as a constraint.

The parsers follow vLLM's `--tool-call-parser` names and formats:
- ``hermes`` (Qwen2.5's chat template, and Hermes'): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, possibly after some text;
- ``llama3_json`` (Llama 3.1/3.2's JSON tool calling): the whole reply is
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``; several calls
  separated by ``;``).

``tool_choice="required"`` and a named function do not need a parser: as in vLLM, the
output is constrained by a JSON schema (an array of calls, or the named function's
arguments), and read back from that JSON.

Every extractor answers two questions: `split(text)` gives the content before the calls
and the calls; `content_end(text)` how much of an unfinished reply is surely content
(what may be streamed before the reply ends).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from hetero.core.sampling_params import StructuredOutputsParams
from hetero.server.errors import APIError


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallExtractor(Protocol):
    def split(self, text: str) -> tuple[str, list[ToolCall]]: ...

    def content_end(self, text: str) -> int: ...


def _call_from(obj: Any, argument_keys: tuple[str, ...]) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _partial_marker_at_end(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that begins `marker` (so may still become it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks (Qwen2.5, Hermes); vLLM's ``hermes``."""

    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text[start:]):
            try:
                call = _call_from(json.loads(body), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # a malformed call: the reply stays text, as in vLLM
            calls.append(call)
        return text[:start], calls

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else len(text) - _partial_marker_at_end(text, self.START)


class Llama3JsonToolParser:
    """A reply that is a JSON call, ``{"name": ..., "parameters": {...}}``; vLLM's ``llama3_json``."""

    PYTHON_TAG = "<|python_tag|>"

    def _body(self, text: str) -> str:
        body = text.lstrip()
        return body[len(self.PYTHON_TAG):].lstrip() if body.startswith(self.PYTHON_TAG) else body

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        body = self._body(text)
        if not body.startswith("{"):
            return text, []
        decoder, calls, position = json.JSONDecoder(), [], 0
        try:
            while position < len(body):
                obj, end = decoder.raw_decode(body, position)
                call = _call_from(obj, ("parameters", "arguments"))
                if call is None:
                    return text, []
                calls.append(call)
                position = end
                while position < len(body) and body[position] in " \t\r\n;":
                    position += 1
        except json.JSONDecodeError:
            return text, []
        return "", calls

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(self.PYTHON_TAG) or self.PYTHON_TAG.startswith(body):
            return 0
        return len(text)


TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


class NamedFunctionCall:
    """tool_choice naming a function: the whole reply is that function's arguments."""

    def __init__(self, name: str):
        self.name = name

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        return "", [ToolCall(self.name, text)]

    def content_end(self, text: str) -> int:
        return 0


class RequiredCalls:
    """tool_choice="required": the reply is a JSON array of {"name", "parameters"}."""

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short (max_tokens) before the array closed
        calls = [_call_from(item, ("parameters",)) for item in items] if isinstance(items, list) else [None]
        return ("", calls) if calls and None not in calls else (text, [])

    def content_end(self, text: str) -> int:
        return 0


def _parameters(tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_choice_constraint(tools: list, tool_choice: Any, parallel_tool_calls: Optional[bool]) -> Optional[StructuredOutputsParams]:
    """The JSON schema that forces a call, for "required" or a named function (None otherwise)."""
    if tool_choice == "required":
        calls = {
            "anyOf": [
                {"type": "object",
                 "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": _parameters(tool)},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for tool in tools
            ]
        }
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    if tool_choice is not None and not isinstance(tool_choice, str):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return StructuredOutputsParams(json=_parameters(tool))
    return None


@dataclass
class ToolCalling:
    """How a chat request uses tools: what the template sees, what constrains and reads the reply."""

    template_tools: Optional[list[dict[str, Any]]] = None
    constraint: Any = None
    extractor: Optional[ToolCallExtractor] = None
    forced: bool = False  # a named function: finish_reason stays as it is, as OpenAI's

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return reason if self.forced or reason != "stop" else "tool_calls"


def tool_calling(
    body, enable_auto_tool_choice: bool, tool_call_parser: Optional[str], constraint_field: Optional[str]
) -> ToolCalling:
    """tools + tool_choice as vLLM reads them: "auto" (the default with tools, under
    --enable-auto-tool-choice) parses the model's own call format; "required" and a named
    function constrain the reply to a call; "none" (the default otherwise) leaves it text.
    `body` is the ChatCompletionRequest; `constraint_field` names the request's own output
    constraint, if any (a forced call cannot take a second one)."""
    if not body.tools or body.tool_choice == "none":
        return ToolCalling()
    template_tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    choice = body.tool_choice or ("auto" if enable_auto_tool_choice else "none")
    if choice == "none":
        return ToolCalling(template_tools)
    if choice == "auto":
        if not enable_auto_tool_choice:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                           param="tool_choice")
        return ToolCalling(template_tools, extractor=TOOL_PARSERS[tool_call_parser]())
    if constraint_field is not None:
        raise APIError(400, f"tool_choice {choice!r} constrains the output, and so does {constraint_field}: give one",
                       param="tool_choice")
    constraint = tool_choice_constraint(body.tools, choice, body.parallel_tool_calls)
    if choice == "required":
        return ToolCalling(template_tools, constraint, RequiredCalls())
    return ToolCalling(template_tools, constraint, NamedFunctionCall(choice.function.name), forced=True)


class ToolCallStream:
    """One streamed choice: passes content on as soon as it is surely content, calls at the end."""

    def __init__(self, extractor: ToolCallExtractor):
        self.extractor = extractor
        self.text = ""
        self.sent = 0

    def feed(self, new_text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """(content to send now, the calls: only once finished)."""
        self.text += new_text
        if not finished:
            end = max(self.extractor.content_end(self.text), self.sent)
            content, self.sent = self.text[self.sent:end], end
            return content, []
        content, calls = self.extractor.split(self.text)
        if not calls:
            content = self.text
        rest, self.sent = content[self.sent:], len(self.text)
        return rest, calls
