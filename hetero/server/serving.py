"""Pure conversions between OpenAI requests/responses and the engine's types."""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from hetero.outputs import CompletionOutput, Logprob, RequestOutput
from hetero.core.sampling_params import SamplingParams, StructuredOutputsParams
from hetero.server.errors import APIError
from hetero.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from hetero.structured_output import grammar_of

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"structured_outputs"}
_NEUTRAL = (None, False, "", [], {})
_NEUTRAL_BY_FIELD = {"length_penalty": 1.0}
# Fields whose API name differs from the SamplingParams name, per endpoint.
_CHAT_FIELD_NAMES = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}

SSE_DONE = "data: [DONE]\n\n"


# ------------------------------------------------------------------ requests
def check_supported(data: Any, unsupported: tuple[str, ...]) -> None:
    """400 "... is not supported" for a field OpenAI or vLLM define that this server does not implement.

    A field at its neutral value (absent, null, false, empty) changes nothing: it is
    dropped from `data` (in place) before the body is validated.
    """
    if not isinstance(data, dict):
        return
    for name in unsupported:
        value = data.pop(name, None)
        if value not in _NEUTRAL and value != _NEUTRAL_BY_FIELD.get(name, None):
            raise APIError(400, f"{name} is not supported by this server", param=name)


def output_constraint(request: SamplingRequest) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The request's output constraint (response_format, vLLM's guided_* or structured_outputs) and its field."""
    if request.structured_outputs is not None:
        given = request.structured_outputs.model_dump(by_alias=True, include={"json_", "regex", "choice", "grammar", "json_object"})
        return _constraint(StructuredOutputsParams, "structured_outputs", **given)
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            return _constraint(StructuredOutputsParams, name, **{key: value})
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None, None
    if response_format.type == "json_object":
        return _constraint(StructuredOutputsParams, "response_format", json_object=True)
    schema = response_format.json_schema.schema_ or {"type": "object"}
    return _constraint(StructuredOutputsParams, "response_format", json=schema)


def _constraint(make, field: str, **given) -> tuple[StructuredOutputsParams, str]:
    """Build and compile the constraint now, so a bad one is a 400 naming the request's field."""
    try:
        spec = make(**given)
        grammar_of(spec)
    except ValueError as exc:
        message = str(exc).replace("structured_outputs", field, 1) if field != "structured_outputs" else str(exc)
        raise APIError(400, message, param=field) from exc
    return spec, field


def completion_sampling_params(request: CompletionRequest, constraint: Optional[StructuredOutputsParams],
                               defaults: Optional[dict] = None) -> SamplingParams:
    prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
    return _sampling_params(request, request.max_tokens, request.logprobs, {}, constraint, defaults, prompt_logprobs)


def chat_sampling_params(request: ChatCompletionRequest, constraint: Optional[StructuredOutputsParams],
                         defaults: Optional[dict] = None) -> SamplingParams:
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return _sampling_params(request, request.output_limit, logprobs, _CHAT_FIELD_NAMES, constraint, defaults)


def _sampling_params(
    request: SamplingRequest, max_tokens: Optional[int], logprobs: Optional[int], api_names: dict[str, str],
    constraint: Optional[StructuredOutputsParams], defaults: Optional[dict] = None, prompt_logprobs: Optional[int] = None,
) -> SamplingParams:
    """SamplingParams from the request, its unset fields from ``defaults`` (the model's generation
    config, `LLMEngine.default_sampling_fields`); its ValueError becomes a 400 naming the API field."""
    given = {**(defaults or {}), **request.model_dump(include=_SAMPLING_FIELDS, exclude_none=True)}
    given.pop("logprobs", None)
    fallback_max_tokens = given.pop("max_tokens", None)  # the request's own, else the model's default
    given.pop("prompt_logprobs", None)
    try:
        return SamplingParams(**given, max_tokens=fallback_max_tokens if max_tokens is None else max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, structured_outputs=constraint)
    except ValueError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        param = api_names.get(field, field) if field in _SAMPLING_FIELDS else None
        if param is not None and param != field:
            message = param + message[len(field):]
        raise APIError(400, message, param=param) from exc


def check_model(requested: Optional[str], served_names: list[str]) -> str:
    """The model name to answer with; 404 for a name this server does not serve."""
    if requested is None or requested in served_names:
        return requested or served_names[0]
    raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")


# ------------------------------------------------------------------ logprobs
def _top_entries(entry: dict[int, Logprob], limit: int) -> list[Logprob]:
    ranked = sorted(entry.values(), key=lambda lp: (lp.rank is None, lp.rank or 0))
    return ranked[:limit]


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], top: int, start_offset: int
) -> dict[str, Any]:
    """The legacy completions `logprobs` object; offsets continue from `start_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = start_offset
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in _top_entries(entry, max(top, 1) + 1)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _chat_token(lp: Logprob) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top: int) -> dict[str, Any]:
    content = []
    for token, entry in zip(token_ids, entries):
        item = _chat_token(entry[token])
        item["top_logprobs"] = [_chat_token(lp) for lp in _top_entries(entry, top)] if top else []
        content.append(item)
    return {"content": content}


# ------------------------------------------------------------------ streaming
@dataclass
class ChoiceProgress:
    """What has already been streamed of one choice."""

    sent_chars: int = 0
    sent_tokens: int = 0
    text_offset: int = 0
    done: bool = False


@dataclass
class ChoiceDelta:
    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]


def stop_holdback(params: SamplingParams) -> int:
    """Characters to hold back while unfinished: a stop string may still be completing.

    The engine cuts a matched stop string out of the text, so text streamed too early
    could later be taken back. A stop that ends in new text starts at most
    len(stop) - 1 characters before it, so holding that many back is enough.
    """
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


def next_delta(progress: ChoiceProgress, completion: CompletionOutput, holdback: int) -> Optional[ChoiceDelta]:
    """The new part of one choice since `progress`, or None when there is nothing to send."""
    if progress.done:
        return None
    finished = completion.finish_reason is not None
    text = completion.text
    visible = len(text) if finished else max(len(text) - holdback, progress.sent_chars)
    delta_text = text[progress.sent_chars : visible]
    if not delta_text and not finished:
        return None
    new_tokens = completion.token_ids[progress.sent_tokens :]
    new_logprobs = completion.logprobs[progress.sent_tokens :] if completion.logprobs is not None else None
    progress.sent_chars = visible
    progress.sent_tokens = len(completion.token_ids)
    progress.done = finished
    return ChoiceDelta(delta_text, new_tokens, new_logprobs, completion.finish_reason, completion.stop_reason)


def sse(payload: dict[str, Any], event: Optional[str] = None) -> str:
    """One server-sent event; with `event`, its type line (the Responses API's events have one)."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------ responses
def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return usage_of(prompt_tokens, completion_tokens)


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def choice_index(prompt_index: int, n: int, completion: CompletionOutput) -> int:
    return prompt_index * n + completion.index


def envelope(response_id: str, obj: str, model: str, created: Optional[int] = None) -> dict[str, Any]:
    return {"id": response_id, "object": obj, "created": created or int(time.time()), "model": model}


def echo_logprobs(prompt_token_ids: list[int], prompt_logprobs: list, top: int, decode) -> dict[str, Any]:
    """The prompt's part of an echoed completion's `logprobs` (the first token has none)."""
    first = prompt_token_ids[0]
    scored = completion_logprobs(prompt_token_ids[1:], prompt_logprobs[1:], top, len(decode(first)))
    return {
        "tokens": [decode(first)] + scored["tokens"],
        "token_logprobs": [None] + scored["token_logprobs"],
        "top_logprobs": [None] + scored["top_logprobs"],
        "text_offset": [0] + scored["text_offset"],
    }


@dataclass
class Echo:
    """What an echoed completion puts before its first delta: the prompt's text and logprobs."""

    text: str
    top_logprobs: Optional[int] = None  # the request's logprobs: the prompt is scored with as many
    decode: Any = None  # token id -> its text
    logprobs: Optional[dict[str, Any]] = None


def echo_of(echoes: Optional[list[Echo]], prompt_index: int, output: RequestOutput) -> Optional[Echo]:
    """The prompt part of an echoed choice, with the prompt's logprobs when they were asked for."""
    if echoes is None:
        return None
    echo = echoes[prompt_index]
    if echo.top_logprobs is None or output.prompt_logprobs is None:
        return echo
    logprobs = echo_logprobs(output.prompt_token_ids, output.prompt_logprobs, echo.top_logprobs, echo.decode)
    return dataclasses.replace(echo, logprobs=logprobs)


def completion_choice(
    index: int, delta: ChoiceDelta, top_logprobs: Optional[int], progress: ChoiceProgress, echo: Optional[Echo] = None
) -> dict[str, Any]:
    logprobs = None
    if echo is not None and echo.logprobs is not None:
        progress.text_offset = len(echo.text)
    if top_logprobs is not None and delta.logprobs is not None:
        logprobs = completion_logprobs(delta.token_ids, delta.logprobs, top_logprobs, progress.text_offset)
        progress.text_offset += sum(len(t) for t in logprobs["tokens"])
        if echo is not None and echo.logprobs is not None:
            logprobs = {key: echo.logprobs[key] + logprobs[key] for key in logprobs}
    return {
        "index": index,
        "text": (echo.text if echo is not None else "") + delta.text,
        "logprobs": logprobs,
        "finish_reason": delta.finish_reason,
        "stop_reason": delta.stop_reason,
    }


def chat_choice_logprobs(delta: ChoiceDelta, top_logprobs: Optional[int]) -> Optional[dict[str, Any]]:
    if top_logprobs is None or delta.logprobs is None:
        return None
    return chat_logprobs(delta.token_ids, delta.logprobs, top_logprobs)


def whole_delta(completion: CompletionOutput) -> ChoiceDelta:
    """A finished choice as one delta (non-streaming responses)."""
    return next_delta(ChoiceProgress(), completion, 0)
