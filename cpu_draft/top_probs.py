"""The drafter's read of a level's logits: each row's k best head columns and their softmax probabilities.

The native forward (`cpu_draft.native_model`) reads them in its own call, from the logits it
has just written; `top_probabilities` is the same read in torch, for the torch forwards (the
lean one, the paged layout, a GPU draft) and as the reference the native one is tested against.
"""
from __future__ import annotations

import torch

TOP_K_MAX = 16  # csrc/draft_forward.cpp's TOP_K_MAX: the most columns the native read takes per row


def top_probabilities(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, columns), each [rows, k], best first, of float32 ``logits`` [rows, columns]."""
    top, columns = torch.topk(logits, k, dim=-1)
    return torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True)), columns
