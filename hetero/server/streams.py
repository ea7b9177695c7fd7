"""The engine calls behind the OpenAI endpoints: submitting a request's prompts all or none,
collecting their outputs, giving up when the client disconnects, and the SSE bodies of
/v1/completions, /v1/chat/completions (stop-string hold-back, usage, errors in-stream) and
/v1/responses (the Responses API's typed events).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence, Union

from fastapi import Request

from hetero.async_engine import AsyncLLMEngine, EngineDeadError, EngineShutdownError, RequestStream
from hetero.core.sampling_params import SamplingParams
from hetero.outputs import RequestOutput
from hetero.server import responses, serving
from hetero.server.errors import APIError, error_body
from hetero.server.protocol import ResponsesRequest
from hetero.server.tool_parsers import ToolCalling, ToolCallStream


def engine_error(exc: Exception) -> APIError:
    if isinstance(exc, EngineShutdownError):
        return APIError(503, str(exc), code="service_unavailable")
    return APIError(500, str(exc), code="engine_dead")


def _stream_error(exc: Exception) -> dict[str, Any]:
    """The error chunk for a stream that fails after its headers were sent."""
    if isinstance(exc, (EngineDeadError, EngineShutdownError)):
        return engine_error(exc).body()
    return error_body(f"internal server error: {exc!r}", "server_error")


async def submit(
    async_engine: AsyncLLMEngine, response_id: str, prompts: list, params: SamplingParams, param: str
) -> list[RequestStream]:
    """Add every prompt, or none: a bad one closes those already added and becomes a 400."""
    streams: list[RequestStream] = []
    try:
        for index, prompt in enumerate(prompts):
            streams.append(await async_engine.add_request(f"{response_id}-{index}", prompt, params))
    except ValueError as exc:
        _close_all(streams)
        raise APIError(400, str(exc), param=param) from exc
    except (EngineDeadError, EngineShutdownError) as exc:
        _close_all(streams)
        raise engine_error(exc) from exc
    except BaseException:
        _close_all(streams)
        raise
    return streams


def _close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come; leaving early aborts them all."""
    if len(streams) == 1:  # one prompt, n = 1: no task and queue between the stream and its reader
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            _close_all(streams)
        return
    queue: asyncio.Queue[tuple[int, Union[RequestOutput, BaseException, None]]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        _close_all(streams)


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[Optional[RequestOutput]] = [None] * len(streams)
    try:
        async for index, output in _merge(streams):
            if output.finished:
                finals[index] = output
    except (EngineDeadError, EngineShutdownError) as exc:
        raise engine_error(exc) from exc
    return [f for f in finals if f is not None]


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable) -> Any:
    """The result of `work`, or None when the client goes away first (the work is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


# ------------------------------------------------------------------ streams
async def _sse_events(
    streams: list[RequestStream],
    head: dict,
    params: SamplingParams,
    usage_mode: Optional[str],
    num_prompt_tokens: int,
    build_choice: Callable[[int, Any, Any, serving.ChoiceProgress, RequestOutput], dict],
    opening: Sequence[dict] = (),
) -> AsyncIterator[str]:
    """The SSE body of both endpoints: opening chunks, one chunk per text delta, usage, [DONE].

    `build_choice(prompt_index, completion, delta, state, output)` formats one choice the way its
    endpoint does; everything else (stop-string hold-back, usage, errors) is shared. With
    `usage_mode` "continuous" (vLLM's continuous_usage_stats) every chunk carries the usage so far.
    """
    holdback = serving.stop_holdback(params)
    progress: dict[tuple[int, int], serving.ChoiceProgress] = {}
    generated: dict[tuple[int, int], int] = {}
    finals: list[RequestOutput] = []

    def chunk(choices: list[dict]) -> str:
        payload = {**head, "choices": choices}
        if usage_mode == "continuous":
            payload["usage"] = serving.usage_of(num_prompt_tokens, sum(generated.values()))
        return serving.sse(payload)

    try:
        for choice in opening:
            yield chunk([choice])
        async for prompt_index, output in _merge(streams):
            for completion in output.outputs:
                key = (prompt_index, completion.index)
                generated[key] = len(completion.token_ids)
                state = progress.setdefault(key, serving.ChoiceProgress())
                delta = serving.next_delta(state, completion, holdback)
                if delta is not None:
                    yield chunk([build_choice(prompt_index, completion, delta, state, output)])
            if output.finished:
                finals.append(output)
        if usage_mode is not None:
            yield serving.sse({**head, "choices": [], "usage": serving.usage(finals)})
    except Exception as exc:  # noqa: BLE001 - headers are sent; the error goes in the stream
        yield serving.sse(_stream_error(exc))
    yield serving.SSE_DONE


def completion_events(
    streams: list[RequestStream], response_id: str, model: str, params: SamplingParams,
    top_logprobs: Optional[int], usage_mode: Optional[str], num_prompt_tokens: int,
    echoes: Optional[list[serving.Echo]],
) -> AsyncIterator[str]:
    echoed: set[int] = set()

    def build_choice(prompt_index, completion, delta, state, output):
        index = serving.choice_index(prompt_index, params.n, completion)
        echo = None
        if echoes is not None and index not in echoed:
            echoed.add(index)
            echo = serving.echo_of(echoes, prompt_index, output)
        return serving.completion_choice(index, delta, top_logprobs, state, echo)

    head = serving.envelope(response_id, "text_completion", model)
    return _sse_events(streams, head, params, usage_mode, num_prompt_tokens, build_choice)


def chat_events(
    streams: list[RequestStream], response_id: str, model: str, params: SamplingParams,
    top_logprobs: Optional[int], usage_mode: Optional[str], num_prompt_tokens: int, tools: ToolCalling,
) -> AsyncIterator[str]:
    tool_streams: dict[int, ToolCallStream] = {}

    def build_choice(_prompt_index, completion, delta, _state, _output):
        content, calls, finish_reason = delta.text, [], delta.finish_reason
        if tools.extractor is not None:
            stream = tool_streams.setdefault(completion.index, ToolCallStream(tools.extractor))
            content, calls = stream.feed(delta.text, delta.finish_reason is not None)
            if calls:
                finish_reason = tools.finish_reason(finish_reason)
        message: dict[str, Any] = {"content": content} if content else {}
        if calls:
            message["tool_calls"] = [{"index": i, **call.as_dict()} for i, call in enumerate(calls)]
        return {
            "index": completion.index,
            "delta": message,
            "logprobs": serving.chat_choice_logprobs(delta, top_logprobs),
            "finish_reason": finish_reason,
            "stop_reason": delta.stop_reason,
        }

    head = serving.envelope(response_id, "chat.completion.chunk", model)
    roles = [
        {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for index in range(params.n)
    ]
    return _sse_events(streams, head, params, usage_mode, num_prompt_tokens, build_choice, roles)


async def response_events(streams: list[RequestStream], response_id: str, model: str, request: ResponsesRequest,
                          params: SamplingParams, tools: ToolCalling) -> AsyncIterator[str]:
    """The Responses API's SSE events for one reply: text deltas as they come (stop strings
    held back as in chat), function calls once the reply is complete."""
    created_at = int(time.time())
    sequence = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        sequence += 1
        return serving.sse({"type": kind, "sequence_number": sequence - 1, **fields}, event=kind)

    opening = responses.response_object(response_id, model, request, created_at, "in_progress", [], None)
    yield event("response.created", response=opening)
    yield event("response.in_progress", response=opening)
    holdback = serving.stop_holdback(params)
    progress = serving.ChoiceProgress()
    calls_stream = ToolCallStream(tools.extractor) if tools.extractor is not None else None
    message_id, text, output = responses.item_id("msg"), "", []
    final: Optional[RequestOutput] = None
    status, reason = "completed", None
    try:
        async for _, update in _merge(streams):
            delta = serving.next_delta(progress, update.outputs[0], holdback)
            if delta is not None:
                finished = delta.finish_reason is not None
                content, calls = calls_stream.feed(delta.text, finished) if calls_stream else (delta.text, [])
                if content:
                    if not text:
                        yield event("response.output_item.added", output_index=0,
                                    item={**responses.message_item(message_id, "", "in_progress"), "content": []})
                        yield event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                    text += content
                    yield event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                                delta=content, logprobs=[])
                if finished:
                    status, reason = responses.ending(delta.finish_reason)
                    if text:
                        item = responses.message_item(message_id, text, status)
                        yield event("response.output_text.done", item_id=message_id, output_index=0, content_index=0,
                                    text=text, logprobs=[])
                        yield event("response.content_part.done", item_id=message_id, output_index=0, content_index=0,
                                    part=item["content"][0])
                        yield event("response.output_item.done", output_index=0, item=item)
                        output.append(item)
                    for call in calls:
                        item = responses.function_call_item(call, status)
                        index = len(output)
                        yield event("response.output_item.added", output_index=index,
                                    item={**item, "arguments": "", "status": "in_progress"})
                        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                    delta=call.arguments)
                        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                    arguments=call.arguments)
                        yield event("response.output_item.done", output_index=index, item=item)
                        output.append(item)
            if update.finished:
                final = update
        if final is not None:
            usage = responses.response_usage(len(final.prompt_token_ids), len(final.outputs[0].token_ids))
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            yield event(kind, response=responses.response_object(response_id, model, request, created_at, status, output, usage, reason))
    except Exception as exc:  # noqa: BLE001 - headers are sent; the error goes in the stream
        error = _stream_error(exc)["error"]
        yield event("error", code=error.get("code"), message=error["message"], param=error.get("param"))
