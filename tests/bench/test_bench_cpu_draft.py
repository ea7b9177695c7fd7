"""The CPU draft benchmark's roofline: the bytes a batched draft forward must read."""
from bench.cpu_draft import bytes_per_forward, random_config


def test_bytes_per_forward_counts_projections_head_and_cached_kv():
    config = random_config("64,2,4,2,128,1000")  # head_dim 16: q 64, k/v 32 wide; tied logits head
    # Per layer q 64x64, k 32x64, v 32x64, o 64x64, gate and up 128x64, down 64x128: 36864
    # weights in 512 rows; the tied head reads the 1000x64 embedding.
    weights, rows = 2 * 36864 + 64000, 2 * 512 + 1000
    kv_elements = 2 * 3 * 10 * 2 * 32  # layers x batch x context x (K, V) x kv width
    assert bytes_per_forward(config, "int8", "fp32", 3, 10) == weights + 4 * rows + 4 * kv_elements
    assert bytes_per_forward(config, "bf16", "bf16", 3, 10) == 2 * weights + 2 * kv_elements
    untied = random_config("64,2,4,2,128,1000,untied")
    assert bytes_per_forward(untied, "fp32", "fp32", 0, 0) == 4 * weights


def test_a_reduced_head_reads_only_its_rows():
    untied = random_config("64,2,4,2,128,1000,untied")
    full = bytes_per_forward(untied, "fp32", "fp32", 0, 0)
    assert bytes_per_forward(untied, "fp32", "fp32", 0, 0, head_rows=100) == full - 4 * 900 * 64
    assert bytes_per_forward(untied, "fp32", "fp32", 0, 0, head_rows=5000) == full  # no more rows than the vocabulary


def test_head_coverage_counts_the_tokens_below_each_head_size():
    from bench.head_coverage import coverage

    assert coverage([0, 5, 9, 10, 20], [10, 21]) == {"head_10": 0.6, "head_21": 1.0}
