"""`AsyncLLMEngine`: the engine loop on its own thread, requests as async streams.

`LLMEngine` is not thread-safe and `step()` blocks for a whole forward pass, so one
dedicated thread owns the engine: it applies queued commands (add, abort, stop), runs
`step()` while there is work, and hands each `RequestOutput` to the asyncio loop of the
caller that is waiting for it. The event loop never waits on a step.

Failure containment:
- `add_request` errors (bad prompt, ...) are raised in the one caller that sent them.
- A caller that stops iterating (client disconnect, cancellation) aborts its request,
  which frees its KV blocks on the engine thread.
- An exception inside `step()` leaves the engine in an unknown state: every in-flight
  request fails with `EngineDeadError` and later requests are refused with it too.
- `shutdown()` refuses new work, lets in-flight requests finish for a while, then fails
  what is left with `EngineShutdownError`.

Text prompts are tokenised in the caller's coroutine on a small thread pool before they
reach the engine thread, so a long prompt stalls neither the event loop nor the other
requests' steps.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Protocol, TypeVar, Union

from hetero.engine import LLMEngine
from hetero.metrics import EngineSnapshot, snapshot_engine
from hetero.outputs import RequestOutput
from hetero.core.sampling_params import SamplingParams

logger = logging.getLogger("hetero")

TOKENIZER_THREADS = 2  # threads that tokenise prompts beside the event loop and the engine thread
Result = TypeVar("Result")


class EngineDeadError(RuntimeError):
    """The engine loop crashed; nothing more can be served."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and no longer takes or finishes requests."""


class EngineObserver(Protocol):
    """Told about the engine from the engine thread (the metrics implement this)."""

    def on_snapshot(self, snapshot: EngineSnapshot) -> None: ...

    def on_request_finished(self, output: RequestOutput) -> None: ...


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    arrival_time: float
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    reason: str


_Command = Union[_Add, _Abort, _Stop]


class _Channel:
    """Outputs of one request, handed from the engine thread to the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.added: concurrent.futures.Future = concurrent.futures.Future()
        self._queue: asyncio.Queue[Union[RequestOutput, BaseException]] = asyncio.Queue()

    def put(self, item: Union[RequestOutput, BaseException]) -> None:
        """Thread-safe; a stream whose loop has closed is silently dropped."""
        _hand_over(self._loop, [(self, item)])

    async def get(self) -> Union[RequestOutput, BaseException]:
        return await self._queue.get()


def _hand_over(loop: asyncio.AbstractEventLoop, items: list[tuple[_Channel, Union[RequestOutput, BaseException]]]) -> None:
    """Put items into their channels' queues on ``loop`` with one thread-safe call (each
    costs the loop a wake-up through its self-pipe); dropped if the loop has closed."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:
        pass


def _put_all(items: list[tuple[_Channel, Union[RequestOutput, BaseException]]]) -> None:
    for channel, item in items:
        channel._queue.put_nowait(item)


class RequestStream:
    """The outputs of one submitted request. Iterate it once; `close()` aborts it if unfinished.

    Iteration ends after the `finished` output, or raises the engine's error. Leaving the
    iteration early (break, cancellation, client disconnect) closes the stream.
    """

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, channel: _Channel):
        self.request_id = request_id
        self._engine = engine
        self._channel = channel
        self._done = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self._done:
                item = await self._channel.get()
                if isinstance(item, BaseException):
                    self._done = True
                    self._engine._release(self.request_id, abort=False)
                    raise item
                if item.finished:
                    self._done = True
                    self._engine._release(self.request_id, abort=False)
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it already finished or failed (idempotent)."""
        if not self._done:
            self._done = True
            self._engine._release(self.request_id, abort=True)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, observer: Optional[EngineObserver] = None):
        self.engine = engine
        self._observer = observer
        self._commands: "queue.SimpleQueue[_Command]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Channel] = {}
        self._streams_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hetero-engine", daemon=True)
        self._accepting = True
        self._dead: Optional[BaseException] = None
        self._closed: Optional[BaseException] = None  # set once the engine thread has exited
        self._ids = itertools.count()
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="hetero-tokenizer")
        self.snapshot = snapshot_engine(engine)

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def dead_error(self) -> Optional[BaseException]:
        return self._dead

    @property
    def num_in_flight(self) -> int:
        with self._streams_lock:
            return len(self._streams)

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Refuse new requests, wait up to `drain_timeout` s for in-flight ones, fail the rest."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self.num_in_flight and self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._send(_Stop("the server is shutting down; the request was aborted"))
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ tokenizing
    async def run_in_tokenizer_pool(self, fn: Callable[..., Result], *args: Any) -> Result:
        """`fn(*args)` on the tokenizer threads: neither the event loop nor the engine thread waits on it."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, functools.partial(fn, *args))

    async def encode_prompt(self, prompt: Any, add_special_tokens: bool = True) -> Any:
        """A text prompt as {"prompt", "prompt_token_ids"}, tokenised on the tokenizer threads as
        `LLMEngine.add_request` would; any other prompt unchanged (the engine validates it)."""
        text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else prompt
        tokenizer = self.engine.tokenizer
        if not isinstance(text, str) or tokenizer is None:
            return prompt
        token_ids = await self.run_in_tokenizer_pool(
            lambda: list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        )
        return {"prompt": text, "prompt_token_ids": token_ids}

    # -------------------------------------------------------------- requests
    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns():x}"

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> "RequestStream":
        """Submit a request; its outputs are read from the returned stream.

        Raises here, to this caller only, what `LLMEngine.add_request` raises (ValueError
        for a bad prompt), and EngineDeadError / EngineShutdownError when the engine
        cannot serve. Cancelling this call aborts the request.
        """
        channel = _Channel(asyncio.get_running_loop())
        with self._streams_lock:
            self._check_serving()
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = channel
        stream = RequestStream(self, request_id, channel)
        try:
            prompt = await self.encode_prompt(prompt)  # in flight meanwhile: shutdown waits for it
            self._send(_Add(request_id, prompt, params, time.time(), channel.added))
            await asyncio.wrap_future(channel.added)
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request, the last one `finished`; leaving early aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def _release(self, request_id: str, abort: bool) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)
        if abort:
            self._send(_Abort(request_id))

    def _check_serving(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop crashed earlier: {self._dead!r}") from self._dead
        if not self._accepting or self._closed is not None:
            raise EngineShutdownError("the server is shutting down and takes no new requests")
        if not self._thread.is_alive():
            raise EngineShutdownError("the engine has not been started")

    def _send(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - any crash must fail the waiters, not hang them
            logger.exception("the engine thread failed; failing all in-flight requests")
            self._dead = exc
            error = EngineDeadError(f"the engine failed: {exc!r}")
            error.__cause__ = exc
            self._fail_all(error, abort=False)

    def _loop(self) -> None:
        """Apply commands, step, deliver; returns on a stop command. Any exception ends the engine."""
        engine = self.engine
        while True:
            stop = self._apply_commands()
            if stop is not None:
                self._fail_all(EngineShutdownError(stop.reason), abort=True)
                self._publish_snapshot()
                return
            if not engine.has_unfinished_requests():
                self._publish_snapshot()
                self._wake.wait()
                self._wake.clear()
                continue
            self._deliver(engine.step())
            self._publish_snapshot()

    def _apply_commands(self) -> Optional[_Stop]:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return None
            if isinstance(command, _Stop):
                return command
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
            else:
                self._add(command)

    def _add(self, command: _Add) -> None:
        if not command.done.set_running_or_notify_cancel():
            return
        with self._streams_lock:
            wanted = command.request_id in self._streams
        if not wanted:  # the caller went away before its request reached the engine
            command.done.set_result(None)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time)
        except Exception as exc:  # noqa: BLE001 - reported to that caller only
            command.done.set_exception(exc)
            return
        command.done.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams, in one hand-over per event loop."""
        with self._streams_lock:
            streams = [self._streams.get(output.request_id) for output in outputs]
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output, stream in zip(outputs, streams):
            if output.finished and self._observer is not None:
                self._observer.on_request_finished(output)
            if stream is not None:
                by_loop.setdefault(stream._loop, []).append((stream, output))
            elif not output.finished:
                self.engine.abort_request(output.request_id)
        for loop, items in by_loop.items():
            _hand_over(loop, items)

    def _fail_all(self, error: BaseException, abort: bool) -> None:
        """Close the engine to new requests and fail every registered one, added or not."""
        with self._streams_lock:
            self._closed = error
            streams = dict(self._streams)
        for request_id, stream in streams.items():
            if abort:
                self.engine.abort_request(request_id)
            if stream.added.done():
                stream.put(error)
            elif stream.added.set_running_or_notify_cancel():
                stream.added.set_exception(error)

    def _publish_snapshot(self) -> None:
        self.snapshot = snapshot_engine(self.engine)
        if self._observer is not None:
            self._observer.on_snapshot(self.snapshot)
