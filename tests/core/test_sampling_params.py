import dataclasses

import pytest

from hetero.core.sampling_params import RequestOutputKind, SamplingParams

VLLM_DEFAULTS = {
    "n": 1,
    "best_of": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "detokenize": True,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "no_repeat_ngram_size": 0,
    "logit_bias": None,
    "structured_outputs": None,
    "output_kind": RequestOutputKind.CUMULATIVE,
}


def test_defaults_are_vllms():
    params = SamplingParams()
    assert {f.name: getattr(params, f.name) for f in dataclasses.fields(params)} == VLLM_DEFAULTS
    assert not params.is_greedy


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("n", "2"),
    ("best_of", 0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1), ("presence_penalty", "x"),
    ("frequency_penalty", -3.0), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("temperature", -1), ("temperature", 2.5), ("temperature", float("nan")), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.1), ("min_p", 1.5),
    ("seed", 1.5), ("seed", "7"),
    ("stop", [""]), ("stop", 3), ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 5),
    ("ignore_eos", "yes"),
    ("max_tokens", 0), ("max_tokens", 1.5),
    ("min_tokens", -1),
    ("logprobs", -2), ("logprobs", 0.5),
    ("prompt_logprobs", -5),
    ("detokenize", "no"),
    ("skip_special_tokens", None),
    ("spaces_between_special_tokens", 2),
    ("include_stop_str_in_output", "true"),
    ("no_repeat_ngram_size", -1), ("no_repeat_ngram_size", 2.0),
    ("output_kind", 2), ("output_kind", RequestOutputKind.DELTA),
    ("logit_bias", {"x": 1.0}), ("logit_bias", {5: 101}), ("logit_bias", {5: float("nan")}), ("logit_bias", [5]),
    ("structured_outputs", "json"), ("structured_outputs", {"regex": "a", "choice": ["b"]}),
])
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"temperature": 0.0, "n": 2}, "n"),
    ({"stop": "x", "detokenize": False}, "stop"),
])
def test_invalid_combinations_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_error_message_carries_the_value():
    with pytest.raises(ValueError, match=r"temperature must be non-negative, got -1"):
        SamplingParams(temperature=-1)


def test_normalisation_as_vllm():
    params = SamplingParams(stop="###", stop_token_ids=[5, 3, 5], seed=-1, logprobs=True, top_k=-1)
    assert params.stop == ["###"]
    assert params.stop_token_ids == [5, 3]
    assert params.seed is None
    assert params.logprobs == 1
    assert params.top_k == -1
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_greedy_resets_truncation_and_tiny_temperature_is_raised():
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert greedy.is_greedy
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    tiny = SamplingParams(temperature=1e-3)
    assert not tiny.is_greedy and tiny.temperature == 1e-2


def test_repr_and_clone():
    params = SamplingParams(temperature=0.5, stop=["x"], no_repeat_ngram_size=3)
    text = repr(params)
    assert text.startswith("SamplingParams(n=1, ")
    assert "temperature=0.5" in text and "stop=['x']" in text and "no_repeat_ngram_size=3" in text
    copy = params.clone()
    assert copy == params and copy.stop is not params.stop
