"""Prometheus metrics with vLLM's names, under the `hetero:` prefix and again under `vllm:`.

The `vllm:` copies let dashboards and clients written for vLLM (its Grafana board,
inference-perf, guidellm) read a hetero server unchanged; where vLLM's name differs
from ours (`spec_decode_num_drafts` for our verification steps) the copy takes vLLM's.

Two sources feed them, both from the engine thread:
- an `EngineSnapshot` after every step (queue gauges, KV usage, token and speculative
  totals), exposed through a collector that reads the latest snapshot at scrape time,
  so totals are never double-counted or torn;
- each finished request (success counter by finish reason, latency, queue-time and token-count histograms).

Every `ServerMetrics` owns its own `CollectorRegistry`, so several servers can live in
one process (tests do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hetero.outputs import RequestOutput
from hetero.proposers import draft_worker_stats

if TYPE_CHECKING:
    from hetero.engine import LLMEngine

PREFIX = "hetero:"
VLLM_PREFIX = "vllm:"
# Our metric name -> vLLM's, where they differ; metrics absent from vLLM get no vllm: copy.
_VLLM_NAMES = {"spec_decode_num_steps": "spec_decode_num_drafts"}
_NOT_IN_VLLM = {"prefix_cache_hit_rate", "spec_decode_mean_acceptance_length", "spec_decode_draft_wait_seconds",
                "spec_decode_unready_steps",
                "cpu_draft_hidden_seconds", "cpu_draft_exposed_seconds", "cpu_draft_predraft_hits", "cpu_draft_predraft_misses",
                "cpu_draft_worker_restarts", "cpu_draft_worker_faults", "cpu_draft_late_replies",
                "cpu_draft_ahead_seconds", "cpu_draft_ahead_levels"}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)  # vLLM's 1-2-5
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges and running totals at one instant."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries: int = 0  # tokens, as vLLM counts them
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0  # the CPU offload tier's, when there is one
    external_prefix_cache_hits: int = 0
    prefix_cache_offloaded_blocks: int = 0
    spec_num_steps: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_mean_accepted_length: float = 0.0
    spec_draft_wait_seconds: float = 0.0  # the engine's time waiting for the proposer's trees
    spec_unready_steps: int = 0  # steps whose proposal came back only pending (the proposer not ready yet)
    cpu_draft: Optional[dict] = None  # the CPU draft worker's counters (`draft_worker_stats`), when there is one

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def snapshot_engine(engine: "LLMEngine") -> EngineSnapshot:
    """Read the engine's counters; call it on the thread that runs the engine."""
    scheduler = engine.scheduler
    allocator = scheduler.allocator
    spec = engine.spec_stats
    running = {seq.group.request_id for seq in scheduler.running}  # requests, not sequences (n > 1)
    return EngineSnapshot(
        num_running=len(running),
        # Waiting for their prefix's copies from the CPU counts as waiting, as in vLLM.
        num_waiting=len({seq.group.request_id for seq in (*scheduler.waiting, *scheduler.restoring)} - running),
        kv_cache_usage=allocator.usage(),
        prompt_tokens_total=engine.num_prompt_tokens_total,
        generation_tokens_total=engine.num_generation_tokens_total,
        prefix_cache_queries=allocator.stats.queries,
        prefix_cache_hits=allocator.stats.hits,
        external_prefix_cache_queries=allocator.stats.external_queries,
        external_prefix_cache_hits=allocator.stats.external_hits,
        prefix_cache_offloaded_blocks=allocator.offload.num_offloaded if allocator.offload is not None else 0,
        spec_num_steps=spec.num_steps,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_mean_accepted_length=spec.mean_accepted_length,
        spec_draft_wait_seconds=engine.draft_wait_seconds,
        spec_unready_steps=engine.num_unready_steps,
        cpu_draft=draft_worker_stats(engine.proposer),
    )


def request_latencies(output: RequestOutput) -> tuple[float | None, float | None, float | None]:
    """(time to first token, mean time per output token after the first, end-to-end) in s."""
    metrics = output.metrics
    if metrics is None:
        return None, None, None
    first = metrics.first_token_time
    end = metrics.finished_time or metrics.last_token_time
    ttft = first - metrics.arrival_time if first is not None else None
    e2e = end - metrics.arrival_time if end is not None else None
    num_tokens = max((len(o.token_ids) for o in output.outputs), default=0)
    tpot = (end - first) / (num_tokens - 1) if first is not None and end is not None and num_tokens > 1 else None
    return ttft, tpot, e2e


class _SnapshotCollector:
    """Exposes the latest `EngineSnapshot` as gauges and counters at scrape time."""

    def __init__(self, model_name: str):
        self._model_name = model_name
        self.snapshot = EngineSnapshot()

    def _gauge(self, name: str, doc: str, value: float) -> Iterator[GaugeMetricFamily]:
        for full_name in _full_names(name):
            family = GaugeMetricFamily(full_name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family

    def _counter(self, name: str, doc: str, value: float) -> Iterator[CounterMetricFamily]:
        for full_name in _full_names(name):
            family = CounterMetricFamily(full_name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family

    def collect(self) -> Iterator:
        for families in self._families():
            yield from families

    def _families(self) -> Iterator:
        s = self.snapshot
        yield self._gauge("num_requests_running", "Requests with a sequence being decoded or prefilled.", s.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", s.kv_cache_usage)
        yield self._counter("prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total)
        yield self._counter("generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prompt tokens whose KV was found in device memory.", s.prefix_cache_hits)
        yield self._gauge("prefix_cache_hit_rate", "Prefix cache hits / queries since start (0-1).", s.prefix_cache_hit_rate)
        yield self._counter(
            "external_prefix_cache_queries", "Prompt tokens looked up with the CPU offload tier on.", s.external_prefix_cache_queries
        )
        yield self._counter(
            "external_prefix_cache_hits", "Prompt tokens whose KV was restored from the CPU offload tier.", s.external_prefix_cache_hits
        )
        yield self._counter(
            "prefix_cache_offloaded_blocks", "KV blocks copied to the CPU offload tier (when freed).", s.prefix_cache_offloaded_blocks
        )
        yield self._counter("spec_decode_num_steps", "Verification steps (one per speculated sequence per step).", s.spec_num_steps)
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", s.spec_num_draft_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens)
        yield self._gauge(
            "spec_decode_mean_acceptance_length",
            "Tokens emitted per verification step (accepted drafts + bonus) since start.",
            s.spec_mean_accepted_length,
        )
        yield self._counter("spec_decode_draft_wait_seconds", "Seconds the engine waited for draft trees.", s.spec_draft_wait_seconds)
        yield self._counter("spec_decode_unready_steps", "Steps whose proposal came back without a tree because the "
                            "proposer was not ready yet (a draft worker prefilling prompts).", s.spec_unready_steps)
        if s.cpu_draft is not None:
            yield from self._cpu_draft_families(s.cpu_draft)

    def _cpu_draft_families(self, stats: dict) -> Iterator:
        """The CPU draft worker's: whether its drafting hides behind verification, how often the
        trees it drafted ahead were the ones asked for, and its restarts."""
        yield self._counter("cpu_draft_hidden_seconds", "Seconds the CPU draft worker drafted after its replies, "
                            "while the GPU verified.", stats["hidden_s"])
        yield self._counter("cpu_draft_exposed_seconds", "Seconds the CPU draft worker spent between a proposal "
                            "and its reply, while the engine waited.", stats["exposed_s"])
        yield self._counter("cpu_draft_predraft_hits", "Trees drafted ahead that a proposal asked for.", stats["predraft_hits"])
        yield self._counter("cpu_draft_predraft_misses", "Trees drafted ahead from a guess that did not hold.",
                            stats["predraft_misses"])
        yield self._counter("cpu_draft_ahead_seconds", "Seconds of the CPU draft worker's drafts made ahead of proposals.",
                            stats["ahead_s"])
        yield self._counter("cpu_draft_ahead_levels", "Depth levels (draft forwards) of those drafts: seconds over levels "
                            "is a draft forward's time in service.", stats["ahead_levels"])
        yield self._counter("cpu_draft_worker_restarts", "CPU draft workers started again after a failure.", stats["restarts"])
        yield self._counter("cpu_draft_worker_faults", "CPU draft worker failures (died, hung, garbled replies).", stats["faults"])
        yield self._counter("cpu_draft_late_replies", "Proposals answered with no trees because the CPU draft "
                            "worker's reply was late.", stats["late_replies"])


def _full_names(name: str) -> list[str]:
    """Our name under `hetero:`, and vLLM's under `vllm:` where vLLM has the metric."""
    names = [PREFIX + name]
    if name not in _NOT_IN_VLLM:
        names.append(VLLM_PREFIX + _VLLM_NAMES.get(name, name))
    return names


class _Both:
    """A counter or histogram recorded under both prefixes."""

    def __init__(self, kind, name: str, doc: str, labels: list[str], registry: CollectorRegistry, **kwargs):
        self._metrics = [kind(full_name, doc, labels, registry=registry, **kwargs) for full_name in _full_names(name)]

    def labels(self, *values: str) -> "_Both":
        bound = _Both.__new__(_Both)
        bound._metrics = [metric.labels(*values) for metric in self._metrics]
        return bound

    def inc(self, amount: float = 1.0) -> None:
        for metric in self._metrics:
            metric.inc(amount)

    def observe(self, value: float) -> None:
        for metric in self._metrics:
            metric.observe(value)


class ServerMetrics:
    """One server's metrics; implements the async engine's observer protocol."""

    def __init__(self, model_name: str):
        disable_created_metrics()  # no `_created` series, as vLLM: they double the scrape for no use
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._snapshot = _SnapshotCollector(model_name)
        self.registry.register(self._snapshot)
        labels = ["model_name"]
        self.request_success = _Both(
            Counter, "request_success", "Finished requests, by finish reason.",
            labels + ["finished_reason"], self.registry,
        )
        self.time_to_first_token = _Both(
            Histogram, "time_to_first_token_seconds", "Time from arrival to the first output token.",
            labels, self.registry, buckets=_TTFT_BUCKETS,
        )
        self.time_per_output_token = _Both(
            Histogram, "time_per_output_token_seconds", "Mean time per output token after the first, per request.",
            labels, self.registry, buckets=_TPOT_BUCKETS,
        )
        self.e2e_request_latency = _Both(
            Histogram, "e2e_request_latency_seconds", "Time from arrival to the last output token.",
            labels, self.registry, buckets=_E2E_BUCKETS,
        )
        self.request_prompt_tokens = _Both(
            Histogram, "request_prompt_tokens", "Prompt tokens per finished request.",
            labels, self.registry, buckets=_TOKEN_BUCKETS,
        )
        self.request_generation_tokens = _Both(
            Histogram, "request_generation_tokens", "Generated tokens per finished request (all its choices).",
            labels, self.registry, buckets=_TOKEN_BUCKETS,
        )
        self.request_queue_time = _Both(
            Histogram, "request_queue_time_seconds", "Time from arrival to first being scheduled.",
            labels, self.registry, buckets=_QUEUE_BUCKETS,
        )

    def on_snapshot(self, snapshot: EngineSnapshot) -> None:
        self._snapshot.snapshot = snapshot

    def on_request_finished(self, output: RequestOutput) -> None:
        """Count the request once, by its first choice's finish reason, and time it."""
        reason = (output.outputs[0].finish_reason if output.outputs else None) or "abort"
        self.request_success.labels(self.model_name, reason).inc()
        ttft, tpot, e2e = request_latencies(output)
        if ttft is not None:
            self.time_to_first_token.labels(self.model_name).observe(ttft)
        if tpot is not None:
            self.time_per_output_token.labels(self.model_name).observe(tpot)
        if e2e is not None:
            self.e2e_request_latency.labels(self.model_name).observe(e2e)
        self.request_prompt_tokens.labels(self.model_name).observe(len(output.prompt_token_ids))
        self.request_generation_tokens.labels(self.model_name).observe(sum(len(o.token_ids) for o in output.outputs))
        if output.metrics is not None and output.metrics.time_in_queue is not None:
            self.request_queue_time.labels(self.model_name).observe(output.metrics.time_in_queue)

    def render(self) -> bytes:
        return generate_latest(self.registry)
