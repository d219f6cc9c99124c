"""Layers that keep a GGUF file's quantized weights quantized, run by
torch's maintained CPU kernels (no kernel of ours).

* :class:`Int4Linear` holds a Q4_1 matrix in torch's CPU int4 packing
  (``aten._convert_weight_to_int4pack_for_cpu``) and multiplies with
  ``aten._weight_int4pack_mm_for_cpu``: groups of 32 along the input
  dimension with a scale and a zero each, ``w = (q - 8) * scale + zero``.
  Q4_1's ``w = q * d + m`` is that with ``scale = d`` and
  ``zero = m + 8 d``: the file's 4-bit values are kept as they are, and
  ``d``, ``m`` (float16 in the file) are exact in float32 scales (bfloat16
  scales round them to 8 bits of mantissa).
* :class:`Int8Embedding` / :class:`Int8Linear`: one int8 matrix with a
  scale per row, read by a token lookup and by
  ``aten._weight_int8pack_mm`` (the tied LM head).  Q8_0 has a scale per
  block of 32 and the kernel takes one per row, so a Q8_0 matrix is
  requantized once, honestly, to int8 with a scale per row
  (:func:`q8_0_per_row`; its error is measured in the README).

The kernels take 2-D contiguous activations of the scales' dtype (float32,
bfloat16 or float16), and have meta kernels, so a capture on the meta
device records them as they are.  They are vectorised for bfloat16 only:
with float32 activations they run several times slower than a dense
float32 matmul (README "Quantized weights").  Every tensor here is a fresh
copy, never a view of the file's mapping.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUP = 32   # Q4_1 / Q8_0 block size = the int4 kernel's group size
_Q4_1_BYTES, _Q8_0_BYTES = 20, 34   # bytes of one block of 32 values


def q4_1_values(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 rows (``[rows, cols // 32 * 20]`` bytes) as ``(q, d, m)``: the
    4-bit values ``q`` uint8 ``[rows, cols]`` and the float32 block scale
    and minimum ``[rows, cols // 32]`` (``w = q * d + m``)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, _Q4_1_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)   # element j in the low nibble, j + 16 in the high
    return q.reshape(rows, -1), d, m


def q8_0_values(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows as ``(q, d)``: int8 values ``[rows, cols]`` and the float32
    block scales ``[rows, cols // 32]`` (``w = q * d``)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, _Q8_0_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:].copy().view(np.int8)
    return q.reshape(rows, -1), d


def q8_0_per_row(q: np.ndarray, d: np.ndarray, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 ``(q, d)`` requantized to int8 with one scale per row: the
    values ``q * d`` (exact in float32), divided by their row's largest
    magnitude over 127 and rounded (``chunk`` rows at a time: a float32
    copy of a whole vocabulary is not needed)."""
    rows = q.shape[0]
    q8 = np.empty(q.shape, dtype=np.int8)
    scale = np.empty(rows, dtype=np.float32)
    for lo in range(0, rows, chunk):
        hi = min(lo + chunk, rows)
        w = (q[lo:hi].reshape(hi - lo, -1, GROUP).astype(np.float32) * d[lo:hi, :, None]).reshape(hi - lo, -1)
        s = np.abs(w).max(axis=1) / np.float32(127.0)
        s[s == 0] = 1.0
        q8[lo:hi] = np.clip(np.rint(w / s[:, None]), -127, 127)
        scale[lo:hi] = s
    return q8, scale


class Int4Linear(nn.Module):
    """``y = x W^T`` (no bias) with ``W`` [out, in] as int4 groups of 32
    (see the module docstring).  Buffers: ``packed`` uint8 [out, in / 2]
    (torch's CPU packing) and ``scales_zeros`` [in / 32, out, 2] in the
    activations' dtype."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        if in_features % GROUP:
            raise ValueError(f"Int4Linear: in_features {in_features} is not a multiple of {GROUP}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_zeros", torch.empty(in_features // GROUP, out_features, 2, dtype=dtype))

    @torch.no_grad()
    def load_q4_1(self, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> None:
        """Fill the buffers from Q4_1 values (:func:`q4_1_values`, rows in the
        model's order)."""
        if q.shape != (self.out_features, self.in_features):
            raise ValueError(f"Int4Linear: values of shape {q.shape}, expected "
                             f"{(self.out_features, self.in_features)}")
        values = torch.from_numpy(np.ascontiguousarray(q, dtype=np.int32))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        d_, m_ = torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(m))
        self.scales_zeros = torch.stack([d_, m_ + 8 * d_], dim=-1).transpose(0, 1).contiguous().to(
            self.scales_zeros.dtype)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """A token embedding as int8 rows with a scale each: ``weight`` int8
    [vocab, dim], ``scales`` [vocab, 1] in the activations' dtype."""

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(vocab, dim, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(vocab, 1, dtype=dtype))

    @torch.no_grad()
    def load_per_row(self, q: np.ndarray, scale: np.ndarray) -> None:
        """Fill the buffers from :func:`q8_0_per_row`'s values and scales."""
        self.weight = torch.from_numpy(np.ascontiguousarray(q))
        self.scales = torch.from_numpy(scale.reshape(-1, 1).copy()).to(self.scales.dtype)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight).to(self.scales.dtype) * F.embedding(ids, self.scales)


class Int8Linear(nn.Module):
    """The LM head tied to an :class:`Int8Embedding` (its very tensors):
    ``y = x W^T`` by ``aten._weight_int8pack_mm`` with the rows' scales."""

    def __init__(self, embedding: Int8Embedding) -> None:
        super().__init__()
        self.embedding = [embedding]   # a list: not a submodule (its buffers are the embedding's)

    def forward(self, x: Tensor) -> Tensor:
        e = self.embedding[0]
        flat = x.reshape(-1, e.weight.shape[1]).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(flat, e.weight, e.scales.view(-1))
        return y.reshape(*x.shape[:-1], e.weight.shape[0])
