"""The batch-1 Triton GEMV against F.linear (on the GPU, or through Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_target import gemv  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


def _inputs(n: int, k: int, dtype: torch.dtype, bias: bool):
    generator = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(1, k, generator=generator).to(DEVICE, dtype)
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


def test_linear_uses_the_gemv_only_for_one_half_precision_row_on_the_gpu():
    weight = torch.randn(8, 16, dtype=torch.bfloat16)
    one_row = torch.randn(1, 16, dtype=torch.bfloat16)
    assert not gemv.gemv_applies(one_row, weight)  # CPU tensors: F.linear
    assert torch.equal(gemv.linear(one_row, weight), F.linear(one_row, weight))
    if CUDA:
        assert gemv.gemv_applies(one_row.cuda(), weight.cuda())
        assert not gemv.gemv_applies(torch.randn(2, 16, dtype=torch.bfloat16, device="cuda"), weight.cuda())
        assert not gemv.gemv_applies(one_row.float().cuda(), weight.float().cuda())
