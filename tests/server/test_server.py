"""`hetero serve`'s HTTP layer, live on loopback with the tiny model and the official client."""
from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hetero.core.protocols import Proposer, TokenTree
from server_helpers import live_server, wait_until

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with live_server(tiny_llama_dir, api_key=API_KEY) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def metric_samples(base_url: str) -> defaultdict[str, float]:
    """Sample name -> value summed over label sets (0 if absent), parsed by prometheus_client."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    samples: defaultdict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] += sample.value
    return samples


def assert_openai_error(response: httpx.Response, status: int, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


# ------------------------------------------------------------ the OpenAI client
def test_completion_stream_equals_non_stream_and_usage_is_right(server, client):
    prompt = "The capital of France is"
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, **GREEDY)
    chunks = list(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    prompt_tokens = len(server.engine.tokenizer(prompt).input_ids)
    assert whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == prompt_tokens + 12
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_stream_equals_non_stream(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, **GREEDY)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10
    assert chunks[-1].usage == whole.usage


def test_stop_string_is_cut_the_same_way_when_streamed(client):
    prompt = "Once upon a time"
    text = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, **GREEDY).choices[0].text
    stop = text[5:8]
    assert stop.strip(), "the tiny model's text should have printable characters here"
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, stop=[stop], **GREEDY)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, stop=[stop], stream=True, **GREEDY
        )
    )
    assert whole.choices[0].text == text[: text.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    assert streamed == whole.choices[0].text


def test_n_seed_and_logprobs(client):
    args = dict(model="tiny", prompt="Hello", max_tokens=6, n=2, temperature=1.0, seed=7, logprobs=2)
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    for choice in first.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert all(value <= 0 for value in lp.token_logprobs)
        assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    assert first.usage.completion_tokens == 12

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(item.top_logprobs) == 3 for item in content)
    assert all(item.logprob == item.top_logprobs[0].logprob for item in content)  # greedy picks the top token


def test_batch_of_prompts_and_token_id_prompts(server, client):
    ids = server.engine.tokenizer("Hello there").input_ids
    out = client.completions.create(model="tiny", prompt=["Hello there", "Bye"], max_tokens=3, **GREEDY)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=3, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert by_ids.choices[0].text == out.choices[0].text
    assert out.usage.completion_tokens == 6


def test_models_tokenize_detokenize_version_health(server):
    models = httpx.get(server.base_url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello there"}, headers=AUTH).json()
    assert tokens["tokens"] == server.engine.tokenizer("Hello there").input_ids
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH).json()
    assert text["prompt"] == "Hello there"
    assert httpx.get(server.base_url + "/version").json()["version"]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_one_model_is_retrieved_as_openais_client_reads_it(server, client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("org/other-model")


# ------------------------------------------------------------------- auth
def test_api_key_is_enforced_on_v1_only(server):
    url = server.base_url + "/v1/completions"
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
    assert_openai_error(httpx.post(url, json=body), 401)
    assert_openai_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(httpx.get(server.base_url + "/v1/models"), 401)
    assert httpx.post(url, json=body, headers=AUTH).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.base_url + "/health").status_code == 200


# -------------------------------------------------------------- bad input
BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "Hi",', 400, None),
    ("body not an object", "/v1/completions", [1, 2], 400, None),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("unknown field", "/v1/completions", {"prompt": "Hi", "temprature": 0.5}, 400, "temprature"),
    ("wrong type", "/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("bad temperature", "/v1/completions", {"prompt": "Hi", "temperature": 7}, 400, "temperature"),
    ("bad top_p", "/v1/completions", {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ("greedy n > 1", "/v1/completions", {"prompt": "Hi", "temperature": 0, "n": 2}, 400, "n"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "Hi"}, 404, "model"),
    ("prompt over max_model_len", "/v1/completions", {"prompt": "word " * 400}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("out-of-vocab token ids", "/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("stream_options without stream", "/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, None),
    ("chat without messages", "/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("chat bad max_completion_tokens", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, 400, None),
    ("chat image content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, None),
    ("chat prompt over max_model_len", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
]


@pytest.mark.parametrize("path, body, status, param", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_its_4xx_and_the_server_keeps_serving(server, path, body, status, param):
    url = server.base_url + path
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={**AUTH, "Content-Type": "application/json"})
    else:
        response = httpx.post(url, json=body, headers=AUTH)
    assert_openai_error(response, status, param)
    ok = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert not server.engine.has_unfinished_requests()


def test_a_bad_request_does_not_disturb_one_in_flight(server):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as http:
            good = asyncio.create_task(http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True}))
            bad = [await http.post("/v1/completions", json={"prompt": "word " * 400}) for _ in range(3)]
            return await good, bad

    good, bad = asyncio.run(scenario())
    assert all(r.status_code == 400 for r in bad)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 24


# ------------------------------------------------------------- disconnects
@pytest.fixture
def slow_steps(server, monkeypatch):
    """Make every engine step take >= 20 ms so a long request is surely still running."""
    import time

    engine = server.engine
    real_step = engine.step

    def slow_step():
        time.sleep(0.02)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    return engine


def _kv_all_free(engine) -> bool:
    allocator = engine.scheduler.allocator
    return not engine.has_unfinished_requests() and allocator.num_free == allocator.num_blocks


def test_client_disconnect_mid_stream_aborts_and_frees_kv(server, slow_steps):
    engine = slow_steps
    before = metric_samples(server.base_url)
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=30) as response:
        received = []
        for line in response.iter_lines():
            if line.startswith("data: {"):
                received.append(line)
            if len(received) == 3:
                break
        assert len(received) == 3
        assert engine.has_unfinished_requests()
        assert engine.scheduler.allocator.num_free < engine.scheduler.allocator.num_blocks
    assert wait_until(lambda: _kv_all_free(engine)), "the aborted request's KV blocks were not freed"
    after = metric_samples(server.base_url)
    assert after["hetero:request_success_total"] == before["hetero:request_success_total"]
    assert after["hetero:generation_tokens_total"] - before["hetero:generation_tokens_total"] < 200


def test_client_giving_up_on_a_non_streaming_request_aborts_it(server, slow_steps):
    engine = slow_steps
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(30, read=0.5))
    assert wait_until(lambda: _kv_all_free(engine)), "the abandoned request's KV blocks were not freed"


# ------------------------------------------------------------------- load
def test_200_concurrent_streams_lose_nothing(server):
    before = metric_samples(server.base_url)
    num_requests, max_tokens = 200, 4

    async def one(http: httpx.AsyncClient, i: int) -> tuple[list[str], list[dict]]:
        body = {"prompt": f"Request {i}: hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        return lines, events

    async def run_all():
        limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=num_requests)
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(num_requests))), timeout=80)

    results = asyncio.run(run_all())
    assert len(results) == num_requests
    ids = set()
    for lines, events in results:
        assert lines[-1] == "data: [DONE]"
        assert not any("error" in e for e in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        ids.add(events[0]["id"])
    assert len(ids) == num_requests
    after = metric_samples(server.base_url)
    assert after["hetero:request_success_total"] - before["hetero:request_success_total"] == num_requests
    assert after["hetero:generation_tokens_total"] - before["hetero:generation_tokens_total"] == num_requests * max_tokens
    assert wait_until(lambda: _kv_all_free(server.engine))


# ---------------------------------------------------------------- metrics
class RepeatLastToken(Proposer):
    """A proposer that drafts the last token again: cheap, deterministic, sometimes right."""

    def propose(self, batch):
        return [TokenTree.chain([r.token_ids[-1]] * min(2, r.max_nodes)) if r.max_nodes else TokenTree.empty() for r in batch]

    def commit(self, verdicts):
        pass

    def release(self, request_id):
        pass


def test_metrics_parse_and_match_what_was_served(tiny_llama_dir):
    with live_server(tiny_llama_dir, proposer=RepeatLastToken()) as spec_server:
        client = openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key="none", max_retries=0)
        usages = [
            client.completions.create(model="tiny", prompt=p, max_tokens=8, **GREEDY).usage
            for p in ("Hello", "The capital of", "def add(a, b):")
        ]
        samples = metric_samples(spec_server.base_url)
        stats = spec_server.engine.spec_stats
        draft_wait = spec_server.engine.draft_wait_seconds
    assert samples["hetero:request_success_total"] == 3
    assert samples["hetero:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert samples["hetero:generation_tokens_total"] == sum(u.completion_tokens for u in usages) == 24
    assert samples["hetero:time_to_first_token_seconds_count"] == 3
    assert samples["hetero:e2e_request_latency_seconds_count"] == 3
    assert samples["hetero:time_per_output_token_seconds_count"] == 3
    assert samples["hetero:num_requests_running"] == 0 and samples["hetero:num_requests_waiting"] == 0
    assert samples["hetero:kv_cache_usage_perc"] == 0
    assert stats.num_draft_tokens > 0
    assert samples["hetero:spec_decode_num_steps_total"] == stats.num_steps
    assert samples["hetero:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert samples["hetero:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    assert samples["hetero:spec_decode_mean_acceptance_length"] == pytest.approx(stats.mean_accepted_length)
    assert samples["hetero:spec_decode_draft_wait_seconds_total"] == pytest.approx(draft_wait) and draft_wait > 0
    assert not any(name.startswith(("hetero:cpu_draft", "vllm:cpu_draft", "vllm:spec_decode_draft_wait")) for name in samples)
    assert np.isfinite(samples["hetero:prefix_cache_hit_rate"])
