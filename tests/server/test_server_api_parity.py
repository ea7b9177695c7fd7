"""What vLLM's server accepts, through the official `openai` client against the live test server.

vLLM's request extensions, OpenAI fields that change nothing here, "not supported" for
those that would change the output, response_format and the guided_* constraints,
logit_bias, completions echo with prompt logprobs (lm-eval's loglikelihood), the
context-length 400, usage in every streamed chunk, and the metrics under vLLM's names.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from hetero import LLM, SamplingParams
from server_helpers import live_server
from test_server import RepeatLastToken, metric_samples

GREEDY = {"temperature": 0.0}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with live_server(tiny_llama_dir) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


# ------------------------------------------------------------ accepted fields
def test_fields_that_change_nothing_are_accepted_and_change_nothing(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, **GREEDY)
    extras = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, store=False, metadata={"k": "v"}, service_tier="auto",
        user="u1", parallel_tool_calls=True, reasoning_effort="low", prompt_cache_key="c", **GREEDY,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "guided_decoding_backend": "auto",
                    "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "ignore_eos": False, "min_tokens": 0},
    )
    assert extras.choices[0].message.content == plain.choices[0].message.content
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, user="u", **GREEDY,
                                           extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2})
    assert completion.choices[0].finish_reason in ("length", "stop")


def test_fields_that_would_change_the_output_are_not_supported_and_unknown_ones_are_unknown(server, client):
    with pytest.raises(openai.BadRequestError, match="suffix is not supported"):
        client.completions.create(model="tiny", prompt="def f(", suffix="    return 1", max_tokens=4)
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prediction": {"type": "content", "content": "x"}})
    assert response.status_code == 400 and "prediction is not supported" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "prediction"
    response = post(server, "/v1/completions", {"prompt": "hi", "use_beam_search": False, "truncate_prompt_tokens": None})
    assert response.status_code == 200, response.text  # neutral values change nothing
    response = post(server, "/v1/completions", {"prompt": "hi", "temprature": 0.5})
    assert response.status_code == 400 and "unknown field 'temprature'" in response.json()["error"]["message"]


def test_an_image_part_gets_a_clear_400(client):
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(openai.BadRequestError, match="image_url content parts are not supported: the served model takes text only"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=4)
    text_parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}], max_tokens=8, **GREEDY
    )
    assert text_parts.choices[0].message.content == client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, **GREEDY
    ).choices[0].message.content


def test_prompt_plus_max_tokens_beyond_the_context_is_a_400(server, client):
    prompt = "Hello, my name is"
    num_prompt = len(server.engine.tokenizer(prompt).input_ids)
    room = server.engine.max_model_len - num_prompt
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=room, **GREEDY,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == room
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256 tokens") as error:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=room + 1)
    assert f"({num_prompt} in the prompt, {room + 1} in the completion)" in str(error.value)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=300)


# ------------------------------------------------------------------- usage
def test_continuous_usage_stats_put_usage_in_every_chunk(server, client):
    for create, kwargs in (
        (client.completions.create, {"prompt": "The capital of France is"}),
        (client.chat.completions.create, {"messages": [{"role": "user", "content": "Name a colour."}]}),
    ):
        chunks = list(create(model="tiny", max_tokens=10, stream=True, **GREEDY, extra_body={"ignore_eos": True},
                             stream_options={"include_usage": True, "continuous_usage_stats": True}, **kwargs))
        assert all(chunk.usage is not None for chunk in chunks)
        final = chunks[-1].usage
        assert final.completion_tokens == 10 and chunks[-1].choices == []
        counts = [chunk.usage.completion_tokens for chunk in chunks]
        assert counts == sorted(counts) and counts[-2] == 10
        assert {chunk.usage.prompt_tokens for chunk in chunks} == {final.prompt_tokens}
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


# ------------------------------------------------------------ constraints
def test_response_format_json_schema_and_parse(client):
    class Verdict(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        answer: bool
        colour: str = pydantic.Field(pattern="^(red|green)$")

    parsed = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Is the sky blue?"}], response_format=Verdict, max_tokens=40, **GREEDY
    )
    assert isinstance(parsed.choices[0].message.parsed, Verdict)
    schema_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=40,
                                           response_format=schema_format, **GREEDY)
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=40,
                                                  response_format=schema_format, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    as_object = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=60,
                                               response_format={"type": "json_object"}, temperature=0.7, seed=1)
    if as_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(as_object.choices[0].message.content), dict)
    else:
        assert as_object.choices[0].message.content.startswith("{")
    text = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          response_format={"type": "text"}, **GREEDY)
    assert text.choices[0].message.content == client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, **GREEDY).choices[0].message.content


@pytest.mark.parametrize("extra, check", [
    ({"guided_json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
    ({"guided_regex": r"[0-9]{2}-[xyz]{3}"}, lambda text: len(text) == 6 and text[2] == "-" or pytest.fail(text)),
    ({"guided_choice": ["Paris", "Rome", "Madrid"]}, lambda text: text in ("Paris", "Rome", "Madrid") or pytest.fail(text)),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda text: text in ("yes", "no") or pytest.fail(text)),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda text: text in ("up", "down") or pytest.fail(text)),
])
def test_vllm_guided_fields_constrain_completions(client, extra, check):
    for temperature in (0.0, 0.9):
        out = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=40,
                                        temperature=temperature, seed=5, extra_body=extra)
        assert out.choices[0].finish_reason == "stop"
        check(out.choices[0].text)


def test_bad_constraints_are_400s_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="guided_regex") as error:
        client.completions.create(model="tiny", prompt="x", extra_body={"guided_regex": "[a"})
    assert error.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError, match="at most one output constraint"):
        client.completions.create(model="tiny", prompt="x", extra_body={"guided_regex": "a", "guided_choice": ["b"]})


def test_a_grammar_with_speculation_gives_the_plain_servers_output(tiny_llama_dir, client):
    kwargs = {"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 40, **GREEDY, "extra_body": {"guided_json": SCHEMA}}
    expected = client.completions.create(**kwargs).choices[0].text
    with live_server(tiny_llama_dir, proposer=RepeatLastToken()) as spec_server:
        spec_server.engine.spec_control.always_speculate = True
        spec_client = openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key="none", max_retries=0)
        assert spec_client.completions.create(**kwargs).choices[0].text == expected
        assert spec_server.engine.spec_stats.num_steps > 0


# ------------------------------------------------------------------ logit_bias
def test_logit_bias_through_the_client(server, client):
    favoured = server.engine.tokenizer.encode(" Paris")[0]
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, logit_bias={str(favoured): 100}, **GREEDY)
    assert out.choices[0].text == server.engine.tokenizer.decode([favoured] * 6)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny", prompt="Hello", logit_bias={"5": 1000})


# ------------------------------------------------------------------- echo
def test_echo_with_logprobs_equals_the_offline_prompt_logprobs(tiny_llama_dir, server, client):
    prompt = "The capital of France is Paris"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, logprobs=1, echo=True, **GREEDY)
    choice = out.choices[0]
    offline = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32").generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, prompt_logprobs=1), use_tqdm=False)[0]
    prompt_ids = offline.prompt_token_ids
    assert choice.text == prompt + offline.outputs[0].text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 1
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [entry[token].logprob for token, entry in zip(prompt_ids[1:], offline.prompt_logprobs[1:])]
    assert logprobs.token_logprobs[1:len(prompt_ids)] == pytest.approx(expected, abs=1e-5)
    assert logprobs.token_logprobs[-1] == pytest.approx(offline.outputs[0].logprobs[0][offline.outputs[0].token_ids[0]].logprob, abs=1e-5)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed if c.choices).startswith(prompt)


# ----------------------------------------------------------------- metrics
def test_metrics_are_also_under_vllms_names(tiny_llama_dir):
    with live_server(tiny_llama_dir, proposer=RepeatLastToken()) as spec_server:
        client = openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key="none", max_retries=0)
        for prompt in ("Hello", "The capital of"):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=6, **GREEDY, extra_body={"ignore_eos": True})
        samples = metric_samples(spec_server.base_url)
        stats = spec_server.engine.spec_stats
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_count",
                 "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total", "prefix_cache_queries_total",
                 "request_prompt_tokens_sum", "request_generation_tokens_sum", "request_queue_time_seconds_count"):
        assert samples["vllm:" + name] == samples["hetero:" + name], name
    assert samples["vllm:generation_tokens_total"] == 12 and samples["vllm:request_success_total"] == 2
    assert samples["vllm:request_generation_tokens_sum"] == 12 and samples["vllm:request_generation_tokens_count"] == 2
    assert samples["vllm:request_prompt_tokens_sum"] == samples["vllm:prompt_tokens_total"]
    assert samples["vllm:request_queue_time_seconds_count"] == 2
    assert samples["vllm:spec_decode_num_drafts_total"] == stats.num_steps > 0
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
