"""Batch-invariant GPU mode: its kernels against references, and bitwise batch invariance.

On a machine without CUDA the Triton kernels run in Triton's interpreter (conftest.py);
the model tests then run the GPU code path on CPU tensors (fused_ops' Triton kernels forced).
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_target import fused_ops, invariant_attention  # noqa: E402
from gpu_target.attention import AttentionMetadata, reference_attention  # noqa: E402
from gpu_target.batch_invariant_gpu import InvariantLinear, make_batch_invariant_gpu  # noqa: E402
from gpu_target.invariant_attention import invariant_paged_attention  # noqa: E402
from gpu_target.invariant_matmul import invariant_linear  # noqa: E402
from gpu_target.kv_cache import KVCachePool  # noqa: E402
from gpu_target.loader import load_config, load_state_dict  # noqa: E402
from gpu_target.model import build_model  # noqa: E402
from gpu_target.runner import ModelRunner, SequenceChunk  # noqa: E402
from hetero.core.config import BATCH_INVARIANT_ENV, EngineConfig  # noqa: E402
from test_triton_attention import DEVICE, Seq, make_batch  # noqa: E402
from test_batch_invariant import one_sequence  # noqa: E402

# --------------------------------------------------------------------------- GEMM


# float32 under the interpreter only: on CUDA the mode takes bf16/fp16 (float32 tiles overflow shared memory)
INTERPRETER_ONLY = pytest.mark.skipif(DEVICE.type == "cuda", reason="CUDA runs bf16/fp16")
INTERPRETER_FLOAT32 = pytest.param(torch.float32, marks=INTERPRETER_ONLY)


@pytest.mark.parametrize("dtype", [torch.bfloat16, INTERPRETER_FLOAT32])
@pytest.mark.parametrize("m, k, n", [(1, 64, 96), (17, 300, 40), (33, 128, 16400)])
def test_linear_matches_the_reference(dtype, m, k, n):
    torch.manual_seed(0)
    x, w, b = torch.randn(m, k, device=DEVICE), torch.randn(n, k, device=DEVICE), torch.randn(n, device=DEVICE)
    got = invariant_linear(x.to(dtype), w.to(dtype), b.to(dtype))
    want = torch.nn.functional.linear(x.to(dtype).double(), w.to(dtype).double(), b.to(dtype).double())
    assert got.dtype == dtype and got.shape == (m, n)
    # float32: TF32 on the GPU; bf16: one step (the interpreter truncates instead of rounding)
    tol = {torch.float32: 2e-3 if DEVICE.type == "cuda" else 1e-5, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol * k**0.5, rtol=tol)


# float32 too: sums of bf16 products are often exact in fp32 and the bf16 result hides the
# last bits, so there another summation order could go unseen.
@pytest.mark.parametrize("n, dtype", [(96, torch.bfloat16), pytest.param(96, torch.float32, marks=INTERPRETER_ONLY),
                                      pytest.param(16400, torch.float32, marks=INTERPRETER_ONLY)])  # 16400: skinny_tile's wide tile
def test_a_row_of_the_linear_is_the_same_bits_at_any_batch(n, dtype):
    """A row alone, and among 16, 63 and 99 other rows (different ones each time, the row at
    the start, middle and end), at a K that is not a multiple of the K tile: one, two, four
    row blocks per program, and several programs of four."""
    torch.manual_seed(1)
    k = 300
    w = torch.randn(n, k, device=DEVICE).to(dtype)
    row = torch.randn(1, k, device=DEVICE).to(dtype)
    alone = invariant_linear(row, w)
    for m in (17, 64, 100):
        others = torch.randn(m, k, device=DEVICE).to(dtype) * m
        for at in (0, m // 2, m - 1):
            batch = others.clone()
            batch[at] = row[0]
            assert torch.equal(invariant_linear(batch, w)[at : at + 1], alone), (m, at)


def test_linear_rejects_bad_shapes():
    with pytest.raises(ValueError, match="one dtype"):
        invariant_linear(torch.zeros(2, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE).bfloat16())
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        invariant_linear(torch.zeros(2, 8, device=DEVICE), torch.zeros(4, 9, device=DEVICE))


# --------------------------------------------------------------------------- per-row kernels


def test_norm_and_silu_kernels_give_a_row_the_same_bits_at_any_batch():
    torch.manual_seed(2)
    hidden, weight = 96, torch.randn(96, device=DEVICE).bfloat16()
    row, residual = torch.randn(1, hidden, device=DEVICE).bfloat16(), torch.randn(1, hidden, device=DEVICE).bfloat16()
    norm = fused_ops.add_rms_norm(row, residual, weight, 1e-5, use_triton=True)
    silu = fused_ops.silu_and_mul(row, use_triton=True)
    for m in (17, 64):
        x, r = torch.randn(m, hidden, device=DEVICE).bfloat16() * 9, torch.randn(m, hidden, device=DEVICE).bfloat16()
        x[5], r[5] = row[0], residual[0]
        normed, summed = fused_ops.add_rms_norm(x, r, weight, 1e-5, use_triton=True)
        assert torch.equal(normed[5:6], norm[0]) and torch.equal(summed[5:6], norm[1])
        assert torch.equal(fused_ops.silu_and_mul(x, use_triton=True)[5:6], silu)


# --------------------------------------------------------------------------- attention

# Trees, causal chunks, a context across a split boundary (SPLIT = 256) and one across two.
MIXED = [Seq(0, 9), Seq(40, 1), Seq(250, 12, tree=True), Seq(3, 1), Seq(20, 24, tree=True), Seq(300, 3), Seq(530, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_the_reference(dtype):
    meta, k_cache, v_cache = make_batch(MIXED, dtype=dtype)
    query = torch.randn(meta.num_tokens, 4, 64, device=DEVICE).to(dtype)
    got = invariant_paged_attention(query, k_cache, v_cache, meta, 0.125)
    want = reference_attention(query.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_attention_of_a_sequence_is_the_same_bits_alone_and_batched():
    """In float32, where another summation order would show in the last bits (see above)."""
    meta, k_cache, v_cache = make_batch(MIXED)
    query = torch.randn(meta.num_tokens, 4, 64, device=DEVICE)
    batched = invariant_paged_attention(query, k_cache, v_cache, meta, 0.125)
    start = 0
    for b, q_len in enumerate(meta.query_lens_host):
        rows = slice(start, start + q_len)
        mask = None if meta.tree_mask is None else meta.tree_mask[rows]
        mask = None if mask is None else mask.cpu()
        alone = _to_device(one_sequence(meta.block_tables[b : b + 1].cpu(), meta.seq_lens_host[b], q_len, mask))
        assert torch.equal(batched[rows], invariant_paged_attention(query[rows], k_cache, v_cache, alone, 0.125)), b
        start += q_len


@pytest.mark.parametrize("num_heads", [4, 8])  # groups of two and four query heads per KV head
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ctx", [30, 250])  # 250: the chain's keys cross the first split boundary
def test_a_tree_node_attends_exactly_as_the_same_token_decoded_alone(ctx, dtype, num_heads):
    """Draft nodes whose ancestors are not contiguous in storage (siblings between them)
    see, bit for bit, what plain decoding of the same path sees."""
    meta, k_cache, v_cache = make_batch([Seq(ctx, 8)], dtype=dtype)
    # Root 0; node 1 a sibling branch; the path 0 -> 2 -> 4 -> 7, with 3, 5, 6 off it.
    masks = [0b1, 0b11, 0b101, 0b1011, 0b10101, 0b100101, 0b1000011, 0b10010101]
    tree = _to_device(one_sequence(meta.block_tables.cpu(), ctx + 8, 8, torch.tensor(masks)))
    query = torch.randn(8, num_heads, 64, device=DEVICE).to(dtype)
    verified = invariant_paged_attention(query, k_cache, v_cache, tree, 0.125)
    # Plain decoding stores the path contiguously: copy its K/V there, in a second table.
    path = [0, 2, 4, 7]
    k_plain, v_plain, table = _contiguous_copy(k_cache, v_cache, meta.block_tables, ctx, path)
    for depth, node in enumerate(path):
        decode = _to_device(one_sequence(table, ctx + depth + 1, 1))
        alone = invariant_paged_attention(query[node : node + 1], k_plain, v_plain, decode, 0.125)
        assert torch.equal(verified[node : node + 1], alone), node


def test_a_row_is_the_same_bits_alone_and_among_other_sequences(monkeypatch):
    """GQA with four query heads per KV head. A decode row whose keys span two splits and a
    tree verification's rows, alone, then among 16 other sequences, then after 73 others of
    other lengths (more than the 64 sequence starts a program reads at once; one longer, so
    the grid holds more splits) with max_seq_len an upper bound
    as under a CUDA graph and every split run by its own worker program (merged by the merge
    kernel; alone, one program runs and merges a row's splits)."""
    rng = random.Random(3)
    others = [Seq(rng.randrange(0, 60), 1) for _ in range(70)] + [Seq(700, 1), Seq(40, 5), Seq(90, 9, tree=True)]
    meta, k_cache, v_cache = make_batch([Seq(300, 1), Seq(270, 9, tree=True), *others], head_dim=32)
    query = torch.randn(meta.num_tokens, 8, 32, device=DEVICE)

    def attend(order, max_seq_len=None):
        sub, rows = _sequences(meta, order, max_seq_len)
        return invariant_paged_attention(query[rows], k_cache, v_cache, sub, 0.125)

    for target in (0, 1):
        alone = attend([target])
        among_16 = attend([target, *range(2, 18)])[: len(alone)]
        assert torch.equal(among_16, alone), target
        with monkeypatch.context() as patch:
            patch.setattr(invariant_attention, "num_sms", lambda device: 10_000)  # as many workers as splits
            after_73 = attend([*range(2, len(meta.seq_lens_host)), target], max_seq_len=1100)[-len(alone) :]
        assert torch.equal(after_73, alone), target


# A chain, a branching tree (ancestors with gaps: 1 and 3 lie between 0 and 2, 4, 6, 8) and a
# causal chunk of nine rows each, as a speculative step verifies them; contexts put their
# new keys across a tile boundary (60: the tile at 64), and across a split boundary (250).
CHAIN = [(1 << (i + 1)) - 1 for i in range(9)]
BRANCHING = [0b1, 0b11, 0b101, 0b1011, 0b10101, 0b101011, 0b1010101, 0b10000101, 0b101010101]
VERIFY = [(Seq(40, 1), None), (Seq(250, 9), CHAIN), (Seq(3, 1), None), (Seq(250, 9), BRANCHING),
          (Seq(60, 9), BRANCHING), (Seq(20, 9), None), (Seq(530, 1), None)]


# 2, 4 (Llama 3 8B's group), 8 query heads per KV head: 8, 4, 2 rows a program; with 64 MMA rows, 16
@pytest.mark.parametrize("num_heads, mma_rows", [(4, 16), (8, 16), (16, 16), (8, 64)])
def test_verify_rows_among_other_sequences_are_the_bits_of_each_row_decoded_alone(monkeypatch, num_heads, mma_rows):
    """Every row of a chain, of branching trees and of a causal chunk, verified among decode
    rows (the kernel puts several rows of a sequence in one program, reading each K/V tile
    once for them), equals bit for bit that row decoded alone: its path's keys stored after
    the context and one query row, in a program of its own. Token padding rows (NaN queries)
    change nothing. In float32 a row's result shows any other summation order in its last
    bits: the test first checks that another tile size (TILE 32, the same keys summed in
    other groups) changes rows here, so a grouped row that took its keys in another order
    or tiling, or saw a key it must not, would fail the comparison."""
    monkeypatch.setattr(invariant_attention, "MMA_ROWS", mma_rows)
    seqs = [seq for seq, _ in VERIFY]
    meta, k_cache, v_cache = make_batch(seqs, head_dim=32)
    masks = [mask or [0] * seq.q_len for seq, mask in VERIFY]
    meta.tree_mask = torch.tensor([m for mask in masks for m in mask], dtype=torch.int64, device=DEVICE)
    real, padding = meta.num_tokens, 3
    query = torch.randn(real + padding, num_heads, 32, device=DEVICE)
    query[real:] = float("nan")
    verified = invariant_paged_attention(query, k_cache, v_cache, meta, 0.125)[:real]
    assert torch.isfinite(verified).all()
    with monkeypatch.context() as patch:
        patch.setattr(invariant_attention, "TILE", 32)
        assert not torch.equal(invariant_paged_attention(query, k_cache, v_cache, meta, 0.125)[:real], verified)
    row = 0
    for b, (seq, mask) in enumerate(VERIFY):
        for i in range(seq.q_len):
            if mask is None:  # causal: new tokens 0..i
                path = list(range(i + 1)) if seq.q_len > 1 else [0]
            else:
                path = [j for j in range(i + 1) if mask[i] >> j & 1]
            k_plain, v_plain, table = _contiguous_copy(k_cache, v_cache, meta.block_tables[b : b + 1].cpu(), seq.ctx, path)
            decode = _to_device(one_sequence(table, seq.ctx + len(path), 1))
            alone = invariant_paged_attention(query[row : row + 1], k_plain, v_plain, decode, 0.125)
            assert torch.equal(verified[row : row + 1], alone), (b, i)
            row += 1


def test_row_groups_cut_by_launches_give_the_same_bits(monkeypatch):
    """With several worker programs a launch holds at most PARTIAL_BYTES of partial results;
    its rows start at any row of a sequence, so a row group may start there too. Launches of
    5 and of 1 rows (every row then alone in its program) give the bits of one launch."""
    seqs = [seq for seq, _ in VERIFY]
    meta, k_cache, v_cache = make_batch(seqs, head_dim=32)
    meta.tree_mask = torch.tensor([m for seq, mask in VERIFY for m in (mask or [0] * seq.q_len)], device=DEVICE)
    query = torch.randn(meta.num_tokens, 8, 32, device=DEVICE)
    together = invariant_paged_attention(query, k_cache, v_cache, meta, 0.125)
    monkeypatch.setattr(invariant_attention, "num_sms", lambda device: 10_000)  # a worker per split
    num_splits = -(-meta.max_seq_len // invariant_attention.SPLIT)
    for rows in (5, 1):
        monkeypatch.setattr(invariant_attention, "PARTIAL_BYTES", rows * num_splits * 8 * (32 + 2) * 4)
        assert torch.equal(invariant_paged_attention(query, k_cache, v_cache, meta, 0.125), together), rows


def test_the_grid_holds_every_row_group_of_a_launch():
    """The kernel's grid (`row_groups`) is at least the launch's number of row groups: a
    sequence's rows in the launch in groups of R from its first row, the first group from
    the launch's first row where the sequence began in an earlier launch. Too small a grid
    would leave rows uncomputed."""
    rng = random.Random(5)
    for _ in range(300):
        q_lens = [rng.choice([1, 1, 2, 5, 9, 17]) for _ in range(rng.randrange(1, 12))]
        starts = [0, *itertools.accumulate(q_lens)]
        for per_group in (1, 2, 4, 8, 16):
            launch = rng.randrange(1, starts[-1] + 1)
            for first in range(0, starts[-1], launch):
                end = min(first + launch, starts[-1])
                groups = sum(1 for s, e in zip(starts, starts[1:]) for r in range(max(s, first), min(e, end))
                             if r == max(s, first) or (r - s) % per_group == 0)
                assert groups <= invariant_attention.row_groups(end - first, per_group, len(q_lens)), (q_lens, first)


def _sequences(meta, order, max_seq_len=None):
    """The metadata of the batch's sequences `order` (in that order) and their query rows."""
    starts = meta.query_start_loc.tolist()
    rows = torch.tensor([r for b in order for r in range(starts[b], starts[b + 1])], device=DEVICE)
    q_lens = [meta.query_lens_host[b] for b in order]
    seq_lens = [meta.seq_lens_host[b] for b in order]
    mask = None if meta.tree_mask is None else meta.tree_mask[rows]
    sub = AttentionMetadata(
        query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=meta.block_tables[torch.tensor(order, device=DEVICE)],
        slot_mapping=meta.slot_mapping[rows],
        tree_mask=mask if mask is not None and bool(mask.any()) else None,
        max_query_len=max(q_lens),
        max_seq_len=max_seq_len or max(seq_lens),
        query_lens_host=q_lens,
        seq_lens_host=seq_lens,
    )
    return sub, rows


def test_splits_combine_to_the_same_bits_in_registers_in_the_merge_kernel_and_over_several_launches(monkeypatch):
    meta, k_cache, v_cache = make_batch(MIXED[:3])  # the tree's rows have two splits
    query = torch.randn(meta.num_tokens, 4, 64, device=DEVICE)
    in_registers = invariant_paged_attention(query, k_cache, v_cache, meta, 0.125)  # one worker a row
    monkeypatch.setattr(invariant_attention, "num_sms", lambda device: 10_000)  # a worker per split
    assert torch.equal(invariant_paged_attention(query, k_cache, v_cache, meta, 0.125), in_registers)
    monkeypatch.setattr(invariant_attention, "PARTIAL_BYTES", 1)  # and one row per launch
    assert torch.equal(invariant_paged_attention(query, k_cache, v_cache, meta, 0.125), in_registers)


def _to_device(meta):
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "tree_mask"):
        value = getattr(meta, name)
        if value is not None:
            setattr(meta, name, value.to(DEVICE))
    return meta


def _contiguous_copy(k_cache, v_cache, tables, ctx, path, block_size=16):
    """Caches with one more sequence: the context of `tables`' first sequence and then the path's new tokens, back to back."""
    src = tables[0].long()
    n = ctx + len(path)
    blocks = -(-n // block_size)
    first_new = k_cache.shape[0]
    k = torch.cat([k_cache, torch.zeros((blocks, *k_cache.shape[1:]), dtype=k_cache.dtype, device=DEVICE)])
    v = torch.cat([v_cache, torch.zeros((blocks, *v_cache.shape[1:]), dtype=v_cache.dtype, device=DEVICE)])
    storage = list(range(ctx)) + [ctx + node for node in path]
    for dst, pos in enumerate(storage):
        block, offset = int(src[pos // block_size]), pos % block_size
        k[first_new + dst // block_size, dst % block_size] = k_cache[block, offset]
        v[first_new + dst // block_size, dst % block_size] = v_cache[block, offset]
    table = torch.arange(first_new, first_new + blocks, dtype=torch.int32).unsqueeze(0)
    return k, v, table


# --------------------------------------------------------------------------- the model


@pytest.fixture
def gpu_kernels_on_cpu(monkeypatch):
    """fused_ops' Triton kernels for CPU tensors too (interpreted), as on the GPU."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(fused_ops, "_wants_triton", lambda x, use_triton: True)


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    config = load_config(tiny_llama_dir)
    state = load_state_dict(tiny_llama_dir, config, torch.bfloat16, DEVICE)
    model = build_model(config, state, torch.bfloat16, DEVICE)
    weights = [p.data_ptr() for p in model.parameters()]
    make_batch_invariant_gpu(model)
    assert [p.data_ptr() for p in model.parameters()] == weights  # switched in place, nothing copied
    assert isinstance(model.layers[0].mlp.down_proj, InvariantLinear)
    return config, model


PROMPT = [5, 17, 42, 8, 99, 3, 61, 7, 12, 13, 40, 41, 77, 2, 9]


def _runner(config, model):
    return ModelRunner(model, KVCachePool(config, 16, 16, torch.bfloat16, DEVICE), DEVICE, invariant_paged_attention)


def test_model_logits_and_kv_do_not_depend_on_the_batch(tiny_model, gpu_kernels_on_cpu):
    config, model = tiny_model
    chunks = [
        SequenceChunk(PROMPT, list(range(15)), [2], 0, range(15)),
        SequenceChunk([7, 12, 13, 40, 41], [0, 1, 1, 2, 2], [4], 0, range(5), [0b1, 0b11, 0b101, 0b1011, 0b10101]),
        SequenceChunk([9], [0], [6], 0, [0]),
    ]
    together = _runner(config, model)
    apart = _runner(config, model)
    logits = together.forward(chunks)
    alone = torch.cat([apart.forward([chunk]) for chunk in chunks])
    assert torch.equal(logits, alone)
    assert torch.equal(together.kv_pool.storage, apart.kv_pool.storage)


def test_model_verifies_a_tree_path_exactly_as_plain_decoding(tiny_model, gpu_kernels_on_cpu):
    """The logits and K/V of a token tree's path equal, bit for bit, those of decoding the
    path one token at a time (beside another sequence's steps), so greedy speculation
    accepts and emits what plain greedy decoding would."""
    config, model = tiny_model
    n = len(PROMPT)
    other = SequenceChunk([4, 4, 8], [0, 1, 2], [8], 0, [2])
    runner = _runner(config, model)
    table_a, table_b = [1, 4], [2, 3]
    runner.forward([SequenceChunk(PROMPT, list(range(n)), table_a, 0, [n - 1]), other])
    runner.forward([SequenceChunk(PROMPT, list(range(n)), table_b, 0, [n - 1])])
    # A verifies a tree: root r, a sibling x, then the path r -> a -> b -> c with y beside it.
    tokens, positions = [11, 30, 21, 31, 22, 23], [n, n + 1, n + 1, n + 2, n + 2, n + 3]
    masks = [0b1, 0b11, 0b101, 0b1101, 0b10101, 0b110101]
    verified = runner.forward([SequenceChunk(tokens, positions, table_a, n, range(6), masks),
                               SequenceChunk([5], [3], [8], 3, [0])])
    path = [0, 2, 4, 5]
    for depth, node in enumerate(path):  # B decodes the path tokens one at a time
        plain = runner.forward([SequenceChunk([tokens[node]], [n + depth], table_b, n + depth, [0])])
        assert torch.equal(verified[node : node + 1], plain), node
    for layer_k, layer_v in runner.kv_pool.layers:
        for depth, node in enumerate(path):
            tree_slot, plain_slot = _slot(table_a, n + node), _slot(table_b, n + depth)
            for cache in (layer_k, layer_v):
                flat = cache.view(-1, *cache.shape[2:])
                assert torch.equal(flat[tree_slot], flat[plain_slot]), (node, depth)


def _slot(table, storage_index, block_size=16):
    return table[storage_index // block_size] * block_size + storage_index % block_size


def test_model_in_invariant_mode_matches_the_normal_model(tiny_llama_dir, tiny_model, gpu_kernels_on_cpu):
    config, model = tiny_model
    normal = build_model(config, load_state_dict(tiny_llama_dir, config, torch.float32, DEVICE), torch.float32, DEVICE)
    chunk = [SequenceChunk(PROMPT, list(range(15)), [2], 0, range(15))]
    want = ModelRunner(normal, KVCachePool(config, 16, 16, torch.float32, DEVICE), DEVICE, reference_attention).forward(chunk)
    got = _runner(config, model).forward(chunk)
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)  # bf16 against float32


def test_quantised_projections_are_refused(tiny_llama_dir):
    config = load_config(tiny_llama_dir)
    model = build_model(config, load_state_dict(tiny_llama_dir, config, torch.bfloat16, DEVICE), torch.bfloat16, DEVICE)
    model.layers[1].mlp.down_proj = torch.nn.Identity()  # stands for a QuantizedLinear: not the model's Linear
    with pytest.raises(ValueError, match="down_proj is a Identity"):
        make_batch_invariant_gpu(model)


def test_float32_targets_are_refused(tiny_llama_dir):
    config = load_config(tiny_llama_dir)
    model = build_model(config, load_state_dict(tiny_llama_dir, config, torch.float32, DEVICE), torch.float32, DEVICE)
    with pytest.raises(ValueError, match="runs bfloat16 or float16 targets"):
        make_batch_invariant_gpu(model)


# --------------------------------------------------------------------------- configuration


def test_cuda_is_accepted(monkeypatch):
    monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig(model="m", device="cuda", batch_invariant=True).resolve_device().type == "cuda"
    assert EngineConfig(model="m", batch_invariant=True).resolve_device().type == "cuda"  # "auto" picks the GPU
