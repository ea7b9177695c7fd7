"""AsyncLLMEngine: the engine thread, error containment, crash and shutdown behaviour."""
from __future__ import annotations

import asyncio
import threading

import pytest

from hetero.async_engine import AsyncLLMEngine, EngineDeadError, EngineShutdownError
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine
from hetero.core.sampling_params import SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def final_output(async_engine, prompt, params, request_id):
    last = None
    async for output in async_engine.generate(prompt, params, request_id):
        last = output
    return last


def kv_all_free(engine) -> bool:
    allocator = engine.scheduler.allocator
    return allocator.num_free == allocator.num_blocks


def test_steps_run_off_the_event_loop_thread_and_match_the_sync_engine(engine, tiny_llama_dir):
    step_threads = set()
    real_step = engine.step

    def recording_step():
        step_threads.add(threading.get_ident())
        return real_step()

    engine.step = recording_step
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def scenario():
        outs = await asyncio.gather(*(final_output(async_engine, p, SHORT, str(i)) for i, p in enumerate(["Hello", "Bye"])))
        await async_engine.shutdown()
        return outs, threading.get_ident()

    outs, loop_thread = run(scenario())
    assert step_threads and loop_thread not in step_threads
    reference = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256))
    for i, prompt in enumerate(["Hello", "Bye"]):
        reference.add_request(str(i), prompt, SHORT)
    expected = {}
    while reference.has_unfinished_requests():
        for out in reference.step():
            expected[out.request_id] = out.outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in outs] == [expected["0"], expected["1"]]


def test_add_request_error_reaches_only_its_caller(engine):
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def scenario():
        good = asyncio.create_task(final_output(async_engine, "Hello", SHORT, "good"))
        with pytest.raises(ValueError, match="max_model_len"):
            await final_output(async_engine, "word " * 400, SHORT, "bad")
        with pytest.raises(ValueError, match="empty"):
            await final_output(async_engine, "", SHORT, "empty")
        result = await good
        await async_engine.shutdown()
        return result

    result = run(scenario())
    assert result.finished and len(result.outputs[0].token_ids) == 5
    assert kv_all_free(engine)


def test_breaking_out_of_a_stream_aborts_the_request(engine):
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def scenario():
        async for output in async_engine.generate("Hello", LONG, "r"):
            if len(output.outputs[0].token_ids) >= 2:
                break
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        await async_engine.shutdown()

    run(scenario())
    assert not engine.has_unfinished_requests() and kv_all_free(engine)


def test_a_crash_inside_step_fails_in_flight_requests_and_later_ones(engine):
    real_step = engine.step
    calls = []

    def crashing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom: kernel fault")
        return real_step()

    engine.step = crashing_step
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def scenario():
        results = await asyncio.gather(
            *(final_output(async_engine, "Hello", LONG, f"r{i}") for i in range(3)), return_exceptions=True
        )
        with pytest.raises(EngineDeadError, match="boom"):
            await final_output(async_engine, "Hello", SHORT, "late")
        return results

    results = run(scenario())
    assert all(isinstance(r, EngineDeadError) and "boom" in str(r) for r in results)
    assert not async_engine.is_running and isinstance(async_engine.dead_error, RuntimeError)


def test_a_crash_outside_step_also_fails_in_flight_requests(engine):
    """An abort that raises (a proposer's release, say) must not leave waiters hanging."""
    def crashing_abort(request_id):
        raise RuntimeError("boom: release failed")

    engine.abort_request = crashing_abort
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def scenario():
        survivor = asyncio.ensure_future(final_output(async_engine, "Hello", LONG, "kept"))
        stream = async_engine.generate("Hello", LONG, "dropped")
        await stream.__anext__()
        await stream.aclose()  # aborts "dropped": the abort raises inside the engine thread
        return await asyncio.wait_for(asyncio.gather(survivor, return_exceptions=True), timeout=30)

    (result,) = run(scenario())
    assert isinstance(result, EngineDeadError) and "release failed" in str(result)
    assert isinstance(async_engine.dead_error, RuntimeError)


def test_shutdown_lets_in_flight_work_finish_then_refuses_new_work(engine):
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def scenario():
        running = asyncio.create_task(final_output(async_engine, "Hello", SHORT, "r"))
        await asyncio.sleep(0)
        await async_engine.shutdown(drain_timeout=30)
        finished = await running
        with pytest.raises(EngineShutdownError):
            await final_output(async_engine, "Hello", SHORT, "late")
        return finished

    assert run(scenario()).finished
    assert kv_all_free(engine)


def test_shutdown_past_its_drain_timeout_fails_what_is_left(engine):
    real_step = engine.step

    def slow_step():
        threading.Event().wait(0.01)
        return real_step()

    engine.step = slow_step
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def scenario():
        running = asyncio.create_task(final_output(async_engine, "Hello", LONG, "r"))
        while not engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        await async_engine.shutdown(drain_timeout=0.1)
        with pytest.raises(EngineShutdownError, match="shutting down"):
            await running

    run(scenario())
    assert not engine.has_unfinished_requests() and kv_all_free(engine)


def test_a_steps_outputs_reach_the_event_loop_in_one_hand_over(engine):
    """Each thread-safe call wakes the loop through its self-pipe: one per step, not one per request."""
    steps, outputs_per_step = [], []
    real_step = engine.step

    def recording_step():
        outputs = real_step()
        outputs_per_step.append(len(outputs))
        return outputs

    engine.step = recording_step
    async_engine = AsyncLLMEngine(engine)

    async def scenario():
        loop = asyncio.get_running_loop()
        real_call = loop.call_soon_threadsafe

        def counting_call(callback, *args, **kwargs):
            if threading.current_thread() is async_engine._thread and callback.__name__ == "_put_all":
                steps.append(callback)
            return real_call(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting_call
        async_engine.start()
        outs = await asyncio.gather(*(final_output(async_engine, f"p{i}", SHORT, str(i)) for i in range(4)))
        await async_engine.shutdown()
        return outs

    outs = run(scenario())
    assert all(o.finished for o in outs)
    busy = [n for n in outputs_per_step if n]
    assert max(busy) == 4 and len(steps) == len(busy)
