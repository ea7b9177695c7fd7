"""The scheduler's per-row mirror of the block tables (`BlockTableRows`), and the CUDA-graph
staging that gathers the tables from it and computes sequential chunks' positions and masks:
the staged buffers are those of the per-chunk writes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gpu_target.cuda_graphs import allocate_buffers, bucket_view, fill_host_inputs, fill_ragged_host_inputs
from gpu_target.kv_cache import NULL_BLOCK, BlockTableRows, KVCachePool
from gpu_target.loader import load_config
from hetero.core.config import EngineConfig
from hetero.core.sampling_params import SamplingParams
from hetero.engine import LLMEngine


def test_rows_hold_each_table_then_null_blocks():
    rows = BlockTableRows(2, width=2)
    a = rows.assign([7, 8])
    b = rows.assign([])
    assert a != b
    rows.append(b, 0, 5)
    rows.append(a, 2, 9)  # past the width: the array widens
    assert rows.array.shape[1] >= 3
    assert rows.array[a, :4].tolist() == [7, 8, 9, NULL_BLOCK]
    rows.drop(a, 2)
    assert rows.array[a, :3].tolist() == [7, 8, NULL_BLOCK]
    c = rows.assign([3])  # a third holder of blocks: a row more
    assert len({a, b, c}) == 3
    rows.release(a, 2)
    assert not rows.array[a].any()
    assert rows.assign([4]) == a


def _assert_mirrored(table_rows: BlockTableRows, row: int, table) -> None:
    mirrored = table_rows.array[row]
    assert mirrored[: len(table)].tolist() == list(table)
    assert not mirrored[len(table):].any()  # NULL_BLOCK after the table


def _stage_both_ways(engine: LLMEngine, checked: list[int]):
    """A forward that first checks every chunk's row against its table, then lays the chunks
    out (uniform and ragged) as they are and as chunks with neither a row nor the sequential
    mark (every table, position and mask written from the chunk's lists), asserting the same buffers."""
    real_forward = engine.runner.forward
    table_rows = engine.scheduler.table_rows
    max_blocks = -(-engine.max_model_len // engine.scheduler.block_size) + 1

    def forward(chunks):
        used = [chunk.table_row for chunk in chunks]
        assert None not in used and len(set(used)) == len(used)
        for chunk in chunks:
            _assert_mirrored(table_rows, chunk.table_row, chunk.block_table)
        num_seqs = len(chunks) + 2  # two padding sequences
        query_len = max(len(chunk.token_ids) for chunk in chunks)
        ragged_tokens = sum(len(chunk.token_ids) for chunk in chunks) + 5
        for fill, args, num_tokens in ((fill_host_inputs, (query_len,), num_seqs * query_len),
                                       (fill_ragged_host_inputs, (), ragged_tokens)):
            staged = []
            plain = [dataclasses.replace(chunk, table_row=None, sequential=False) for chunk in chunks]
            for laid_out, rows in ((plain, None), (chunks, table_rows)):
                host = allocate_buffers(num_tokens, num_seqs, max_blocks, "cpu")
                arrays = {name: t.numpy() for name, t in bucket_view(host, num_seqs, num_tokens).items()}
                for array in arrays.values():
                    array[:] = 99  # what a previous step left
                picked = fill(arrays, laid_out, *args, engine.scheduler.block_size, rows)
                staged.append((picked, {name: array.copy() for name, array in arrays.items()}))
            assert staged[0][0] == staged[1][0]
            for name in staged[0][1]:
                np.testing.assert_array_equal(staged[0][1][name], staged[1][1][name], err_msg=name)
        checked.append(sum(chunk.sequential for chunk in chunks))
        return real_forward(chunks)

    engine.runner.forward = forward


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_staging_from_the_rows_matches_per_chunk_tables_through_preemption_and_prefix_hits(tiny_llama_dir, async_scheduling):
    """Trees appended and trimmed every step, preemptions (16 blocks for four sequences that
    need up to 7 each), prefix-cache hits on re-admission, and a request aborted midway."""
    block_bytes = KVCachePool.bytes_per_block(load_config(tiny_llama_dir), 16, torch.float32)
    engine = LLMEngine(EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4,
        async_scheduling=async_scheduling, kv_cache_space=16 * block_bytes / 2**30,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    ))
    engine.spec_control.always_speculate = True
    checked: list[int] = []
    _stage_both_ways(engine, checked)
    for i in range(5):
        prompt = [(11 * i + 5 * j) % 250 + 3 for j in range(20)] if i < 4 else [3] * 40  # the last shares a prefix
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=60 + 8 * i, ignore_eos=True))
    seqs = [seq for group in engine.groups.values() for seq in group.seqs]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for seq in seqs:  # between steps too: trees' blocks trimmed, sequences preempted or finished
            if seq.table_row is None:
                assert seq.block_table == []
            else:
                _assert_mirrored(engine.scheduler.table_rows, seq.table_row, seq.block_table)
        if steps == 10:
            engine.abort_request("r1")
    assert engine.scheduler.num_preemptions > 0
    assert len(checked) > 20 and sum(checked) > 40
    table_rows = engine.scheduler.table_rows
    assert sorted(table_rows._free) == list(range(len(table_rows.array)))  # every row given back
    assert not table_rows.array.any()
