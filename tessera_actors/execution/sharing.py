"""What a device actor holds for its share groups, across the plans
installed in them (``InstallPlan.share``: the bucket plans of one served
model): one device tensor per named weight or state buffer, one pinned host
home per streamed weight, one staging ring per group with the lock its
steps take turns under, and which of these were loaded.

Contract: :meth:`Shares.allocate` runs on the device actor's worker thread
(it allocates memory); everything else runs on the actor's event loop.  A
name already held with another size is refused (not the same tensor), and
so is a plan whose staging ring differs from its group's.
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

import torch

from tessera_actors.execution.program import BackendError
from tessera_actors.execution.streaming import Staging
from tessera_actors.graph import KernelGraph


class Shares:
    def __init__(self, device_name: str) -> None:
        self.device_name = device_name
        self.shared: dict[tuple[str, str], torch.Tensor] = {}       # (group, buffer name) -> device bytes
        self.homes: dict[tuple[str, str, str], torch.Tensor] = {}   # (group, name, "home") -> pinned host bytes
        self.rings: dict[str, tuple[Staging, asyncio.Lock]] = {}    # group -> its staging ring
        self.loaded: set[tuple] = set()                             # keys whose values were loaded

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
                 slot_bytes: int, device: torch.device, backend: Any, budget: int | None
                 ) -> tuple[dict, dict, Staging | None, int | None]:
        """On the worker: the group's tensors for ``keys`` and homes for
        ``home_keys`` (made where missing), the ring (``ring``, or a new one
        when the plan streams), and the bytes the plan's own buffers may
        take of ``budget`` (None: no budget)."""
        new = {key: max(graph.buffers[b].nbytes, 1) for b, key in keys.items() if key not in self.shared}
        fresh = ring is None and bool(home_keys)
        if fresh:
            ring = Staging(device, slots, slot_bytes, backend)
        held = self.device_bytes() + (ring.nbytes if fresh else 0) + sum(new.values())
        if budget is not None and held > budget:
            raise BackendError(f"{self.device_name}: the shared weights, state and staging would take "
                               f"{held} bytes, budget is {budget}")
        shared = {}
        for b, key in keys.items():
            if key not in self.shared:
                self.shared[key] = torch.zeros(new[key], dtype=torch.uint8, device=device)
            shared[b] = self.shared[key]
        homes = {}
        for b, key in home_keys.items():
            if key not in self.homes:
                self.homes[key] = torch.zeros(max(graph.buffers[b].nbytes, 1), dtype=torch.uint8,
                                              pin_memory=device.type == "cuda")
            homes[b] = self.homes[key]
        return shared, homes, ring if home_keys else None, None if budget is None else budget - held

    def lock(self, share: str, ring: Staging) -> asyncio.Lock:
        """The lock of the group's ring (registering ``ring`` as it on first use)."""
        if share not in self.rings:
            self.rings[share] = (ring, asyncio.Lock())
        return self.rings[share][1]

    def staging_bytes(self) -> int:
        return sum(r.nbytes for r, _ in self.rings.values())

    def device_bytes(self) -> int:
        """Device bytes the groups hold: shared tensors and staging rings."""
        return sum(t.numel() for t in self.shared.values()) + self.staging_bytes()

    def clear(self) -> None:
        self.shared.clear()
        self.homes.clear()
        self.rings.clear()


__all__ = ["Shares"]
