"""``lookahead_cache_config.json``: TACO-LLM's lookahead-cache knobs, same names; `EngineConfig.lookahead`
holds one (read from ``lookahead_cache_config_dir``, or vLLM's ngram ``speculative_config``).

Defaults are the values of TACO-LLM's manual example, except ``eos_token_id`` (model
specific, so ``None`` until the engine fills it in). What each key means *here*:

cache_mode           0 raw: copy the most recent continuation of the longest matching
                     n-gram (``min_match_length``..``match_length`` tokens); 1 turbo: a
                     multi-branch tree from a frequency trie, matched on up to
                     ``turbo_match_length`` tokens, pruned by ``threshold``/``decay``;
                     2 hybrid: turbo, with raw when turbo finds nothing.
cache_size           most nodes the global (cross-request) trie may hold.
copy_length          deepest a proposal goes (tokens after the matched context).
match_length         longest n-gram raw mode matches.
turbo_match_length   longest context turbo mode matches.
min_match_length     shortest context either mode accepts as a match.
cell_max_size        most children a node of the global trie keeps; a new one evicts
                     the least recently used sibling.
voc_size             token ids in a warm-up file must lie in ``[0, voc_size)``.
max_seq_len          a sequence going into the global cache keeps its last
                     ``max_seq_len`` tokens.
eos_token_id         proposals never continue past this token.
top_k                raw mode: number of alternative copies (branches) proposed.
threshold            turbo: a node is proposed only when its score (frequency, a
                     request's own history weighted by ``start_freq``) reaches this.
decay                turbo: factor applied to a node's frequency each time the
                     verifier rejects it (dynamic pruning).
is_hybrid            mode 2: also fill a turbo tree's unused budget with raw's copy
                     (false: raw only when turbo's tree is empty).
is_debug             log ``log_line()`` every ``log_interval`` verdicts (logger
                     ``hetero.lookahead``).
log_interval         see ``is_debug``.
target_parallelism   the step's node budget summed over the batch; read by the
                     coordinator, which hands each sequence its ``max_nodes``.
top_k_in_cell        turbo: most children of one node expanded into a proposal.
token_paths_top_k    turbo: how many matched contexts (longest first) per history
                     contribute continuations.
start_freq           weight of one occurrence in the request's own history (prompt and
                     output) relative to 1.0 for one occurrence in the global history.
num_threads          accepted; this implementation proposes on one thread.
global_cache_switch  false: no cross-request history (only the request's own).
ignore_prompt        prompts are not put into the global cache (the request's own
                     history still holds its prompt).
warmup_file          JSON ``[{"prompt": [ids], "output": [ids]}, ...]`` loaded into
                     the global cache at start; relative to the config directory.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

CONFIG_FILE_NAME = "lookahead_cache_config.json"


@dataclass(frozen=True)
class LookaheadConfig:
    cache_mode: int = 2
    cache_size: int = 5_000_000
    copy_length: int = 7
    match_length: int = 2
    turbo_match_length: int = 7
    min_match_length: int = 2
    cell_max_size: int = 16
    voc_size: int = 200_000
    max_seq_len: int = 32_768
    eos_token_id: Optional[int] = None
    top_k: int = 1
    threshold: float = 2.0
    decay: float = 0.5
    is_hybrid: bool = True
    is_debug: bool = True
    log_interval: int = 3000
    target_parallelism: int = 512
    top_k_in_cell: int = 16
    token_paths_top_k: int = 2
    start_freq: float = 10.0
    num_threads: int = 8
    global_cache_switch: bool = True
    ignore_prompt: bool = False
    warmup_file: Optional[str] = None

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def context_length(self) -> int:
        """Longest context any enabled mode matches."""
        if self.cache_mode == 0:
            return self.match_length
        return max(self.match_length, self.turbo_match_length)

    @property
    def trie_depth(self) -> int:
        """Tokens stored per history position: a full context plus a full copy."""
        return self.context_length + self.copy_length

    @classmethod
    def from_dict(cls, values: dict, source: str = "lookahead cache config") -> "LookaheadConfig":
        if not isinstance(values, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise ValueError(f"{source}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        for key, value in values.items():
            problem = _type_problem(key, value)
            if problem:
                raise ValueError(f"{source}: {problem}")
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_dir(cls, config_dir: str | os.PathLike) -> "LookaheadConfig":
        """Read ``lookahead_cache_config.json`` from ``config_dir``; defaults when absent."""
        path = os.path.join(os.fspath(config_dir), CONFIG_FILE_NAME)
        if not os.path.exists(path):
            return cls()
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
        config = cls.from_dict(values, source=path)
        if config.warmup_file and not os.path.isabs(config.warmup_file):
            warmup = os.path.join(os.path.dirname(os.path.abspath(path)), config.warmup_file)
            config = dataclasses.replace(config, warmup_file=warmup)
        return config

    @classmethod
    def from_ngram(
        cls,
        num_speculative_tokens: int,
        prompt_lookup_max: Optional[int] = None,
        prompt_lookup_min: Optional[int] = None,
    ) -> "LookaheadConfig":
        """vLLM's ``speculative_config={"method": "ngram", ...}``: raw prompt lookup.

        As in vLLM, a missing bound takes the other's value, and both default to 5.
        Only the request's own tokens are searched (no global cache), one copy.
        """
        if prompt_lookup_max is None and prompt_lookup_min is None:
            prompt_lookup_max = prompt_lookup_min = 5
        elif prompt_lookup_max is None:
            prompt_lookup_max = prompt_lookup_min
        elif prompt_lookup_min is None:
            prompt_lookup_min = prompt_lookup_max
        values = {
            "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_max": prompt_lookup_max,
            "prompt_lookup_min": prompt_lookup_min,
        }
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {key} must be a positive integer, got {value!r}")
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({prompt_lookup_max})"
            )
        return cls(
            cache_mode=0,
            copy_length=num_speculative_tokens,
            match_length=prompt_lookup_max,
            turbo_match_length=prompt_lookup_max,
            min_match_length=prompt_lookup_min,
            top_k=1,
            is_hybrid=False,
            is_debug=False,
            global_cache_switch=False,
        )


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(LookaheadConfig)}


def _type_problem(key: str, value: Any) -> Optional[str]:
    kind = _FIELD_TYPES[key]
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{key} must be an integer, got {value!r}"
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"{key} must be a number, got {value!r}"
    if kind == "bool" and not isinstance(value, bool):
        return f"{key} must be true or false, got {value!r}"
    if kind == "Optional[int]" and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{key} must be an integer or null, got {value!r}"
    if kind == "Optional[str]" and value is not None and not isinstance(value, str):
        return f"{key} must be a path string or null, got {value!r}"
    return None


_POSITIVE_INTS = (
    "cache_size", "copy_length", "match_length", "turbo_match_length", "min_match_length",
    "cell_max_size", "voc_size", "max_seq_len", "top_k", "log_interval",
    "target_parallelism", "top_k_in_cell", "token_paths_top_k", "num_threads",
)


def _problems(config: LookaheadConfig) -> list[str]:
    problems = [p for p in (_type_problem(k, getattr(config, k)) for k in _FIELD_TYPES) if p]
    if problems:
        return problems
    if config.cache_mode not in (0, 1, 2):
        problems.append(f"cache_mode must be 0 (raw), 1 (turbo) or 2 (hybrid), got {config.cache_mode}")
    problems += [f"{k} must be >= 1, got {getattr(config, k)}" for k in _POSITIVE_INTS if getattr(config, k) < 1]
    if config.min_match_length > config.match_length:
        problems.append(
            f"min_match_length ({config.min_match_length}) must not exceed match_length ({config.match_length})"
        )
    if config.cache_mode != 0 and config.min_match_length > config.turbo_match_length:
        problems.append(
            f"min_match_length ({config.min_match_length}) must not exceed "
            f"turbo_match_length ({config.turbo_match_length})"
        )
    if config.threshold < 0:
        problems.append(f"threshold must be >= 0, got {config.threshold}")
    if not 0 < config.decay <= 1:
        problems.append(f"decay must be in (0, 1], got {config.decay}")
    if config.start_freq <= 0:
        problems.append(f"start_freq must be > 0, got {config.start_freq}")
    if config.eos_token_id is not None and config.eos_token_id < 0:
        problems.append(f"eos_token_id must be >= 0, got {config.eos_token_id}")
    return problems
