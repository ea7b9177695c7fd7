"""Sampling parameters, with vLLM's field names, defaults and validation.

A user moving from vLLM passes the same keywords and gets the same errors: every
invalid value raises ``ValueError`` whose message starts with the field's name. The one
addition is TACO-LLM's ``no_repeat_ngram_size``. ``structured_outputs`` takes vLLM's
``StructuredOutputsParams`` (json / regex / choice / grammar / json_object).
"""
from __future__ import annotations

import copy
import enum
import logging
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

logger = logging.getLogger(__name__)

SAMPLING_EPS = 1e-5  # temperatures below this mean greedy decoding
MIN_TEMPERATURE = 1e-2  # smaller positive temperatures are raised to this, as vLLM does


def _check_int(name: str, value, minimum: Optional[int] = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def _check_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


def _check_flag(name: str, value) -> None:
    if value not in (True, False):
        raise ValueError(f"{name} must be a bool, got {value!r}")


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, vLLM's spelling: exactly one of the fields is set.

    ``json``: a JSON schema (dict or JSON text); ``regex``: a regular expression;
    ``choice``: a list of strings, one of which is the output; ``grammar``: a Lark or
    GBNF (``::=``) grammar; ``json_object``: any JSON object.
    """

    json: Union[str, dict, None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple)) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its text), got {self.json!r}")


def _normalise_logit_bias(logit_bias: Any) -> Optional[dict[int, float]]:
    """{token id: bias}; keys may be strings of digits (JSON object keys), as OpenAI sends them."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token ids to numbers, got {logit_bias!r}")
    result: dict[int, float] = {}
    for key, value in logit_bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if token < 0 or isinstance(key, bool):
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
        _check_real("logit_bias", value)
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token}")
        result[token] = float(value)
    return result or None


def logprobs_over_cap(value: Optional[int], max_logprobs: int, vocab_size: int) -> Optional[int]:
    """The logprobs a request's ``value`` asks for (-1: the whole vocabulary) where they exceed
    ``max_logprobs`` (vLLM's cap; -1: none), else None."""
    if value is None or max_logprobs == -1:
        return None
    requested = vocab_size if value == -1 else value
    return requested if requested > max_logprobs else None


class RequestOutputKind(enum.Enum):
    """Which RequestOutputs a request gets (vLLM's names and values).

    The offline `LLM` asks for FINAL_ONLY, as vLLM's does: it only keeps finished outputs,
    and building one per request per step cost ~4 % of a speculative step at batch 64.
    """

    CUMULATIVE = 0  # every step that adds tokens: everything generated so far
    DELTA = 1  # what is new since the last output: not supported (the server streams deltas itself)
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    no_repeat_ngram_size: int = 0  # TACO-LLM: ban any n-gram already in prompt + output; 0 = off
    logit_bias: Optional[dict[int, float]] = None  # added to the logits of those token ids
    structured_outputs: Optional[StructuredOutputsParams] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        else:
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")

        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._verify_args()

        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors; using %s",
                self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE
        if self.is_greedy:
            # Greedy decoding ignores the truncation knobs; resetting them keeps the
            # sampler's fast paths honest (vLLM does the same).
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")

    def _verify_args(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_int("best_of", self.best_of, minimum=1, allow_none=True)
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_real(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        _check_real("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if self.temperature > 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}")
        _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_int("seed", self.seed, allow_none=True)
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must contain only strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only non-negative integers, got {self.stop_token_ids}")
        _check_int("max_tokens", self.max_tokens, minimum=1, allow_none=True)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check_int(name, value, allow_none=True)
            if value is not None and value < -1:
                raise ValueError(f"{name} must be non-negative or -1, got {value}")
        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output"):
            _check_flag(name, getattr(self, name))
        _check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, minimum=0)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.output_kind is RequestOutputKind.DELTA:
            raise ValueError("output_kind DELTA is not supported; use CUMULATIVE (each output holds everything so far) or FINAL_ONLY")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        return (
            f"SamplingParams(n={self.n}, "
            f"best_of={self.best_of}, "
            f"presence_penalty={self.presence_penalty}, "
            f"frequency_penalty={self.frequency_penalty}, "
            f"repetition_penalty={self.repetition_penalty}, "
            f"temperature={self.temperature}, "
            f"top_p={self.top_p}, "
            f"top_k={self.top_k}, "
            f"min_p={self.min_p}, "
            f"seed={self.seed}, "
            f"stop={self.stop}, "
            f"stop_token_ids={self.stop_token_ids}, "
            f"include_stop_str_in_output={self.include_stop_str_in_output}, "
            f"ignore_eos={self.ignore_eos}, "
            f"max_tokens={self.max_tokens}, "
            f"min_tokens={self.min_tokens}, "
            f"logprobs={self.logprobs}, "
            f"prompt_logprobs={self.prompt_logprobs}, "
            f"skip_special_tokens={self.skip_special_tokens}, "
            f"spaces_between_special_tokens={self.spaces_between_special_tokens}, "
            f"no_repeat_ngram_size={self.no_repeat_ngram_size}, "
            f"logit_bias={self.logit_bias}, "
            f"structured_outputs={self.structured_outputs}, "
            f"output_kind={self.output_kind})"
        )


# generation_config.json's sampling keys, each with HF GenerationConfig's default and SamplingParams'
# name: what vLLM's generation_config takes as default sampling parameters (`get_diff_sampling_param`),
# and the keys its override_generation_config may set.
GENERATION_CONFIG_FIELDS = {"temperature": (1.0, "temperature"), "top_p": (1.0, "top_p"), "top_k": (50, "top_k"),
                            "min_p": (None, "min_p"), "repetition_penalty": (1.0, "repetition_penalty"),
                            "max_new_tokens": (None, "max_tokens")}


def generation_config_overrides(overrides: Optional[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's `override_generation_config` under SamplingParams' names (`max_new_tokens` as `max_tokens`):
    default sampling parameters set over generation_config's
    (https://docs.vllm.ai/en/latest/configuration/engine_args.html). A ValueError names a key that is
    not one of generation_config's sampling fields, or a value SamplingParams would refuse."""
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise ValueError(f"override_generation_config must be a dict such as {{'temperature': 0.5}}, got {overrides!r}")
    fields = {}
    for key, value in overrides.items():
        if key not in GENERATION_CONFIG_FIELDS:
            raise ValueError(f"override_generation_config[{key!r}] is not a sampling field of generation_config; "
                             f"it takes {', '.join(GENERATION_CONFIG_FIELDS)}")
        if value is None:
            raise ValueError(f"override_generation_config[{key!r}] must be a value, got None")
        name = GENERATION_CONFIG_FIELDS[key][1]
        try:
            SamplingParams(**{name: value})
        except ValueError as exc:
            raise ValueError(f"override_generation_config[{key!r}]: {exc}") from None
        fields[name] = value
    return fields
