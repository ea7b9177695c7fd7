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
