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


def test_several_thread_counts_are_each_a_row(tmp_path):
    """--threads 1 2: each batch size timed at each thread count, the count in its row."""
    import csv
    import os

    import torch

    from bench.cpu_draft import main

    out = tmp_path / "draft.csv"
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:  # the benchmark pins the process it runs in: this test's, which the other tests share
        assert main(["--random-shape", "64,2,4,2,128,1000", "--precisions", "fp32", "--kernels", "lean", "--batch-sizes", "1",
                     "2", "--threads", "1", "2", "--context", "8", "--steps", "1", "--warmup", "1", "--cpus", "0",
                     "--out", str(out)]) == 0
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
    rows = list(csv.DictReader(out.open()))
    assert [(r["batch_size"], r["threads"]) for r in rows] == [("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")]
