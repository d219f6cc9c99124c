"""Weights kept as a GGUF file has them: quantized linears over torch's CPU kernels.

GGUF blocks (llama.cpp's ``ggml-quants``), 32 weights a block along a row:
``Q4_0`` w = d * (q - 8), ``Q4_1`` w = d * q + m (q in 0..15; d, m float16),
``Q8_0`` w = d * q (q int8).  :func:`decode_blocks` splits a tensor's raw
bytes into (q, d, m) with numpy, exactly as ``gguf.quants.dequantize``
reads them.

Two modules run them, through maintained aten kernels (the same op on the
meta device, so the serving capture records one kernel each):

* :class:`Int4Linear` - ``aten._weight_int4pack_mm_for_cpu`` with groups of
  32 along the input: torch's form w = (q - 8) * scale + zero holds Q4_0 and
  Q4_1 exactly (scale = d, zero = m + 8 d), so the 4-bit values and their
  blocks are the file's.  The scales and zeros are stored in bfloat16 (the
  kernel takes them in the activations' dtype) and the activations go in
  as bfloat16: on this kernel float32 activations run a scalar path 10-30x
  slower.
* :class:`Int8Linear` - ``aten._weight_int8pack_mm``: int8 weights with one
  bfloat16 scale a row (output channel), bfloat16 activations.  A ``Q8_0``
  tensor (one scale per 32-block) is requantized to it, as is a float one;
  :class:`Int8Embedding` reads the same bytes for a tied embedding.

Both kernels are CPU kernels (``_for_cpu`` / a CPU-only fast path), so a
model with these modules is served on CPU devices only.  The int4 packing
is the CPU's own (``_convert_weight_to_int4pack_for_cpu`` picks its layout
for the instruction set torch runs with): packed bytes are for machines of
the same kind.  Accuracy against the float32-dequantized model:
``benchmarks/results/cpu_step/`` (greedy tokens for fixed prompts).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

GROUP = 32   # weights per GGUF block (Q4_0, Q4_1, Q8_0)
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
INT4_KINDS = ("Q4_0", "Q4_1")


def decode_blocks(kind: str, raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q, d, m) of a ``[rows, row_bytes]`` uint8 array of ``kind`` blocks:
    ``q`` [rows, cols] (uint8 0..15 for Q4_x, int8 for Q8_0), ``d`` and ``m``
    [rows, cols // 32] float32 (``m`` None but for Q4_1)."""
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"no quantized kernel for GGUF {kind} tensors (have {', '.join(_BLOCK_BYTES)})")
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, _BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8).reshape(rows, cols), d, None
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    qs = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    # byte j of a block holds weight j in its low nibble and weight j + 16 in its high one
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return q, d, m


def dequantize(kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """The float32 weights of decoded blocks (as ``gguf.quants.dequantize``)."""
    rows, cols = q.shape
    qf = q.reshape(rows, cols // GROUP, GROUP).astype(np.float32)
    if kind == "Q4_0":
        qf = qf - 8
    w = d[..., None] * qf
    if m is not None:
        w = w + m[..., None]
    return w.reshape(rows, cols)


class Int4Linear(nn.Module):
    """``y = x @ W^T`` with W in 4-bit groups of 32 along the input (see the
    module docstring).  Buffers (weights of the capture): ``weight_int4``
    uint8 [out, in / 2] (CPU-packed) and ``scales_zeros`` bfloat16
    [in / 32, out, 2], zeros until :meth:`load`.  The result is in
    ``result_dtype``, or when that is None in ``x``'s dtype (bfloat16, the
    kernel's, saves a cast where the consumer promotes it anyway: a residual
    add, or a projection that takes bfloat16)."""

    def __init__(self, in_features: int, out_features: int, result_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if in_features % GROUP or out_features % 16:
            raise ValueError(f"Int4Linear needs in_features % {GROUP} == 0 and out_features % 16 == 0, "
                             f"got {in_features} x {out_features}")
        self.in_features, self.out_features, self.result_dtype = in_features, out_features, result_dtype
        self.register_buffer("weight_int4", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_zeros", torch.zeros(in_features // GROUP, out_features, 2,
                                                         dtype=torch.bfloat16))

    @torch.no_grad()
    def load(self, kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> None:
        """Take decoded ``Q4_0``/``Q4_1`` blocks ([out, in] values 0..15)."""
        if q.shape != (self.out_features, self.in_features) or kind not in INT4_KINDS:
            raise ValueError(f"Int4Linear {self.out_features}x{self.in_features} cannot take {kind} {q.shape}")
        # torch's (q - 8) * scale + zero: Q4_1 d * q + m with zero = m + 8 d; Q4_0 d * (q - 8) with zero 0
        zero = m + 8.0 * d if kind == "Q4_1" else np.zeros_like(d)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
        sz = np.stack([d.T, zero.T], axis=-1)
        self.weight_int4.copy_(packed)
        self.scales_zeros.copy_(torch.from_numpy(np.ascontiguousarray(sz)))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).to(torch.bfloat16),
                                                       self.weight_int4, GROUP, self.scales_zeros)
        return y.to(self.result_dtype or x.dtype).view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """``y = x @ W^T`` with int8 weights and a bfloat16 scale per output row.
    Buffers: ``weight_int8`` int8 [out, in], ``scales`` bfloat16 [out].
    ``result_dtype`` as :class:`Int4Linear`'s."""

    def __init__(self, in_features: int, out_features: int, result_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.result_dtype = in_features, out_features, result_dtype
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.zeros(out_features, dtype=torch.bfloat16))

    @torch.no_grad()
    def load_float(self, w: np.ndarray) -> None:
        """Take float weights [out, in], quantized to one scale a row:
        symmetric, rounded to nearest against the bfloat16 scale itself."""
        w = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"Int8Linear {self.out_features}x{self.in_features} cannot take {tuple(w.shape)}")
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
        self.scales.copy_(scale)
        self.weight_int8.copy_(torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16),
                                               self.weight_int8, self.scales)
        return y.to(self.result_dtype or x.dtype).view(*x.shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """Embedding rows read from an :class:`Int8Linear`'s bytes (a tied LM
    head): ``row = weight_int8[id] * scale[id]`` in ``out_dtype``.  The int8
    weights are the head's tensor (one copy); the scales are kept here as
    float32 [vocab, 1] (the bfloat16 values, exactly), set by :meth:`tie`."""

    def __init__(self, head: Int8Linear, out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.out_dtype = out_dtype
        self.register_buffer("row_scales", torch.zeros(head.out_features, 1, dtype=torch.float32,
                                                       device=head.scales.device))
        self.tie(head)

    @torch.no_grad()
    def tie(self, head: Int8Linear) -> None:
        self.register_buffer("weight_int8", head.weight_int8)   # the same tensor, registered here too
        if head.scales.device.type != "meta":
            self.row_scales.copy_(head.scales.float()[:, None])

    def forward(self, ids: Tensor) -> Tensor:
        rows = torch.nn.functional.embedding(ids, self.weight_int8).to(self.out_dtype)
        return rows * torch.nn.functional.embedding(ids, self.row_scales).to(self.out_dtype)


def quantized_linear(kind: str, in_features: int, out_features: int,
                     result_dtype: torch.dtype | None = None) -> nn.Module:
    """The (empty) module that runs blocks of ``kind``: 4-bit kinds as they
    are, others (``Q8_0``) requantized to one int8 scale a row.  Built on the
    current default device (``meta`` for the serving capture's twin)."""
    if kind in INT4_KINDS:
        return Int4Linear(in_features, out_features, result_dtype)
    if kind in _BLOCK_BYTES:
        return Int8Linear(in_features, out_features, result_dtype)
    raise ValueError(f"no quantized kernel for GGUF {kind} tensors (have {', '.join(_BLOCK_BYTES)})")
