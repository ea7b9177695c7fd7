"""GPU benchmark of the target engine on an 8B Llama-3-shaped model with random bf16 weights.

Sections (all in one run, side by side):
  decode   hetero decode tokens/s at several batch sizes, batch 1 as a fraction of the HBM
           roofline (weight + KV bytes over the measured device copy bandwidth);
  hf       HF transformers `generate` at the same batch sizes (eager, its default cache);
  verify   step time of verifying a token tree of n nodes per sequence vs a plain decode step;
  spec     wall speedup and tokens per step of speculative decoding vs plain decoding, with an
           oracle proposer whose drafts are right with probability p (the acceptance knob);
           ``spec_run_steps`` / ``plain_run_steps`` split each mode's time by step kind (`StepKinds`):
           share of the time @ tokens/s within those steps / mean ms per step; ``pair_ratios``
           is each speculative run's tokens/s over the plain run just before it; ``--draft-mix``
           makes a share of the sequences draft worse (prompts unlike their drafter's);
           ``--trace NAME[,NAME...]`` in place of ``--draft-p``: each step's accepted length is
           drawn from an acceptance trace measured on real text (`bench.traces`, e.g. ``code``,
           ``chat/lookahead-hybrid``) instead of an i.i.d. p;
  floor    (only when named in --sections) speculation where it does not pay, against plain
           decoding's own run-to-run noise: per round, in shuffled order, two plain runs (no
           proposer), one with the proposer attached and the controller held to plain
           decoding (no node budget), and one speculating as usual; each over the round's
           first plain run (`plain2` is the A/A); ``spec_steps_per_run`` (and
           ``spec_steps_by_round``): trees verified per sequence in a speculating run (where
           speculation does not pay, its probes), so rounds without any can be told apart.

``--async-scheduling on,off`` runs the decode and spec sections with the engine's async
scheduling on and off side by side (`LLMEngine.async_scheduling`); ``gpu_idle_ms`` columns
are the device's mean time per step outside the runner's forward calls (`GpuIdle`: CUDA
events around them), i.e. the device waiting for the host. ``--stream`` makes every request
stream its outputs (a `RequestOutput` per step, as a server's requests do) instead of
`LLM.generate`'s final ones.

``--waves W`` runs each batch point as a server would: batch x W requests through `batch`
slots, a finished request's slot going to the next waiting one (W = 1: one closed batch,
whose requests all start and end together, run as `LLM.generate` runs one: the engine
knows its caller waits for all of them, `LLMEngine.waits_for_all`). With ``--offline`` the
waves run as `LLM.generate` runs more prompts than slots: once no prompt waits, the engine
knows the rest is a closed batch draining. ``--min-new-tokens M`` gives each request its own
max_tokens, uniform in [M, --new-tokens], as requests that end at EOS have: requests of one
length let plain decoding run every wave in lockstep, with no partly drained batch at all.

    python -m bench.gpu_decode --out bench/results
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
import zlib

import numpy as np
import torch

from bench._cuda_timing import median_replay_ms
from bench._machine import describe_machine
from bench._report import markdown_table, section_tables, write_markdown_and_json
from bench.traces import Trace, load_trace
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine
from hetero.core.protocols import Proposer, TokenTree
from hetero.core.sampling_params import RequestOutputKind, SamplingParams
from hetero.spec.controller import SpeculationController

DAMPING = 1e-5  # scale of the random models' layer output projections (see stabilise_greedy)
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
    torch_dtype="bfloat16",
)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus written."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return 2 * n * 2 / float(np.median(times))


def decode_kv_bytes(cfg, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Bytes of bf16 K and V a decode step reads for `batch` sequences at their mean context
    over a run (the prompt and half the new tokens), over every layer: the rooflines' KV term."""
    return batch * (prompt_len + new_tokens / 2) * cfg.num_layers * 2 * cfg.kv_size * 2


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1000, vocab) for _ in range(length)]} for _ in range(count)]


def request_lengths(count: int, longest: int, shortest: int, seed: int) -> list[int]:
    """Each request's max_tokens, uniform in [shortest, longest]: real requests end at
    different steps (EOS), which keeps plain decoding from running them in lockstep."""
    rng = random.Random(seed)
    return [rng.randint(shortest, longest) for _ in range(count)]


OUTPUT_KIND = [RequestOutputKind.FINAL_ONLY]  # as LLM.generate asks; --stream: CUMULATIVE, as a server's requests


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          output_kind=OUTPUT_KIND[0])


class GpuIdle:
    """The device's time between the end of one runner call's work and the start of the next
    (CUDA events recorded around `runner.forward` and `runner.decode_steps`): time it waits
    for the host, plus the small kernels the host queues between steps (sampling, KV moves)."""

    def __init__(self, engine: LLMEngine):
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        runner = engine.runner

        def timed(call):
            def wrapper(*args, **kwargs):
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                result = call(*args, **kwargs)
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.events.append((start, end))
                return result

            return wrapper

        runner.forward, runner.decode_steps = timed(runner.forward), timed(runner.decode_steps)

    def reset(self) -> None:
        self.events = []

    def mean_gap_ms(self) -> float:
        """Mean idle time between consecutive recorded calls, in ms (0 with fewer than two)."""
        torch.cuda.synchronize()
        gaps = [end.elapsed_time(start) for (_, end), (start, _) in zip(self.events, self.events[1:])]
        return sum(gaps) / len(gaps) if gaps else 0.0


def unwrap_runner(engine: LLMEngine) -> None:
    """Take `GpuIdle`'s and `StepKinds`' wrappers off the engine's runner: while they are on,
    the runner (its weights and KV cache) outlives the engine, and the next section's engine
    finds the GPU memory still taken."""
    for name in ("forward", "decode_steps"):
        engine.runner.__dict__.pop(name, None)


TRITON_COMPILES: list[str] = []  # kernels whose variants were built in this process, in order (see `count_triton_compiles`)


def count_triton_compiles() -> None:
    """Count every Triton kernel variant built from now on (a first use of a specialisation
    compiles it, which inside a timed run is a stall of a second or more)."""
    try:
        from triton import knobs
    except ImportError:
        return
    previous = knobs.runtime.jit_cache_hook

    def on_cache_miss(*args, **kwargs):
        TRITON_COMPILES.append(str(kwargs.get("repr", "?")).split("[")[0])
        return previous(*args, **kwargs) if previous else False

    knobs.runtime.jit_cache_hook = on_cache_miss


class StepKinds:
    """Labels each engine step by what the device ran, and sums time and tokens per label.

    'spec': trees verified, decodes only; 'spec+prefill': trees beside a prefill (a request
    admitted mid-run); 'plain': one decode step or a multi-step window; 'prefill': a step
    that prefills, no trees. Installed on the engine's runner; `timed_decode` records.

    A step is labelled by the work it verified. Under async scheduling (`LLMEngine.async_scheduling`)
    that is the work launched before the step's own launch: the one launched by the step
    before (or first in this step, when it launched twice), or the last one if it launched none.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.kind = "plain"
        self.labels: list[str] = ["plain"]  # each launch's label, the last two kept
        self.launches = 0
        self._launches_at_start = 0
        self.seconds: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self.compiles: dict[str, list[str]] = {}
        runner = engine.runner
        forward, decode_steps = runner.forward, runner.decode_steps

        def labelled_forward(chunks):
            trees = any(c.tree_mask is not None for c in chunks)
            prefill = any(len(c.token_ids) > 1 and c.tree_mask is None for c in chunks)
            self._launched("spec+prefill" if trees and prefill else "spec" if trees else "prefill" if prefill else "plain")
            return forward(chunks)

        def labelled_decode_steps(*args, **kwargs):
            self._launched("plain")
            return decode_steps(*args, **kwargs)

        runner.forward, runner.decode_steps = labelled_forward, labelled_decode_steps

    def _launched(self, label: str) -> None:
        self.labels = [self.labels[-1], label]
        self.launches += 1

    def start(self) -> None:
        """Called before each timed step."""
        self._launches_at_start = self.launches

    def reset(self) -> None:
        self.seconds, self.tokens, self.steps, self.compiles = {}, {}, {}, {}

    def record(self, seconds: float, tokens: int, compiled: tuple[str, ...] = ()) -> None:
        launched = self.launches - self._launches_at_start
        self.kind = self.labels[-2] if self.engine.async_scheduling and launched else self.labels[-1]
        if compiled:
            self.compiles.setdefault(self.kind, []).extend(compiled)
        self.seconds[self.kind] = self.seconds.get(self.kind, 0.0) + seconds
        self.tokens[self.kind] = self.tokens.get(self.kind, 0) + tokens
        self.steps[self.kind] = self.steps.get(self.kind, 0) + 1

    def summary(self) -> str:
        """Per label: share of the time @ tokens per second within those steps / mean ms per step
        (+compiled:kernel,...: Triton kernel variants built during those steps)."""
        total = sum(self.seconds.values()) or 1.0
        return " ".join(f"{kind} {self.seconds[kind] / total:.2f}@{self.tokens[kind] / max(self.seconds[kind], 1e-9):.0f}"
                        f"/{1e3 * self.seconds[kind] / self.steps[kind]:.1f}ms"
                        + (f"+compiled:{','.join(self.compiles[kind])}" if kind in self.compiles else "") for kind in sorted(self.seconds))


def timed_decode(engine: LLMEngine, prompts: list[dict], max_tokens: int | list[int], kinds: StepKinds | None = None,
                 idle: GpuIdle | None = None) -> tuple[float, int, dict]:
    """Prefill the first batch of prompts (as many as the engine runs at once), then time the
    steps until every prompt is done, later ones prefilled as slots free up: (seconds, tokens, outputs).
    `max_tokens`: one length for all, or each prompt's. With `kinds`, each timed step's
    seconds and tokens are added under its label; `idle` records the timed steps only."""
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    ids = []
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        rid = f"r{time.monotonic_ns()}-{i}"
        engine.add_request(rid, prompt, greedy(length))
        ids.append(rid)
    first_batch = ids[: engine.scheduler.max_num_seqs]
    outputs: dict[str, list[int]] = {}
    while not all(engine.groups[r].seqs[0].output_token_ids for r in first_batch if r in engine.groups):
        engine.step()
    done_before = sum(len(engine.groups[r].seqs[0].output_token_ids) for r in ids if r in engine.groups)
    torch.cuda.synchronize()
    if idle is not None:
        idle.reset()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start, tokens_before, compiles_before = time.perf_counter(), engine.num_generation_tokens_total, len(TRITON_COMPILES)
        if kinds is not None:
            kinds.start()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if kinds is not None:
            kinds.record(time.perf_counter() - step_start, engine.num_generation_tokens_total - tokens_before,
                         tuple(TRITON_COMPILES[compiles_before:]))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(v) for v in outputs.values()) - done_before
    return elapsed, tokens, {tuple(prompts[ids.index(r)]["prompt_token_ids"]): v for r, v in outputs.items()}


def timed_steps(engine: LLMEngine, prompts: list[dict], steps: int, headroom: int) -> float:
    """Seconds per engine step over exactly `steps` decode steps after the prefill.

    Requests get `steps + headroom` tokens to spare, so nothing near its max_tokens shrinks
    the trees being timed; they are aborted afterwards.
    """
    ids = [f"t{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, greedy(steps + headroom))
    while not all(engine.groups[r].seqs[0].output_token_ids for r in ids):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    for rid in ids:
        engine.abort_request(rid)
    return elapsed / steps


def greedy_successors(model, chunk: int = 1024) -> list[int]:
    """Each token's greedy successor with the context left out: the argmax of its own normalised embedding's logits.

    `stabilise_greedy` damps every layer's output, so the target's next token is (nearly)
    this function of the current token alone; `successor_agreement` measures how nearly.
    """
    successors = []
    with torch.no_grad():
        embeddings = model.embed_tokens.weight
        for start in range(0, embeddings.shape[0], chunk):
            successors.append(model.compute_logits(model.norm(embeddings[start : start + chunk])).argmax(dim=-1))
    return torch.cat(successors).tolist()


def successor_agreement(successors: list[int], truth: dict) -> float:
    """Share of the plain greedy runs' transitions (token -> next token) that `successors` predicts."""
    pairs = [(a, b) for prompt, out in truth.items() for a, b in zip((prompt[-1], *out), out)]
    return sum(successors[a] == b for a, b in pairs) / max(len(pairs), 1)


class ChainOracle(Proposer):
    """Drafts a chain of k tokens from each sequence's last token, each right with probability p.

    "Right" is the token's greedy successor (`greedy_successors`), so the drafts follow
    whatever the sequence actually holds. Drafting the recorded plain continuation instead
    made a sequence whose output flipped on a near-tied logit (bf16 rounding differs
    between kernel shapes) get no accepted draft for the rest of its run, which no real
    drafter, drafting from the sequence's own context, would do.
    """

    def __init__(self, successors: list[int], k: int, p: float, vocab: int, target_parallelism: int, seed: int = 0,
                 mix: tuple[float, float] = (0.0, 1.0)):
        self.successors, self.k, self.p, self.vocab = successors, k, p, vocab
        self.target_parallelism = target_parallelism
        self.mix = mix  # (share, factor): that share of the sequences (by key) draft right with probability p * factor
        self.rng = random.Random(seed)
        self.draws = np.random.default_rng(seed)
        self._successor_array = (None, np.zeros(0, np.int64))  # (the list it was made from, the array)

    def right(self, request_id: str) -> float:
        share, factor = self.mix
        return self.p * factor if zlib.crc32(request_id.encode()) % 1000 < 1000 * share else self.p

    def propose(self, batch):
        if isinstance(self.p, Trace):
            return [self.trace_chain(request) for request in batch]
        # The whole batch's draws at once: the oracle stands in for a proposer whose reply is
        # ready (a draft worker's ring), and its own Python would otherwise sit in the host's
        # time between two speculative steps that the GPU benchmark measures.
        if self._successor_array[0] is not self.successors:
            self._successor_array = (self.successors, np.asarray(self.successors, dtype=np.int64))
        successors = self._successor_array[1]
        right = self.draws.random((len(batch), self.k)) < np.array([self.right(r.request_id) for r in batch])[:, None]
        guesses = self.draws.integers(self.vocab, size=(len(batch), self.k))
        last = np.array([r.token_ids[-1] for r in batch], dtype=np.int64)
        chains = np.empty((len(batch), self.k), dtype=np.int64)
        for position in range(self.k):
            if len(successors):  # without successors (p=0: a verification-cost run) every draft is a guess
                last = chains[:, position] = np.where(right[:, position], successors[last], guesses[:, position])
            else:
                last = chains[:, position] = guesses[:, position]
        return [TokenTree.chain(chain[: min(self.k, request.max_nodes)]) for chain, request in zip(chains, batch)]

    def trace_chain(self, request) -> TokenTree:
        """A chain whose first `self.p.sample_accepted(depth)` tokens are right, the next one wrong."""
        depth = min(self.k, request.max_nodes)
        right = self.p.sample_accepted(depth, self.rng)
        tokens, last = [], request.token_ids[-1]
        for position in range(depth):
            successor = self.successors[last]
            if position < right:
                last = successor
            else:  # any token but the right one
                last = self.rng.randrange(self.vocab - 1)
                last += last >= successor
            tokens.append(last)
        return TokenTree.chain(tokens)

    def commit(self, verdicts):
        pass

    def release(self, request_id):
        pass


def engine_for(model_dir: str, max_num_seqs: int, proposer=None, num_speculative_tokens=None, utilization=0.55) -> LLMEngine:
    config = EngineConfig(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=utilization,
        num_speculative_tokens=num_speculative_tokens,
    )
    engine = LLMEngine(config, proposer=proposer)
    stabilise_greedy(engine.model)
    return engine


def stabilise_greedy(model, damping: float = DAMPING) -> None:
    """Make the random model's greedy path robust to kernel-shape rounding.

    With random N(0, 0.02) weights the top logits are nearly tied, and greedy decoding
    flips on bf16 rounding differences between kernels of different shapes (decode vs
    verification); drafts taken from a plain run would then stop matching. Shrinking the
    attention and MLP output projections makes each layer's update small next to the
    token embedding, so the next token is (nearly) a function of the current one with
    clear margins. The bytes and FLOPs per step, hence the timings, are unchanged. Every
    engine here is built with the same seed, so with the same weights. A quantised
    projection is scaled through its scales.
    """
    from gpu_target.quantization.linear import QuantizedLinear

    with torch.no_grad():
        for layer in model.layers:
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                if isinstance(projection, QuantizedLinear):
                    projection.quantized.scales.mul_(damping)
                else:
                    projection.weight.mul_(damping)


def graph_replay_ms(engine: LLMEngine, batch: int) -> float | None:
    """GPU time of one decode step's graph alone (median of 50 replays), or None without graphs."""
    runner = engine.runner.graph_runner
    if runner is None or (batch, 1) not in runner.graphs:
        return None
    graph, _ = runner.graphs[(batch, 1)]
    return median_replay_ms(graph, 50)


def bench_decode(model_dir, batches, scheduler_steps, prompt_len, new_tokens, bandwidth, rows, waves=1, async_modes=(True,)):
    engine = engine_for(model_dir, max(batches))
    idle = GpuIdle(engine)
    rows.append(dict(section="startup", what="cuda_graph_capture_s", value=round(engine.cuda_graph_capture_seconds, 2)))
    rows.append(dict(section="profile", text=profile_decode_step(engine)))
    print(rows[-1]["text"], flush=True)
    cfg = engine.model_config
    weight_bytes = cfg.num_parameters() * 2  # the roofline: every weight byte
    # A step reads only B rows of an untied embedding table: the stricter "bytes read" roofline.
    embedding_bytes = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 2
    truth = {}
    for batch, steps, mode in [(b, s, m) for b in batches for s in scheduler_steps for m in async_modes]:
        engine.num_scheduler_steps = steps
        engine.async_scheduling = mode
        engine.scheduler.max_num_seqs = batch
        prompts = random_prompts(batch * waves, prompt_len, cfg.vocab_size, seed=batch)
        timed_decode(engine, prompts[:1], 8)  # warm-up
        elapsed, tokens, outputs = timed_decode(engine, prompts, new_tokens, idle=idle)
        # Multi-step decoding must not change a token: the first setting's outputs are the reference.
        same_tokens = all(truth.get(prompt, tokens_out) == tokens_out for prompt, tokens_out in outputs.items())
        truth.update(outputs)
        tok_s = tokens / elapsed
        steps_s = tok_s / batch
        kv_bytes = decode_kv_bytes(cfg, batch, prompt_len, new_tokens)
        roofline_steps = bandwidth / (weight_bytes + kv_bytes)
        read_roofline_steps = bandwidth / (weight_bytes - embedding_bytes + kv_bytes)
        replay_ms = graph_replay_ms(engine, batch)
        rows.append(dict(section="decode", engine="hetero", num_scheduler_steps=steps, async_scheduling=mode, batch=batch, waves=waves,
                         tokens_per_s=round(tok_s, 1), step_ms=round(1e3 / steps_s, 3), gpu_idle_ms=round(idle.mean_gap_ms(), 3),
                         graph_replay_ms=round(replay_ms, 3) if replay_ms else "",
                         roofline_steps_per_s=round(roofline_steps, 1),
                         fraction_of_roofline=round(steps_s / roofline_steps, 3),
                         fraction_of_bytes_read_roofline=round(steps_s / read_roofline_steps, 3),
                         same_tokens_as_first_setting=same_tokens))
        print(rows[-1], flush=True)
    unwrap_runner(engine)
    del engine
    return truth


def profile_decode_step(engine: LLMEngine, batch: int = 1, replays: int = 5) -> str:
    """Kernel-time table of `replays` replays of the batch's decode graph (torch.profiler/CUPTI)."""
    graph, _ = engine.runner.graph_runner.graphs[(batch, 1)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    averages = profiler.key_averages()
    total_us = sum(event.device_time_total for event in averages) / replays
    table = averages.table(sort_by="device_time_total", row_limit=15, max_name_column_width=60)
    return f"kernel time per step: {total_us / 1e3:.3f} ms over {replays} replays of the ({batch}, 1) graph\n{table}"


def bench_verify(model_dir, tree_sizes, batches, prompt_len, rows, repeats=1):
    vocab = LLAMA3_8B["vocab_size"]
    oracle = ChainOracle([], k=max(tree_sizes), p=0.0, vocab=vocab, target_parallelism=63 * max(batches))
    engine = engine_for(model_dir, max(batches), oracle, num_speculative_tokens=max(tree_sizes))
    engine.spec_control.always_speculate = True  # this measures the cost of verifying
    rows.append(dict(section="startup", what="cuda_graph_capture_s_spec", value=round(engine.cuda_graph_capture_seconds, 2)))
    for batch in batches:
        prompts = random_prompts(batch, prompt_len, vocab, seed=100 + batch)
        runs: dict[int, list[float]] = {}
        for _ in range(repeats):  # every size once per round, so drift hits them alike; medians below
            for nodes in [0] + list(tree_sizes):
                oracle.k = nodes
                engine.spec_control.max_nodes_per_seq = max(nodes, 1)
                runs.setdefault(nodes, []).append(1e3 * timed_steps(engine, prompts, steps=32, headroom=64 + max(tree_sizes)))
        step_ms = {nodes: float(np.median(times)) for nodes, times in runs.items()}
        for nodes in tree_sizes:
            rows.append(dict(section="verify", batch=batch, tree_nodes=nodes, step_ms=round(step_ms[nodes], 3),
                             plain_step_ms=round(step_ms[0], 3), ratio_to_plain=round(step_ms[nodes] / step_ms[0], 3),
                             ratio_per_round=" ".join(f"{a / b:.3f}" for a, b in zip(runs[nodes], runs[0]))))
            print(rows[-1], flush=True)
    unwrap_runner(engine)
    del engine


def fresh_controller(engine: LLMEngine, k: int, target_parallelism: int, **options) -> SpeculationController:
    """A controller with no measurements, for the engine's graphs (their query buckets size its trees)."""
    return SpeculationController(k, target_parallelism, query_buckets=engine.spec_control.tree_sizer.query_buckets, **options)


def warm_up_speculation(engine: LLMEngine, oracle: ChainOracle, prompts: list[dict], k: int, target_parallelism: int) -> None:
    """Speculate through a short run: verification and mixed prefill/decode shapes compile their kernels on first use."""
    oracle.p, engine.proposer = 0.5, oracle
    engine.spec_control = fresh_controller(engine, k, target_parallelism, always_speculate=True)
    timed_decode(engine, prompts, 16)


def bench_spec(model_dir, truth, batches, probabilities, k, target_parallelism, prompt_len, new_tokens, repeats, rows, waves=1,
               mix=(0.0, 1.0), offline=False, min_new_tokens=None, async_modes=(True,)):
    vocab = LLAMA3_8B["vocab_size"]
    oracle = ChainOracle([], k=k, p=0.0, vocab=vocab, target_parallelism=target_parallelism, mix=mix)
    engine = engine_for(model_dir, max(batches), oracle, num_speculative_tokens=k)
    engine.waits_for_all = waves == 1 or offline
    kinds, plain_kinds, idle = StepKinds(engine), StepKinds(engine), GpuIdle(engine)
    oracle.successors = greedy_successors(engine.model)
    rows.append(dict(section="startup", what="oracle_successor_agreement", value=round(successor_agreement(oracle.successors, truth), 4)))
    print(rows[-1], flush=True)
    for batch in batches:
        engine.scheduler.max_num_seqs = batch
        prompts = random_prompts(batch * waves, prompt_len, vocab, seed=batch)
        lengths = request_lengths(len(prompts), new_tokens, min_new_tokens or new_tokens, seed=batch)
        warm_up_speculation(engine, oracle, prompts, k, target_parallelism)
        for p, mode in [(p, m) for p in probabilities for m in async_modes]:
            oracle.p = p
            engine.async_scheduling = mode
            engine.spec_control = fresh_controller(engine, k, target_parallelism)  # learns across the repeats
            plain_runs, spec_runs, steps, accepted, drafted, matching, outputs = [], [], 0, 0, 0, 0, 0
            plain_idle, spec_idle = [], []
            kinds.reset()
            plain_kinds.reset()
            for _ in range(repeats):  # alternate, so drift hits both alike; medians below
                engine.proposer = None  # the same engine, graphs and KV pool, decoding plainly
                elapsed, tokens, _ = timed_decode(engine, prompts, lengths, plain_kinds, idle)
                plain_runs.append(tokens / elapsed)
                plain_idle.append(idle.mean_gap_ms())
                engine.proposer = oracle
                stats = engine.spec_stats
                before = (stats.num_steps, stats.num_accepted_tokens, stats.num_draft_tokens)
                elapsed, tokens, spec_out = timed_decode(engine, prompts, lengths, kinds, idle)
                spec_runs.append(tokens / elapsed)
                spec_idle.append(idle.mean_gap_ms())
                matching += sum(truth.get(prompt, [])[: len(out)] == out for prompt, out in spec_out.items())
                outputs += len(spec_out)
                steps += stats.num_steps - before[0]
                accepted += stats.num_accepted_tokens - before[1]
                drafted += stats.num_draft_tokens - before[2]
            plain, spec = float(np.median(plain_runs)), float(np.median(spec_runs))
            rows.append(dict(section="spec", batch=batch, async_scheduling=mode, waves=waves,
                             caller="generate" if engine.waits_for_all else "server",
                             new_tokens=f"{min(lengths)}-{max(lengths)}", draft_p=getattr(p, "name", p), draft_mix=f"{mix[0]:g} at {mix[1]:g}p", k=k, repeats=repeats,
                             spec_seq_steps=steps, mean_tree_nodes=round(drafted / max(steps, 1), 2),
                             mean_accepted_length=round((accepted + steps) / max(steps, 1), 2),
                             same_tokens_as_plain=f"{matching}/{outputs}",
                             tokens_per_s=round(spec, 1), plain_tokens_per_s=round(plain, 1),
                             spec_gpu_idle_ms=round(float(np.median(spec_idle)), 3),
                             plain_gpu_idle_ms=round(float(np.median(plain_idle)), 3),
                             speedup=round(spec / plain, 2), speedup_range=f"{min(spec_runs) / max(plain_runs):.2f}-{max(spec_runs) / min(plain_runs):.2f}",
                             pair_ratios=",".join(f"{s / p:.3f}" for s, p in zip(spec_runs, plain_runs)),
                             spec_run_steps=kinds.summary(), plain_run_steps=plain_kinds.summary()))
            print(rows[-1], flush=True)
    unwrap_runner(engine)
    del engine


def bench_floor(model_dir, batches, p, k, target_parallelism, prompt_len, new_tokens, rounds, rows):
    """See the module docstring's `floor`. The controllers learn across the rounds, as in `bench_spec`."""
    vocab = LLAMA3_8B["vocab_size"]
    oracle = ChainOracle([], k=k, p=p, vocab=vocab, target_parallelism=target_parallelism)
    engine = engine_for(model_dir, max(batches), oracle, num_speculative_tokens=k)
    engine.waits_for_all = True  # closed batches, as `LLM.generate` runs them
    oracle.successors = greedy_successors(engine.model)
    for batch in batches:
        engine.scheduler.max_num_seqs = batch
        prompts = random_prompts(batch, prompt_len, vocab, seed=batch)
        warm_up_speculation(engine, oracle, prompts, k, target_parallelism)
        oracle.p = p
        controllers = {"held_plain": fresh_controller(engine, k, 0), "spec": fresh_controller(engine, k, target_parallelism)}
        runs: dict[str, list[float]] = {"plain": [], "plain2": [], "held_plain": [], "spec": []}
        order = random.Random(batch)
        spec_steps: list[float] = []  # per round: trees verified per sequence in the speculating run
        for _ in range(rounds):
            names = list(runs)
            order.shuffle(names)
            for name in names:
                engine.proposer = oracle if name in controllers else None
                if name in controllers:
                    engine.spec_control = controllers[name]
                before = engine.spec_stats.num_steps
                elapsed, tokens, _ = timed_decode(engine, prompts, new_tokens)
                runs[name].append(tokens / elapsed)
                if name == "spec":
                    spec_steps.append((engine.spec_stats.num_steps - before) / batch)
        plain = np.array(runs["plain"])
        row = dict(section="floor", batch=batch, draft_p=p, rounds=rounds, plain_tokens_per_s=round(float(np.median(plain)), 1),
                   spec_steps_per_run=round(float(np.mean(spec_steps)), 2),
                   spec_steps_by_round=",".join(f"{n:.2g}" for n in spec_steps))
        for name in ("plain2", "held_plain", "spec"):
            ratios = np.array(runs[name]) / plain
            row[f"{name}_over_plain"] = round(float(np.median(ratios)), 4)
            row[f"{name}_pairs"] = ",".join(f"{r:.3f}" for r in ratios)
        rows.append(row)
        print(rows[-1], flush=True)
    unwrap_runner(engine)
    del engine


def time_generate(model, ids: torch.Tensor, new_tokens: int) -> float:
    """Seconds for HF `generate` to produce exactly `new_tokens` greedy tokens per row (on `ids`' device)."""
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_hf(model_dir, batches, prompt_len, new_tokens, rows):
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    torch.set_default_dtype(torch.float32)
    model.eval()
    for batch in batches:
        ids = torch.tensor([p["prompt_token_ids"] for p in random_prompts(batch, prompt_len, config.vocab_size, batch)], device="cuda")
        time_generate(model, ids, 2)
        t_short, t_long = time_generate(model, ids, 1), time_generate(model, ids, new_tokens + 1)
        tok_s = batch * new_tokens / (t_long - t_short)
        rows.append(dict(section="decode", engine="transformers", batch=batch, tokens_per_s=round(tok_s, 1),
                         step_ms=round(1e3 * (t_long - t_short) / new_tokens, 3)))
        print(rows[-1], flush=True)
    del model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--sections", default="decode,verify,spec,hf")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--scheduler-steps", default="1,8", help="hetero's num_scheduler_steps values, side by side")
    parser.add_argument("--async-scheduling", default="on", help="'on', 'off' or both ('on,off'), side by side")
    parser.add_argument("--stream", action="store_true", help="requests stream an output per step, as a server's do")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hf-new-tokens", type=int, default=32)
    parser.add_argument("--tree-sizes", default="1,4,8,16,32,63")
    parser.add_argument("--verify-batches", default="1,16")
    parser.add_argument("--draft-p", default="0.0,0.5,0.8,0.95")
    parser.add_argument("--trace", default=None,
                        help="acceptance traces in place of --draft-p (spec section), e.g. code,chat,rewrite,summarise")
    parser.add_argument("--draft-mix", default="0,1",
                        help="SHARE,FACTOR: that share of the sequences draft right with probability p * FACTOR (spec section)")
    parser.add_argument("--spec-k", type=int, default=8)
    parser.add_argument("--target-parallelism", type=int, default=512,
                        help="tree nodes per step over the batch (default: the lookahead cache's, TACO-LLM's)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating plain/speculative runs per spec point; rounds of 32 timed steps per verify point")
    parser.add_argument("--waves", type=int, default=1, help="requests per slot in the decode and spec sections (1: a closed batch)")
    parser.add_argument("--offline", action="store_true",
                        help="spec section: run the waves as `LLM.generate` does (the caller waits for every request)")
    parser.add_argument("--min-new-tokens", type=int, default=None,
                        help="spec section: each request's max_tokens uniform in [this, --new-tokens] (default: all --new-tokens)")
    parser.add_argument("--floor-batches", default="32,64")
    parser.add_argument("--floor-p", type=float, default=0.3, help="the floor section's draft acceptance: one where speculation does not pay")
    parser.add_argument("--floor-rounds", type=int, default=8)
    args = parser.parse_args(argv)
    if args.min_new_tokens is not None and not 1 <= args.min_new_tokens <= args.new_tokens:
        parser.error(f"--min-new-tokens must be in [1, --new-tokens={args.new_tokens}], got {args.min_new_tokens}")
    sections = set(args.sections.split(","))
    if not set(args.async_scheduling.split(",")) <= {"on", "off"}:
        parser.error(f"--async-scheduling takes 'on', 'off' or 'on,off', got {args.async_scheduling!r}")
    async_modes = tuple(mode == "on" for mode in args.async_scheduling.split(","))
    if args.stream:
        OUTPUT_KIND[0] = RequestOutputKind.CUMULATIVE
    batches = [int(b) for b in args.batches.split(",")]
    os.makedirs(args.out, exist_ok=True)
    model_dir = tempfile.mkdtemp(prefix="llama3-8b-shape-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    device = torch.device("cuda")
    count_triton_compiles()
    bandwidth = copy_bandwidth(device)
    rows: list[dict] = [dict(section="machine", what="copy_bandwidth_TBps", value=round(bandwidth / 1e12, 3))]
    print(rows[-1], flush=True)
    truth = {}
    if "decode" in sections or "spec" in sections:
        steps = [int(n) for n in args.scheduler_steps.split(",")]
        truth = bench_decode(model_dir, batches, steps, args.prompt_len, args.new_tokens, bandwidth, rows, args.waves, async_modes)
    gc.collect()
    torch.cuda.empty_cache()
    if "verify" in sections:
        bench_verify(model_dir, [int(n) for n in args.tree_sizes.split(",")],
                     [int(b) for b in args.verify_batches.split(",")], args.prompt_len, rows, args.repeats)
        gc.collect()
        torch.cuda.empty_cache()
    if "spec" in sections:
        acceptances = [load_trace(n) for n in args.trace.split(",")] if args.trace else [float(p) for p in args.draft_p.split(",")]
        bench_spec(model_dir, truth, batches, acceptances, args.spec_k, args.target_parallelism,
                   args.prompt_len, args.new_tokens, args.repeats, rows, args.waves,
                   tuple(float(x) for x in args.draft_mix.split(",")), args.offline, args.min_new_tokens, async_modes)
        gc.collect()
        torch.cuda.empty_cache()
    if "floor" in sections:
        bench_floor(model_dir, [int(b) for b in args.floor_batches.split(",")], args.floor_p, args.spec_k,
                    args.target_parallelism, args.prompt_len, args.new_tokens, args.floor_rounds, rows)
        gc.collect()
        torch.cuda.empty_cache()
    if "hf" in sections:
        bench_hf(model_dir, batches, args.prompt_len, args.hf_new_tokens, rows)
    write_results(args, rows)


def write_results(args, rows) -> None:
    info = dict(describe_machine(), torch=torch.__version__, gpu=torch.cuda.get_device_name(), python=platform.python_version())
    command = "python -m bench.gpu_decode " + " ".join(sys.argv[1:])
    body: list[str] = []
    for row in rows:
        if row.get("section") == "profile":
            body += ["## profile (batch-1 decode step)", "", "```", row["text"], "```", ""]
    body += section_tables(rows, ["machine", "startup", "decode", "verify", "spec", "floor"])
    hetero = [r for r in rows if r.get("engine") == "hetero"]
    hf = {r["batch"]: r["tokens_per_s"] for r in rows if r.get("engine") == "transformers"}
    if hetero and hf:
        speedups = [dict(num_scheduler_steps=r["num_scheduler_steps"], batch=r["batch"],
                         speedup=f"{r['tokens_per_s'] / hf[r['batch']]:.1f}x") for r in hetero if r["batch"] in hf]
        body += ["## hetero / transformers", "", *markdown_table(speedups)]
    stem = os.path.join(args.out, f"gpu_decode-{time.strftime('%Y%m%d-%H%M%S')}")
    print(write_markdown_and_json(stem, f"GPU decode benchmark ({info['gpu']})", command, info, rows, body))


if __name__ == "__main__":
    main()
