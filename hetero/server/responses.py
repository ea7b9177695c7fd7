"""OpenAI's Responses API (`POST /v1/responses`, as vLLM serves it) over the chat path.

A request becomes a chat request (`chat_request`): `instructions` a system
message, `input` text or items (messages with input_text / output_text parts, earlier
`function_call` items and their `function_call_output`s), `max_output_tokens`,
`text.format` (text, json_object, json_schema) and function `tools`. The reply is a
`response` object whose `output` holds a message with one output_text part, or
`function_call` items; streamed, the Responses API's typed events
(response.created ... response.output_text.delta ... response.completed). Nothing is
stored: `previous_response_id` is a 400 that says to send the conversation in `input`.
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Optional

import pydantic

from hetero.outputs import RequestOutput
from hetero.server.errors import APIError, validation_error
from hetero.server.protocol import ChatCompletionRequest, ResponsesRequest
from hetero.server.tool_parsers import ToolCall, ToolCalling

_TEXT_PART_TYPES = ("input_text", "output_text", "text")
_MESSAGE_ROLES = ("user", "assistant", "system", "developer")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response; what chat cannot take is a 400 naming the Responses field."""
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses; "
                            "send the conversation so far in input", param="previous_response_id")
    if body.background:
        raise APIError(400, "background responses are not supported", param="background")
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body), "stream": body.stream,
                            "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
                            "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls}
    if body.text is not None and body.text.format is not None:
        chat["response_format"] = _response_format(body.text.format)
    if body.tools:
        chat["tools"] = [_chat_tool(tool) for tool in body.tools]
    if isinstance(body.tool_choice, dict):
        if body.tool_choice.get("type") != "function" or not isinstance(body.tool_choice.get("name"), str):
            raise APIError(400, "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}",
                           param="tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice["name"]}}
    else:
        chat["tool_choice"] = body.tool_choice
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except pydantic.ValidationError as exc:
        raise validation_error(exc.errors()) from exc


# Chat request fields and the Responses fields they came from, for errors the chat path raises.
_RESPONSES_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def responses_error(error: APIError) -> APIError:
    """`error`, raised for the chat request a Responses request became, in the Responses request's names."""
    message = error.message
    for chat_name, name in _RESPONSES_NAMES.items():
        if chat_name != "messages":  # also an ordinary word in error messages: only the param is renamed
            message = message.replace(chat_name, name)
    return dataclasses.replace(error, message=message, param=_RESPONSES_NAMES.get(error.param, error.param))


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last.get("content"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported: messages, function_call and "
                                "function_call_output are", param="input")
    if not messages:
        raise APIError(400, "input has no messages", param="input")
    return messages


def _message(item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise APIError(400, f"a message's role must be one of {', '.join(_MESSAGE_ROLES)}, got {role!r}", param="input")
    content = item.get("content")
    if isinstance(content, list):  # parts: text ones become chat text parts; others fail as chat's media parts do
        content = [{"type": "text", "text": part.get("text")} if part.get("type") in _TEXT_PART_TYPES else part
                   for part in content]
    return {"role": "system" if role == "developer" else role, "content": content}


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    """Responses' text.format ({type, name, schema, strict} flat) as chat's response_format."""
    kind = text_format.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {key: text_format[key] for key in ("name", "description", "schema", "strict") if key in text_format}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, f"text.format type must be text, json_object or json_schema, got {kind!r}", param="text.format")


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool ({type, name, description, parameters, strict} flat) as a chat tool."""
    if tool.get("type") != "function":
        raise APIError(400, f"tools of type {tool.get('type')!r} are not supported: function tools are", param="tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


# ------------------------------------------------------------------ the response object
def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(identifier: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": identifier, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def response_object(response_id: str, model: str, request: ResponsesRequest, created_at: int, status: str,
                    output: list[dict[str, Any]], usage: Optional[dict[str, Any]],
                    incomplete_reason: Optional[str] = None) -> dict[str, Any]:
    text_format = (request.text.format if request.text is not None else None) or {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "error": None,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
        "temperature": request.temperature, "text": {"format": text_format}, "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [], "top_p": request.top_p, "truncation": "disabled", "usage": usage,
        "user": request.user, "metadata": request.metadata or {},
    }


def response_usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def ending(finish_reason: Optional[str]) -> tuple[str, Optional[str]]:
    """(the response's status, also its output items', and why it is incomplete) for the choice's finish reason."""
    return ("incomplete", "max_output_tokens") if finish_reason == "length" else ("completed", None)


def output_items(text: str, tools: ToolCalling, status: str) -> list[dict[str, Any]]:
    """A finished reply's output items: its function calls (and any text before them), or one message."""
    if tools.extractor is not None:
        content, calls = tools.extractor.split(text)
        if calls:
            message = [message_item(item_id("msg"), content.strip(), status)] if content.strip() else []
            return message + [function_call_item(call, status) for call in calls]
    return [message_item(item_id("msg"), text, status)]


def finished_response(response_id: str, model: str, request: ResponsesRequest, created_at: int,
                      final: RequestOutput, tools: ToolCalling) -> dict[str, Any]:
    completion = final.outputs[0]
    status, reason = ending(completion.finish_reason)
    output = output_items(completion.text, tools, status)
    usage = response_usage(len(final.prompt_token_ids), len(completion.token_ids))
    return response_object(response_id, model, request, created_at, status, output, usage, reason)
