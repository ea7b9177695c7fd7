"""Requests' prompts as token ids, made off the event loop and checked against the context.

Text is tokenised (and chat templates rendered) on the async engine's tokenizer threads;
a text that cannot fit max_model_len is refused before it is tokenised, and one that
tokenises too long, or leaves no room for max_tokens, before the engine sees it.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from hetero.async_engine import AsyncLLMEngine
from hetero.core.sampling_params import SamplingParams
from hetero.server.errors import APIError
from hetero.server.limits import check_context, check_roles, check_text_fits
from hetero.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest


async def completion_prompts(
    async_engine: AsyncLLMEngine, body: CompletionRequest, params: SamplingParams, add_special_tokens: bool = True
) -> list[Any]:
    """The engine prompts of a completions request, each within the context with its max_tokens."""
    engine = async_engine.engine
    prompts = body.prompts()
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str) and engine.tokenizer is None:
            raise APIError(400, "a text prompt needs a tokenizer, and this server runs with --skip-tokenizer-init", param="prompt")
        if isinstance(prompt, str):
            check_text_fits(len(prompt), engine.tokenizer, engine.max_model_len, "prompt")
            prompt = await async_engine.encode_prompt(prompt, add_special_tokens)
        if isinstance(prompt, dict):
            check_context(len(prompt["prompt_token_ids"]), params.max_tokens, engine.max_model_len, "prompt", "max_tokens")
        encoded.append(prompt)
    return encoded


async def chat_prompt(
    async_engine: AsyncLLMEngine, body: ChatCompletionRequest, params: SamplingParams, render: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """The rendered and tokenised conversation (`render()` runs on the tokenizer threads), within the context."""
    engine = async_engine.engine
    check_messages(async_engine, body.messages)
    prompt = await async_engine.run_in_tokenizer_pool(render)
    limit_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    check_context(len(prompt["prompt_token_ids"]), params.max_tokens, engine.max_model_len, "messages", limit_field)
    return prompt


def check_messages(async_engine: AsyncLLMEngine, messages: list[ChatMessage]) -> None:
    """Known roles, and message text short enough that the conversation could fit the context."""
    check_roles(messages)
    tokenizer = async_engine.engine.tokenizer
    if tokenizer is not None:
        check_text_fits(sum(_text_length(m) for m in messages), tokenizer, async_engine.engine.max_model_len, "messages")


def _text_length(message: ChatMessage) -> int:
    content: Optional[Any] = message.content
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(getattr(part, "text", "") or "") for part in content)
    return 0
