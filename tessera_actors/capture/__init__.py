"""Capture: one forward pass -> :class:`~tessera_actors.graph.KernelGraph`.

``aten`` records at the aten-op level (any device torch runs on: CPU in CI);
``inductor`` (GPU) records the generated Triton kernels with their PTX."""
from .aten import CaptureError, CaptureResult, capture, capture_module

__all__ = ["CaptureError", "CaptureResult", "capture", "capture_module"]
