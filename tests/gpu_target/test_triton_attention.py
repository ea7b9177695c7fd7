"""The Triton paged-attention kernel against the plain-torch reference.

On a CUDA machine the kernels run on the GPU; elsewhere through Triton's CPU interpreter
(TRITON_INTERPRET=1, set here before the kernels are defined), with small shapes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()  # without CUDA, conftest.py runs Triton kernels in its interpreter
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_target.attention import AttentionMetadata, reference_attention  # noqa: E402
from gpu_target.triton_attention import (  # noqa: E402
    MIN_TOKENS_PER_SPLIT,
    compile_variants,
    paged_attention,
    plan_launch,
    tile_shapes,
)
from hetero.core.protocols import TokenTree  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class Seq:
    ctx: int  # tokens cached before the step
    q_len: int  # new tokens this step
    tree: bool = False  # new tokens form a random token tree (root = new token 0)


def random_tree_masks(num_tokens: int, gen: np.random.Generator) -> np.ndarray:
    """Ancestor bitmasks for a root plus num_tokens - 1 random draft nodes.

    TokenTree numbers nodes from 0 below an implicit root; here the root is new token 0,
    so node i becomes bit i + 1 and every mask also holds the root's bit 0.
    """
    n = num_tokens - 1
    parents = np.array([gen.integers(-1, i) for i in range(n)], dtype=np.int32)
    nodes = TokenTree(np.zeros(n, np.int64), parents).ancestor_masks()
    return np.concatenate([[1], (nodes << 1) | 1]).astype(np.int64)


def make_batch(seqs, *, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32, seed=0):
    """A step's metadata over a cache filled with random K/V and shuffled block tables."""
    gen = np.random.default_rng(seed)
    torch.manual_seed(seed)
    seq_lens = [s.ctx + s.q_len for s in seqs]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks nobody owns
    order = torch.from_numpy(gen.permutation(num_blocks)).int()
    max_blocks = max(blocks_per_seq) + 1
    tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    taken = 0
    for b, count in enumerate(blocks_per_seq):
        tables[b, :count] = order[taken : taken + count]
        taken += count
    slots = []
    for b, s in enumerate(seqs):
        for p in range(s.ctx, s.ctx + s.q_len):
            slots.append(int(tables[b, p // block_size]) * block_size + p % block_size)
    q_lens = [s.q_len for s in seqs]
    masks = [random_tree_masks(s.q_len, gen) if s.tree else np.zeros(s.q_len, np.int64) for s in seqs]
    any_tree = any(s.tree for s in seqs)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        tree_mask=torch.from_numpy(np.concatenate(masks)).to(DEVICE) if any_tree else None,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=q_lens,
        seq_lens_host=seq_lens,
    )
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, device=DEVICE).to(dtype)
    return meta, k_cache, v_cache


def check(seqs, *, num_heads=4, num_splits=None, block_n=None, query_dtype=None, **batch):
    meta, k_cache, v_cache = make_batch(seqs, **batch)
    T, D = meta.num_tokens, k_cache.shape[3]
    query = torch.randn(T, num_heads, D, device=DEVICE).to(query_dtype or k_cache.dtype)
    scale = D**-0.5
    plan = plan_launch(T, meta.num_seqs, num_heads, k_cache.shape[2], D, meta.max_query_len, meta.max_seq_len, 1)
    if num_splits is not None:
        plan = dataclasses.replace(plan, num_splits=num_splits)
    if block_n is not None:
        plan = dataclasses.replace(plan, block_n=block_n)
    got = paged_attention(query, k_cache, v_cache, meta, scale, plan=plan)
    want = reference_attention(query, k_cache, v_cache, meta, scale)
    assert got.dtype == query.dtype and got.shape == want.shape
    assert torch.isfinite(got.float()).all()
    tol = TOLERANCE[query.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode(dtype):
    plan = check([Seq(70, 1), Seq(0, 1), Seq(16, 1), Seq(33, 1)], dtype=dtype, block_n=32)
    assert plan.q_blocks_per_seq == 1 and plan.num_q_programs == 4  # one program per sequence


def test_decode_head_dim_128_group_of_three():
    check([Seq(40, 1), Seq(100, 1)], num_heads=6, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv_merges_exactly(num_splits):
    # 8 splits of a 40-token sequence leave some splits empty; they must not disturb the merge.
    check([Seq(300, 1), Seq(39, 1), Seq(90, 3, tree=True)], num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_verification(dtype):
    check([Seq(50, 17, tree=True), Seq(5, 9, tree=True)], dtype=dtype, block_n=16)


def test_tree_of_64_tokens_uses_bit_63():
    meta, _, _ = make_batch([Seq(20, 64, tree=True)])
    assert (meta.tree_mask < 0).any() or (meta.tree_mask >> 62).any()
    check([Seq(20, 64, tree=True), Seq(0, 64, tree=True)], seed=0)


def test_tree_masks_may_name_later_tokens():
    """The metadata allows any bitmask; a row that sees a later new token must see it, also
    when that token lies in a later token tile (group 8: 16 tokens per tile)."""
    meta, k_cache, v_cache = make_batch([Seq(12, 40), Seq(3, 6)])
    gen = torch.Generator().manual_seed(3)
    masks = torch.randint(0, 2**40, (meta.num_tokens,), generator=gen, dtype=torch.int64)
    masks[40:] &= 0b111111
    masks |= 1 << torch.cat([torch.arange(40), torch.arange(6)])  # every row sees itself
    meta = dataclasses.replace(meta, tree_mask=masks.to(DEVICE))
    query = torch.randn(meta.num_tokens, 16, 64, device=DEVICE)
    got = paged_attention(query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, reference_attention(query, k_cache, v_cache, meta, 0.125), atol=2e-5, rtol=2e-5)


def test_chain_tree_equals_causal():
    meta, k_cache, v_cache = make_batch([Seq(30, 8)])
    query = torch.randn(8, 4, 64, device=DEVICE)
    causal = paged_attention(query, k_cache, v_cache, meta, 0.125)
    chain = torch.tensor([(1 << (i + 1)) - 1 for i in range(8)], dtype=torch.int64, device=DEVICE)
    as_tree = paged_attention(query, k_cache, v_cache, dataclasses.replace(meta, tree_mask=chain), 0.125)
    torch.testing.assert_close(causal, as_tree, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_causal_chunks(block_size):
    # 40 new tokens × group 2 span several token tiles; ctx 0 is a plain prefill.
    check([Seq(0, 40), Seq(37, 21)], block_size=block_size, block_n=16)


def test_mixed_batch_searches_for_sequences():
    seqs = [Seq(0, 90), Seq(64, 1), Seq(7, 0), Seq(10, 12, tree=True), Seq(200, 1), Seq(31, 5), Seq(3, 1)]
    # Seq(7, 0) has no new tokens this step: its empty program range must not shift the others.
    plan = check(seqs, num_splits=2, block_n=32)
    assert plan.q_blocks_per_seq == 0  # the long chunk makes the searched grid the smaller one


def test_mixed_batch_uniform_grid():
    plan = check([Seq(20, 6, tree=True), Seq(44, 1), Seq(9, 6), Seq(0, 2)], block_n=16)
    assert plan.q_blocks_per_seq > 0


def test_fp32_cache_with_bf16_queries():
    check([Seq(45, 1), Seq(20, 5, tree=True)], dtype=torch.float32, query_dtype=torch.bfloat16)


def test_strided_query_and_cache_views():
    meta, k_cache, v_cache = make_batch([Seq(25, 3), Seq(60, 1)])
    qkv = torch.randn(meta.num_tokens, 4 + 2 * 2, 64, device=DEVICE)
    query = qkv[:, :4]  # a view into a fused QKV projection
    kv = torch.stack([k_cache, v_cache], dim=2)  # one [blocks, bs, 2, KVH, D] allocation
    got = paged_attention(query, kv[:, :, 0], kv[:, :, 1], meta, 0.125)
    want = reference_attention(query.contiguous(), k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_rejects_bad_shapes():
    meta, k_cache, v_cache = make_batch([Seq(4, 1)])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(torch.randn(1, 3, 64, device=DEVICE), k_cache, v_cache, meta, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(torch.randn(1, 4, 32, device=DEVICE), k_cache, v_cache, meta, 1.0)


def test_plan_fills_the_gpu_at_batch_one():
    plan = plan_launch(1, 1, 32, 8, 128, 1, 32768, num_sms=132)
    assert plan.num_splits > 1 and plan.num_q_programs * 8 * plan.num_splits >= 132
    assert plan_launch(1, 1, 32, 8, 128, 1, 4096, num_sms=132).num_splits == 4096 // MIN_TOKENS_PER_SPLIT
    assert plan_launch(64, 64, 32, 8, 128, 1, 4096, num_sms=132).num_splits == 1
    assert plan_launch(1, 1, 32, 8, 128, 1, 500, num_sms=132).num_splits == 1  # too short to split


@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (4, 2), (12, 12), (16, 1), (24, 8)])
def test_tile_shapes_cover_every_plan(num_heads, num_kv_heads):
    """compile_variants builds one variant per tile shape; a plan outside them would compile mid-run."""
    shapes = tile_shapes(num_heads, num_kv_heads)
    chosen = {
        plan_launch(num_seqs * q_len, num_seqs, num_heads, num_kv_heads, 128, q_len, 4096, 132).block_q
        for q_len in range(1, 300)
        for num_seqs in (1, 3, 64)
    }
    assert chosen == set(shapes)


@pytest.mark.skipif(not CUDA, reason="counts compiles of GPU kernel variants")
def test_no_compile_after_compile_variants():
    """After start-up's compile_variants, no batch shape (mixed prefill and decode, trees, splits,
    block-table widths) builds another attention kernel variant."""
    from bench.gpu_decode import TRITON_COMPILES, count_triton_compiles

    meta, k_cache, v_cache = make_batch([Seq(3, 1)], num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    compile_variants(torch.bfloat16, 8, k_cache, v_cache)
    count_triton_compiles()
    compiled_before = len(TRITON_COMPILES)
    batches = [
        [Seq(0, 300), Seq(64, 1), Seq(10, 12, tree=True), Seq(200, 1)],
        [Seq(0, 17), Seq(500, 1)],
        [Seq(900, 1)],
        [Seq(40, 5, tree=True), Seq(3, 5, tree=True)],
        [Seq(0, 3)],
        [Seq(1, 1)] * 33,
    ]
    for seed, seqs in enumerate(batches):
        for num_splits in (None, 4):
            check(seqs, num_heads=8, num_splits=num_splits, dtype=torch.bfloat16, seed=seed)
    assert TRITON_COMPILES[compiled_before:] == []


def test_benchmark_smoke(tmp_path, capsys):
    from bench.attention_kernels import main

    out = tmp_path / "attention.csv"
    assert main(["--smoke", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("kind,batch,context,new_tokens") and len(lines) == 5  # header, 2 decode rows, 2 tree rows
    assert "--smoke" in lines[1] and "vs_decode" in capsys.readouterr().out


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_with_new_metadata():
    """Capture once, then change lengths, tables and trees in place: the replay must follow."""
    first = [Seq(100, 5, tree=True), Seq(300, 1)]
    second = [Seq(250, 5, tree=True), Seq(17, 1)]
    meta, k_cache, v_cache = make_batch(first, seed=1)
    query = torch.randn(meta.num_tokens, 4, 64, device=DEVICE)
    bound = 512
    torch.cuda.synchronize()
    paged_attention(query, k_cache, v_cache, meta, 0.125, max_seq_len=bound)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(query, k_cache, v_cache, meta, 0.125, max_seq_len=bound)
    new_meta, new_k, new_v = make_batch(second, seed=2)
    for field in ("query_start_loc", "seq_lens", "tree_mask"):
        getattr(meta, field).copy_(getattr(new_meta, field))
    meta.block_tables.fill_(-1)
    meta.block_tables[:, : new_meta.block_tables.shape[1]].copy_(new_meta.block_tables)
    k_cache[: new_k.shape[0]].copy_(new_k)
    v_cache[: new_v.shape[0]].copy_(new_v)
    graph.replay()
    want = reference_attention(query, new_k, new_v, new_meta, 0.125)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
