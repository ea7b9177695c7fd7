"""Sampling and tree verification for a whole step, and the KV moves of the accepted paths.

Plain rows are sampled; each token tree is verified against the target's rows for its
root and nodes. When every row is plain greedy, all trees are verified at once over flat
arrays (`accept_greedy`: node tokens, parents and offsets, as vLLM's rejection sampler is
fed flat metadata); otherwise each tree runs SpecInfer's multi-draft rejection sampling
(Miao et al. 2024; `gpu_target.sampler.verify_tree`) against its rows' exact target
distributions, which is lossless (Leviathan et al. 2023). An accepted path's KV is then
compacted behind the root, one copy for the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

import numpy as np
import torch

from gpu_target.sampler import RowContext, sample, target_probs, verify_tree
from hetero.core.protocols import Verdict
from hetero.input_layout import ChunkRows, SampleRow, row_offsets
from hetero.scheduler import ScheduledSeq, Scheduler, Sequence
from hetero.spec.step_trees import StepTrees

KVMove = tuple[list[int], int, int]  # (block table, source storage index, destination storage index)


@dataclass
class StepTokens:
    """What a step's logits decided: each sampling sequence's new tokens and the rows that scored them."""

    sample_logits: Optional[torch.Tensor] = None  # the sampling rows, which `appends` index
    appends: list[tuple[Sequence, list[int], Seq[int]]] = field(default_factory=list)  # (sequence, tokens, rows)
    verdicts: list[Verdict] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    accepted_counts: list[int] = field(default_factory=list)
    kv_moves: list[KVMove] = field(default_factory=list)


def accept_greedy(argmax: np.ndarray, tokens: np.ndarray, parents: Optional[np.ndarray], node_offsets: np.ndarray,
                  row_starts: np.ndarray) -> np.ndarray:
    """Greedy acceptance over every tree of a step at once: per tree, the deepest node whose
    whole path matches the target's argmaxes (ties to the lowest index; -1: none).

    Tree b's nodes are ``tokens[node_offsets[b]:node_offsets[b + 1]]`` with tree-local
    ``parents`` (-1 for the root's children, parents before children; None: every tree is a
    chain); its rows start at ``argmax[row_starts[b]]`` (the root's), node i's row is
    ``row_starts[b] + i + 1``. Trees must be non-empty. Same result as
    `gpu_target.sampler.greedy_accept` per tree.
    """
    sizes = np.diff(node_offsets)
    firsts = node_offsets[:-1]
    index = np.arange(len(tokens))
    if parents is None:
        return _accept_chains(argmax, tokens, index, sizes, firsts, row_starts)
    tree_of = np.repeat(np.arange(len(sizes)), sizes)
    first = firsts[tree_of]
    local = index - first
    if np.array_equal(parents, local - 1):
        return _accept_chains(argmax, tokens, index, sizes, firsts, row_starts)
    match = tokens == argmax[row_starts[tree_of] + parents + 1]
    span = int(sizes.max()) + 1
    # Pointer jumping, one round per doubling of the depth rather than one per level: `up` is
    # a node's 2^r-th ancestor, or past the root the sentinel n (matching, of depth 0, its own
    # ancestor); `whole` says whether every node from just below `up` down to the node
    # matches, `depth` counts them.
    n = len(tokens)
    up = np.append(np.where(parents < 0, n, first + parents), n)
    whole = np.append(match, True)
    depth = np.ones(n + 1, dtype=np.int64)
    depth[n] = 0
    for _ in range((int(sizes.max()) - 1).bit_length()):
        whole = whole & whole[up]
        depth = depth + depth[up]
        up = up[up]
    depth = np.where(whole[:n], depth[:n], 0)  # depth of each node's matching path (0: its path misses somewhere)
    best = np.maximum.reduceat(depth * span + (span - 1 - local), firsts)
    return np.where(best // span > 0, span - 1 - best % span, -1)


def _accept_chains(argmax: np.ndarray, tokens: np.ndarray, index: np.ndarray, sizes: np.ndarray, firsts: np.ndarray,
                   row_starts: np.ndarray) -> np.ndarray:
    """`accept_greedy` of chains: a chain's path is its leading matches. Node ``index[j]`` of tree b
    is compared with its parent's row, ``row_starts[b] + j - firsts[b]``; each chain's first
    miss (or its end) is its accepted length."""
    match = tokens == argmax[index + np.repeat(row_starts - firsts, sizes)]
    first_miss = np.minimum.reduceat(np.where(match, len(tokens), index), firsts)
    return np.minimum(first_miss - firsts, sizes) - 1


class BatchVerifier:
    def __init__(self, scheduler: Scheduler, eos_token_ids: Seq[int]):
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids

    def sample_and_verify(self, scheduled: list[ScheduledSeq], layout: list[ChunkRows], logits: torch.Tensor,
                          step_trees: Optional[StepTrees] = None) -> StepTokens:
        """Sample each plain sequence's next token and verify each tree; queue the accepted paths' KV moves.

        `step_trees`: the step's trees already flat (the engine's, from attaching them), used
        when they are exactly the trees verified here.
        """
        _, sample_starts, sample_index = row_offsets(layout)
        # Sequences finished since the step was launched (aborted) are left out, as if never scheduled.
        sampling = [b for b, rows in enumerate(layout) if rows.num_sample_rows and not rows.seq.is_finished]
        if not sampling:
            return StepTokens()
        # Decode and verification steps sample every row: no gather (a copy of all the logits).
        sample_logits = logits if len(sample_index) == logits.shape[0] else logits[sample_index]
        result = StepTokens(sample_logits)
        plain = [b for b in sampling if scheduled[b].tree is None]
        # Plain greedy needs only the argmax of each row: one reduction and one host copy.
        all_greedy = all(scheduled[b].seq.group.plain_greedy for b in sampling)
        argmax = sample_logits.argmax(dim=-1).cpu().numpy() if all_greedy else None
        contexts = [] if all_greedy else [c for rows in layout for c in self.row_contexts(rows, logits.device)]
        probs = target_probs(sample_logits, contexts) if contexts else None
        if argmax is not None:
            greedy_tokens = argmax.tolist()  # read a few times per sequence: Python ints, not numpy scalars
            plain_tokens = {b: greedy_tokens[sample_starts[b]] for b in plain}
        elif plain:
            picks = [sample_starts[b] for b in plain]
            plain_tokens = dict(zip(plain, sample(probs[picks], [contexts[i] for i in picks]).tolist()))
        else:
            plain_tokens = {}
        trees = [b for b in sampling if scheduled[b].tree is not None]
        greedy_best = self._accept_greedy(scheduled, trees, sample_starts, argmax, step_trees) if argmax is not None and trees else {}
        # Looked up once: the loop below runs for every sequence of every step, between the
        # device finishing the step and the host launching the next one.
        appends, verdicts, tree_sizes, accepted_counts = result.appends, result.verdicts, result.tree_sizes, result.accepted_counts
        trim_blocks = self.scheduler.trim_blocks
        for b in sampling:
            item, first = scheduled[b], sample_starts[b]
            seq = item.seq
            if item.tree is None:
                seq.num_computed += item.num_new_tokens
                appends.append((seq, [plain_tokens[b]], [first]))
                continue
            tree = item.tree
            if argmax is not None:
                best = greedy_best[b]
                accepted, bonus = None if tree.is_chain else tree.path_to(best), greedy_tokens[first + best + 1]
                num_accepted = best + 1 if tree.is_chain else len(accepted)
            else:
                end = first + layout[b].num_sample_rows
                accepted, bonus = verify_tree(probs[first:end], tree, seq.params.is_greedy, seq.generator)
                num_accepted = len(accepted)
            tree_tokens, num_nodes = tree.token_list, len(tree.token_list)
            if tree.is_chain:  # the path is a prefix: its rows follow the root's, its KV is in place
                accepted_tokens, rows = tree_tokens[:num_accepted], range(first, first + num_accepted + 1)
                seq.num_computed += 1 + num_accepted
                trim_blocks(seq, seq.num_computed)
            else:
                accepted_tokens, rows = [tree_tokens[i] for i in accepted], [first] + [first + i + 1 for i in accepted]
                self._keep_accepted_kv(item, accepted, result.kv_moves)
            seq.spec.record(num_nodes, num_accepted)
            tree_sizes.append(num_nodes)
            accepted_counts.append(num_accepted)
            seq.draft_backoff.record(num_accepted)
            verdicts.append(Verdict(seq.seq_key, accepted_tokens, bonus, num_nodes))
            appends.append((seq, accepted_tokens + [bonus], rows))
        return result

    @staticmethod
    def _accept_greedy(scheduled: list[ScheduledSeq], trees: list[int], sample_starts: list[int],
                       argmax: np.ndarray, step_trees: Optional[StepTrees]) -> dict[int, int]:
        """Each tree's deepest matching node, by `accept_greedy` over the step's flat tree arrays."""
        verified = [scheduled[b].tree for b in trees]
        flat = step_trees if step_trees is not None and step_trees.holds(verified) else StepTrees(verified)
        best = accept_greedy(argmax, flat.tokens, flat.parents, flat.node_offsets,
                             np.asarray([sample_starts[b] for b in trees], dtype=np.int64))
        return dict(zip(trees, best.tolist()))

    def row_contexts(self, rows: ChunkRows, device: torch.device) -> list[RowContext]:
        """The contexts of one sequence's sampling rows, with its grammar's mask at each."""
        contexts = [self.row_context(r) for r in rows.sample_rows()]
        grammar = rows.seq.grammar
        if grammar is not None and contexts:
            for context, allowed in zip(contexts, grammar.row_masks(rows.tree, device)):
                context.allowed_tokens = allowed
        return contexts

    def row_context(self, row: SampleRow) -> RowContext:
        seq = row.seq
        return RowContext(seq.params, seq.group.prompt_token_ids, row.context(), self.eos_token_ids, seq.generator)

    def _keep_accepted_kv(self, item: ScheduledSeq, accepted: list[int], moves: list[KVMove]) -> None:
        """Queue the moves of the accepted nodes' KV right behind the root and drop the rest of the tree.

        The caller copies every sequence's moves at once; each move keeps its own copy of the
        block table, whose tail is freed here.
        """
        seq = item.seq
        root = seq.num_computed
        # A path's node indices increase (parents precede children), so it is already in
        # place, nodes 0..m-1, exactly when its last node is m - 1.
        if accepted and accepted[-1] != len(accepted) - 1:
            table = list(seq.block_table)
            moves.extend((table, root + 1 + node, root + 1 + m) for m, node in enumerate(accepted) if node != m)
        seq.num_computed = root + 1 + len(accepted)
        self.scheduler.trim_blocks(seq, seq.num_computed)
