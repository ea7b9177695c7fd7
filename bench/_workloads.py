"""The project's real-text workloads (bench/data/workloads/*.jsonl) and the target's greedy
continuations of them, generated once with hetero's own engine and cached under
bench/data/reference/<model>/<workload>.json.

A workload line is `{"id", "prompt"}` (raw text, code completion) or `{"id", "messages"}`
(a chat conversation, rendered with the model's chat template from its GGUF).
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Optional

from hetero.llm import render_chat_prompt

DATA_DIR = pathlib.Path(__file__).parent / "data"
WORKLOADS = ("code", "rewrite", "chat", "summarise")


def load_workload(name: str) -> list[dict[str, Any]]:
    path = DATA_DIR / "workloads" / f"{name}.jsonl"
    if not path.is_file():
        raise ValueError(f"unknown workload {name!r}: no {path}; workloads: {', '.join(WORKLOADS)}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def spread(items: list, count: Optional[int]) -> list:
    """`count` items evenly spaced over `items` (all of them when count is None or too large)."""
    if count is None or count >= len(items):
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def prompt_token_ids(tokenizer, item: dict[str, Any]) -> list[int]:
    """The ids `LLM.chat` (messages) or `LLM.generate` (a raw prompt) would feed the model."""
    if "messages" in item:
        return render_chat_prompt(tokenizer, item["messages"], None, True, False)["prompt_token_ids"]
    return list(tokenizer(item["prompt"]).input_ids)


def reference_path(model: str, workload: str) -> pathlib.Path:
    return DATA_DIR / "reference" / model.replace("/", "_") / f"{workload}.json"


def _cached(path: pathlib.Path, ids: list[str], new_tokens: int, dtype: str) -> Optional[list[dict[str, Any]]]:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data["new_tokens"] != new_tokens or data["dtype"] != dtype:
        return None
    by_id = {item["id"]: item for item in data["items"]}
    if not all(i in by_id for i in ids):
        return None
    return [by_id[i] for i in ids]


def greedy_references(model: str, workload: str, items: list[dict[str, Any]], new_tokens: int, dtype: str,
                      llm_factory) -> list[dict[str, Any]]:
    """Each item's prompt ids and the model's greedy continuation (up to `new_tokens`, stopping at EOS).

    Generated in one batch by `llm_factory()` (an `LLM` of `model`) unless cached with the same
    length and dtype; the cache keeps earlier items, so a larger run extends a smaller one.
    """
    from hetero import SamplingParams

    path = reference_path(model, workload)
    ids = [item["id"] for item in items]
    cached = _cached(path, ids, new_tokens, dtype)
    if cached is not None:
        return cached
    llm = llm_factory()
    tokenizer = llm.get_tokenizer()
    prompts = [prompt_token_ids(tokenizer, item) for item in items]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=new_tokens), use_tqdm=False)
    fresh = [{"id": item["id"], "prompt_ids": p, "output_ids": list(o.outputs[0].token_ids)}
             for item, p, o in zip(items, prompts, outputs)]
    previous = json.loads(path.read_text())["items"] if path.is_file() else []
    keep = [item for item in previous if item["id"] not in set(ids)] if _same_settings(path, new_tokens, dtype) else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "workload": workload, "dtype": dtype, "new_tokens": new_tokens,
                                "items": keep + fresh}, separators=(",", ":")))
    return fresh


def _same_settings(path: pathlib.Path, new_tokens: int, dtype: str) -> bool:
    if not path.is_file():
        return False
    data = json.loads(path.read_text())
    return data["new_tokens"] == new_tokens and data["dtype"] == dtype
