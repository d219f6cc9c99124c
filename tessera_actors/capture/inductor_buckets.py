"""Shape buckets: one captured graph per (kind, size) so every segment has
static shapes (replayable as a CUDA graph).

A bucket spec is ``decode:B`` (B sequences, one new token each),
``prefill:B:T`` (B sequences of a T-token chunk) or ``denoise:B``. All graphs
of one model name their state buffers (KV cache, SSM state) by the same
module paths (``graph.buffers[b].name``) and record them in
``meta["state_names"]``: a runtime keeps one copy of each state buffer per
device and binds it into whichever bucket's graph runs the step.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import torch

from tessera_actors.capture.aten import CaptureError, CaptureResult, capture_module

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KINDS = ("decode", "prefill", "denoise")


def parse_bucket(spec: str) -> tuple[str, int, int]:
    """``decode:64`` -> (decode, 64, 1); ``prefill:1:1024`` -> (prefill, 1, 1024);
    ``denoise:2`` -> (denoise, 2, 1)."""
    parts = spec.strip().split(":")
    try:
        kind, nums = parts[0], [int(x) for x in parts[1:]]
    except ValueError:
        raise ValueError(f"bad bucket {spec!r}: expected decode:B, prefill:B:T or denoise:B") from None
    if kind not in KINDS or not nums or any(n <= 0 for n in nums):
        raise ValueError(f"bad bucket {spec!r}: expected decode:B, prefill:B:T or denoise:B")
    if kind == "prefill":
        if len(nums) != 2:
            raise ValueError(f"bad bucket {spec!r}: prefill needs a batch and a chunk size (prefill:B:T)")
        return kind, nums[0], nums[1]
    if len(nums) != 1:
        raise ValueError(f"bad bucket {spec!r}: {kind} takes one size ({kind}:B)")
    return kind, nums[0], 1


def bucket_name(kind: str, batch: int, seq: int = 1) -> str:
    return f"prefill-b{batch}-t{seq}" if kind == "prefill" else f"{kind}-b{batch}"


def bucket_overrides(cfg: Any, kind: str, batch: int, seq: int, pos: int = 0) -> dict[str, int]:
    """Config fields to raise so the model can hold the bucket (static cache sizes)."""
    out = {}
    if hasattr(cfg, "max_batch") and batch > cfg.max_batch:
        out["max_batch"] = batch
    need = pos + (seq if kind == "prefill" else 1)
    if hasattr(cfg, "max_seq") and need > cfg.max_seq:
        out["max_seq"] = need
    return out


def bucket_inputs(model: torch.nn.Module, kind: str, batch: int, seq: int = 1) -> dict[str, torch.Tensor]:
    """Example inputs of a bucket; decode writes at a position inside the cache."""
    cfg = getattr(model, "cfg", None)
    max_seq = getattr(cfg, "max_seq", None)
    pos = 0 if kind != "decode" or not max_seq else min(16, max_seq - 1)
    return model.example_inputs(kind, batch=batch, seq=seq, pos=pos)


def capture_buckets(model: torch.nn.Module, kinds: Iterable[tuple[str, Iterable[Any]]],
                    device: str | torch.device | None = None, out_dir: str | None = None, prefix: str = "",
                    capture: Callable[..., CaptureResult] | None = None,
                    progress: Callable[[str], None] | None = None) -> dict[str, CaptureResult | str]:
    """One graph per bucket. ``kinds``: e.g. ``[("decode", [1, 2, 4]), ("prefill", [128, 512])]``
    (decode/denoise sizes are batches, prefill sizes are chunk lengths at batch 1, or
    ``(batch, chunk)`` pairs). CPU devices use the aten capture, CUDA the inductor
    capture. With ``out_dir`` each graph is saved as ``<prefix><bucket>.tgraph``.
    A bucket that fails maps to its error message; the others still run."""
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    if capture is None:
        if dev.type == "cuda":
            from tessera_actors.capture.inductor import capture_inductor as capture
        else:
            capture = capture_module
    cfg = getattr(model, "cfg", None)
    state_names = list(model.state_names()) if hasattr(model, "state_names") else []
    out: dict[str, CaptureResult | str] = {}
    for kind, sizes in kinds:
        for size in sizes:
            batch, seq = (size if isinstance(size, (tuple, list)) else ((1, size) if kind == "prefill" else (size, 1)))
            name = bucket_name(kind, batch, seq)
            too_big = bucket_overrides(cfg, kind, batch, seq) if cfg is not None else {}
            if too_big:
                out[name] = f"skipped: needs config {too_big} (build the model with these overrides)"
                continue
            if progress:
                progress(f"bucket {name}")
            try:
                inputs = bucket_inputs(model, kind, batch, seq)
                meta = {"bucket": name, "kind": kind, "batch": batch, "seq": seq, "device": str(dev),
                        "state_names": state_names}
                res = capture(model, inputs, meta=meta)
            except (CaptureError, ValueError, RuntimeError) as e:
                out[name] = f"failed: {type(e).__name__}: {e}"
                continue
            out[name] = res
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
                res.graph.save(os.path.join(out_dir, f"{prefix}{name}.tgraph"))
    return out
