"""Per-device kernel variants: a graph node run by a kernel of the device's own kind.

A node of the kernel graph names one aten op.  On a device whose own
library has a faster kernel for that node - same inputs, same output - the
program binds that kernel instead (:func:`cpu_variant`, asked by
:meth:`~tessera_actors.execution.program.AtenProgram._bind` for every kernel
on a CPU).  The table today:

* **a linear layer on a CPU**: ``aten.mm(x, W.t())`` and
  ``aten.addmm(bias, x, W.t())`` where ``W`` is a weight buffer (a float32
  or bfloat16 ``[out, in]`` matrix) run as oneDNN's inner product on
  ``W`` reordered once into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``,
  what inductor's CPU backend emits for a frozen linear).  torch's ``mm``
  goes to MKL, which on AMD CPUs takes a generic code path: on the 2-core
  EPYC box the packed kernel runs SmolLM2's 16-row LM head 2.4-2.9x and
  its layers' matrices 1.2-1.4x faster, one thread, same shapes.

A reordered weight lives beside the original (the arena keeps the bytes
the graph names: transfers, the embedding of tied weights and loads read
them), one per weight view per device, made at the node's first run and
made again when the weight's bytes change (a load bumps the buffer's
version counter).  ``TESSERA_CPU_VARIANTS=0`` binds the plain ops.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_DTYPES = ("float32", "bfloat16")
_PACKED_ATTR = "_tessera_packed"   # on a weight buffer's tensor: its reordered views, by view


def enabled() -> bool:
    return (os.environ.get("TESSERA_CPU_VARIANTS", "1") != "0" and _REORDER is not None and _LINEAR is not None
            and torch.backends.mkldnn.is_available())


def cpu_variant(prog, payload: dict[str, Any], dst: torch.Tensor | None) -> Callable[[], None] | None:
    """The CPU variant of the kernel ``payload`` bound on ``prog`` (an
    :class:`~tessera_actors.execution.program.AtenProgram` on a CPU), writing
    ``dst``; None where the node has none (the plain op runs)."""
    op, args = payload["op"], payload["args"]
    if dst is None or payload["kwargs"] or not enabled():
        return None
    if op == "aten.mm.default" and len(args) == 2:
        bias, x, w = None, args[0], args[1]
    elif op == "aten.addmm.default" and len(args) == 3:
        bias, x, w = args
    else:
        return None
    weight = _weight_of(prog, w)
    if weight is None or not (isinstance(x, dict) and "t" in x) or len(x["t"][2]) != 2:
        return None
    b_view = None
    if bias is not None:
        if not (isinstance(bias, dict) and "t" in bias and len(bias["t"][2]) == 1):
            return None
        b_view = prog.shared_view(bias["t"])
    return PackedLinear(prog.shared_view(x["t"]), weight, b_view, dst)


def _weight_of(prog, ref: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the buffer's tensor, ``W`` as ``[out, in]``) when ``ref`` is ``W.t()``
    for a contiguous matrix ``W`` of a weight buffer, else None."""
    if not (isinstance(ref, dict) and "t" in ref):
        return None
    b, _, shape, stride, dt = ref["t"]
    if dt not in _DTYPES or len(shape) != 2 or prog.graph.buffers[b].role != "weight":
        return None
    k, n = shape
    if tuple(stride) != (1, k) or k == 0 or n == 0:
        return None
    base = prog.arena.get(b)
    if base is None:
        return None
    return base, prog.shared_view(ref["t"]).t()


class PackedLinear:
    """``dst = x @ W.t() (+ bias)`` by oneDNN on ``W`` reordered (module docstring)."""

    __slots__ = ("x", "base", "w", "bias", "dst", "packed", "version")

    def __init__(self, x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None,
                 dst: torch.Tensor) -> None:
        self.x, (self.base, self.w), self.bias, self.dst = x, weight, bias, dst
        self.packed: torch.Tensor | None = None
        self.version = -1

    def __call__(self) -> None:
        if self.base._version != self.version:
            self._pack()
        self.dst.copy_(_LINEAR(self.x, self.packed, self.bias, "none", [], ""))

    def _pack(self) -> None:
        """The reordered weight: the one another kernel of this device made
        for the same view and bytes, else a new one (kept on the buffer)."""
        cache = getattr(self.base, _PACKED_ATTR, None)
        if cache is None:
            cache = {}
            setattr(self.base, _PACKED_ATTR, cache)
        key = (self.w.storage_offset(), tuple(self.w.shape), str(self.w.dtype))
        version = self.base._version
        got = cache.get(key)
        if got is None or got[1] != version:
            got = cache[key] = (_REORDER(self.w, None), version)
        self.packed, self.version = got


def packed_bytes(tensors) -> int:
    """Bytes of the reordered weights kept on ``tensors`` (buffers' tensors)."""
    total = 0
    for t in tensors:
        for packed, _ in (getattr(t, _PACKED_ATTR, None) or {}).values():
            total += packed.numel() * packed.element_size()
    return total
