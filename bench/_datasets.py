"""Prompt sources for the serving benchmark: ShareGPT JSON, a JSONL of prompts, synthetic.

The benchmark is tokenizer-free so that it can drive any endpoint: where a dataset does
not say how many tokens to generate, the length is estimated at four characters per
token (pass ``--output-len`` to fix it), and the token counts that go into the results
come from the server's ``usage`` block, not from these estimates.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

CHARS_PER_TOKEN = 4

_HUMAN_ROLES = {"human", "user"}
_MODEL_ROLES = {"gpt", "assistant", "chatgpt", "bard", "model"}

# Short common words: with a leading space each is a single token in the usual BPE vocabularies.
_SYNTHETIC_WORDS = (
    "the of and to in is it you that he was for on are as with his they at be this from "
    "have or by one had not but what all were when we there can an your which their said "
    "if do will each about how up out them then she many some so these would other into "
    "has more her two like him see time could no make than first been its who now people "
    "my made over did down only way find use may water long little very after words called "
    "just where most know get through back much go good new write our me man too any day "
    "same right look think also around another came come work three word must because does "
    "part even place well such here take why things help put years different away again off"
).split()


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file (and line)."""


@dataclass(frozen=True)
class Prompt:
    """One request to send: text (or token ids, completions only) and tokens to generate."""

    prompt: Union[str, list[int]]
    output_len: int


def estimate_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def _read_text(path: Union[str, Path]) -> str:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    return path.read_text(encoding="utf-8")


def load_sharegpt(path: Union[str, Path], output_len: Optional[int] = None) -> list[Prompt]:
    """First human turn of each conversation, generating as many tokens as the model's
    reply had (estimated) unless ``output_len`` is given. Conversations without a human
    turn followed by a model reply are skipped."""
    try:
        entries = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(entries, list):
        raise DatasetError(f"{path}: expected a JSON list of {{'conversations': [...]}} entries")
    prompts = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        pair = _first_exchange(turns or [])
        if pair is None:
            continue
        question, reply = pair
        prompts.append(Prompt(question, output_len or estimate_tokens(reply)))
    if not prompts:
        raise DatasetError(f"{path}: no conversation with a human turn followed by a reply")
    return prompts


def _first_exchange(turns: list) -> Optional[tuple[str, str]]:
    for turn, following in zip(turns, turns[1:]):
        if not (isinstance(turn, dict) and isinstance(following, dict)):
            continue
        if (turn.get("from") in _HUMAN_ROLES and following.get("from") in _MODEL_ROLES
                and turn.get("value") and following.get("value")):
            return turn["value"], following["value"]
    return None


def load_jsonl(path: Union[str, Path], default_output_len: int) -> list[Prompt]:
    """One JSON object per line with a ``prompt``; ``output_len`` or ``max_tokens`` per line
    overrides ``default_output_len``."""
    prompts = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not valid JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise DatasetError(f'{path}:{number}: expected an object with a non-empty "prompt" string')
        length = row.get("output_len", row.get("max_tokens", default_output_len))
        if not isinstance(length, int) or length < 1:
            raise DatasetError(f"{path}:{number}: output_len must be a positive integer, got {length!r}")
        prompts.append(Prompt(row["prompt"], length))
    if not prompts:
        raise DatasetError(f"{path}: no prompts")
    return prompts


def synthetic_prompts(num: int, input_len: int, output_len: int, rng: random.Random,
                      vocab_size: Optional[int] = None) -> list[Prompt]:
    """Random prompts of ``input_len`` words, or of ``input_len`` token ids drawn from
    ``[0, vocab_size)`` when a vocabulary size is given (exact lengths; completions only)."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be positive")
    if vocab_size is not None:
        return [Prompt([rng.randrange(vocab_size) for _ in range(input_len)], output_len)
                for _ in range(num)]
    return [Prompt(" ".join(rng.choice(_SYNTHETIC_WORDS) for _ in range(input_len)), output_len)
            for _ in range(num)]


def sample_prompts(prompts: list[Prompt], num: int, rng: random.Random) -> list[Prompt]:
    """``num`` prompts in a seeded random order; a dataset smaller than ``num`` is reused
    round after round, each round shuffled afresh."""
    chosen: list[Prompt] = []
    while len(chosen) < num:
        round_ = list(prompts)
        rng.shuffle(round_)
        chosen.extend(round_[: num - len(chosen)])
    return chosen
