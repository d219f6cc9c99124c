"""Minimal GGUF (v2/v3) reader: metadata and tensors of one file, memory-mapped.

Why not ``gguf.GGUFReader``: it builds a numpy view per array element, which
takes ~5 s for a 49k-token vocabulary; this reader parses the same header in
well under a second. The ``gguf`` package is still used to dequantise blocks.

``GGUFFile(path)``: ``.metadata`` (key -> int/float/bool/str/list, numeric
arrays as numpy), ``.tensor_names()``, ``.tensor(name) -> float32 ndarray`` in
numpy order (``[rows, cols]`` = llama.cpp ``[ne1, ne0]``), ``.raw(name)``: its
blocks as the file stores them.
"""
from __future__ import annotations

import struct

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFFile:
    """Read-only view of a GGUF file; see the module docstring."""

    def __init__(self, path: str):
        self.path = path
        self._data = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._data)
        self._pos = 0
        magic, version = self._unpack("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        n_tensors, n_kv = self._unpack("<QQ")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            infos.append((name, dims, qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = (self._pos + align - 1) // align * align
        self._tensors = {name: (dims, qtype, start + off) for name, dims, qtype, off in infos}

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        text = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return text

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])[0]
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self._pos}")
        etype, count = self._unpack("<IQ")
        if etype in _NUMPY:
            dtype = np.dtype(_NUMPY[etype])
            values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos += dtype.itemsize * count
            return values
        return [self._value(etype) for _ in range(count)]

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def raw(self, name: str) -> tuple[int, tuple[int, ...], np.ndarray]:
        """``(qtype, shape, rows)`` of tensor ``name``: its GGML type number,
        its shape (``dims[::-1]``) and a copy of its bytes as uint8
        ``[rows, row_bytes]`` (quantized blocks as the file stores them)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: PLC0415

        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} not in {self.path}")
        dims, qtype, offset = self._tensors[name]
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        shape = tuple(int(d) for d in reversed(dims))
        row_bytes = shape[-1] // block * type_size
        n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return qtype, shape, np.array(self._data[offset:offset + n_rows * row_bytes]).reshape(n_rows, row_bytes)

    def tensor(self, name: str) -> np.ndarray:
        """Dequantised float32 copy of tensor ``name`` (shape ``dims[::-1]``)."""
        from gguf.constants import GGMLQuantizationType  # noqa: PLC0415
        from gguf.quants import dequantize  # noqa: PLC0415

        qtype, shape, raw = self.raw(name)
        return np.ascontiguousarray(dequantize(raw, GGMLQuantizationType(qtype)), dtype=np.float32).reshape(shape)
