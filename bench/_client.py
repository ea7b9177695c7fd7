"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

from bench._datasets import Prompt
from bench._stats import RequestRecord


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run shares."""

    url: str  # full URL of /v1/completions or /v1/chat/completions
    endpoint: str  # "completions" or "chat"
    model: str
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)


def request_body(settings: RequestSettings, prompt: Prompt) -> dict:
    body = {
        "model": settings.model,
        "max_tokens": prompt.output_len,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        body["prompt"] = prompt.prompt
    if settings.ignore_eos:
        body["ignore_eos"] = True
    body.update(settings.extra_body)
    return body


def openai_error_text(body: bytes) -> str:
    """The ``error.message`` of an OpenAI-shaped error body, else the body's raw text."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        payload = json.loads(text)
        error = payload.get("error", payload)
        text = error.get("message", text) if isinstance(error, dict) else str(error)
    except (json.JSONDecodeError, AttributeError):
        pass
    return text[:300]


def error_message(status: int, body: bytes) -> str:
    return f"HTTP {status}: {openai_error_text(body)}"


def _chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def stream_request(client: httpx.AsyncClient, settings: RequestSettings, prompt: Prompt,
                         run_start: float) -> RequestRecord:
    """Send one streaming request and time it; never raises for server or network faults,
    which become a failed record carrying the error."""
    sent = time.perf_counter()
    record = RequestRecord(success=False, start=sent - run_start)
    last: Optional[float] = None
    chunks_with_text = 0
    try:
        async with client.stream("POST", settings.url, json=request_body(settings, prompt)) as response:
            if response.status_code != 200:
                record.error = error_message(response.status_code, await response.aread())
                record.e2e = time.perf_counter() - sent
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("error"):
                    record.error = f"error in stream: {openai_error_text(data.encode())}"
                    record.e2e = now - sent
                    return record
                if _chunk_text(chunk, settings.endpoint):
                    chunks_with_text += 1
                    if last is None:
                        record.ttft = now - sent
                    else:
                        record.itl.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    record.usage_reported = True
                    record.prompt_tokens = usage.get("prompt_tokens") or 0
                    record.output_tokens = usage.get("completion_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        record.e2e = time.perf_counter() - sent
        return record
    record.e2e = time.perf_counter() - sent
    if chunks_with_text == 0:
        claimed = f" (its usage claims {record.output_tokens} completion tokens)" if record.usage_reported else ""
        record.error = f"stream ended without any generated text{claimed}"
        return record
    if not record.usage_reported:
        record.output_tokens = chunks_with_text
    record.success = True
    return record
