"""From logits to tokens: the request's processors, sampling, logprobs and tree acceptance.

``target_probs`` turns each row of logits into the exact distribution plain decoding
would sample from, so that ``verify_tree`` can accept draft tokens losslessly against it.
Processors run in vLLM's order: min_tokens, no_repeat_ngram_size, the structured-output
mask and logit_bias, repetition penalty, presence/frequency penalties, then (sampling rows
only) temperature, top-k, top-p, min-p. The mask is given per row (`RowContext.allowed_tokens`)
so a tree's rows each carry the grammar's state along their own draft path.

``target_probs`` is batched over rows with per-row parameter vectors: its only per-row
Python work is gathering each row's token ids (O(sequence length), never O(vocab)).
``sample`` draws all unseeded rows at once and each seeded row from its own generator.
Works on any device: tensors stay where the logits are, and a row's generator must live
on that device too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from hetero.core.protocols import TokenTree
from hetero.core.sampling_params import SamplingParams


@dataclass
class RowContext:
    """One row of logits to turn into a distribution."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated before this row's position
    eos_token_ids: Sequence[int]  # the model's EOS ids, banned (with stop_token_ids) below min_tokens
    generator: Optional[torch.Generator] = None  # the request's own, when params.seed is set
    allowed_tokens: Optional[torch.Tensor] = None  # bool [V]: the tokens a structured output allows here


def _row_tensor(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)


def _ban(logits: torch.Tensor, row_ids: list[int], token_ids: list[int]) -> None:
    """Set logits[row_ids[i], token_ids[i]] to -inf in one scatter."""
    if row_ids:
        index = torch.tensor([row_ids, token_ids], dtype=torch.long, device=logits.device)
        logits[index[0], index[1]] = float("-inf")


def no_repeat_ngram_bans(token_ids: Sequence[int], ngram_size: int) -> np.ndarray:
    """Tokens that would complete an n-gram already present in ``token_ids``.

    Same result as transformers' NoRepeatNGramLogitsProcessor: the last ``ngram_size - 1``
    tokens are looked up among all earlier windows, and every token that followed a match
    is banned. Vectorised over positions with numpy.
    """
    seq = np.asarray(token_ids, dtype=np.int64)
    length = len(seq)
    if ngram_size <= 0 or length + 1 < ngram_size:
        return np.zeros(0, np.int64)
    prefix_len = ngram_size - 1
    num_windows = length - prefix_len  # windows seq[i : i + ngram_size] that end inside seq
    if num_windows <= 0:
        return np.zeros(0, np.int64)
    match = np.ones(num_windows, dtype=bool)
    suffix = seq[length - prefix_len:]
    for j in range(prefix_len):
        match &= seq[j:j + num_windows] == suffix[j]
    return np.unique(seq[prefix_len:][match])


def _apply_bans(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    """min_tokens (EOS and stop_token_ids) and no_repeat_ngram_size, in place."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) < params.min_tokens:
            stops = set(row.eos_token_ids) | set(params.stop_token_ids)
            row_ids += [i] * len(stops)
            token_ids += sorted(stops)
        if params.no_repeat_ngram_size > 0:
            context = list(row.prompt_token_ids) + list(row.output_token_ids)
            banned = no_repeat_ngram_bans(context, params.no_repeat_ngram_size).tolist()
            row_ids += [i] * len(banned)
            token_ids += banned
    _ban(logits, row_ids, token_ids)


def _apply_mask_and_bias(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    """Structured-output masks (disallowed tokens to -inf) and logit_bias, in place."""
    masked = [i for i, r in enumerate(rows) if r.allowed_tokens is not None]
    if masked:
        allowed = torch.stack([rows[i].allowed_tokens for i in masked]).to(logits.device)
        logits[masked] = logits[masked].masked_fill(~allowed, float("-inf"))
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            row_ids += [i] * len(row.params.logit_bias)
            token_ids += list(row.params.logit_bias)
            biases += list(row.params.logit_bias.values())
    if row_ids:
        index = torch.tensor([row_ids, token_ids], dtype=torch.long, device=logits.device)
        logits.index_put_((index[0], index[1]), torch.tensor(biases, device=logits.device), accumulate=True)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    """Repetition penalty over prompt + output, presence/frequency over output; in place."""
    rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        seen = torch.zeros(len(rep_rows), logits.shape[1], dtype=torch.bool, device=logits.device)
        row_ids, token_ids = [], []
        for k, i in enumerate(rep_rows):
            tokens = list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids)
            row_ids += [k] * len(tokens)
            token_ids += tokens
        if token_ids:
            index = torch.tensor([row_ids, token_ids], dtype=torch.long, device=logits.device)
            seen[index[0], index[1]] = True
        penalty = _row_tensor([rows[i].params.repetition_penalty for i in rep_rows], logits)
        sub = logits[rep_rows]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[rep_rows] = torch.where(seen, penalised, sub)

    freq_rows = [i for i, r in enumerate(rows)
                 if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
    if freq_rows:
        counts = torch.zeros(len(freq_rows), logits.shape[1], dtype=torch.float32, device=logits.device)
        row_ids, token_ids = [], []
        for k, i in enumerate(freq_rows):
            tokens = list(rows[i].output_token_ids)
            row_ids += [k] * len(tokens)
            token_ids += tokens
        if token_ids:
            index = torch.tensor([row_ids, token_ids], dtype=torch.long, device=logits.device)
            counts.index_put_((index[0], index[1]), torch.ones(len(token_ids), device=logits.device),
                              accumulate=True)
        frequency = _row_tensor([rows[i].params.frequency_penalty for i in freq_rows], logits)
        presence = _row_tensor([rows[i].params.presence_penalty for i in freq_rows], logits)
        logits[freq_rows] -= frequency * counts + presence * (counts > 0).float()


def _apply_top_k_top_p(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """vLLM's rule: keep logits >= the k-th largest (ties kept), then the smallest set of
    most likely tokens whose probability reaches top_p (always at least one)."""
    vocab = logits.shape[1]
    ascending, order = logits.sort(dim=-1)
    k = torch.tensor([vocab if kk <= 0 else min(kk, vocab) for kk in top_k],
                     dtype=torch.long, device=logits.device)
    kth_largest = ascending.gather(1, (vocab - k).unsqueeze(1))
    ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    p = _row_tensor(top_p, logits)
    outside = (cumulative <= 1.0 - p) & (p < 1.0)
    outside[:, -1] = False
    ascending = ascending.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def target_probs(logits: torch.Tensor, rows: Sequence[RowContext]) -> torch.Tensor:
    """float32 [n, V] probabilities: the distribution plain decoding samples each row from.

    Greedy rows come back one-hot at the argmax of their penalised logits.
    """
    if logits.shape[0] != len(rows):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(rows)} RowContexts were given")
    logits = logits.to(torch.float32, copy=True)
    if not rows:
        return logits
    vocab = logits.shape[1]
    _apply_bans(logits, rows)
    _apply_mask_and_bias(logits, rows)
    _apply_penalties(logits, rows)

    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    probs = torch.empty_like(logits)
    if greedy:
        probs[greedy] = torch.nn.functional.one_hot(logits[greedy].argmax(dim=-1), vocab).float()
    if not sampled:
        return probs

    params = [rows[i].params for i in sampled]
    scaled = logits[sampled] / _row_tensor([p.temperature for p in params], logits)
    truncating = [k for k, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if truncating:
        scaled[truncating] = _apply_top_k_top_p(
            scaled[truncating], [params[k].top_k for k in truncating], [params[k].top_p for k in truncating]
        )
    if any(p.min_p > 0.0 for p in params):
        min_p = _row_tensor([p.min_p for p in params], logits)
        row_probs = scaled.softmax(dim=-1)
        threshold = min_p * row_probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(row_probs < threshold, float("-inf"))
    probs[sampled] = scaled.softmax(dim=-1)
    return probs


def _exponential_race(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with probability p_i / sum(p).

    Works on unnormalised rows, needs no cumsum (so no float drift over a large vocab)
    and draws exactly V numbers per row, so a seeded row's stream never depends on its
    neighbours. E is floored at the smallest normal float so a zero draw cannot make 0/0.
    """
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


def sample(probs: torch.Tensor, rows: Sequence[RowContext]) -> torch.Tensor:
    """int64 [n]: argmax for greedy rows, otherwise a draw using the row's own generator
    (the default generator for rows without one)."""
    if probs.shape[0] != len(rows):
        raise ValueError(f"probs has {probs.shape[0]} rows but {len(rows)} RowContexts were given")
    tokens = probs.argmax(dim=-1)
    unseeded = [i for i, r in enumerate(rows) if not r.params.is_greedy and r.generator is None]
    if unseeded:
        tokens[unseeded] = _exponential_race(probs[unseeded], None)
    for i, row in enumerate(rows):
        if not row.params.is_greedy and row.generator is not None:
            tokens[i] = _exponential_race(probs[i:i + 1], row.generator)[0]
    return tokens


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                 num_top: Sequence[int]) -> list[dict[int, tuple[float, int]]]:
    """Per row, {token_id: (logprob, rank)} for the chosen token and the row's top tokens.

    Logprobs are of the raw logits, before any processor, as vLLM reports them. Rank is
    1-based; the chosen token's rank counts the tokens at least as likely as it (vLLM's
    convention). ``num_top[i]`` of -1 means the whole vocabulary, 0 the chosen token only.
    """
    if not (logits.shape[0] == len(token_ids) == len(num_top)):
        raise ValueError("raw_logprobs needs one chosen token and one num_top per row of logits")
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    vocab = logprobs.shape[1]
    chosen = token_ids.to(device=logprobs.device, dtype=torch.long).unsqueeze(1)
    chosen_logprob = logprobs.gather(1, chosen)
    chosen_rank = (logprobs >= chosen_logprob).sum(dim=-1)
    widths = [vocab if k == -1 else min(k, vocab) for k in num_top]
    top_values, top_ids = logprobs.topk(max(widths, default=0), dim=-1)

    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    chosen_ids = chosen[:, 0].tolist()
    chosen_values, chosen_ranks = chosen_logprob[:, 0].tolist(), chosen_rank.tolist()
    result = []
    for i, width in enumerate(widths):
        entry = {chosen_ids[i]: (chosen_values[i], chosen_ranks[i])}
        for rank in range(width):
            entry[top_ids[i][rank]] = (top_values[i][rank], rank + 1)
        result.append(entry)
    return result


def _children(tree: TokenTree) -> list[list[int]]:
    """children[r]: the nodes whose row-of-origin is r (row 0 = root, row i+1 = node i)."""
    kids: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for node, parent in enumerate(tree.parent_list):
        kids[parent + 1].append(node)
    return kids


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with no processor that can move the argmax: the raw logits' argmax is the token."""
    return (
        params.is_greedy
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.no_repeat_ngram_size
        and params.min_tokens == 0
        and not params.logit_bias
        and params.structured_outputs is None
    )


def greedy_accept(argmax: Sequence[int], tree: TokenTree) -> tuple[list[int], int]:
    """The deepest node whose whole path matches the row argmaxes; ties go to the lowest index.

    ``argmax[0]`` is the target's choice at the root, ``argmax[i + 1]`` after node i.
    """
    tokens, parents = tree.token_list, tree.parent_list
    depth = [0] * len(tree)
    best, best_depth = -1, 0
    for node, parent in enumerate(parents):
        parent_ok = parent < 0 or depth[parent] > 0
        if parent_ok and tokens[node] == argmax[parent + 1]:
            depth[node] = (depth[parent] if parent >= 0 else 0) + 1
            if depth[node] > best_depth:
                best, best_depth = node, depth[node]
    return tree.path_to(best), argmax[best + 1]


def verify_tree(probs: torch.Tensor, tree: TokenTree, greedy: bool,
                generator: Optional[torch.Generator]) -> tuple[list[int], int]:
    """Accept a path of draft nodes and pick the bonus token after it.

    ``probs`` is [len(tree) + 1, V]: row 0 the target distribution at the root, row i+1
    the distribution after node i. Returns (accepted node indices, root's child first;
    bonus token).

    Sampling is SpecInfer's multi-draft recursive rejection with point-mass drafts: at a
    row p, children are tried in order, child token x accepted with probability
    p[x] / Z where Z is the mass not yet rejected at this row; a rejected x leaves the
    residual (p with x zeroed, renormalised). Each token is therefore emitted with
    probability exactly p[token], by induction over the children; a duplicate sibling
    meets p[x] = 0 and is rejected. When no child is accepted, the bonus is drawn from
    the residual; after an accepted leaf, from the leaf's row.

    Randomness comes from ``generator`` only, and always in the same amounts (one
    uniform per node, then V exponentials for the bonus), so a seeded request replays.
    """
    if probs.shape[0] != len(tree) + 1:
        raise ValueError(f"probs must have len(tree) + 1 = {len(tree) + 1} rows, got {probs.shape[0]}")
    if greedy:
        return greedy_accept(probs.argmax(dim=-1).tolist(), tree)

    n = len(tree)
    kids = _children(tree)
    tokens = tree.token_list
    device = probs.device
    uniforms = torch.rand(n, generator=generator, dtype=torch.float64, device=device).tolist()
    # One gather for every probability the walk can need: each node's token in its parent's row.
    origin_rows = torch.as_tensor(tree.parents.astype(np.int64) + 1, device=device)
    draft_probs = probs[origin_rows, torch.as_tensor(tree.tokens, device=device)].double().tolist()
    row_mass = probs.sum(dim=-1, dtype=torch.float64).tolist()

    accepted: list[int] = []
    row = 0
    while True:
        rejected: dict[int, float] = {}  # token -> its mass at this row
        remaining = row_mass[row]
        chosen = -1
        for node in kids[row]:
            x = tokens[node]
            p_x = 0.0 if x in rejected else draft_probs[node]
            if p_x > 0.0 and uniforms[node] * remaining < p_x:
                chosen = node
                break
            if x not in rejected:
                rejected[x] = p_x
                remaining -= p_x
        if chosen < 0:
            residual = probs[row]
            if rejected:
                residual = residual.clone()
                residual[torch.tensor(list(rejected), dtype=torch.long, device=device)] = 0.0
            return accepted, int(_exponential_race(residual.unsqueeze(0), generator)[0])
        accepted.append(chosen)
        row = chosen + 1
