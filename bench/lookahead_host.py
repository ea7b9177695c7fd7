"""Host cost of the lookahead cache: microseconds per learned token and per proposal.

The cache runs on the engine's thread, so at large batches its learning (each step's
accepted and bonus tokens go into the request's trie) and proposing (a token tree per
request) is time the GPU waits for. This drives ``LookaheadCache`` with no model: each
request has a prompt and a "true" continuation (copies of prompt spans between stretches
of Zipf-distributed tokens, as in rewrites, code edits and RAG answers); every step proposes
for the batch, accepts the longest tree path the true continuation follows, and commits
that plus the bonus token. Before timing, a few finished requests fill the global cache.

``--baseline REV ...`` also runs the ``lookahead`` package of each git revision side by side
(a fresh subprocess per implementation and batch size, interleaved; each step's least CPU
time over ``--repeats`` runs), and checks that all proposed the same trees.

    python -m bench.lookahead_host --baseline main --out bench/results
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

VOCAB = 32_000
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def zipf_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) % VOCAB for t in rng.zipf(1.2, n)]


def make_stream(rng: np.random.Generator, prompt_len: int, output_len: int) -> tuple[list[int], list[int]]:
    """A prompt and its true continuation: copied prompt spans between fresh Zipf stretches."""
    prompt = zipf_tokens(rng, prompt_len)
    output: list[int] = []
    while len(output) < output_len:
        span = int(rng.integers(8, 33))
        if rng.random() < 0.5:
            start = int(rng.integers(0, prompt_len - span))
            output.extend(prompt[start:start + span])
        else:
            output.extend(zipf_tokens(rng, span))
    return prompt, output[:output_len]


def accepted_path(tree, truth: list[int]) -> list[int]:
    """The longest root path of ``tree`` that ``truth`` follows."""
    accepted, parent = [], -1
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    while len(accepted) < len(truth):
        nxt = next((i for i, p in enumerate(parents) if p == parent and tokens[i] == truth[len(accepted)]), None)
        if nxt is None:
            break
        accepted.append(tokens[nxt])
        parent = nxt
    return accepted


def drive(cache, streams, prefix: str, steps: int, max_nodes: int):
    """Run a batch for ``steps`` steps after its first (which learns the prompts, untimed);
    returns (propose s per step, commit s per step, proposals, learned tokens, digest of all trees)."""
    from hetero.core.protocols import ProposalRequest, Verdict

    histories = {f"{prefix}{i}": list(prompt) for i, (prompt, _) in enumerate(streams)}
    truths = {f"{prefix}{i}": (len(prompt), output) for i, (prompt, output) in enumerate(streams)}
    produced = dict.fromkeys(histories, 0)
    propose_s: list[float] = []
    commit_s: list[float] = []
    proposals = learned = 0
    digest = hashlib.sha256()
    for step in range(steps + 1):
        live = [rid for rid in histories if produced[rid] < len(truths[rid][1]) - 1]
        if not live:
            break
        batch = [ProposalRequest(rid, histories[rid], truths[rid][0], max_nodes) for rid in live]
        start = time.process_time()
        trees = cache.propose(batch)
        propose_time = time.process_time() - start
        verdicts = []
        for rid, tree in zip(live, trees):
            digest.update(tree.tokens.tobytes() + tree.parents.tobytes() + (b"" if tree.scores is None else tree.scores.tobytes()))
            truth = truths[rid][1][produced[rid]:]
            accepted = accepted_path(tree, truth[:-1])
            verdicts.append(Verdict(rid, accepted, truth[len(accepted)], len(tree)))
            histories[rid] = histories[rid] + truth[:len(accepted) + 1]
            produced[rid] += len(accepted) + 1
        start = time.process_time()
        cache.commit(verdicts)
        commit_time = time.process_time() - start
        if step:
            propose_s.append(propose_time)
            commit_s.append(commit_time)
            proposals += len(live)
            learned += sum(len(v.accepted_tokens) + 1 for v in verdicts)
    return propose_s, commit_s, proposals, learned, digest.hexdigest()


def measure(batch: int, args) -> dict:
    """One implementation (whichever ``lookahead`` is importable), one batch size."""
    from lookahead import LookaheadCache, LookaheadConfig

    rng = np.random.default_rng(args.seed + batch)
    cache = LookaheadCache(LookaheadConfig(is_debug=False), memory_budget_bytes=8 << 30)
    warm = [make_stream(rng, args.prompt_len, args.output_len) for _ in range(args.warm_requests)]
    drive(cache, warm, "warm", args.output_len, 16)
    for i in range(len(warm)):
        cache.release(f"warm{i}")
    streams = [make_stream(rng, args.prompt_len, args.output_len) for _ in range(batch)]
    max_nodes = min(63, max(8, cache.target_parallelism // batch))
    propose_s, commit_s, proposals, learned, digest = drive(cache, streams, "r", args.steps, max_nodes)
    return dict(batch=batch, propose_s=propose_s, commit_s=commit_s, proposals=proposals, learned=learned, digest=digest)


def extract(rev: str, into: str) -> str:
    """The ``lookahead`` package of git revision ``rev``, unpacked under ``into``."""
    root = REPO_ROOT
    archive = subprocess.run(["git", "-C", root, "archive", rev, "lookahead"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", rev], capture_output=True, text=True, check=True)
    return commit.stdout.strip()


def child(args) -> None:
    if args.package_root:  # ahead of the working tree, which ``-m`` puts first on the path
        sys.path.insert(0, args.package_root)
    import lookahead

    gc.collect()  # start-up objects out of the collector's scans, as the engine does (hetero.engine)
    gc.freeze()
    rows = [measure(b, args) for b in args.batches]
    print(json.dumps([dict(row, package=os.path.dirname(os.path.dirname(lookahead.__file__))) for row in rows]))


def run_child(argv: list[str], package_root: str | None) -> list[dict]:
    extra = ["--package-root", package_root] if package_root else []
    out = subprocess.run([sys.executable, "-m", "bench.lookahead_host", "--child", *extra, *argv],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48, help="timed steps per batch size")
    parser.add_argument("--warm-requests", type=int, default=16, help="finished requests in the global cache")
    parser.add_argument("--repeats", type=int, default=5, help="runs per implementation (each step's least time is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", nargs="*", default=[], help="git revisions whose lookahead package runs side by side")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--package-root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--child"]
    child_argv = _child_args(args)
    with tempfile.TemporaryDirectory(prefix="lookahead-baseline-") as tmp:
        impls: dict[str, str | None] = {}
        for i, rev in enumerate(args.baseline):
            into = os.path.join(tmp, str(i))
            impls[f"{rev} ({extract(rev, into)})"] = into
        impls["working tree"] = None
        runs: dict[str, dict[int, list[dict]]] = {name: {b: [] for b in args.batches} for name in impls}
        # A fresh process per batch size: a heap left fragmented by a larger run slows the next one.
        for _ in range(args.repeats):
            for batch in args.batches:
                for name, path in impls.items():
                    (row,) = run_child(["--batches", str(batch), *child_argv], path)
                    if os.path.realpath(row["package"]) != os.path.realpath(path or REPO_ROOT):
                        raise RuntimeError(f"{name}: imported lookahead from {row['package']}")
                    runs[name][batch].append(row)
    rows = []
    names = list(impls)
    for batch in args.batches:
        for name in names:
            # Every repeat runs the same steps: each step's least time over the repeats is
            # its cost with the least interference from other processes.
            first = runs[name][batch][0]
            propose_s = np.min([r["propose_s"] for r in runs[name][batch]], axis=0).sum()
            commit_s = np.min([r["commit_s"] for r in runs[name][batch]], axis=0).sum()
            rows.append(dict(implementation=name, batch=batch,
                             us_per_learned_token=round(commit_s / first["learned"] * 1e6, 2),
                             us_per_proposal=round(propose_s / first["proposals"] * 1e6, 2),
                             tokens_per_step=round(first["learned"] / first["proposals"], 2),
                             same_trees_as_first=all(r["digest"] == runs[names[0]][batch][0]["digest"]
                                                     for n in names for r in runs[n][batch])))
    write(args, passed, rows)


def _child_args(args) -> list[str]:
    return ["--prompt-len", str(args.prompt_len), "--output-len",
            str(args.output_len), "--steps", str(args.steps), "--warm-requests", str(args.warm_requests),
            "--seed", str(args.seed)]


def write(args, passed: list[str], rows: list[dict]) -> None:
    from bench._machine import describe_machine
    from bench._report import markdown_table, write_markdown_and_json

    info = describe_machine()
    command = "python -m bench.lookahead_host " + " ".join(passed)
    body = ["Steady-state steps after each request's prompt was learned; CPU time of each step, the least over the",
            "repeats (implementations interleaved, each in its own process). `us_per_learned_token`: commit time per accepted + bonus token; `us_per_proposal`: propose",
            "time per request tree; `same_trees_as_first`: every tree equal to the first implementation's.", "",
            *markdown_table(rows)]
    print(write_markdown_and_json(os.path.join(args.out, f"lookahead_host-{info['hostname']}"),
                                  "Lookahead cache host cost (learning and proposing), no model", command, info, rows, body))


if __name__ == "__main__":
    main()
