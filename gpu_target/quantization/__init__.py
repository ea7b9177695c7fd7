"""Quantised target weights: the `quantization=` methods (vLLM's names) and what each one means.

- "fp8": bf16/fp16 weights quantised at load to FP8 E4M3, one scale per output channel
  (`fp8.py`); also the method of checkpoints already in FP8 (`quant_method` "fp8", or
  compressed-tensors float-quantized 8-bit weights).
- "int4": weights quantised at load to 4 bits by round-to-nearest, asymmetric, in groups
  of 128 along K (`int4.py`): for testing the 4-bit kernels without a GPTQ/AWQ checkpoint.
- "gptq", "awq": 4-bit checkpoints in those packed layouts (`checkpoint.py`).

Only the decoder layers' projections are quantised; embeddings, norms and lm_head stay in
the compute dtype. `linear.QuantizedLinear` runs them (on the GPU through gpu_target/gemv.py's
kernels, which dequantise W in registers).
"""
from __future__ import annotations

import re
from typing import Optional, Union

import torch

from gpu_target.quantization.fp8 import Fp8Weight, quantize_fp8
from hetero.core.config import check_quantization
from gpu_target.quantization.int4 import Int4Weight, quantize_int4

QuantizedWeight = Union[Fp8Weight, Int4Weight]
QUANTIZED_AT_LOAD = ("fp8", "int4")  # methods a full-precision checkpoint can be quantised to
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: E4M3 in hardware

_PROJECTION_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def is_projection_weight(name: str) -> bool:
    """Whether an HF parameter name is a decoder projection's weight (what gets quantised)."""
    return _PROJECTION_WEIGHT.match(name) is not None


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """A full-precision [N, K] weight quantised at load by `method` ("fp8" or "int4")."""
    if method == "fp8":
        return quantize_fp8(weight)
    if method == "int4":
        return quantize_int4(weight)
    raise ValueError(f"quantization={method!r} reads a pre-quantised checkpoint; weights can be quantised at load "
                     f"only to {list(QUANTIZED_AT_LOAD)}")


def check_device(method: Optional[str], device: Union[torch.device, str]) -> None:
    """FP8 on a CUDA GPU needs compute capability 8.9+ (the kernels convert E4M3 in hardware)."""
    device = torch.device(device)
    if method == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise ValueError(
                f"quantization='fp8' needs a GPU of compute capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+ "
                f"(Ada, Hopper), but {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
            )


def resolve_method(requested: Optional[str], checkpoint_method: Optional[str], source: str) -> Optional[str]:
    """The method to run: the checkpoint's own (vLLM's rule: `quantization` may be left out or
    must name it), or `requested` applied at load to a full-precision checkpoint."""
    check_quantization(requested)
    if checkpoint_method is None:
        if requested is not None and requested not in QUANTIZED_AT_LOAD:
            raise ValueError(f"quantization={requested!r} needs a checkpoint with a {requested} quantization_config, "
                             f"and {source} has none (full-precision checkpoints can be quantised to {list(QUANTIZED_AT_LOAD)})")
        return requested
    if requested is not None and requested != checkpoint_method:
        raise ValueError(f"quantization={requested!r} does not match {source}'s quantization_config ({checkpoint_method!r})")
    return checkpoint_method


def contains_quantized(state: dict) -> bool:
    return any(isinstance(value, (Fp8Weight, Int4Weight)) for value in state.values())
