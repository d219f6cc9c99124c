"""Per-device kernel variants: a graph node run by a kernel of the device's own kind.

A node of the kernel graph names one aten op.  On a device whose own
library has a faster kernel for that node - same inputs, same output - the
program binds that kernel instead (:func:`cpu_variant`, asked by
:meth:`~tessera_actors.execution.program.AtenProgram._bind` for every kernel
on a CPU).  The table today:

* **a linear layer on a CPU**: ``aten.mm(x, W.t())`` and
  ``aten.addmm(bias, x, W.t())`` where ``W`` is a weight buffer (a float32
  or bfloat16 ``[out, in]`` matrix) run as oneDNN's inner product
  (``torch.ops.mkldnn._linear_pointwise``, the op inductor's CPU backend
  emits for a linear) on ``W`` as the arena holds it.  torch's ``mm`` goes
  to MKL, which on AMD CPUs takes a generic code path.  Served on the
  2-core EPYC box (SmolLM2 dense float32, prompt chunks on 2 threads):
  batch-1 14.5 tok/s, 16 streams 70.7; oneDNN's reordered (blocked) copy
  of every weight (``_reorder_linear_weight``) gave 15.6 and 76.5 for a
  second copy of the weights, so the weight is used as it is: no memory
  beyond the graph's, the same kernel on every CPU device (budgeted or
  not), so a split stays bitwise equal to one device.

``TESSERA_CPU_VARIANTS=0`` binds the plain ops.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_DTYPES = ("float32", "bfloat16")


def enabled() -> bool:
    return (os.environ.get("TESSERA_CPU_VARIANTS", "1") != "0" and _LINEAR is not None
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
    return OneDnnLinear(prog.shared_view(x["t"]), weight, b_view, dst)


def _weight_of(prog, ref: Any) -> torch.Tensor | None:
    """``W`` as ``[out, in]`` when ``ref`` is ``W.t()`` for a contiguous
    matrix ``W`` of a weight buffer, else None."""
    if not (isinstance(ref, dict) and "t" in ref):
        return None
    b, _, shape, stride, dt = ref["t"]
    if dt not in _DTYPES or len(shape) != 2 or prog.graph.buffers[b].role != "weight":
        return None
    k, n = shape
    if tuple(stride) != (1, k) or k == 0 or n == 0:
        return None
    if b not in prog.arena:
        return None
    return prog.shared_view(ref["t"]).t()


class OneDnnLinear:
    """``dst = x @ W.t() (+ bias)`` by oneDNN (module docstring)."""

    __slots__ = ("x", "w", "bias", "dst")

    def __init__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dst: torch.Tensor) -> None:
        self.x, self.w, self.bias, self.dst = x, w, bias, dst

    def __call__(self) -> None:
        self.dst.copy_(_LINEAR(self.x, self.w, self.bias, "none", [], ""))
