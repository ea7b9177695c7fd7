"""How much of a target's text a reduced draft head can propose (`speculative_draft_vocab_size`).

Reads the target's greedy continuations that `bench.acceptance` caches (bench/data/reference/
<model>/<workload>.json) and reports, per workload, the share of those tokens whose id is
among the N a reduced head keeps with no token map (the N lowest ids, BPE merge order). A
token outside the head is one the draft cannot propose: the share caps per-token acceptance.

    python -m bench.head_coverage --model Qwen2.5-Coder-1.5B-Instruct --sizes 8192,16384,32768,65536
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from bench._machine import describe_machine
from bench._report import markdown_table, write_markdown_and_json

REFERENCE_DIR = pathlib.Path(__file__).parent / "data" / "reference"


def coverage(token_ids: list[int], sizes: list[int]) -> dict[str, float]:
    """Share of ``token_ids`` below each head size."""
    return {f"head_{size}": round(sum(t < size for t in token_ids) / len(token_ids), 4) for size in sizes}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--sizes", default="8192,16384,32768,65536")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    files = sorted((REFERENCE_DIR / args.model).glob("*.json"))
    if not files:
        sys.exit(f"no cached continuations of {args.model} in {REFERENCE_DIR}: run python -m bench.acceptance first")
    rows, every = [], []
    for path in files:
        items = json.loads(path.read_text())["items"]
        tokens = [t for item in items for t in item["output_ids"]]
        every += tokens
        rows.append(dict(workload=path.stem, prompts=len(items), tokens=len(tokens), **coverage(tokens, sizes)))
    rows.append(dict(workload="all", prompts=sum(r["prompts"] for r in rows), tokens=len(every), **coverage(every, sizes)))
    command = "python -m bench.head_coverage " + " ".join(sys.argv[1:] if argv is None else argv)
    print(write_markdown_and_json(str(pathlib.Path(args.out) / f"head_coverage-{args.model}"),
                                  f"Reduced draft head: share of {args.model}'s tokens it can propose", command, describe_machine(), rows,
                                  markdown_table(rows)))


if __name__ == "__main__":
    main()
