"""Bounds on what one request may ask of `hetero serve`, checked before any engine work.

Each check answers 400 in OpenAI's error shape naming the field, so one request can neither
exhaust the server's memory nor crash a handler:
- the body's JSON: nesting depth, and strings that are not valid Unicode (lone surrogates
  such as "\\ud800", which no tokenizer or response encoder accepts);
- integer fields given as JSON booleans (pydantic would read `true` as 1);
- logprobs, top_logprobs and prompt_logprobs above vLLM's `--max-logprobs` (default 20,
  OpenAI's top_logprobs limit);
- n / best_of above `--max-seqs-per-request`; a seed outside int64 (vLLM's range);
- chat roles OpenAI does not define;
- prompt plus max_tokens beyond max_model_len, as vLLM's OpenAI server answers
  (`OpenAIServing._validate_input`); the one place the request path checks the context.
"""
from __future__ import annotations

import functools
import json
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import pydantic

from hetero.core.config import DEFAULT_MAX_LOGPROBS
from hetero.core.sampling_params import logprobs_over_cap
from hetero.server.errors import APIError, malformed_json, validation_error
from hetero.server.serving import check_supported

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 64  # far deeper than any OpenAI request (tool schemas included) nests
PARSE_ON_LOOP_BYTES = 256 * 1024  # larger bodies are parsed on a worker thread
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class RequestLimits:
    """The server's per-request caps (`hetero serve --max-logprobs ...`)."""

    max_seqs_per_request: int  # n and best_of; the CLI's default is max_num_seqs
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # -1: no cap, as in vLLM
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES

    def __post_init__(self) -> None:
        if self.max_seqs_per_request < 1:
            raise ValueError(f"max_seqs_per_request must be at least 1, got {self.max_seqs_per_request}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be non-negative or -1 (no cap), got {self.max_logprobs}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be at least 1, got {self.max_request_body_bytes}")


# ------------------------------------------------------------------ the body
def parse_request(raw: bytes, model: type[pydantic.BaseModel]) -> pydantic.BaseModel:
    """The body as `model`: JSON within the limits below, no booleans for integers, then pydantic's checks."""
    data = decode_json(raw)
    reject_bool_integers(data, model)
    check_supported(data, getattr(model, "UNSUPPORTED", ()))
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise validation_error(exc.errors()) from exc


def decode_json(raw: bytes) -> Any:
    """The body's JSON, or a 400: malformed, nested deeper than MAX_JSON_DEPTH, or not valid Unicode."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise malformed_json(str(exc)) from exc
    except RecursionError as exc:
        raise _too_deep() from exc
    check_json_tree(data)
    return data


def check_json_tree(data: Any) -> None:
    """Walk the decoded JSON without recursion: depth within MAX_JSON_DEPTH, every string encodable as UTF-8."""
    stack: list[tuple[Any, int, tuple]] = [(data, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, path)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise _too_deep()
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_unicode(key, path)
                if isinstance(item, (str, dict, list)):  # numbers need no look (long token-id lists stay cheap)
                    stack.append((item, depth + 1, (*path, key)))


def _check_unicode(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        field = ".".join(map(str, path)) or None
        where = f"{field} is" if field else "the body is"
        raise APIError(
            400, f"{where} not valid Unicode: a lone surrogate at character {exc.start} (escape \\u{ord(text[exc.start]):04x})",
            param=field,
        ) from None


def _too_deep() -> APIError:
    return APIError(400, f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")


def reject_bool_integers(data: Any, model: type[pydantic.BaseModel]) -> None:
    """A 400 for `true`/`false` where `model` takes an integer (pydantic's lax mode reads `true` as 1)."""
    if not isinstance(data, dict):
        return
    for name in _integer_fields(model):
        if name in data and _holds_bool(data[name]):
            raise APIError(400, f"{name} must be an integer, got a boolean", param=name)


@functools.lru_cache(maxsize=None)
def _integer_fields(model: type[pydantic.BaseModel]) -> tuple[str, ...]:
    """Fields whose type admits int (alone or in lists) but not bool."""
    names = []
    for name, field in model.model_fields.items():
        leaves = set(_leaf_types(field.annotation))
        if int in leaves and bool not in leaves:
            names.append(field.alias or name)
    return tuple(names)


def _leaf_types(annotation: Any) -> Iterable[Any]:
    args = typing.get_args(annotation)
    if not args:
        yield annotation
        return
    for arg in args:
        yield from _leaf_types(arg)


def _holds_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    return isinstance(value, list) and any(_holds_bool(item) for item in value)


# ------------------------------------------------------------------ sampling
def check_sampling(params, limits: RequestLimits, vocab_size: int, logprobs_field: str) -> None:
    """n/best_of, logprobs and seed within the server's caps; `logprobs_field` is the API's name for logprobs."""
    num_seqs = max(params.n, params.best_of or params.n)
    if num_seqs > limits.max_seqs_per_request:
        field = "best_of" if params.best_of is not None and params.best_of > params.n else "n"
        raise APIError(
            400, f"{field} must be at most {limits.max_seqs_per_request} (--max-seqs-per-request), got {num_seqs}",
            param=field,
        )
    for field, value in ((logprobs_field, params.logprobs), ("prompt_logprobs", getattr(params, "prompt_logprobs", None))):
        requested = logprobs_over_cap(value, limits.max_logprobs, vocab_size)
        if requested is not None:
            raise APIError(
                400, f"{field}: requested {requested} logprobs, more than the {limits.max_logprobs} allowed (--max-logprobs)",
                param=field,
            )
    if params.seed is not None and not INT64_MIN <= params.seed <= INT64_MAX:
        raise APIError(400, f"seed must be within [{INT64_MIN}, {INT64_MAX}], got {params.seed}", param="seed")


def check_roles(messages: Iterable[Any], field: str = "messages") -> None:
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            roles = ", ".join(sorted(CHAT_ROLES))
            raise APIError(400, f"{field}.{index}.role must be one of {roles}; got {message.role!r}",
                           param=f"{field}.{index}.role")


# ------------------------------------------------------------------ context
@functools.lru_cache(maxsize=8)
def longest_token_chars(tokenizer) -> int:
    """Characters of the vocabulary's longest token: no token covers more text than this."""
    return max((len(piece) for piece in tokenizer.get_vocab()), default=1)


def check_text_fits(num_chars: int, tokenizer, max_model_len: int, param: str) -> None:
    """Reject, without tokenizing, text too long to fit max_model_len tokens whatever its tokenization.

    Every token covers at most `longest_token_chars` characters of the text, so text longer
    than that times max_model_len tokenizes to more than max_model_len tokens.
    """
    bound = longest_token_chars(tokenizer) * max_model_len
    if num_chars > bound:
        raise APIError(
            400, f"the {param} has {num_chars} characters, more than any {max_model_len} tokens "
            f"(max_model_len) can hold ({bound})", param=param,
        )


def check_context(num_prompt_tokens: int, max_tokens: Optional[int], max_model_len: int,
                  prompt_param: str, max_tokens_param: str) -> None:
    """The prompt leaves room for at least one token, and prompt + max_tokens fits max_model_len (vLLM's 400)."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(
            400, f"the {prompt_param} ({num_prompt_tokens} tokens) is longer than max_model_len ({max_model_len}) "
            "minus the one token it must leave room to generate", param=prompt_param,
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_param}, {max_tokens} in the "
            f"completion). Please reduce the length of the {prompt_param} or {max_tokens_param}.",
            param=max_tokens_param,
        )
