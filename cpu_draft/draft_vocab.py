"""The draft's reduced vocabulary: the LM head over the most frequent tokens only (FR-Spec).

A small draft with a large vocabulary spends most of its bytes on the logits head (Llama-3:
576 x 128,256 against ~28 M parameters in eight layers). FR-Spec (Zhao et al., 2025,
"FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative
Sampling") and EAGLE-3 restrict the draft's head to the few tens of thousands of tokens that
carry almost all of the text's mass; the target still verifies over its whole vocabulary, so
the output is unchanged and only a draft whose best token lies outside the set misses.

The set is the first ``size`` ids of a token map (SGLang's ``speculative_token_map``: a file of
token ids, most frequent first), or with no map the ``size`` lowest ids: byte-level BPE
vocabularies (Llama-3, Qwen2, SmolLM2) number tokens in merge order, which follows frequency
in the tokenizer's training corpus. Special ids (EOS, chat markers) are always kept.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Optional

import numpy as np


def load_token_map(path: str) -> np.ndarray:
    """Token ids, most frequent first, from ``.npy``, ``.pt``, ``.json`` (a list) or text (ids split by whitespace)."""
    if not os.path.isfile(path):
        raise ValueError(f"speculative_token_map {path!r} is not a file")
    if path.endswith(".npy"):
        ids = np.load(path)
    elif path.endswith(".pt"):
        import torch

        ids = torch.load(path, map_location="cpu", weights_only=True)
        ids = ids.numpy() if hasattr(ids, "numpy") else np.asarray(ids)
    elif path.endswith(".json"):
        with open(path) as f:
            ids = np.asarray(json.load(f))
    else:
        with open(path) as f:
            ids = np.asarray(f.read().split(), dtype=np.int64)
    ids = np.asarray(ids).reshape(-1)
    if ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"speculative_token_map {path!r} must hold a non-empty list of integer token ids")
    return ids.astype(np.int64)


def draft_head_ids(vocab_size: int, size: Optional[int], token_map: Optional[str] = None,
                   always: Iterable[int] = ()) -> Optional[np.ndarray]:
    """Sorted token ids the draft's head scores, or None for the whole vocabulary.

    ``size``: how many ids to keep (None: all the map holds, or the whole vocabulary without
    a map); ``always``: ids kept whatever their rank (special tokens).
    """
    if size is None and token_map is None:
        return None
    if size is not None and size < 1:
        raise ValueError(f"draft_vocab_size must be at least 1, got {size}")
    ranked = load_token_map(token_map) if token_map is not None else np.arange(vocab_size, dtype=np.int64)
    if ranked.min() < 0 or ranked.max() >= vocab_size:
        raise ValueError(f"speculative_token_map {token_map!r} holds ids outside the vocabulary [0, {vocab_size})")
    _, first = np.unique(ranked, return_index=True)
    ranked = ranked[np.sort(first)]  # duplicates dropped, rank order kept
    keep = ranked[:size] if size is not None else ranked
    extra = np.asarray([i for i in always if 0 <= i < vocab_size], dtype=np.int64)
    ids = np.union1d(keep, extra)
    return None if ids.size >= vocab_size else ids
