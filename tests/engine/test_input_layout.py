"""Where each sequence's logits rows sit (`row_offsets`), against a row-by-row count."""
import random

import pytest

from hetero.input_layout import ChunkRows, row_offsets


def _row_by_row(layout):
    prompt_slices, sample_starts, sample_index, offset = [], [], [], 0
    for rows in layout:
        prompt_slices.append((offset, offset + rows.num_prompt_rows))
        offset += rows.num_prompt_rows
        sample_starts.append(len(sample_index))
        for _ in range(rows.num_sample_rows):
            sample_index.append(offset)
            offset += 1
    return prompt_slices, sample_starts, sample_index


@pytest.mark.parametrize("with_prompt_rows", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_row_offsets_match_a_row_by_row_count(seed, with_prompt_rows):
    rng = random.Random(seed)
    layout = [ChunkRows(None, rng.randint(0, 5) if with_prompt_rows else 0, rng.randint(0, 9)) for _ in range(rng.randint(0, 70))]
    assert row_offsets(layout) == _row_by_row(layout)


@pytest.mark.parametrize("num_nodes", [1, 2, 7, 15, 62])
def test_a_chains_chunk_is_laid_out_as_any_tree_of_its_shape(num_nodes):
    """Chains take their layout by length (`chain_layout`); the same parents as a general tree
    (one more node hanging off the root, then dropped) give the same positions and masks."""
    from types import SimpleNamespace

    import numpy as np

    from hetero.core.protocols import TokenTree
    from hetero.input_layout import build_chunks, tree_layout
    from hetero.scheduler import ScheduledSeq

    seq = SimpleNamespace(num_computed=40, token_ids=list(range(41)), block_table=[3, 5, 9, 11, 12, 13], table_row=None)
    chain = TokenTree.chain(list(range(100, 100 + num_nodes)))
    assert chain.is_chain and not TokenTree(np.arange(num_nodes + 1), [*range(-1, num_nodes - 1), -1]).is_chain
    (chunk,), _ = build_chunks([ScheduledSeq(seq, 1, chain)])
    depths, masks = tree_layout(tuple(range(-1, num_nodes - 1)) + (-1,))  # the chain plus a second child of the root
    assert chunk.token_ids == [40, *range(100, 100 + num_nodes)]
    assert list(chunk.positions) == [40 + depth for depth in depths[:-1]]
    assert chunk.sequential  # staging may compute its positions and masks from the token's index
    assert list(chunk.tree_mask) == list(masks[:-1])
