"""`hetero serve` under hostile or oversized requests (issue #28): caps, 400/413 in OpenAI's
shape, fair admission, tokenising off the event loop, auth on every tokenizer route, and
nothing left behind after SIGTERM with a draft worker."""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import httpx
import pytest

from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine
from hetero.core.sampling_params import SamplingParams
from hetero.scheduler import SeqStatus
from hetero.server.errors import APIError
from hetero.server.limits import MAX_JSON_DEPTH, RequestLimits, check_sampling, longest_token_chars
from hetero.server.startup import engine_summary, is_loopback, log_startup
from server_helpers import free_port, live_server, wait_until

API_KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_SEQS = 4
BODY_LIMIT = 256 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    limits = RequestLimits(max_seqs_per_request=MAX_SEQS, max_request_body_bytes=BODY_LIMIT)
    with live_server(tiny_llama_dir, api_key=API_KEY, settings={"limits": limits}) as live:
        yield live


def post(server, path, body, headers=AUTH):
    if isinstance(body, (bytes, str)):
        return httpx.post(server.base_url + path, content=body, headers={**headers, "Content-Type": "application/json"}, timeout=60)
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def assert_openai_error(response: httpx.Response, status: int, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_still_serving(server) -> None:
    ok = post(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert wait_until(lambda: not server.engine.has_unfinished_requests())


# ------------------------------------------------------------------ caps
def prompt_len(server, text: str) -> int:
    return len(server.engine.tokenizer(text).input_ids)


BAD = [
    ("chat top_logprobs over 20", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21, "max_tokens": 2}, "top_logprobs"),
    ("chat top_logprobs huge", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 1000000, "max_tokens": 64}, "top_logprobs"),
    ("completion logprobs over 20", COMPLETIONS, {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("completion logprobs -1 means the whole vocabulary", COMPLETIONS, {"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ("n over the cap", COMPLETIONS, {"prompt": "Hi", "n": MAX_SEQS + 1, "temperature": 1}, "n"),
    ("best_of over the cap", COMPLETIONS, {"prompt": "Hi", "n": 1, "best_of": 2000, "temperature": 1}, "best_of"),
    ("max_tokens a boolean", COMPLETIONS, {"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ("n a boolean", COMPLETIONS, {"prompt": "Hi", "n": True}, "n"),
    ("token ids with a boolean", COMPLETIONS, {"prompt": [1, True]}, "prompt"),
    ("chat max_tokens a boolean", CHAT, {"messages": HI, "max_tokens": False}, "max_tokens"),
    ("max_tokens beyond the context", COMPLETIONS, {"prompt": "Hi", "max_tokens": 10**12}, "max_tokens"),
    ("chat max_completion_tokens beyond the context", CHAT, {"messages": HI, "max_completion_tokens": 10**12}, "max_completion_tokens"),
    ("seed beyond int64", COMPLETIONS, {"prompt": "Hi", "seed": 2**70}, "seed"),
    ("seed below int64", COMPLETIONS, {"prompt": "Hi", "seed": -(2**63) - 1}, "seed"),
    ("unknown chat role", CHAT, {"messages": [{"role": "hacker", "content": "Hi"}]}, "messages.0.role"),
    ("unknown role on /tokenize", "/tokenize", {"messages": [{"role": "user", "content": "a"}, {"role": "root", "content": "b"}]},
     "messages.1.role"),
]


@pytest.mark.parametrize("path, body, param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_over_a_cap_is_a_400_naming_the_field(server, path, body, param):
    assert_openai_error(post(server, path, body), 400, param)
    assert_still_serving(server)


def test_at_the_caps_is_served(server):
    ok = post(server, CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 20, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert all(len(t["top_logprobs"]) == 20 for t in ok.json()["choices"][0]["logprobs"]["content"])
    ok = post(server, COMPLETIONS, {"prompt": "Hi", "n": 2, "best_of": MAX_SEQS, "temperature": 1, "max_tokens": 2, "seed": 2**63 - 1})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == 2


def test_prompt_plus_max_tokens_must_fit_the_context(server):
    room = server.engine.max_model_len - prompt_len(server, "Hello there")
    fits = post(server, COMPLETIONS, {"prompt": "Hello there", "max_tokens": room, "ignore_eos": True})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == room
    error = assert_openai_error(post(server, COMPLETIONS, {"prompt": "Hello there", "max_tokens": room + 1}), 400, "max_tokens")
    assert f"maximum context length is {server.engine.max_model_len} tokens" in error["message"]


def test_prompt_logprobs_are_capped_too():
    limits = RequestLimits(max_seqs_per_request=1)
    with pytest.raises(APIError) as caught:
        check_sampling(SamplingParams(prompt_logprobs=21), limits, vocab_size=100, logprobs_field="logprobs")
    assert caught.value.status == 400 and caught.value.param == "prompt_logprobs"
    check_sampling(SamplingParams(prompt_logprobs=20), limits, vocab_size=100, logprobs_field="logprobs")
    check_sampling(SamplingParams(logprobs=-1), RequestLimits(1, max_logprobs=-1), vocab_size=100, logprobs_field="logprobs")


# -------------------------------------------------------- hostile bodies
SURROGATE = [
    (COMPLETIONS, rb'{"prompt": "\ud800"}', "prompt"),
    (COMPLETIONS, rb'{"prompt": ["ok", "\udfff tail"]}', "prompt.1"),
    (CHAT, rb'{"messages": [{"role": "user", "content": "a\ud800"}]}', "messages.0.content"),
    ("/tokenize", rb'{"prompt": "\ud800"}', "prompt"),
]


@pytest.mark.parametrize("path, raw, param", SURROGATE)
def test_lone_surrogates_are_a_400(server, path, raw, param):
    assert_openai_error(post(server, path, raw), 400, param)
    assert_still_serving(server)


@pytest.mark.parametrize("path, raw", [
    (COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("/detokenize", b'{"tokens": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    (CHAT, b'{"messages": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}"),
], ids=["100000 deep", "5000 deep", "just over the depth limit"])
def test_deeply_nested_json_is_a_400(server, path, raw):
    assert_openai_error(post(server, path, raw), 400)
    assert_still_serving(server)


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    big = b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}'
    assert_openai_error(post(server, COMPLETIONS, big), 413)

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"a" * (BODY_LIMIT // 4)
        yield b'"}'

    chunked = httpx.post(server.base_url + COMPLETIONS, content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert "content-length" not in {k.lower() for k in chunked.request.headers}
    assert_openai_error(chunked, 413)
    assert_still_serving(server)


@pytest.fixture
def encode_calls(server, monkeypatch):
    """The text prompts the async engine tokenised during the test."""
    async_engine = server.app.state.async_engine
    calls = []
    real = async_engine.encode_prompt

    async def recording(prompt, *args):
        if isinstance(prompt, str):
            calls.append(prompt)
        return await real(prompt, *args)

    monkeypatch.setattr(async_engine, "encode_prompt", recording)
    return calls


def test_text_that_cannot_fit_the_context_is_refused_without_tokenizing(server, encode_calls):
    too_long = "a" * (longest_token_chars(server.engine.tokenizer) * server.engine.max_model_len + 1)
    assert_openai_error(post(server, COMPLETIONS, {"prompt": too_long}), 400, "prompt")
    assert_openai_error(post(server, "/tokenize", {"prompt": too_long}), 400, "prompt")
    assert_openai_error(post(server, CHAT, {"messages": [{"role": "user", "content": too_long}]}), 400, "messages")
    assert encode_calls == []
    assert post(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 1}).status_code == 200
    assert encode_calls == ["Hi"]


# ------------------------------------------------------------ tokenising
class GatedTokenizer:
    """The engine's tokenizer, recording the threads that encode, and holding texts that start with HOLD."""

    def __init__(self, real):
        self._real = real
        self.encode_threads: list[str] = []
        self.holding = threading.Event()
        self.release = threading.Event()

    def _record(self, text):
        self.encode_threads.append(threading.current_thread().name)
        if isinstance(text, str) and text.startswith("HOLD"):
            self.holding.set()
            assert self.release.wait(30)

    def __call__(self, text, *args, **kwargs):
        self._record(text)
        return self._real(text, *args, **kwargs)

    def encode(self, text, *args, **kwargs):
        self._record(text)
        return self._real.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture
def gated_tokenizer(server, monkeypatch):
    gated = GatedTokenizer(server.engine.tokenizer)
    monkeypatch.setattr(server.engine, "tokenizer", gated)
    yield gated
    gated.release.set()


def test_prompts_are_tokenised_on_the_tokenizer_threads(server, gated_tokenizer):
    assert post(server, COMPLETIONS, {"prompt": "Hello", "max_tokens": 1}).status_code == 200
    assert post(server, CHAT, {"messages": HI, "max_tokens": 1}).status_code == 200
    assert post(server, "/tokenize", {"prompt": "Hello"}).status_code == 200
    assert post(server, "/tokenize", {"messages": HI}).status_code == 200
    assert len(gated_tokenizer.encode_threads) == 4
    assert all(name.startswith("hetero-tokenizer") for name in gated_tokenizer.encode_threads), gated_tokenizer.encode_threads


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": "HOLD this prompt", "max_tokens": 1}),
    ("/tokenize", {"prompt": "HOLD this prompt"}),
])
def test_a_request_being_tokenised_stalls_nothing_else(server, gated_tokenizer, path, body):
    """While one prompt's tokenisation is held, a stream and the other endpoints still finish."""

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as http:
            held = asyncio.create_task(http.post(path, json=body))
            assert await asyncio.to_thread(gated_tokenizer.holding.wait, 30)
            stream_body = {"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True, "stream": True}
            async with http.stream("POST", COMPLETIONS, json=stream_body) as response:
                lines = [line async for line in response.aiter_lines() if line]
            health = await http.get("/health")
            finished_first = not held.done()
            gated_tokenizer.release.set()
            return finished_first, lines, health, await held

    finished_first, lines, health, held = asyncio.run(scenario())
    assert finished_first, "the held request finished before the others"
    assert lines[-1] == "data: [DONE]" and health.status_code == 200
    assert held.status_code == 200


# ------------------------------------------------------------ fair admission
def test_a_big_n_request_takes_turns_with_a_later_one(tiny_llama_dir):
    """max_num_seqs 2: a 1-token request behind a request of 8 sequences is admitted at the
    first free slot, not after all 8 (which would leave it behind 6 finished ones)."""
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_llama_dir), dtype="float32", max_model_len=64, max_num_seqs=2))
    engine.add_request("big", "Hello", SamplingParams(n=8, temperature=1.0, max_tokens=4, ignore_eos=True, seed=1))
    engine.add_request("small", "Hi", SamplingParams(max_tokens=1, ignore_eos=True))
    small_done = big_done = None
    while engine.has_unfinished_requests():
        for group in engine.groups.values():
            assert group.num_running == sum(seq.status is SeqStatus.RUNNING for seq in group.seqs)
        for output in engine.step():
            if output.request_id == "small" and output.finished:
                small_done = sum(1 for s in engine.groups["big"].seqs if s.is_finished)
            if output.request_id == "big" and output.finished:
                big_done = len(output.outputs)
    assert big_done == 8
    assert small_done is not None and small_done <= 2, f"{small_done} of the big request's sequences finished first"


def test_over_http_the_small_request_finishes_before_the_big_one(tiny_llama_dir, monkeypatch):
    limits = RequestLimits(max_seqs_per_request=16)
    with live_server(tiny_llama_dir, settings={"limits": limits}, max_num_seqs=2) as live:
        async_engine = live.app.state.async_engine
        gate = threading.Event()
        real_step = live.engine.step

        def gated_step():  # no step runs until both requests are in
            assert gate.wait(30)
            return real_step()

        monkeypatch.setattr(live.engine, "step", gated_step)

        async def scenario():
            order = []
            async with httpx.AsyncClient(base_url=live.base_url, timeout=60) as http:
                async def send(name, body):
                    response = await http.post(COMPLETIONS, json=body)
                    assert response.status_code == 200, response.text
                    order.append(name)

                big = asyncio.create_task(send("big", {"prompt": "Hello", "n": 16, "temperature": 1, "max_tokens": 2, "ignore_eos": True}))
                assert await asyncio.to_thread(wait_until, lambda: async_engine.num_in_flight == 1)
                small = asyncio.create_task(send("small", {"prompt": "Hi", "max_tokens": 1}))
                assert await asyncio.to_thread(wait_until, lambda: async_engine.num_in_flight == 2)
                gate.set()
                await asyncio.gather(big, small)
            return order

        assert asyncio.run(scenario()) == ["small", "big"]


# ------------------------------------------------------------------ auth
def test_tokenizer_routes_need_the_key_and_docs_are_off(server):
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1, 2]})):
        assert_openai_error(post(server, path, body, headers={}), 401)
        assert post(server, path, body).status_code == 200
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.base_url + path, headers=AUTH).status_code == 404
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_without_a_key_the_docs_are_served(tiny_llama_dir):
    with live_server(tiny_llama_dir) as open_server:
        assert httpx.get(open_server.base_url + "/openapi.json").status_code == 200
        assert httpx.post(open_server.base_url + "/tokenize", json={"prompt": "Hi"}).status_code == 200


# ------------------------------------------------------------ start-up
def test_startup_log_states_dtype_kv_size_and_its_source_and_warns_when_open(server, caplog):
    summary = engine_summary(server.engine)
    assert "float32" in summary and re.search(r"KV cache [\d.]+ (MiB|GiB) \(\d+ tokens\)", summary), summary
    assert re.search(r"sized by (--max-num-seqs \d+ x --max-model-len 256|--kv-cache-space)", summary), summary
    with caplog.at_level(logging.INFO, logger="hetero.server"):
        log_startup(server.engine, "0.0.0.0", None)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--api-key" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hetero.server"):
        log_startup(server.engine, "127.0.0.1", None)
        log_startup(server.engine, "0.0.0.0", "key")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_serve_flags_set_the_limits(tiny_llama_dir):
    from hetero.cli import build_server_app, parse_serve_args

    base = ["serve", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "8"]
    default = build_server_app(parse_serve_args(base)).state.limits
    assert default == RequestLimits(max_seqs_per_request=8, max_logprobs=20, max_request_body_bytes=16 * 2**20)
    flags = ["--max-logprobs", "5", "--max-seqs-per-request", "3", "--max-request-body-bytes", "1000"]
    assert build_server_app(parse_serve_args(base + flags)).state.limits == RequestLimits(3, 5, 1000)
    with pytest.raises(ValueError, match="max_seqs_per_request"):
        build_server_app(parse_serve_args(base + ["--max-seqs-per-request", "0"]))


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")


# ------------------------------------------------------------ SIGTERM
def _ours(directory: str, pid: int) -> list[str]:
    return sorted(name for name in os.listdir(directory) if f"_pid{pid}_" in name)


@pytest.fixture
def socket_dir():
    """A short directory for the doorbell sockets (a Unix socket's path must fit 107 bytes)."""
    path = tempfile.mkdtemp(prefix="hetero-test-", dir="/tmp")
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_sigterm_with_a_draft_worker_leaves_no_segments_or_sockets(tiny_llama_dir, socket_dir):
    port = free_port()
    command = [
        sys.executable, "-m", "hetero.cli", "serve", str(tiny_llama_dir), "--speculative-model", str(tiny_llama_dir),
        "--cpu-draft-worker", "--num-speculative-tokens", "2", "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "128", "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", "5",
    ]
    env = {**os.environ, "TMPDIR": str(socket_dir), "HETERO_DRAFT_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def up() -> bool:
            assert process.poll() is None, process.stdout.read()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(up, timeout=120, interval=0.2)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert response.status_code == 200
        assert len(_ours("/dev/shm", process.pid)) == 2, "the draft worker's rings should exist while serving"
        assert len(_ours(str(socket_dir), process.pid)) == 4, "the doorbell sockets should exist while serving"
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "KV cache" in output
    assert _ours("/dev/shm", process.pid) == []
    assert _ours(str(socket_dir), process.pid) == []
