"""The native read of a level's logits against torch's topk and logsumexp."""
import pytest
import torch

from cpu_draft import native
from cpu_draft.top_probs import top_probabilities

library = native.load_library()
pytestmark = pytest.mark.skipif(library is None, reason="the native draft forward does not build here")


def reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest first, equal logits by the lower column (stable), probabilities in float64."""
    order = torch.sort(logits.double(), dim=-1, descending=True, stable=True).indices[:, :k]
    probs = torch.softmax(logits.double(), dim=-1).gather(-1, order)
    return probs, order


@pytest.mark.parametrize("rows, cols, k", [(1, 100, 1), (8, 32768, 2), (33, 5003, 5), (3, 16, 16), (2, 9000, 3)])
def test_matches_torch(rows, cols, k):
    torch.manual_seed(rows * cols + k)
    logits = torch.randn(rows, cols) * 4
    probs, columns = top_probabilities(logits, k, library)
    want_probs, want_columns = reference(logits, k)
    assert torch.equal(columns, want_columns)
    torch.testing.assert_close(probs.double(), want_probs, rtol=1e-5, atol=1e-9)
    torch_probs, torch_columns = top_probabilities(logits, k)  # no library: torch
    torch.testing.assert_close(torch_probs.double(), want_probs, rtol=1e-5, atol=1e-9)


def test_equal_logits_take_the_lower_column_first_across_chunks():
    logits = torch.full((2, 10000), -5.0)
    logits[0, [9000, 12, 4100]] = 3.0  # three equal maxima in three chunks
    logits[1, 7] = 1.0
    probs, columns = top_probabilities(logits, 3, library)
    assert columns[0].tolist() == [12, 4100, 9000]
    assert columns[1, 0].item() == 7 and columns[1, 1:].tolist() == [0, 1]
    assert probs[0].sum().item() == pytest.approx(3 * torch.softmax(logits[0], -1)[12].item(), rel=1e-5)


def test_k_out_of_range_falls_back_to_torch():
    logits = torch.randn(2, 40)
    probs, columns = top_probabilities(logits, 17, library)
    assert columns.shape == (2, 17)
    torch.testing.assert_close(probs.double(), reference(logits, 17)[0], rtol=1e-5, atol=1e-9)
