"""The weight-streaming GEMV (M = 1) and skinny GEMM (M = 2..64) against F.linear, and
`linear`'s dispatch between them (on the GPU, or through Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_target import gemv  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


def _inputs(n: int, k: int, dtype: torch.dtype, bias: bool, m: int = 1):
    generator = torch.Generator().manual_seed(m * 1_000_000 + n * 1000 + k)
    x = torch.randn(m, k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(37, 300), (64, 4096), (6, 2049)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_f_linear(dtype, n, k, bias):
    """Ragged N and K exercise the masks; the bias path is Qwen2's qkv projection."""
    x, weight, b = _inputs(n, k, dtype, bias)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = gemv.gemv(x, weight, b)
    assert got.shape == (1, n) and got.dtype == dtype
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # one rounding of the output
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=ulp)


def test_gemv_small_tiles_cover_every_row_and_column():
    x, weight, _ = _inputs(9, 70, torch.float16, False)
    got = gemv.gemv(x, weight, block_n=4, block_k=16, num_warps=1)
    torch.testing.assert_close(got.float(), F.linear(x.float(), weight.float()), atol=1e-3, rtol=2.0**-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(2, 37, 300), (7, 64, 515), (17, 70, 256), (40, 16, 40), (64, 33, 129)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_f_linear(dtype, m, n, k, bias):
    """Rows that are not a power of two, ragged N and K, and the bias path, through the masks."""
    x, weight, b = _inputs(n, k, dtype, bias, m)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = gemv.skinny_gemm(x, weight, b)
    assert got.shape == (m, n) and got.dtype == dtype
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=ulp)


@pytest.mark.parametrize("w_first", [False, True])
@pytest.mark.parametrize("block_k", [16, 32])  # K = 70 with 16: a ragged last K tile; K = 64 with 32: EVEN_K
def test_skinny_gemm_small_tiles_and_strided_rows(w_first, block_k):
    """Several programs and K steps, rows of x further apart than K (a slice of a wider buffer), either operand order."""
    wide, weight, b = _inputs(50, 90, torch.bfloat16, True, m=5)
    k = 70 if block_k == 16 else 64
    x = wide[:, :k]
    weight = weight[:, :k].contiguous()
    got = gemv.skinny_gemm(x, weight, b, block_n=16, block_k=block_k, num_warps=1, num_stages=1, w_first=w_first)
    expected = F.linear(x.float(), weight.float(), b.float())
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=2.0**-7)


class _ClaimsCuda(torch.Tensor):
    """A CPU tensor that says it is on the GPU, so the dispatch runs without one."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize("m,n,path", [(1, 8, "gemv"), (2, 4096, "skinny"), (17, 4096, "skinny"), (32, 4096, "skinny"),
                                      (33, 4096, "cublas"), (64, 16384, "skinny"), (65, 16384, "cublas"), (17, 1536, "cublas")])
def test_linear_dispatches_on_rows_and_width(monkeypatch, m, n, path):
    calls = []
    monkeypatch.setattr(gemv, "gemv", lambda x, w, b=None: calls.append("gemv"))
    monkeypatch.setattr(gemv, "skinny_gemm", lambda x, w, b=None: calls.append("skinny"))
    monkeypatch.setattr(gemv.F, "linear", lambda x, w, b=None: calls.append("cublas"))
    weight = torch.randn(n, 16, dtype=torch.bfloat16)
    gemv.linear(torch.randn(m, 16, dtype=torch.bfloat16).as_subclass(_ClaimsCuda), weight)
    assert calls == [path]


def test_linear_streams_only_half_precision_rows_on_the_gpu():
    weight = torch.randn(8, 16, dtype=torch.bfloat16)
    for m in (1, 17):
        rows = torch.randn(m, 16, dtype=torch.bfloat16)
        assert not gemv.streaming_applies(rows, weight)  # CPU tensors: F.linear
        assert torch.equal(gemv.linear(rows, weight), F.linear(rows, weight))
    if CUDA:
        weight = weight.cuda()
        for m in (1, 2, 64):
            assert gemv.streaming_applies(torch.randn(m, 16, dtype=torch.bfloat16, device="cuda"), weight)
        assert not gemv.streaming_applies(torch.randn(65, 16, dtype=torch.bfloat16, device="cuda"), weight)
        assert not gemv.streaming_applies(torch.randn(4, 16, device="cuda"), weight.float())
        assert not gemv.streaming_applies(torch.randn(16, 4, dtype=torch.bfloat16, device="cuda").t(), weight)
        x = torch.randn(17, 16, dtype=torch.bfloat16, device="cuda")
        torch.testing.assert_close(gemv.linear(x, weight).float(), F.linear(x.float(), weight.float()),
                                   atol=1e-3, rtol=2.0**-7)
