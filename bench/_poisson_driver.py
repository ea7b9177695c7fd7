"""Requests into an in-process engine at Poisson arrival times, each timed as a server's client would.

`bench.serve` measures an endpoint over HTTP; this measures the engine itself, on this
thread: before each step, every request whose arrival time has come is added (a server's
engine thread, too, takes new requests only between steps), and each step's outputs are
stamped when the step returns. TTFT runs from a request's arrival time, so the time it
waited behind a running step or in the scheduler's queue counts. HTTP, JSON and
detokenising are left out (their cost per chunk is `bench.serve`'s to measure).

The records are `bench._stats.RequestRecord`s, so `summarize` and the cost report read
them as they read `hetero-bench-serve` results.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

from bench._stats import RequestRecord
from hetero.core.sampling_params import RequestOutputKind, SamplingParams


def greedy_params(max_tokens: int) -> SamplingParams:
    """Every request generates exactly `max_tokens` greedy tokens, streamed step by step."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.CUMULATIVE)


def drive(engine, prompts: Sequence[dict], max_tokens: int, offsets: Sequence[float], tag: str = "req",
          clock: Callable[[], float] = time.perf_counter,
          sleep: Callable[[float], None] = time.sleep) -> tuple[list[RequestRecord], float]:
    """Send `prompts[i]` (``{"prompt_token_ids": [...]}``) at `offsets[i]` seconds after the start and
    step the engine until every request is done: (one record per prompt, in prompt order;
    seconds from the start to the last output)."""
    if len(prompts) != len(offsets):
        raise ValueError(f"{len(prompts)} prompts but {len(offsets)} arrival offsets")
    order = sorted(range(len(prompts)), key=lambda i: offsets[i])
    records = [RequestRecord(success=False, prompt_tokens=len(p["prompt_token_ids"]), start=offsets[i],
                             usage_reported=True) for i, p in enumerate(prompts)]
    index_of: dict[str, int] = {}
    emitted = [0] * len(prompts)
    last_output = [0.0] * len(prompts)
    params = greedy_params(max_tokens)
    sent = 0
    start = clock()
    while sent < len(order) or engine.has_unfinished_requests():
        now = clock() - start
        while sent < len(order) and offsets[order[sent]] <= now:
            i = order[sent]
            request_id = f"{tag}-{i}"
            engine.add_request(request_id, prompts[i], params)
            index_of[request_id] = i
            sent += 1
        if not engine.has_unfinished_requests():
            sleep(max(0.0, offsets[order[sent]] - (clock() - start)))
            continue
        outputs = engine.step()
        stamp = clock() - start
        for output in outputs:
            i = index_of[output.request_id]
            record, tokens = records[i], len(output.outputs[0].token_ids)
            if tokens > emitted[i]:
                if record.ttft is None:
                    record.ttft = stamp - offsets[i]
                else:
                    record.itl.append(stamp - last_output[i])
                emitted[i], last_output[i] = tokens, stamp
            if output.finished:
                record.success, record.output_tokens, record.e2e = True, tokens, stamp - offsets[i]
    return records, clock() - start
