"""Host time of the engine's speculative steps, per phase, with the target's forward faked out.

On the GPU host a batch-64 speculative step spends about 8 ms on the device (graph replay
and logits) and 2-3 ms of Python on one core around it: scheduling, asking the proposer,
laying the trees out, staging the graph's inputs, accepting and appending the tokens. The
device idles meanwhile, so that Python decides whether speculation can beat multi-step
plain windows at large batches. This benchmark measures it alone, on any machine:

* an engine on the CPU with a small random Llama-shaped model (`--vocab` tokens);
* `bench.gpu_decode.ChainOracle` drafting chains of `--nodes` tokens, each right with
  probability p;
* the runner's forward replaced by what the CUDA-graph path does on the host
  (`fill_host_inputs` into a bucket's buffers) and logits whose argmax is each token's
  successor, so trees are accepted as p says, as on the GPU host.

Each phase is the time inside one of the engine's parts (the hooks `LLMEngine` documents:
scheduler, proposer, runner, verifier, output processor; ``append`` is the engine's appending
of the step's tokens, which calls the output processor per sequence), summed over the timed steps;
``step_ms`` is the whole `LLMEngine.step`. ``critical_ms`` is the host's part of the device's
idle gap between two speculative steps (`CriticalPath`): from verification starting to read a
step's results to the next step's inputs being staged for launch, with ``crit_<phase>_ms`` the
phases inside that window and ``crit_other_ms`` the engine's own code between them;
``critical_host_ms`` leaves out the verifier's argmax over the logits (``logits_argmax``, inside
``sample_and_verify``), which the GPU computes. The rest of the step (``after_launch_ms``) runs
while the device computes. ``--async-scheduling on,off``
measures both engine modes (without async scheduling the window also holds the outputs and
the caller's loop); ``--clock cpu`` times the engine thread's CPU time instead of wall time,
for a machine that other work shares. Compare commits by running it from each checkout side by side
(``PYTHONPATH`` pointing at the other tree).

    python -m bench.host_step --batches 64 --nodes 1,3 --draft-p 0.3,0.6
"""
from __future__ import annotations

import argparse
import contextlib
import random
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import torch

from bench._machine import describe_machine
from bench._report import markdown_table, write_csv_with_context
from bench.e2e_speculation import write_model_dir
from bench.gpu_decode import ChainOracle, greedy
from gpu_target.cuda_graphs import allocate_buffers, bucket_view, fill_host_inputs
from gpu_target.loader import load_config
from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine
from hetero.spec.controller import SpeculationController

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUERY_BUCKETS = (1, 2, 4, 8, 16)  # the GPU engine's graph query lengths for trees of up to 15 nodes
# (engine attribute, or "" for the engine itself; its method; the phase's name): each timed on its own,
# each called once a step (timing a call costs two clock reads, ~1.2 us with --clock cpu: a per-sequence
# method's wrapper would add ~0.1 ms to a batch-64 step that the engine does not spend)
PHASES = (("scheduler", "schedule", "schedule"), ("proposer", "propose", "propose"), ("proposer", "commit", "commit"),
          ("runner", "forward", "forward"), ("verifier", "sample_and_verify", "sample_and_verify"),
          ("", "_append", "append"), ("outputs", "request_outputs", "request_outputs"))
# and the verifier's argmax over the logits (inside sample_and_verify), device work on the GPU host
PHASE_NAMES = (*(name for _, _, name in PHASES), "logits_argmax")
# Every time here: wall time, or (--clock cpu) this thread's CPU time, which other processes
# sharing the cores do not inflate (a busy machine can double the wall times of a side-by-side run).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
CLOCK = [time.perf_counter]


def tiny_llama_config(vocab: int) -> dict:
    """A small Llama-shaped config; weights come from load_format="dummy"."""
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)


class GraphHostForward:
    """The host side of a CUDA-graph step (input staging) and logits that make each row's
    argmax its input token's successor: a chain of successors is accepted whole."""

    def __init__(self, engine: LLMEngine, successors: list[int]):
        self.engine = engine
        self.staged = lambda: None  # told when a step's inputs are staged, where a graph replay would start
        self.real_forward = engine.runner.forward
        max_seqs = engine.scheduler.max_num_seqs
        self.host = allocate_buffers(max_seqs * QUERY_BUCKETS[-1], max_seqs, -(-engine.max_model_len // engine.runner.block_size), "cpu")
        self.successors = torch.tensor(successors)
        self.arrays: dict[tuple[int, int], dict] = {}

    def __call__(self, chunks):
        longest = max(len(c.token_ids) for c in chunks)
        if longest > QUERY_BUCKETS[-1] or any(c.num_cached == 0 for c in chunks):
            return self.real_forward(chunks)  # prefills run the model
        query_len = next(q for q in QUERY_BUCKETS if q >= longest)
        arrays = self.arrays.get((len(chunks), query_len))
        if arrays is None:  # sliced once per bucket, as the graph runner does
            view = bucket_view(self.host, len(chunks), len(chunks) * query_len)
            arrays = self.arrays[(len(chunks), query_len)] = {name: t.numpy() for name, t in view.items()}
        rows = fill_host_inputs(arrays, chunks, query_len, self.engine.runner.block_size, self.engine.scheduler.table_rows)
        self.staged()
        next_tokens = self.successors[torch.from_numpy(arrays["input_ids"][rows])]
        return torch.nn.functional.one_hot(next_tokens, len(self.successors)).float()


class CriticalPath:
    """The host work between a speculative step's results and the next step's launch.

    On the GPU the device idles from the moment the host starts reading a step's verified
    results (`BatchVerifier.sample_and_verify` of a step with trees: its argmax copy is the
    step's sync) until the next step's inputs are staged and its graph replayed. Each such
    window is timed (`windows`), and the phases run inside one are summed apart (`critical`)
    from their totals (`seconds`).
    """

    def __init__(self):
        self.seconds: Counter = Counter()
        self.critical: Counter = Counter()
        self.windows: list[float] = []
        self.opened: Optional[float] = None

    def open(self) -> None:
        self.opened = CLOCK[0]()

    def close(self) -> None:
        if self.opened is not None:
            self.windows.append(CLOCK[0]() - self.opened)
            self.opened = None

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        if self.opened is not None:
            self.critical[name] += seconds


def timed_phases(engine: LLMEngine, forward: GraphHostForward) -> CriticalPath:
    """Wrap the engine's step phases so each call adds its seconds to the returned `CriticalPath`,
    which a verification with trees opens and the next staged launch closes."""
    path = CriticalPath()

    def timed(owner, method_name: str, name: str) -> None:
        method = getattr(owner, method_name)

        def wrapper(*args, **kwargs):
            start = CLOCK[0]()
            try:
                return method(*args, **kwargs)
            finally:
                path.add(name, CLOCK[0]() - start)

        setattr(owner, method_name, wrapper)

    for part, method_name, name in PHASES:
        timed(getattr(engine, part) if part else engine, method_name, name)
    verify = engine.verifier.sample_and_verify

    def opening_verify(scheduled, *args):
        if any(item.tree is not None for item in scheduled):
            path.open()
        return verify(scheduled, *args)

    engine.verifier.sample_and_verify = opening_verify
    forward.staged = path.close
    return path


@contextlib.contextmanager
def argmax_timed(path: CriticalPath):
    """Time `Tensor.argmax` as a phase of its own: the verifier's reduction over the step's
    logits, which on the GPU host is device work (the host copies its small result) and here
    costs the CPU as much as a large share of the host work."""
    original = torch.Tensor.argmax

    def timed(self, *args, **kwargs):
        start = CLOCK[0]()
        try:
            return original(self, *args, **kwargs)
        finally:
            path.add("logits_argmax", CLOCK[0]() - start)

    torch.Tensor.argmax = timed
    try:
        yield
    finally:
        torch.Tensor.argmax = original


def measure(model_dir: str, batch: int, nodes: int, p: float, steps: int, seed: int, async_scheduling: bool = True) -> dict:
    config = EngineConfig(model=model_dir, load_format="dummy", skip_tokenizer_init=True, device="cpu",
                          dtype="float32", max_model_len=4096, max_num_seqs=batch, num_speculative_tokens=nodes,
                          async_scheduling=async_scheduling)
    vocab = load_config(model_dir, require_weights=False).vocab_size
    rng = random.Random(seed)
    successors = list(range(vocab))
    rng.shuffle(successors)
    oracle = ChainOracle(successors, k=nodes, p=p, vocab=vocab, target_parallelism=batch * nodes, seed=seed)
    engine = LLMEngine(config, proposer=oracle)
    engine.spec_control = SpeculationController(nodes, batch * nodes, always_speculate=True, query_buckets=QUERY_BUCKETS)
    forward = engine.runner.forward = GraphHostForward(engine, successors)
    max_tokens = (steps + 8) * (nodes + 1)
    if max_tokens + 32 > engine.max_model_len:
        raise ValueError(f"{steps} steps of {nodes + 1} tokens do not fit max_model_len {engine.max_model_len}")
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(vocab) for _ in range(32)]}, greedy(max_tokens))
    while engine.spec_stats.num_steps < 3 * batch:  # prefill, then warm speculative steps
        engine.step()
    path = timed_phases(engine, forward)
    tokens_before = engine.num_generation_tokens_total
    with argmax_timed(path):
        start = CLOCK[0]()
        for _ in range(steps):
            engine.step()
        elapsed = CLOCK[0]() - start
    windows = path.windows  # without async scheduling the last step's window closes only at the next call's launch
    critical = 1e3 * sum(windows) / len(windows)
    in_phases = 1e3 * sum(seconds for name, seconds in path.critical.items() if name != "logits_argmax") / len(windows)
    return dict(batch=batch, nodes=nodes, draft_p=p, async_scheduling=async_scheduling, steps=steps,
                tokens_per_seq_step=round((engine.num_generation_tokens_total - tokens_before) / steps / batch, 3),
                step_ms=round(1e3 * elapsed / steps, 4), critical_ms=round(critical, 4),
                critical_host_ms=round(critical - 1e3 * path.critical["logits_argmax"] / len(windows), 4),
                after_launch_ms=round(1e3 * elapsed / steps - critical, 4),
                **{f"{name}_ms": round(1e3 * path.seconds[name] / steps, 4) for name in PHASE_NAMES},
                **{f"crit_{name}_ms": round(1e3 * path.critical[name] / len(windows), 4) for name in PHASE_NAMES},
                crit_other_ms=round(critical - in_phases, 4))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.host_step", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="64", help="comma-separated batch sizes")
    parser.add_argument("--nodes", default="1,3", help="comma-separated chain lengths (tree nodes per sequence)")
    parser.add_argument("--draft-p", default="0.3,0.6", help="comma-separated probabilities that a drafted token is right")
    parser.add_argument("--async-scheduling", default="on", help="'on', 'off' or both ('on,off'), side by side")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="wall time, or this thread's CPU time")
    parser.add_argument("--steps", type=int, default=100, help="timed speculative steps per point")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary of the random model (small: logits are host-side here)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="CSV path (default bench/results/host_step-HOSTNAME.csv)")
    args = parser.parse_args(argv)
    if not set(args.async_scheduling.split(",")) <= {"on", "off"}:
        parser.error(f"--async-scheduling takes 'on', 'off' or 'on,off', got {args.async_scheduling!r}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    command = shlex.join([Path(sys.executable).name, "-m", "bench.host_step", *(argv if argv is not None else sys.argv[1:])])
    machine = describe_machine()
    CLOCK[0] = CLOCKS[args.clock]
    torch.set_num_threads(1)  # the engine's host work is one Python thread; the tiny prefills need no more
    model_dir = write_model_dir(tiny_llama_config(args.vocab))
    rows = []
    for batch in map(int, args.batches.split(",")):
        for nodes in map(int, args.nodes.split(",")):
            for p in map(float, args.draft_p.split(",")):
                for mode in args.async_scheduling.split(","):
                    rows.append(measure(model_dir, batch, nodes, p, args.steps, args.seed, mode == "on"))
                    print(" ".join(f"{key} {value}" for key, value in rows[-1].items()), flush=True)
    print("\n".join(markdown_table(rows)))
    context = dict(command=command, hostname=machine["hostname"], cpu_model=machine["cpu_model"],
                   hetero_commit=machine["hetero_commit"], torch=torch.__version__,
                   measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    write_csv_with_context(args.out or RESULTS_DIR / f"host_step-{machine['hostname']}.csv", rows, context)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
