"""What a device actor holds for its share groups, across the plans
installed in them (``InstallPlan.share``: the bucket plans of one served
model): one device tensor per named weight or state buffer, one pinned host
home per streamed weight, one staging ring per group with the lock its
steps take turns under, and which of these were loaded.  And, for every
plan of the device: one *scratch* buffer that holds each plan's
segment-local temporaries (:func:`scratch_layout`), as big as the largest
plan's, so the activations of 40 buckets take the memory of one.

Why scratch may be shared: the device's single worker thread runs one
segment's kernels at a time, in one call (on a GPU, queued on the one
compute stream in that order), and a segment-local temporary is written
and read only by kernels of one segment of its plan - never by a transfer,
a step input or output, or another segment - so its bytes mean nothing
outside that run.  A plan that needs more scratch grows it in place (the
storage is resized: every plan's views follow it); on a GPU the CUDA graphs
captured over the old address are dropped first and captured again.

Contract: :meth:`Shares.allocate` runs on the device actor's worker thread
(it allocates memory); everything else runs on the actor's event loop.  A
name already held with another size is refused (not the same tensor), and
so is a plan whose staging ring differs from its group's.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import torch

from tessera_actors.execution.program import BackendError
from tessera_actors.execution.streaming import Staging
from tessera_actors.graph import KernelGraph
from tessera_actors.models.common import LAZY_BYTES, zeroed
from tessera_actors.plan import Plan

SCRATCH_ALIGN = 256   # bytes: every temporary's offset in the scratch (any dtype's views, a GPU's vector loads)


def scratch_layout(graph: KernelGraph, plan: Plan, device: int) -> tuple[dict[int, int], int]:
    """(buffer id -> byte offset in the device's scratch, bytes spanned) for
    ``plan``'s temporaries on ``device`` that live within one segment: every
    kernel of this device that touches the buffer is in the same segment,
    and no transfer, step input or output names it.  The offsets are
    disjoint (the capture already packed temporaries with disjoint
    lifetimes into one slot buffer)."""
    resident = set(plan.resident[device])
    segment_of: dict[int, set[int]] = {}
    for seg in plan.segments:
        if seg.device != device:
            continue
        for k in seg.kernels:
            for a in graph.kernels[k].accesses:
                segment_of.setdefault(a.buffer, set()).add(seg.id)
    crossing = {t.buffer for t in plan.transfers} | {b for b, *_ in plan.outputs}
    crossing |= set(plan.inputs[device]) | set(graph.inputs.values()) | set(graph.outputs)
    crossing |= {ref[0] for ref in graph.meta.get("output_views") or []}
    crossing |= {ref[0] for ref in (graph.meta.get("input_views") or {}).values()}
    offsets, end = {}, 0
    for b in sorted(resident):
        buf = graph.buffers[b]
        if buf.role != "temp" or b in crossing or len(segment_of.get(b, ())) != 1:
            continue
        offsets[b] = end
        end += -(-max(buf.nbytes, 1) // SCRATCH_ALIGN) * SCRATCH_ALIGN
    return offsets, end


def _adoptable(value: Any, nbytes: int, device: torch.device) -> torch.Tensor | None:
    """``value`` when a CPU device may hold it as a buffer of ``nbytes``: flat
    contiguous uint8 host bytes of exactly that size; else None (copied)."""
    if device.type != "cpu" or not isinstance(value, torch.Tensor):
        return None
    if value.device.type != "cpu" or value.dtype != torch.uint8 or value.dim() != 1 or value.numel() != nbytes:
        return None
    return value if value.is_contiguous() else None


class Shares:
    def __init__(self, device_name: str) -> None:
        self.device_name = device_name
        self.shared: dict[tuple[str, str], torch.Tensor] = {}       # (group, buffer name) -> device bytes
        self.homes: dict[tuple[str, str, str], torch.Tensor] = {}   # (group, name, "home") -> pinned host bytes
        self.rings: dict[str, tuple[Staging, asyncio.Lock]] = {}    # group -> its staging ring
        self.loaded: set[tuple] = set()                             # keys whose values were loaded
        self.scratch: torch.Tensor | None = None                    # every plan's segment-local temporaries

    def keys(self, graph: KernelGraph, resident: Sequence[int], share: str) -> dict[int, tuple[str, str]]:
        """Buffer id -> share key for the named weights and state of a group."""
        if not share:
            return {}
        keys = {}
        for b in resident:
            buf = graph.buffers[b]
            if buf.role in ("weight", "state") and buf.name:
                key = (share, buf.name)
                held = self.shared.get(key)
                if held is not None and held.numel() != max(buf.nbytes, 1):
                    raise ValueError(f"{self.device_name}: buffer {buf.name!r} of share group {share!r} holds "
                                     f"{held.numel()} bytes, this plan's has {buf.nbytes}")
                keys[b] = key
        return keys

    @staticmethod
    def home_keys(graph: KernelGraph, streamed: Sequence[int], share: str) -> dict[int, tuple[str, str, str]]:
        """Streamed buffer id -> the key of its host home in a group."""
        return {b: (share, graph.buffers[b].name, "home") for b in streamed if share and graph.buffers[b].name}

    def ring(self, share: str, slots: int, slot_bytes: int, plan_id: str) -> Staging | None:
        """The group's staging ring (None: none yet); refuses other sizes."""
        have = self.rings.get(share) if share else None
        if have is None:
            return None
        if (have[0].slots, have[0].slot_bytes) != (slots, slot_bytes):
            raise BackendError(f"{self.device_name}: plan {plan_id!r} wants {slots} staging slots of {slot_bytes} "
                               f"bytes, share group {share!r} has {have[0].slots} of {have[0].slot_bytes}")
        return have[0]

    def allocate(self, graph: KernelGraph, keys: dict, home_keys: dict, ring: Staging | None, slots: int,
                 slot_bytes: int, device: torch.device, backend: Any, budget: int | None,
                 scratch: tuple[dict[int, int], int] = ({}, 0), moved: Callable[[], None] = lambda: None,
                 adopt: dict | None = None) -> tuple[dict, dict, Staging | None, int | None, set]:
        """On the worker: the group's tensors for ``keys`` and homes for
        ``home_keys`` (made where missing; a missing weight that ``adopt``
        offers as host bytes of its size, on a CPU device, is that tensor
        itself), the ring (``ring``, or a new one when the plan streams),
        views into the device's scratch for the plan's ``scratch`` layout
        (:func:`scratch_layout`; grown to it when smaller, after ``moved()``,
        which must forget whatever recorded the scratch's address), the
        bytes the plan's own buffers may take of ``budget`` (None: no
        budget), and the keys adopted (their values are held: loaded)."""
        new = {key: max(graph.buffers[b].nbytes, 1) for b, key in keys.items() if key not in self.shared}
        offsets, span = scratch
        grow = max(0, span - self.scratch_bytes())
        fresh = ring is None and bool(home_keys)
        if fresh:
            ring = Staging(device, slots, slot_bytes, backend)
        held = self.device_bytes() + (ring.nbytes if fresh else 0) + sum(new.values()) + grow
        if budget is not None and held > budget:
            raise BackendError(f"{self.device_name}: the shared weights, state, staging and scratch would take "
                               f"{held} bytes, budget is {budget}")
        if grow:
            self._grow_scratch(span, device, moved)
        shared = {b: self.scratch[off:off + max(graph.buffers[b].nbytes, 1)] for b, off in offsets.items()}
        adopted = set()
        for b, key in keys.items():
            if key not in self.shared:
                held_as_is = _adoptable((adopt or {}).get(b), new[key], device)
                self.shared[key] = held_as_is if held_as_is is not None else zeroed(new[key], device)
                if held_as_is is not None:
                    adopted.add(key)
            shared[b] = self.shared[key]
        homes = {}
        for b, key in home_keys.items():
            if key not in self.homes:
                self.homes[key] = torch.zeros(max(graph.buffers[b].nbytes, 1), dtype=torch.uint8,
                                              pin_memory=device.type == "cuda")
            homes[b] = self.homes[key]
        return shared, homes, ring if home_keys else None, None if budget is None else budget - held, adopted

    def _grow_scratch(self, nbytes: int, device: torch.device, moved: Callable[[], None]) -> None:
        """The scratch made ``nbytes`` long: a new one, or the storage every
        plan's views share resized in place (its bytes are scratch: none is
        kept across a run of kernels, so none needs to survive)."""
        if self.scratch is None:
            self.scratch = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            return
        moved()
        storage = self.scratch.untyped_storage()
        storage.resize_(nbytes)
        self.scratch.set_(storage, 0, (nbytes,), (1,))

    def scratch_tensors(self) -> list[torch.Tensor]:
        return [] if self.scratch is None else [self.scratch]

    def scratch_bytes(self) -> int:
        return 0 if self.scratch is None else self.scratch.numel()

    def lock(self, share: str, ring: Staging) -> asyncio.Lock:
        """The lock of the group's ring (registering ``ring`` as it on first use)."""
        if share not in self.rings:
            self.rings[share] = (ring, asyncio.Lock())
        return self.rings[share][1]

    def staging_bytes(self) -> int:
        return sum(r.nbytes for r, _ in self.rings.values())

    def device_bytes(self) -> int:
        """Device bytes held across plans: shared tensors, staging rings and the scratch."""
        return sum(t.numel() for t in self.shared.values()) + self.staging_bytes() + self.scratch_bytes()

    def clear(self) -> None:
        self.shared.clear()
        self.homes.clear()
        self.rings.clear()
        self.scratch = None


__all__ = ["LAZY_BYTES", "SCRATCH_ALIGN", "Shares", "scratch_layout", "zeroed"]
