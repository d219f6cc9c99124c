"""Device memory a device actor holds, counted once per storage.

What a budgeted device allocates must be what the offload planner counted
(``planning/offload``: resident weights, KV cache, each plan's own buffers,
the staging ring, and a reserve for transient results).  The device counts
it from the tensors themselves, not from the plans: the share groups'
tensors and rings, every installed plan's arena, the state its steps keep
between steps (decode rows, the sampling batch, the last sampled ids) and
the capture pool of its graphs.  Views count as the storage they view,
once; host tensors (pinned homes and staging buffers) are not device
memory and are left out.  Blocking: none; reads tensor metadata only, so the
event loop may call it while the worker runs.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch


def storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device | None = None) -> int:
    """Bytes of the distinct storages of ``tensors`` (on ``device``'s type
    when given), each storage once however many views of it are given."""
    seen: dict[int, int] = {}
    for t in tensors:
        if device is not None and t.device.type != device.type:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def kept_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors ``obj`` keeps as attributes, directly or inside lists,
    tuples and dicts of them (not inside other objects: their owner names
    them)."""
    if obj is None:
        return
    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else [obj]
    while values:
        v = values.pop()
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            values.extend(v)
        elif isinstance(v, dict):
            values.extend(v.values())


__all__ = ["kept_tensors", "storage_bytes"]
