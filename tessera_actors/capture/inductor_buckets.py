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

from typing import Any

import torch


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
