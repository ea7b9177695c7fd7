"""Batch-invariant CPU mode: a row's numbers are bit-identical whatever else is in the batch.

The random paged batches come from test_triton_attention (so these tests, like those,
skip where Triton is not installed).
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from gpu_target import fused_ops
from gpu_target.attention import AttentionMetadata, reference_attention
from gpu_target.batch_invariant import batch_invariant_attention, make_batch_invariant, per_row
from gpu_target.kv_cache import KVCachePool
from gpu_target.loader import load_config, load_state_dict
from gpu_target.model import build_model
from gpu_target.runner import ModelRunner, SequenceChunk
from hetero.core.config import BATCH_INVARIANT_ENV, EngineConfig
from test_triton_attention import Seq, make_batch

CPU = torch.device("cpu")


def cpu_batch(seqs, **kwargs):
    """`make_batch`'s random paged metadata and caches, on the CPU whatever its default device."""
    meta, k_cache, v_cache = make_batch(seqs, **kwargs)
    moved = {f.name: getattr(meta, f.name).cpu() for f in dataclasses.fields(meta) if torch.is_tensor(getattr(meta, f.name))}
    return dataclasses.replace(meta, **moved), k_cache.cpu(), v_cache.cpu()


def one_sequence(tables: torch.Tensor, seq_len: int, q_len: int, tree_mask=None, block_size: int = 16) -> AttentionMetadata:
    """Metadata of a single sequence with block table row `tables` [1, max_blocks]."""
    storage = torch.arange(seq_len - q_len, seq_len)
    slots = tables[0, storage // block_size].long() * block_size + storage % block_size
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=slots,
        tree_mask=tree_mask,
        max_query_len=q_len,
        max_seq_len=seq_len,
        query_lens_host=[q_len],
        seq_lens_host=[seq_len],
    )


# --------------------------------------------------------------------------- per_row


@pytest.mark.parametrize("in_features, out_features", [(64, 192), (65, 33), (1024, 512)])
def test_a_linear_row_does_not_depend_on_the_other_rows(in_features, out_features):
    """The row alone is a fresh tensor, as a decode step's is. With an odd width a row of the
    batch sits at another address alignment, and MKL's rounding depends on that too."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features)
    x = torch.randn(64, in_features)
    alone = [per_row(linear, x[i : i + 1].clone()) for i in range(64)]
    for rows in (2, 5, 17, 64):
        batched = per_row(linear, x[:rows])
        for i in range(rows):
            assert torch.equal(batched[i : i + 1], alone[i]), (rows, i)
    torch.testing.assert_close(per_row(linear, x), linear(x), atol=1e-5, rtol=1e-5)


def test_per_row_takes_several_inputs_and_returns_tuples():
    x, residual, weight = torch.randn(9, 64), torch.randn(9, 64), torch.randn(64)
    add_norm = functools.partial(fused_ops.add_rms_norm, weight=weight, eps=1e-6)
    normed, summed = per_row(add_norm, x, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed[3:4], add_norm(x[3:4].clone(), residual[3:4].clone())[0])
    assert per_row(add_norm, x[:0], residual[:0])[0].shape == (0, 64)


# --------------------------------------------------------------------------- attention

MIXED = [Seq(0, 9), Seq(40, 1), Seq(7, 0), Seq(30, 17, tree=True), Seq(3, 1), Seq(20, 64, tree=True), Seq(17, 5)]


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (6, 2), (4, 4)])
def test_attention_matches_the_reference(num_heads, num_kv_heads):
    meta, k_cache, v_cache = cpu_batch(MIXED, num_kv_heads=num_kv_heads)
    query = torch.randn(meta.num_tokens, num_heads, 64)
    got = batch_invariant_attention(query, k_cache, v_cache, meta, 0.125)
    want = reference_attention(query, k_cache, v_cache, meta, 0.125)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_attention_of_a_sequence_is_unchanged_by_the_others():
    meta, k_cache, v_cache = cpu_batch(MIXED)
    query = torch.randn(meta.num_tokens, 4, 64)
    batched = batch_invariant_attention(query, k_cache, v_cache, meta, 0.125)
    start = 0
    for b, q_len in enumerate(meta.query_lens_host):
        rows = slice(start, start + q_len)
        mask = None if meta.tree_mask is None else meta.tree_mask[rows]
        alone = one_sequence(meta.block_tables[b : b + 1], meta.seq_lens_host[b], q_len, mask)
        assert torch.equal(batched[rows], batch_invariant_attention(query[rows], k_cache, v_cache, alone, 0.125)), b
        start += q_len


def test_a_tree_node_attends_exactly_as_the_same_token_decoded_alone():
    """A chain of draft nodes sees what plain decoding of the same tokens, one at a time, sees."""
    ctx, q_len = 30, 8
    meta, k_cache, v_cache = cpu_batch([Seq(ctx, q_len)])
    chain = torch.tensor([(1 << (i + 1)) - 1 for i in range(q_len)], dtype=torch.int64)
    tree = one_sequence(meta.block_tables, ctx + q_len, q_len, chain)
    query = torch.randn(q_len, 4, 64)
    verified = batch_invariant_attention(query, k_cache, v_cache, tree, 0.125)
    for i in range(q_len):
        decode = one_sequence(meta.block_tables, ctx + i + 1, 1)
        assert torch.equal(verified[i : i + 1], batch_invariant_attention(query[i : i + 1], k_cache, v_cache, decode, 0.125)), i


# --------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir):
    config = load_config(tiny_llama_dir)
    return config, load_state_dict(tiny_llama_dir, config, torch.float32, CPU)


CHUNKS = [
    SequenceChunk([5, 17, 42, 8, 99, 3, 61], list(range(7)), [2], 0, range(7)),
    SequenceChunk([7, 12, 13, 40, 41], [0, 1, 1, 2, 2], [4], 0, range(5), [0b1, 0b11, 0b101, 0b1011, 0b10101]),
    SequenceChunk([9], [0], [6], 0, [0]),
]


def run_chunks(model, config, attention_fn, batches):
    """(logits of every batch, concatenated; the KV pool after them all)."""
    runner = ModelRunner(model, KVCachePool(config, 8, 16, torch.float32, CPU), CPU, attention_fn)
    return torch.cat([runner.forward(chunks) for chunks in batches]), runner.kv_pool.storage


def test_model_logits_and_kv_do_not_depend_on_the_batch(tiny_llama):
    """A prefill, a token tree and a one-token step: together or one by one, the same bits."""
    config, state = tiny_llama
    model = build_model(config, state, torch.float32, CPU)
    weights = [p.data_ptr() for p in model.parameters()]
    make_batch_invariant(model)
    assert [p.data_ptr() for p in model.parameters()] == weights  # switched in place, nothing copied
    together = run_chunks(model, config, batch_invariant_attention, [CHUNKS])
    apart = run_chunks(model, config, batch_invariant_attention, [[chunk] for chunk in CHUNKS])
    assert torch.equal(together[0], apart[0]) and torch.equal(together[1], apart[1])
    normal = run_chunks(build_model(config, state, torch.float32, CPU), config, reference_attention, [CHUNKS])
    torch.testing.assert_close(together[0], normal[0], atol=1e-5, rtol=1e-5)  # the same function, row by row
    torch.testing.assert_close(together[1], normal[1], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- configuration


def test_config_validates_the_flag_and_reads_the_environment(monkeypatch):
    monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)
    assert not EngineConfig(model="m").batch_invariant
    assert EngineConfig(model="m", batch_invariant=True).batch_invariant
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        EngineConfig(model="m", batch_invariant="yes")
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert EngineConfig(model="m").batch_invariant
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "true")
    with pytest.raises(ValueError, match="HETERO_BATCH_INVARIANT must be 0 or 1"):
        EngineConfig(model="m")
