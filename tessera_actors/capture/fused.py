"""Composite ops recorded whole by the aten capture, so every device runs its own kernel.

``F.scaled_dot_product_attention`` is a composite: below autograd it
becomes whatever kernel the tensors' device picks - cuDNN or flash
attention in bf16 on a GPU, the fused flash kernel on a CPU, and on the meta
device (where serving captures) the math decomposition, which upcasts bf16
to fp32, multiplies the whole key cache in CUDA-core fp32 GEMMs and copies
it.  :func:`whole_ops` routes the call, made from the capturing thread, to
the recorder as one ``aten.scaled_dot_product_attention`` kernel: one node
of the graph, run on each device by that device's dispatch (its per-device
variant), with no upcast and no copy of the cache.  Only eval-mode calls
(dropout 0) are recorded whole; a training-mode call goes the usual way
(and the capture refuses its random numbers).

``F.rms_norm`` likewise becomes one ``aten.rms_norm`` kernel, not the six
ops (pow, mean, add, rsqrt, two muls) it decomposes into before a dispatch
mode sees it: a CPU runs the same six in C++ in one call (the same bits),
a GPU its fused kernel.  Models call it only where they ask for the fewest
ops (``models.common.use_fewest_ops``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.nn.functional as F

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_RMS_NORM = torch.ops.aten.rms_norm.default
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_RMS_NAMES = ("input", "normalized_shape", "weight", "eps")


@contextlib.contextmanager
def whole_ops(recorder) -> Iterator[None]:
    """While active, the capturing thread's ``F.scaled_dot_product_attention``
    and ``F.rms_norm`` calls go to ``recorder.record_whole`` as one kernel
    each (other threads' calls behave as always)."""
    orig, orig_rms = F.scaled_dot_product_attention, F.rms_norm
    me = threading.get_ident()

    def sdpa(*args, **kwargs):
        bound = dict(zip(_NAMES, args))
        bound.update(kwargs)
        if threading.get_ident() != me or bound.get("dropout_p"):
            return orig(*args, **kwargs)
        return recorder.record_whole(_SDPA, tuple(args), kwargs)

    def rms_norm(*args, **kwargs):
        if threading.get_ident() != me:
            return orig_rms(*args, **kwargs)
        bound = dict(zip(_RMS_NAMES, args))
        bound.update(kwargs)
        shape = bound["normalized_shape"]
        shape = [shape] if isinstance(shape, int) else [int(n) for n in shape]
        return recorder.record_whole(_RMS_NORM, (bound["input"], shape, bound.get("weight"), bound.get("eps")), {})
    F.scaled_dot_product_attention, F.rms_norm = sdpa, rms_norm
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.rms_norm = orig, orig_rms
