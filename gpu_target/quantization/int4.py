"""4-bit integer weights in groups along K (W4A16): RTN at load, and the GPTQ / AWQ layouts' target.

One layout serves every 4-bit source: the codes of a [N, K] weight packed two per byte along K
(even k in the low nibble), and per (row, group of `group_size` consecutive k) an fp16 scale
and, for asymmetric codes, a zero point: W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G].
Symmetric codes have the implicit zero point 8, as GPTQ's `sym=True` (Frantar et al., 2022,
arXiv:2210.17323, and AutoGPTQ's packing). GPTQ's act-order (`desc_act`) checkpoints
permute K so that each group's columns are contiguous: `perm` then says which input column
each stored column reads (x[:, perm] @ W_stored^T = x @ W^T).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

DEFAULT_GROUP_SIZE = 128
SYMMETRIC_ZERO = 8
_MIN_SCALE = 2.0**-24  # fp16's smallest subnormal: an all-zero group keeps a finite scale


@dataclass
class Int4Weight:
    """qweight uint8 [N, K/2]; scales fp16 [N, ceil(K/G)]; zeros uint8 [N, ceil(K/G)] or None
    (symmetric: 8); perm int64 [K] or None (stored column j reads input column perm[j])."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    group_size: int
    perm: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.group_size % 2:
            raise ValueError(f"4-bit groups must hold an even number of columns (a byte's two), got group_size={self.group_size}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qweight.shape[0], 2 * self.qweight.shape[1]))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.qweight, self.scales, self.zeros) if t is not None)

    def codes(self) -> torch.Tensor:
        """The unsigned 4-bit codes, uint8 [N, K] in stored column order."""
        return unpack_nibbles(self.qweight)

    def dequantize_stored(self, dtype: torch.dtype) -> torch.Tensor:
        """W_stored in `dtype` (columns in stored order), each element rounded once from float32."""
        k = self.shape[1]
        per_column = lambda groups: groups.float().repeat_interleave(self.group_size, dim=1)[:, :k]  # noqa: E731
        zeros = SYMMETRIC_ZERO if self.zeros is None else per_column(self.zeros)
        return ((self.codes().float() - zeros) * per_column(self.scales)).to(dtype)

    def in_stored_order(self) -> "Int4Weight":
        """The same tensors read as a weight over x[:, perm] (no permutation left)."""
        return replace(self, perm=None)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W in `dtype`, columns in the input's order."""
        stored = self.dequantize_stored(dtype)
        if self.perm is None:
            return stored
        weight = torch.empty_like(stored)
        weight[:, self.perm] = stored
        return weight

    @classmethod
    def cat(cls, parts: list["Int4Weight"]) -> "Int4Weight":
        """The weights stacked along N (fused q/k/v or gate/up): they must share K's grouping."""
        first = parts[0]
        for part in parts[1:]:
            if part.group_size != first.group_size or part.shape[1] != first.shape[1]:
                raise ValueError("fused 4-bit projections differ in K or group size")
            if (part.perm is None) != (first.perm is None) or (part.perm is not None and not torch.equal(part.perm, first.perm)):
                raise ValueError("fused 4-bit projections have different act-order permutations (g_idx)")
        if all(p.zeros is None for p in parts):
            zeros = None
        else:
            zeros = torch.cat([p.zeros if p.zeros is not None else torch.full_like(p.scales, SYMMETRIC_ZERO, dtype=torch.uint8)
                               for p in parts])
        return replace(first, qweight=torch.cat([p.qweight for p in parts]), scales=torch.cat([p.scales for p in parts]),
                       zeros=zeros)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes 0..15 -> uint8 [N, K/2], even k in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit weights need an even K, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] codes (inverse of `pack_nibbles`)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool = False) -> Int4Weight:
    """Round-to-nearest 4-bit quantisation of a [N, K] weight in groups of `group_size` along K.

    Asymmetric: each group's [min, max] (widened to include 0) spans codes 0..15 with an
    integer zero point. Symmetric: scale = 2 max|w| / 15 around the zero point 8 (GPTQ's grid).
    The codes are rounded against the fp16-rounded scales that dequantisation will use.
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_int4 needs a 2-D weight, got shape {tuple(weight.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    n, k = weight.shape
    groups = -(-k // group_size)
    padded = torch.zeros(n, groups * group_size, dtype=torch.float32, device=weight.device)
    padded[:, :k] = weight.float()
    tiles = padded.view(n, groups, group_size)
    if symmetric:
        scales = (tiles.abs().amax(dim=2) * (2 / 15)).clamp(min=_MIN_SCALE).half()
        zeros = torch.full_like(scales, SYMMETRIC_ZERO, dtype=torch.float32)
    else:
        low, high = tiles.amin(dim=2).clamp(max=0), tiles.amax(dim=2).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=_MIN_SCALE).half()
        zeros = (-low / scales.float()).round().clamp(0, 15)
    codes = (tiles / scales.float()[:, :, None] + zeros[:, :, None]).round().clamp(0, 15)
    codes = codes.view(n, -1)[:, :k].to(torch.uint8)
    return Int4Weight(pack_nibbles(codes), scales, None if symmetric else zeros.to(torch.uint8), group_size)
