"""The drafter's read of a level's logits: each row's k best columns and their softmax probabilities.

With the native draft forward loaded, one C++/OpenMP call (`draft_top_probs` in
csrc/draft_forward.cpp) does it in a pass over the logits; torch's ``topk`` and
``logsumexp`` over a 32k-column head took about as long as the forward itself at 8-32 rows
(bench/results). Elsewhere (the torch forward, a GPU draft) torch does it.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

TOP_K_MAX = 16  # csrc/draft_forward.cpp's TOP_K_MAX


def top_probabilities(logits: torch.Tensor, k: int, library: Optional[ctypes.CDLL] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, columns), each [rows, k], largest first, of float32 ``logits`` [rows, columns]."""
    if library is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or not 1 <= k <= min(TOP_K_MAX, logits.shape[-1]):
        top, columns = torch.topk(logits, k, dim=-1)
        return torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True)), columns
    logits = logits.contiguous()
    rows, width = logits.shape
    probs = torch.empty(rows, k, dtype=torch.float32)
    columns = torch.empty(rows, k, dtype=torch.int64)
    if rows:
        code = library.draft_top_probs(logits.data_ptr(), rows, width, k, torch.get_num_threads(), probs.data_ptr(), columns.data_ptr())
        if code:
            raise ValueError(f"draft_top_probs: k = {k} out of range for {width} columns")
    return probs, columns
