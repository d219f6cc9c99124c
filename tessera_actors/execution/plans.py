"""The plans installed on one device: installing one, and what they hold.

:func:`install_plan` makes a plan's share of one device ready to step: the
graph and plan from an ``InstallPlan`` (the objects themselves from this
process, their bytes from another), the share group's tensors (weights,
state, the staging ring of streamed weights, the scratch of every plan's
segment-local temporaries: :mod:`.sharing`), the program with its kernels
pre-bound (:mod:`.streaming` picks the streaming one), and its step path
(:class:`~.step.DeviceStep`).  :func:`device_stats` is the device's
``GetStats``: steps, capture counters, streamed copies, hand-offs (and
``mapped_reads``: those a GPU's SMs read from pinned host memory,
:mod:`.mapped`) and every byte the device holds (:mod:`.held`).

Blocking: the torch work of an install runs on the device's worker
(``worker.call``); the rest reads counters and tensor metadata on the
event loop.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tessera_actors.devices import DeviceSpec
from tessera_actors.execution.backends.cpu import step_threads
from tessera_actors.execution.held import storage_bytes
from tessera_actors.execution.inbox import Inbox
from tessera_actors.execution.program import AtenProgram, BackendError
from tessera_actors.execution.segments import SegmentRunner, program_class
from tessera_actors.execution.sharing import Shares, scratch_layout
from tessera_actors.execution.step import DeviceStep
from tessera_actors.execution.streaming import program_for, staging_of, streamed_buffers
from tessera_actors.execution.worker import Worker
from tessera_actors.graph import KernelGraph, graph_from_bytes
from tessera_actors.plan import Plan, plan_from_dict
from tessera_actors.runtime.messages import Installed, InstallPlan


@dataclass
class DevicePlan:
    """One plan on one device: its program and step path, and the steps
    queued for it (each ``(RunStep, future)``, run by :mod:`.driver`)."""
    graph: KernelGraph
    plan: Plan
    device: int
    prog: AtenProgram | None
    step: DeviceStep | None = None
    steps: asyncio.Queue = field(default_factory=asyncio.Queue)
    inbox: Inbox = field(default_factory=Inbox)   # transfer bytes, possibly ahead of their step
    task: asyncio.Task | None = None                 # the plan's step loop
    share_keys: dict = field(default_factory=dict)   # buffer id -> (share group, name)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)   # a step was queued, or one landed
    home_keys: dict = field(default_factory=dict)   # streamed buffer id -> (share group, name, "home")
    ring_lock: asyncio.Lock | None = None           # held around each step: the share group's staging ring
    copied: int = 0                                 # streamed bytes copied in (PCIe) as of the last step answered

    def fail(self, why: str) -> None:
        """Stop the step loop; every step queued fails with ``why``."""
        if self.task is not None:
            self.task.cancel()
        while not self.steps.empty():
            _, fut = self.steps.get_nowait()
            if not fut.done():
                fut.set_exception(BackendError(why))

    def loaded(self, buffers) -> list:
        """The share keys of ``buffers`` (weights or state just written)."""
        return [k[b] for k in (self.share_keys, self.home_keys) for b in buffers if b in k]


async def install_plan(msg: InstallPlan, spec: DeviceSpec, runner: SegmentRunner | None, shares: Shares,
                       worker: Worker, peers: dict, open_error: str = "") -> tuple[DevicePlan, Installed]:
    """The plan of ``msg`` on this device, and the answer (what it holds,
    the weights and state still to load).  ``peers``: the hand-offs of the
    co-located plan devices (:class:`~.step.DeviceStep`); ``runner`` None:
    the device could not be opened (``open_error``)."""
    # from this process the objects themselves (shared, read only), from another their bytes
    graph = msg.graph if isinstance(msg.graph, KernelGraph) else graph_from_bytes(msg.graph)
    plan = msg.plan if isinstance(msg.plan, Plan) else plan_from_dict(msgpack.unpackb(msg.plan, strict_map_key=False))
    d = msg.device
    if not 0 <= d < len(plan.devices):
        raise ValueError(f"device index {d} not in plan {msg.plan_id!r} ({len(plan.devices)} devices)")
    mine = [s for s in plan.segments if s.device == d]
    if runner is None:
        raise BackendError(f"{spec.name}: device could not be opened: {open_error}")
    cls = program_class(graph)
    streamed = set(streamed_buffers(plan, d))   # homed in host memory: not shared device tensors
    keys = shares.keys(graph, [b for b in plan.resident[d] if b not in streamed], msg.share)
    home_keys = shares.home_keys(graph, sorted(streamed), msg.share)
    slots, slot_bytes = staging_of(plan, d)
    have = shares.ring(msg.share, slots, slot_bytes, msg.plan_id) if streamed else None
    scratch = scratch_layout(graph, plan, d)

    def build() -> tuple[AtenProgram, Any, set]:
        # one staging ring and one host home per weight serve the whole share group, one scratch every
        # plan's segment-local temporaries; the plan's own buffers get what these leave of the budget
        shared, homes, ring, left, adopted = shares.allocate(
            graph, keys, home_keys, have, slots, slot_bytes, runner.device, runner.backend,
            spec.mem, scratch, runner.recapture, msg.adopt)
        prog = program_for(cls, graph, plan, d, runner, left, shared, spec.slow, ring, homes)
        for s in mine:
            for k in s.kernels:
                prog.bind(k)
        return prog, ring, adopted
    prog, ring, adopted = await worker.call(build)
    shares.loaded.update(adopted)
    inst = DevicePlan(graph, plan, d, prog, DeviceStep(msg.plan_id, graph, plan, d, prog, runner, peers),
                      share_keys=keys, home_keys=home_keys)
    inst.step.threads = step_threads(spec, graph_tokens(graph))
    inst.ring_lock = shares.lock(msg.share, ring) if ring is not None else None
    need = [b for b in plan.resident[d] if graph.buffers[b].role in ("weight", "state")
            and (keys.get(b) or home_keys.get(b)) not in shares.loaded]
    # the plan's buffers wherever they live: its own, and its temporaries in the device's scratch
    resident = prog.nbytes + sum(graph.buffers[b].nbytes for b in scratch[0])
    return inst, Installed(msg.plan_id, d, resident, sum(len(s.kernels) for s in mine), len(mine), need)


def device_stats(runner: SegmentRunner | None, shares: Shares, plans: dict[str, DevicePlan], handoffs: dict
                 ) -> dict[str, Any]:
    """The device's counters and bytes (module docstring) but the step
    loop's; ``handoffs``: the co-located hand-off's counts."""
    out = runner.stats() if runner is not None else {"graphs": False}
    out["per_plan"] = {p: dict(c) for p, c in runner.per_plan.items()} if runner is not None else {}
    # a CPU's intra-op threads per plan where its steps set them (prefill_threads): else absent
    out["step_threads"] = {p: i.step.threads for p, i in plans.items() if i.step is not None and i.step.threads}
    progs = [i.prog for i in plans.values() if i.prog is not None]
    streaming = [p for p in progs if getattr(p, "streamed", None)]
    out.update({"streamed_copies": sum(p.copies for p in streaming),
                "streamed_copies_ahead_used": sum(p.ahead_used for p in streaming),
                "streamed_bytes": sum(p.copied_bytes for p in streaming), **handoffs,
                "mapped_reads": sum(w.reads for i in plans.values() if i.step is not None for w in i.step.mapped),
                "shared_bytes": shares.device_bytes() - shares.staging_bytes() - shares.scratch_bytes(),
                "staging_bytes": shares.staging_bytes(), "home_bytes": sum(t.numel() for t in shares.homes.values()),
                "scratch_bytes": shares.scratch_bytes(), "plan_bytes": sum(p.nbytes for p in progs)})
    out.update(_held(runner, shares, plans, out.get("capture_pool_bytes", 0)))
    return out


def _held(runner: SegmentRunner | None, shares: Shares, plans: dict[str, DevicePlan], pool_bytes: int
          ) -> dict[str, int]:
    """What the device holds (:mod:`.held`): ``allocated_bytes``, every
    byte of it - the share groups' weights, state and staging rings, the
    scratch of every plan's temporaries, every installed plan's own
    buffers, what their steps keep between steps (``step_state_bytes``) and
    the capture pool of its graphs (``capture_pool_bytes``)."""
    if runner is None:
        return {"allocated_bytes": 0, "step_state_bytes": 0, "capture_pool_bytes": 0}
    live = [i for i in plans.values() if i.prog is not None]
    buffers = [*shares.shared.values(), *(r.buf for r, _ in shares.rings.values()), *shares.scratch_tensors(),
               *(t for i in live for t in i.prog.arena.values()),
               *(i.prog.ring.buf for i in live if getattr(i.prog, "ring", None) is not None)]
    kept = [t for i in live if i.step is not None for t in i.step.kept()]
    arenas = storage_bytes(buffers, runner.device)
    held = storage_bytes(buffers + kept, runner.device)
    return {"allocated_bytes": held + pool_bytes, "step_state_bytes": held - arenas, "capture_pool_bytes": pool_bytes}


__all__ = ["DevicePlan", "device_stats", "install_plan"]


def graph_tokens(graph: KernelGraph) -> int:
    """Tokens a step of ``graph`` carries: its ``input_ids``' elements (0 without)."""
    ids = graph.inputs.get("input_ids")
    if ids is None:
        return 0
    n = 1
    for d in graph.buffers[ids].shape:
        n *= d
    return n
