"""Capture: one forward pass -> :class:`~tessera_actors.graph.KernelGraph`.

``aten`` records at the aten-op level (any device torch runs on: CPU in CI);
``inductor`` (GPU) records the generated Triton kernels with their PTX."""
from tessera_actors.capture.aten import CaptureError, CaptureResult, capture, capture_module


def __getattr__(name: str):
    # the inductor capture imports torch._inductor: loaded only when asked for
    if name == "capture_inductor":
        from tessera_actors.capture import inductor
        return inductor.capture_inductor
    raise AttributeError(name)


__all__ = ["CaptureError", "CaptureResult", "capture", "capture_module", "capture_inductor"]
