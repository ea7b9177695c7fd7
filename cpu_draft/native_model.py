"""The draft forward in one native call: `LeanDraftModel`'s maths, without torch's per-op costs.

Each small torch op costs microseconds of OpenMP fork/join and dispatch, and
`LeanDraftModel` runs ~28 of them per layer, so a small draft's forward is mostly op
overhead (bench/results/cpu_draft-*). `csrc/draft_forward.cpp` (built by `cpu_draft.native`) runs
the whole forward (embedding, every layer, the logits head) in one OpenMP parallel region
with five barriers per layer, streaming each weight once per forward.

The weights are `LeanDraftModel`'s, built in float32 (norms folded, Q scaled, rotary pairs
adjacent: one implementation of the folding), then converted once to the kernel's format:

* ``fp32``, ``bf16`` (rounded as `LeanDraftModel` rounds them), or ``int8`` per output
  channel (`cpu_draft.quantize.quantize_per_channel` of the weights rounded to the compute
  dtype, as `Int8Linear` quantises them) with float32 scales;
* packed in panels of the kernel's vector width, ``[panels, in, width]``, gate and up
  panels interleaved so one thread computes silu(gate) * up of its channels; where the
  library was built with AVX512_BF16 (``bf16_pairs``), bf16 panels hold pairs of
  consecutive inputs side by side, ``[panels, in / 2, width, 2]``, for ``vpdpbf16ps``, and
  those matmuls round their (rms-scaled) input rows to bf16 once: float32 accumulation of
  bf16 x bf16 products, as the AMX / oneDNN BF16 path of the torch forward also computes;
  where it was built with AVX512_VNNI (``int8_quads``), int8 panels hold quads of consecutive
  inputs, ``[panels, in / 4, width, 4]``, stored + 128 as uint8 for ``vpdpbusd``, and those
  matmuls quantise their input rows to int8 once, per block of 64 inputs (symmetric, one scale
  each; llama.cpp's Q8 activations): weights and activations in int8, exact int32 sums per
  block, so INT8 logits are no longer the weight-only `Int8Linear` ones (SmolLM2-135M's greedy
  tokens agreed with BF16's at 95% of positions, weight-only at 96-97%; drafts are proposals
  the target verifies, so speculation stays lossless);
* the logits head in the compute dtype (bf16, or fp32 for a float32 model), or int8 per
  row like the projections under ``int8_weights``: for a large-vocabulary draft the head is
  most of the bytes a forward streams (Llama 3's 128256 x 576 is 148 MB in bf16), and
  per-row scales keep each logit's relative error at the projections' level
  (`tests/cpu_draft/test_native_draft.py` checks the drafted tokens and logits against float).

The residual stream and attention stay float32; the K/V cache is float32 or bfloat16 (the
`SlotKVCache`'s dtype: bf16 K/V are stored rounded to nearest even, as torch's
``.to(torch.bfloat16)`` rounds them, and widened to float32 in registers when attention reads
them). The cache is `cpu_draft.slot_kv`'s: token t writes its K/V at ``(write_slots[t], write_positions[t])``
and attends to indices ``0..write_positions[t]`` of its slot, which is what the lean
forward's causal mask encodes, so rollback, snapshots and regrowth are unchanged.
`forward` keeps `LeanDraftModel.forward`'s signature; `meta` needs only ``write_slots`` and
``write_positions`` (`NativeSlotMetadata`), and ``kv_caches`` may be the whole slot storage.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from cpu_draft import native
from cpu_draft.lean_model import LeanDraftModel
from cpu_draft.quantize import quantize_per_channel
from cpu_draft.top_probs import TOP_K_MAX
from gpu_target.model import CausalLM

logger = logging.getLogger("hetero.cpu_draft.native")

FORMATS = {"fp32": 0, "bf16": 1, "int8": 2}
_ERRORS = {1: "a token id is outside the vocabulary", 2: "a position is outside the rotary table or the KV capacity",
           3: "a slot is outside the KV storage", 4: "a logits row is outside the batch",
           5: "the weights were packed for another vector width", 6: "the K/V are neither float32 nor bfloat16",
           7: "top_k is out of range"}
KV_FORMATS = {torch.float32: FORMATS["fp32"], torch.bfloat16: FORMATS["bf16"]}


class _Matrix(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("panels", ctypes.c_int64), ("format", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Matrix), ("o", _Matrix), ("gate_up", _Matrix), ("down", _Matrix)]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                                      "intermediate", "vocab", "max_positions", "embed_format")] + [
        ("embed", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("eps", ctypes.c_void_p),
        ("layers", ctypes.c_void_p), ("head", _Matrix), ("vector_width", ctypes.c_int64)]


@dataclass
class NativeSlotMetadata:
    """What the native forward reads of a forward's `SlotMetadata`: where each new token's K/V goes."""

    write_slots: torch.Tensor  # int64 [T]
    write_positions: torch.Tensor  # int64 [T]


def weight_formats(dtype: torch.dtype, int8_weights: bool) -> Optional[tuple[str, str]]:
    """(projection format, logits head format) for a draft in ``dtype``; None if the kernel has none for it."""
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    if int8_weights:
        return "int8", "int8"
    plain = "bf16" if dtype == torch.bfloat16 else "fp32"
    return plain, plain


class NativeDraftModel:
    def __init__(self, lean: LeanDraftModel, weight_format: str, head_format: str, library: ctypes.CDLL,
                 quantize_from: torch.dtype = torch.bfloat16):
        """From a float32 `LeanDraftModel` with plain projections (``pack_linears=False``).

        ``quantize_from``: int8 weights are quantised from the folded weights rounded to this dtype.
        """
        if weight_format not in FORMATS or head_format not in FORMATS:
            raise ValueError(f"unsupported native formats: weights {weight_format!r}, head {head_format!r}")
        c = self.config = lean.config
        self.weight_format, self.head_format = weight_format, head_format
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(head_format, quantize_from)  # biases round to it
        self.standard_k_order = lean.standard_k_order
        self.library = library
        self.vector_width = int(library.draft_vector_width())
        self.bf16_pairs = bool(library.draft_bf16_pairs())
        self.int8_quads = bool(library.draft_int8_quads())
        self._keep: list[torch.Tensor] = []  # everything the C structures point into

        def matrix(linear, fmt: str, interleave: int = 0) -> _Matrix:
            bias = None if linear.bias is None else linear.bias.detach().to(self.dtype).float()
            return self._matrix(_plain_weight(linear), bias, fmt, quantize_from, interleave)

        layers = (_Layer * c.num_layers)()
        eps = []
        for i, layer in enumerate(lean.layers):
            layers[i] = _Layer(matrix(layer.qkv, weight_format), matrix(layer.o, weight_format),
                               matrix(layer.gate_up, weight_format, interleave=c.intermediate_size), matrix(layer.down, weight_format))
            eps += [layer.eps, layer.post_eps]
        self._layers = layers
        self._eps = torch.tensor(eps + [lean.final_eps], dtype=torch.float32)
        head = matrix(lean.lm_head, head_format)
        self.head_size = head.n
        embed = lean.embed_tokens if lean.embed_tokens.dtype in (torch.float32, torch.bfloat16) else lean.embed_tokens.float()
        self.embed_tokens = embed.contiguous()
        self._cos = lean.rotary.real.contiguous()
        self._sin = lean.rotary.imag.contiguous()
        self._keep += [self._eps, self.embed_tokens, self._cos, self._sin]
        self._model = _Model(c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                             c.vocab_size, self._cos.shape[0], FORMATS["bf16" if embed.dtype == torch.bfloat16 else "fp32"],
                             self.embed_tokens.data_ptr(), self._cos.data_ptr(), self._sin.data_ptr(), self._eps.data_ptr(),
                             ctypes.addressof(layers), head, self.vector_width)
        self._cache_key: Optional[tuple] = None
        self._logits_buffer = torch.empty(0, dtype=torch.float32)  # `forward_top`'s logits, which only the call reads

    @classmethod
    def build(cls, model: CausalLM, dtype: torch.dtype, int8_weights: bool = False,
              extra_flags: Sequence[str] = (), head_ids: Optional[torch.Tensor] = None) -> Optional["NativeDraftModel"]:
        """The native forward of ``model`` in ``dtype``; None where the kernel cannot be built or has no such format.

        ``head_ids``: the token ids the logits head scores (`cpu_draft.draft_vocab`); None: the whole vocabulary.
        """
        formats = weight_formats(dtype, int8_weights)
        if formats is None:
            logger.info("no native draft forward for %s weights; using the torch forward", dtype)
            return None
        library = native.load_library(extra_flags)
        if library is None:
            return None
        lean = LeanDraftModel(model, torch.float32, int8_weights=False, pack_linears=False, head_ids=head_ids)
        return cls(lean, *formats, library, quantize_from=dtype)

    def _matrix(self, weight: torch.Tensor, bias: Optional[torch.Tensor], fmt: str, quantize_from: torch.dtype,
                interleave: int = 0) -> _Matrix:
        """The kernel's structure for float32 ``weight`` [out, in] (and ``bias``) in ``fmt``; kept alive with the model.

        ``interleave``: gate_up, whose first ``interleave`` rows (gate) and the rest (up) go in panels g0, u0, g1, u1, ...
        """
        if interleave:
            halves = [self._pack(w, None, fmt, quantize_from) for w in weight.split(interleave)]
            packed = torch.stack([h[0] for h in halves], 1).flatten(0, 1)
            scale = None if fmt != "int8" else torch.stack([h[1].view(-1, self.vector_width) for h in halves], 1).reshape(-1)
            n = interleave
        else:
            packed, scale, bias = self._pack(weight, bias, fmt, quantize_from)
            n = weight.shape[0]
        self._keep += [t for t in (packed, scale, bias) if t is not None]
        return _Matrix(packed.data_ptr(), _ptr(scale), _ptr(bias), n, weight.shape[1], packed.shape[0], FORMATS[fmt])

    def _pack(self, weight: torch.Tensor, bias: Optional[torch.Tensor], fmt: str, quantize_from: torch.dtype):
        """[panels, in, width] in ``fmt`` (rows padded with zeros), int8 scales and bias padded to panels * width.

        Where the library has the AVX512_BF16 / AVX512_VNNI kernels, bf16 weights go in pairs of inputs,
        [panels, in / 2, width, 2], and int8 ones in quads, [panels, in / 4, width, 4], stored + 128 as uint8
        (inputs padded with zeros to whole pairs / quads).
        """
        n, k = weight.shape
        width = self.vector_width
        panels = -(-n // width)
        scale = None
        if fmt == "int8":
            weight, scale = quantize_per_channel(weight.to(quantize_from))
        elif fmt == "bf16":
            weight = weight.to(torch.bfloat16)
        group = 2 if fmt == "bf16" and self.bf16_pairs else 4 if fmt == "int8" and self.int8_quads else 1
        padded = weight.new_zeros(panels * width, -(-k // group) * group)
        padded[:n, :k] = weight
        packed = padded.view(panels, width, -1).transpose(1, 2)
        if group > 1:  # [panels, k / group, width, group]
            packed = packed.unflatten(1, (-1, group)).transpose(2, 3)
        packed = packed.contiguous()
        if fmt == "int8" and self.int8_quads:
            packed = (packed.to(torch.int16) + 128).to(torch.uint8)
        return packed, _pad(scale, panels * width), _pad(bias, panels * width)

    def __call__(self, *args):
        return self.forward(*args)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta, last_rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the rows ``last_rows`` [N, head ids]; K/V of every token lands in the cache.

        ``kv_caches``: per layer (K, V), each [slots, kv_heads, capacity, head_dim] float32 or bfloat16
        and contiguous, or the whole `SlotKVCache.storage` [layers, 2, slots, kv_heads, capacity, head_dim].
        """
        return self._run(input_ids, positions, kv_caches, meta, last_rows, 0)[0]

    def forward_top(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta, last_rows: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, read as `cpu_draft.top_probs.top_probabilities` reads its logits: (probabilities, head columns),
        each [N, k], best first, from the same call (its threads read the rows they have just written). The logits
        themselves land in a buffer kept for the next call (nothing returns them)."""
        if not 1 <= k <= min(TOP_K_MAX, self.head_size):
            raise ValueError(f"the native top-k read takes 1 to {min(TOP_K_MAX, self.head_size)} columns, not {k}")
        _, probs, columns = self._run(input_ids, positions, kv_caches, meta, last_rows, k)
        return probs, columns

    def _run(self, input_ids, positions, kv_caches, meta, last_rows, k: int):
        ids, positions = _int64(input_ids), _int64(positions)
        slots, kv_positions, rows = _int64(meta.write_slots), _int64(meta.write_positions), _int64(last_rows)
        T = ids.shape[0]
        if not (positions.shape[0] == slots.shape[0] == kv_positions.shape[0] == T):
            raise ValueError(f"input_ids, positions, write_slots and write_positions must have one entry per token ({T})")
        k_ptrs, v_ptrs, kv_format, num_slots, capacity = self._cache_pointers(kv_caches)
        if not k:
            logits = torch.empty(rows.shape[0], self.head_size, dtype=torch.float32)
        else:
            if self._logits_buffer.numel() < rows.shape[0] * self.head_size:
                self._logits_buffer = torch.empty(rows.shape[0] * self.head_size, dtype=torch.float32)
            logits = self._logits_buffer
        probs = torch.empty(rows.shape[0], k, dtype=torch.float32) if k else None
        columns = torch.empty(rows.shape[0], k, dtype=torch.int64) if k else None
        code = self.library.draft_forward(
            ctypes.byref(self._model), T, ids.data_ptr(), positions.data_ptr(), slots.data_ptr(), kv_positions.data_ptr(),
            rows.shape[0], rows.data_ptr(), k_ptrs, v_ptrs, kv_format, num_slots, capacity, torch.get_num_threads(), logits.data_ptr(),
            k, _ptr(probs), _ptr(columns))
        if code:
            raise IndexError(f"native draft forward: {_ERRORS.get(code, f'error {code}')}")
        return logits, probs, columns

    def _cache_pointers(self, kv_caches):
        """Per-layer K and V base pointers (ctypes arrays), K/V format, slots and capacity; reused while the storage is."""
        c = self.config
        if isinstance(kv_caches, torch.Tensor):
            storage = kv_caches
            expected = (c.num_layers, 2, storage.shape[2], c.num_kv_heads, storage.shape[4], c.head_dim)
            if tuple(storage.shape) != expected or storage.dtype not in KV_FORMATS or not storage.is_contiguous():
                raise ValueError(f"KV storage must be float32 or bfloat16, contiguous {expected}, got {storage.dtype} {tuple(storage.shape)}")
            key = (storage.data_ptr(), tuple(storage.shape), storage.dtype)
            if key != self._cache_key:
                size = storage.element_size()
                base, layer, half = storage.data_ptr(), storage[0].numel() * size, storage[0, 0].numel() * size
                self._k_ptrs = (ctypes.c_void_p * c.num_layers)(*[base + i * layer for i in range(c.num_layers)])
                self._v_ptrs = (ctypes.c_void_p * c.num_layers)(*[base + i * layer + half for i in range(c.num_layers)])
                self._cache_key = key
            return self._k_ptrs, self._v_ptrs, KV_FORMATS[storage.dtype], storage.shape[2], storage.shape[4]
        if len(kv_caches) != c.num_layers:
            raise ValueError(f"expected K/V of {c.num_layers} layers, got {len(kv_caches)}")
        shape, dtype = tuple(kv_caches[0][0].shape), kv_caches[0][0].dtype
        if len(shape) != 4 or shape[1] != c.num_kv_heads or shape[3] != c.head_dim:
            raise ValueError(f"K/V caches must be [slots, {c.num_kv_heads}, capacity, {c.head_dim}], got {shape}")
        if dtype not in KV_FORMATS:
            raise ValueError(f"K/V caches must be float32 or bfloat16, got {dtype}")
        for k, v in kv_caches:
            for t in (k, v):
                if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                    raise ValueError(f"every K/V cache must be {dtype}, contiguous and {shape}")
        k_ptrs = (ctypes.c_void_p * c.num_layers)(*[k.data_ptr() for k, _ in kv_caches])
        v_ptrs = (ctypes.c_void_p * c.num_layers)(*[v.data_ptr() for _, v in kv_caches])
        return k_ptrs, v_ptrs, KV_FORMATS[dtype], shape[0], shape[2]


def _plain_weight(linear) -> torch.Tensor:
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32:
        raise TypeError(f"NativeDraftModel needs a float32 LeanDraftModel with plain projections, got {type(linear).__name__}")
    return weight.detach()


def _pad(t: Optional[torch.Tensor], size: int) -> Optional[torch.Tensor]:
    if t is None:
        return None
    out = torch.zeros(size, dtype=torch.float32)
    out[: t.shape[0]] = t.float()
    return out


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _int64(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int64 or not t.is_contiguous():
        t = t.to(torch.int64).contiguous()
    return t
