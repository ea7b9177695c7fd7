"""The FastAPI app: OpenAI endpoints over an `AsyncLLMEngine`.

`build_app(engine, settings)` wires one engine, its metrics and the routes together; the
engine thread starts with the app's lifespan and is shut down (draining in-flight work)
when the app stops, which also stops the draft worker and removes its shared memory.
With an API key, /v1/*, /tokenize and /detokenize need it and /docs, /redoc and
/openapi.json are off.
"""
from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import jinja2
import pydantic
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hetero import __version__
from hetero.async_engine import AsyncLLMEngine, RequestStream
from hetero.core.sampling_params import SamplingParams
from hetero.engine import LLMEngine
from hetero.llm import render_chat_prompt
from hetero.metrics import CONTENT_TYPE, ServerMetrics
from hetero.server import responses, serving
from hetero.server.body_limit import BodySizeLimitMiddleware
from hetero.server.errors import APIError, error_body, install_error_handlers
from hetero.server.limits import PARSE_ON_LOOP_BYTES, RequestLimits, check_sampling, check_text_fits, parse_request
from hetero.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from hetero.server.request_prompts import chat_prompt, check_messages, completion_prompts
from hetero.server.streams import chat_events, collect, completion_events, response_events, submit, until_disconnect
from hetero.server.tool_parsers import TOOL_PARSERS, ToolCalling, tool_calling

_CLIENT_CLOSED_REQUEST = 499
BodyModel = TypeVar("BodyModel", bound=pydantic.BaseModel)


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: Optional[str] = None
    chat_template: Optional[str] = None
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on shutdown
    limits: Optional[RequestLimits] = None  # None: the defaults, n/best_of up to max_num_seqs
    enable_auto_tool_choice: bool = False  # vLLM's --enable-auto-tool-choice
    tool_call_parser: Optional[str] = None  # vLLM's --tool-call-parser: a name in TOOL_PARSERS

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser")


PROTECTED_PATHS = ("/v1/", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    """Bearer-token check on /v1/*, /tokenize and /detokenize (before the body is read, so a bad key is always 401)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = api_key.encode()

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers", [])).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._expected)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PATHS) and scope["method"] != "OPTIONS":
            if not self._authorized(scope):
                error = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(settings.served_model_names[0])
    async_engine = AsyncLLMEngine(engine, observer=metrics)
    limits = settings.limits or RequestLimits(max_seqs_per_request=engine.config.max_num_seqs)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown(settings.shutdown_timeout)
            _close_proposer(engine)

    docs = {} if not settings.api_key else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="hetero", version=__version__, lifespan=lifespan, **docs)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.limits = limits
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    app.include_router(_v1_routes(async_engine, settings, limits))
    app.include_router(_service_routes(async_engine, metrics, settings))
    return app


def _close_proposer(engine: LLMEngine) -> None:
    """Stop the draft worker and remove its shared memory and socket files now: uvicorn re-raises
    SIGTERM once the app has stopped, and that default handler skips exit-time clean-up."""
    if engine.proposer is not None:
        engine.proposer.close()


# ------------------------------------------------------------------ /v1
def _v1_routes(async_engine: AsyncLLMEngine, settings: ServerSettings, limits: RequestLimits) -> APIRouter:
    router = APIRouter(prefix="/v1")
    names = settings.served_model_names
    engine = async_engine.engine

    def model_card(name: str, created: int) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "hetero",
                "root": engine.config.model, "max_model_len": engine.max_model_len}

    @router.get("/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list", "data": [model_card(name, created) for name in names]}

    @router.get("/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        """One served model, as OpenAI's models.retrieve reads it (names may hold "/")."""
        return model_card(serving.check_model(model, names), int(time.time()))

    @router.post("/completions")
    async def completions(raw: Request):
        body = await parse_body(raw, CompletionRequest)
        model = serving.check_model(body.model, names)
        constraint, _ = serving.output_constraint(body)
        params = serving.completion_sampling_params(body, constraint, engine.default_sampling_fields)
        check_sampling(params, limits, engine.model_config.vocab_size, "logprobs")
        prompts = await completion_prompts(async_engine, body, params, body.add_special_tokens)
        response_id = async_engine.new_request_id("cmpl")
        streams = await submit(async_engine, response_id, prompts, params, "prompt")
        echoes = [_echo(engine, prompt, body) for prompt in prompts] if body.echo else None
        if body.stream:
            usage_mode = _usage_mode(body)
            num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
            events = completion_events(streams, response_id, model, params, body.logprobs, usage_mode, num_prompt_tokens, echoes)
            return StreamingResponse(events, media_type="text/event-stream")
        finals = await until_disconnect(raw, collect(streams))
        if finals is None:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        choices = [
            serving.completion_choice(
                serving.choice_index(i, params.n, c), serving.whole_delta(c), body.logprobs, serving.ChoiceProgress(),
                serving.echo_of(echoes, i, output),
            )
            for i, output in enumerate(finals)
            for c in output.outputs
        ]
        return {**serving.envelope(response_id, "text_completion", model), "choices": choices, "usage": serving.usage(finals)}

    async def start_chat(body: ChatCompletionRequest, id_prefix: str) -> _ChatRun:
        """Check, template and submit a chat request (also a Responses request made one)."""
        model = serving.check_model(body.model, names)
        if body.modalities and body.modalities != ["text"]:
            raise APIError(400, f"modalities {body.modalities} are not supported: this server answers in text only", param="modalities")
        constraint, constraint_field = serving.output_constraint(body)
        tools = tool_calling(body, settings.enable_auto_tool_choice, settings.tool_call_parser, constraint_field)
        if tools.constraint is not None:
            constraint = tools.constraint
        params = serving.chat_sampling_params(body, constraint, engine.default_sampling_fields)
        check_sampling(params, limits, engine.model_config.vocab_size, "top_logprobs")
        prompt = await chat_prompt(
            async_engine, body, params, lambda: _render_chat(engine, body, settings.chat_template, tools.template_tools)
        )
        response_id = async_engine.new_request_id(id_prefix)
        streams = await submit(async_engine, response_id, [prompt], params, "messages")
        return _ChatRun(model, tools, params, len(prompt["prompt_token_ids"]), response_id, streams)

    @router.post("/chat/completions")
    async def chat_completions(raw: Request):
        body = await parse_body(raw, ChatCompletionRequest)
        run = await start_chat(body, "chatcmpl")
        model, tools, params, response_id, streams = run.model, run.tools, run.params, run.response_id, run.streams
        top = (body.top_logprobs or 0) if body.logprobs else None
        if body.stream:
            events = chat_events(streams, response_id, model, params, top, _usage_mode(body), run.num_prompt_tokens, tools)
            return StreamingResponse(events, media_type="text/event-stream")
        finals = await until_disconnect(raw, collect(streams))
        if finals is None:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        choices = []
        for completion in finals[0].outputs:
            delta = serving.whole_delta(completion)
            message: dict[str, Any] = {"role": "assistant", "content": delta.text}
            finish_reason = delta.finish_reason
            if tools.extractor is not None:
                content, calls = tools.extractor.split(delta.text)
                if calls:
                    message = {"role": "assistant", "content": content.strip() or None,
                               "tool_calls": [call.as_dict() for call in calls]}
                    finish_reason = tools.finish_reason(finish_reason)
            choices.append({
                "index": completion.index,
                "message": message,
                "logprobs": serving.chat_choice_logprobs(delta, top),
                "finish_reason": finish_reason,
                "stop_reason": delta.stop_reason,
            })
        return {**serving.envelope(response_id, "chat.completion", model), "choices": choices, "usage": serving.usage(finals)}

    @router.post("/responses")
    async def create_response(raw: Request):
        body = await parse_body(raw, ResponsesRequest)
        try:
            run = await start_chat(responses.chat_request(body), "resp")
        except APIError as exc:
            raise responses.responses_error(exc) from exc
        if body.stream:
            events = response_events(run.streams, run.response_id, run.model, body, run.params, run.tools)
            return StreamingResponse(events, media_type="text/event-stream")
        created_at = int(time.time())
        finals = await until_disconnect(raw, collect(run.streams))
        if finals is None:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        return responses.finished_response(run.response_id, run.model, body, created_at, finals[0], run.tools)

    return router


@dataclass
class _ChatRun:
    """A submitted chat request: what its reply is formatted with, and its output stream."""

    model: str
    tools: ToolCalling
    params: SamplingParams
    num_prompt_tokens: int
    response_id: str
    streams: list[RequestStream]


def _require_tokenizer(engine: LLMEngine, what: str):
    if engine.tokenizer is None:
        raise APIError(400, f"{what} needs a tokenizer, and this server runs with --skip-tokenizer-init")
    return engine.tokenizer


def _render_chat(
    engine: LLMEngine, body: ChatCompletionRequest, default_template: Optional[str], tools: Optional[list[dict]] = None
) -> dict[str, Any]:
    _require_tokenizer(engine, "a chat request")
    try:
        return render_chat_prompt(
            engine.tokenizer,
            [message.for_template() for message in body.messages],
            body.chat_template or default_template,
            body.add_generation_prompt,
            body.continue_final_message,
            tools=tools,
            template_kwargs=body.chat_template_kwargs,
            add_special_tokens=body.add_special_tokens,
        )
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc


def _echo(engine: LLMEngine, prompt: dict[str, Any], body: CompletionRequest) -> serving.Echo:
    text = prompt.get("prompt")
    if text is None:
        text = _require_tokenizer(engine, "echo").decode(prompt["prompt_token_ids"])
    return serving.Echo(text, top_logprobs=body.logprobs, decode=lambda token: engine.tokenizer.decode([token]))


def _usage_mode(body) -> Optional[str]:
    """None, "final" (one usage chunk at the end) or "continuous" (vLLM: usage in every chunk too)."""
    options = body.stream_options
    if options is None or not options.include_usage:
        return None
    return "continuous" if options.continuous_usage_stats else "final"


async def parse_body(request: Request, model: type[BodyModel]) -> BodyModel:
    """The JSON body as `model`, whatever the Content-Type (curl -d sends a form type), within the limits.

    A large body is parsed on a worker thread, so the event loop keeps serving the streams.
    """
    raw = await request.body()
    if len(raw) <= PARSE_ON_LOOP_BYTES:
        return parse_request(raw, model)
    return await asyncio.to_thread(parse_request, raw, model)


# ---------------------------------------------------------- service routes
def _service_routes(async_engine: AsyncLLMEngine, metrics: ServerMetrics, settings: ServerSettings) -> APIRouter:
    router = APIRouter()
    engine = async_engine.engine
    names = settings.served_model_names

    @router.get("/health")
    async def health() -> Response:
        if async_engine.is_running:
            return Response(status_code=200)
        reason = async_engine.dead_error or "the engine is not running"
        return JSONResponse(error_body(f"unhealthy: {reason!r}", "server_error"), status_code=503)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @router.post("/tokenize")
    async def tokenize(raw: Request) -> dict[str, Any]:
        body = await parse_body(raw, TokenizeRequest)
        serving.check_model(body.model, names)
        if body.messages is not None:
            check_messages(async_engine, body.messages)
            chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
            rendered = await async_engine.run_in_tokenizer_pool(_render_chat, engine, chat, settings.chat_template)
            tokens = rendered["prompt_token_ids"]
        else:
            tokenizer = _require_tokenizer(engine, "tokenizing")
            check_text_fits(len(body.prompt), tokenizer, engine.max_model_len, "prompt")
            tokens = await async_engine.run_in_tokenizer_pool(
                lambda: tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            )
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": list(tokens)}

    @router.post("/detokenize")
    async def detokenize(raw: Request) -> dict[str, str]:
        body = await parse_body(raw, DetokenizeRequest)
        serving.check_model(body.model, names)
        vocab = engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of the vocabulary range [0, {vocab})", param="tokens")
        tokenizer = _require_tokenizer(engine, "detokenizing")
        return {"prompt": await async_engine.run_in_tokenizer_pool(tokenizer.decode, body.tokens)}

    return router
