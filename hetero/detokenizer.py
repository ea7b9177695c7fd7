"""Incremental detokenisation and stop-string handling, as vLLM does them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

# Number of earlier tokens decoded together with the new ones, so that multi-token
# characters and leading-space rules of BPE/SentencePiece come out right.
_CONTEXT_TOKENS = 5


@dataclass
class DetokenizerState:
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    num_seen: int = 0  # tokens the detokeniser has been shown, text held back or not


def init_state(prompt_token_ids: Sequence[int]) -> DetokenizerState:
    start = len(prompt_token_ids)
    return DetokenizerState(prefix_offset=max(start - _CONTEXT_TOKENS, 0), read_offset=start, num_seen=start)


def decode_new_text(tokenizer, all_token_ids: Sequence[int], state: DetokenizerState, skip_special_tokens: bool,
                    spaces_between_special_tokens: bool = True, end: Optional[int] = None) -> str:
    """Append the newly decodable text of `all_token_ids[:end]` to `state.text`; return the delta.

    Text is held back while the tail decodes to an incomplete UTF-8 sequence (U+FFFD).
    """
    end = len(all_token_ids) if end is None else end
    kwargs = {"skip_special_tokens": skip_special_tokens}
    if not spaces_between_special_tokens:
        kwargs["spaces_between_special_tokens"] = False
    state.num_seen = end
    prefix = tokenizer.decode(all_token_ids[state.prefix_offset : state.read_offset], **kwargs)
    full = tokenizer.decode(all_token_ids[state.prefix_offset : end], **kwargs)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix) :]
    state.prefix_offset = state.read_offset
    state.read_offset = end
    state.text += delta
    return delta


def catch_up(tokenizer, all_token_ids: Sequence[int], state: DetokenizerState, skip_special_tokens: bool,
             spaces_between_special_tokens: bool = True) -> None:
    """Show the detokeniser the tokens appended since it last looked, one at a time: the same
    text as `decode_new_text` called after every append, produced later (off the step's path)."""
    for end in range(state.num_seen + 1, len(all_token_ids) + 1):
        decode_new_text(tokenizer, all_token_ids, state, skip_special_tokens, spaces_between_special_tokens, end)


def find_stop_string(text: str, new_chars: int, stops: Sequence[str], include_stop: bool) -> Optional[tuple[str, int]]:
    """First stop string completed by the last `new_chars` characters of `text`.

    Returns (stop string, length to truncate the text to), or None.
    """
    earliest: Optional[tuple[int, str]] = None
    for stop in stops:
        index = text.find(stop, max(len(text) - new_chars - len(stop) + 1, 0))
        if index >= 0 and (earliest is None or index < earliest[0]):
            earliest = (index, stop)
    if earliest is None:
        return None
    index, stop = earliest
    return stop, index + len(stop) if include_stop else index
