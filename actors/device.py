"""The device actor: owns one device (its memory and its worker) and runs its
part of installed plans, step by step.

Contract:
* ``InstallPlan`` allocates the device's buffers and pre-binds its kernels;
  ``LoadValues`` fills weights and state; ``Uninstall`` frees them.
* ``RunStep`` is answered with ``StepDone`` when this device has finished its
  program for that step.  Steps of one plan run in the order they arrive, one
  at a time; the mailbox stays open meanwhile, so ``Deliver`` messages (the
  bytes of cross-device transfers, whole or in spans, possibly ahead of
  their step) are taken while a step waits for them; each span is written
  as soon as it arrives, and a ``Deliver`` carrying an error fails the step.
* Torch work never runs on the event loop: it goes to the device's single
  worker thread, so the actor keeps answering while a segment runs, and a
  step costs O(segments) loop work.
* On the worker, a :class:`~tessera_actors.execution.segments.SegmentRunner` owns the device
  (``backend_for(spec)``: a green context for ``cuda:1?sms=32``, the
  ``mem=`` cap) and its compute and communication streams.  Each run of
  kernels between transfers runs eagerly on the first step and is captured
  (a CUDA graph) on the second and replayed from then on; the host waits
  for the device only before bytes leave it (sends, outputs).
  ``graphs=False`` (or ``TESSERA_CUDA_GRAPHS=0``) keeps every run eager.
  ``busy_s`` is therefore host time on the worker (queueing work, waiting
  for bytes to send), not device time.
* Share groups (``InstallPlan.share``): the bucket graphs of one served
  model name the same weights and state (KV cache); the device keeps one
  tensor per (group, buffer name) and every plan of the group runs on it, so
  a prefill plan fills the KV rows a decode plan then reads.  The tensors
  live as long as the device actor (a re-placed deployment reuses them).
  A CPU device given a weight's bytes by a scheduler of its own process
  (``InstallPlan.adopt``) holds those bytes as they are: one copy of the
  weights in the process, not the engine's and the device's.  Every plan of
  the device keeps its segment-local temporaries in one scratch
  (``execution/sharing.py``).
* Sampling (``RunStep.sample``, or a decode step's ``RunStep.rows``): the
  device holding the step's logits draws the tokens there, on the worker
  (``tessera_actors.execution.sampling``), and answers ``StepDone.tokens``;
  the logits never leave the device.  A decode plan's rows (positions,
  input tokens, sampling parameters) are kept on its devices between steps
  (``tessera_actors.execution.rows``).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from tessera_actors.execution.allow import warm_meta
from tessera_actors.execution.program import AtenProgram, BackendError
from tessera_actors.execution.spans import sub_ranges
from tessera_actors.execution.handoff import Handoff, hub_for
from tessera_actors.execution.held import storage_bytes
from tessera_actors.execution.inbox import Inbox, TransferFailed
from tessera_actors.execution.segments import SegmentRunner, graphs_from_env, program_class
from tessera_actors.execution.sharing import Shares, scratch_layout
from tessera_actors.execution.worker import Worker
from tessera_actors.execution.streaming import program_for, staging_of, streamed_buffers
from tessera_actors.runtime.actor import Actor, handler
from tessera_actors.devices import DeviceSpec
from tessera_actors.graph import KernelGraph, graph_from_bytes
from tessera_actors.runtime.messages import (Deliver, GetStats, Installed, InstallPlan, LoadValues, Ok, RunStep,
                                     Ship, Stats, StepDone, Uninstall)
from tessera_actors.plan import Plan, plan_from_dict
from tessera_actors.execution.step import AHEAD, DeviceStep, StepRun

log = logging.getLogger("tessera_actors.device")

SPIN_S = 0.05   # a worker's longest wait for a co-located peer's transfer (it stops early for other work)


_INITIAL_THREADS = torch.get_num_threads()


@dataclass
class _Installed:
    graph: KernelGraph
    plan: Plan
    device: int
    prog: AtenProgram
    step: DeviceStep | None = None                   # the program's step path (execution/step.py)
    steps: asyncio.Queue = field(default_factory=asyncio.Queue)
    inbox: Inbox = field(default_factory=Inbox)   # transfer bytes, possibly ahead of their step
    runner: asyncio.Task | None = None
    share_keys: dict = field(default_factory=dict)   # buffer id -> (share group, name)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)   # a step was queued
    home_keys: dict = field(default_factory=dict)   # streamed buffer id -> (share group, name, "home")
    ring_lock: asyncio.Lock | None = None           # held around each step: the share group's staging ring
    copied: int = 0                                 # streamed bytes copied in (PCIe) as of the last step answered


class DeviceActor(Actor):
    def __init__(self, spec: DeviceSpec, transfer: str = "transfer", recv_timeout: float = 60.0,
                 graphs: bool | None = None, spin_s: float = SPIN_S) -> None:
        """``graphs``: capture and replay runs of kernels (None: from
        ``TESSERA_CUDA_GRAPHS``, default on); ``spin_s``: how long at most
        the worker waits, after its kernels, for a co-located peer's transfer
        before leaving the wait to the event loop (0: always the loop); it
        stops sooner when another worker call is queued."""
        self.spec = spec
        self.spin_s = spin_s
        self.graphs = graphs_from_env() if graphs is None else graphs
        self.recv_timeout = recv_timeout
        self.transfer_name = transfer
        self.plans: dict[str, _Installed] = {}
        self.shares = Shares(spec.name)   # what the share groups hold across plans
        self.steps_run = 0
        self.busy_s = 0.0
        self.waiter: Worker | None = None

    async def on_start(self) -> None:
        # a thread starts with the intra-op thread count last set in the process: a device without
        # threads= gets the process's initial count, whatever a cpu?threads=1 device set before it
        threads = self.spec.threads or _INITIAL_THREADS

        def init() -> None:
            torch.get_num_threads()          # this thread's lazy intra-op init first (it would reset the count
            torch.set_num_threads(threads)   # to the process's latest one at the thread's first op)
        self.worker = Worker(f"dev-{self.spec.name}", init)
        self.transfer = self.system.ref(self.transfer_name)
        self.handoff: Handoff = hub_for(self.system).register(self.name, asyncio.get_running_loop())
        # streams and green contexts belong to the thread that uses them: open the device there
        self.runner: SegmentRunner | None = None
        self.open_error = ""
        try:
            self.runner = await self._on_worker(SegmentRunner, self.spec, self.graphs)
            # installs size their kernels on meta tensors (execution/allow.py): torch's first meta run imports
            # for seconds - started now, on the worker, so the first install does not wait for all of it
            self.worker.call(warm_meta)
        except Exception as e:   # reported by every install, so the node itself keeps serving
            self.open_error = f"{type(e).__name__}: {e}"
            log.error("%s: cannot open the device: %s", self.spec.name, self.open_error)

    async def on_stop(self) -> None:
        if getattr(self, "handoff", None) is not None and self.system is not None:
            hub_for(self.system).unregister(self.name, self.handoff)
        for inst in self.plans.values():
            self._fail_plan(inst, "device stopped")
        self.worker.shutdown()
        if self.waiter is not None:
            self.waiter.shutdown()
        # a stopped actor may still be referenced (a ref kept by a caller): keep no device memory alive
        self.plans.clear()
        self.shares.clear()
        self.runner = None

    async def _on_worker(self, fn, *args):
        return await self.worker.call(fn, *args)

    # -- installation ---------------------------------------------------
    @handler(InstallPlan)
    async def install(self, msg: InstallPlan) -> Installed:
        if msg.plan_id in self.plans:
            raise ValueError(f"plan {msg.plan_id!r} is already installed on {self.spec.name}")
        # from this process the objects themselves (shared, read only), from another their bytes
        graph = msg.graph if isinstance(msg.graph, KernelGraph) else graph_from_bytes(msg.graph)
        plan = msg.plan if isinstance(msg.plan, Plan) else plan_from_dict(msgpack.unpackb(msg.plan, strict_map_key=False))
        d = msg.device
        if not 0 <= d < len(plan.devices):
            raise ValueError(f"device index {d} not in plan {msg.plan_id!r} ({len(plan.devices)} devices)")
        mine = [s for s in plan.segments if s.device == d]
        if self.runner is None:
            raise BackendError(f"{self.spec.name}: device could not be opened: {self.open_error}")
        cls = program_class(graph)
        streamed = set(streamed_buffers(plan, d))   # homed in host memory: not shared device tensors
        shares = self.shares
        keys = shares.keys(graph, [b for b in plan.resident[d] if b not in streamed], msg.share)
        home_keys = shares.home_keys(graph, sorted(streamed), msg.share)
        slots, slot_bytes = staging_of(plan, d)
        have = shares.ring(msg.share, slots, slot_bytes, msg.plan_id) if streamed else None

        scratch = scratch_layout(graph, plan, d)

        def build() -> tuple[AtenProgram, Any, set]:
            # one staging ring and one host home per weight serve the whole share group, one scratch every
            # plan's segment-local temporaries; the plan's own buffers get what these leave of the budget
            shared, homes, ring, left, adopted = shares.allocate(
                graph, keys, home_keys, have, slots, slot_bytes, self.runner.device, self.runner.backend,
                self.spec.mem, scratch, self.runner.recapture, msg.adopt)
            prog = program_for(cls, graph, plan, d, self.runner, left, shared, self.spec.slow, ring, homes)
            for s in mine:
                for k in s.kernels:
                    prog.bind(k)
            return prog, ring, adopted
        prog, ring, adopted = await self._on_worker(build)
        shares.loaded.update(adopted)
        inst = _Installed(graph, plan, d, prog)
        inst.share_keys = keys
        inst.home_keys = home_keys
        inst.ring_lock = shares.lock(msg.share, ring) if ring is not None else None
        inst.step = DeviceStep(msg.plan_id, graph, plan, d, prog, self.runner, self._peers(msg.routes, d))
        inst.runner = asyncio.get_running_loop().create_task(self._run_steps(msg.plan_id, inst))
        self.plans[msg.plan_id] = inst
        need = [b for b in plan.resident[d] if graph.buffers[b].role in ("weight", "state")
                and (keys.get(b) or home_keys.get(b)) not in shares.loaded]
        # the plan's buffers wherever they live: its own, and its temporaries in the device's scratch
        resident = prog.nbytes + sum(graph.buffers[b].nbytes for b in scratch[0])
        return Installed(msg.plan_id, d, resident, sum(len(s.kernels) for s in mine), len(mine), need)

    def _peers(self, routes: list, me: int) -> dict[int, Handoff]:
        """The hand-offs of the plan devices served by device actors of this
        process (their transfers go thread to thread)."""
        here, hub = {"", self.system.address}, hub_for(self.system)
        peers = {}
        for d, endpoint, name in routes:
            handoff = hub.get(name) if int(d) != me and endpoint in here else None
            if handoff is not None and handoff is not self.handoff:
                peers[int(d)] = handoff
        return peers

    @handler(LoadValues)
    async def load(self, msg: LoadValues) -> Ok:
        inst = self._plan(msg.plan_id)
        await self._on_worker(inst.prog.load, dict(zip(msg.buffers, msg.data)))
        self.shares.loaded.update(inst.share_keys[b] for b in msg.buffers if b in inst.share_keys)
        self.shares.loaded.update(inst.home_keys[b] for b in msg.buffers if b in inst.home_keys)
        return Ok(f"{len(msg.buffers)} buffers offered")

    @handler(Uninstall)
    async def uninstall(self, msg: Uninstall) -> Ok:
        """The plan's units and arena go after the work already queued for it
        (which keeps the arena alive until then); with ``wait`` the answer
        comes once they are gone, so the memory is free for the next plan
        (a loss's clean-up does not wait: the survivors' queued steps would
        hold up the recovery)."""
        inst = self.plans.pop(msg.plan_id, None)
        self.handoff.drop(msg.plan_id)
        if inst is not None:
            self._fail_plan(inst, "plan uninstalled")
            if self.runner is not None:
                done = self.worker.call(self.runner.forget, msg.plan_id, inst.prog)
                if msg.wait:
                    await done
            inst.prog = None
        return Ok()

    @handler(GetStats)
    def stats(self, msg: GetStats) -> Stats:
        graphs = self.runner.stats() if self.runner is not None else {"graphs": False}
        graphs["per_plan"] = {p: dict(c) for p, c in self.runner.per_plan.items()} if self.runner is not None else {}
        sh = self.shares
        return Stats({"steps": self.steps_run, "busy_s": self.busy_s, "plans": list(self.plans), **graphs,
                      **self._streaming_stats(),
                      **self.handoff.counts,
                      "shared_bytes": sh.device_bytes() - sh.staging_bytes() - sh.scratch_bytes(),
                      "staging_bytes": sh.staging_bytes(), "home_bytes": sum(t.numel() for t in sh.homes.values()),
                      "scratch_bytes": sh.scratch_bytes(),
                      "plan_bytes": sum(i.prog.nbytes for i in self.plans.values() if i.prog is not None),
                      **self._held(graphs.get("capture_pool_bytes", 0))})

    def _held(self, pool_bytes: int) -> dict[str, int]:
        """What this device holds (:mod:`tessera_actors.execution.held`):
        ``allocated_bytes``, every byte of it - the share groups' weights,
        state and staging rings, the scratch of every plan's temporaries,
        every installed plan's own buffers, what their steps keep between
        steps (``step_state_bytes``) and the capture pool of its graphs
        (``capture_pool_bytes``)."""
        if self.runner is None:
            return {"allocated_bytes": 0, "step_state_bytes": 0, "capture_pool_bytes": 0}
        dev = self.runner.device
        sh = self.shares
        plans = [i for i in self.plans.values() if i.prog is not None]
        buffers = [*sh.shared.values(), *(r.buf for r, _ in sh.rings.values()), *sh.scratch_tensors(),
                   *(t for i in plans for t in i.prog.arena.values()),
                   *(i.prog.ring.buf for i in plans if getattr(i.prog, "ring", None) is not None)]
        kept = [t for i in plans if i.step is not None for t in i.step.kept()]
        arenas = storage_bytes(buffers, dev)
        held = storage_bytes(buffers + kept, dev)
        return {"allocated_bytes": held + pool_bytes, "step_state_bytes": held - arenas,
                "capture_pool_bytes": pool_bytes}

    def _streaming_stats(self) -> dict[str, Any]:
        """Over the installed plans that stream weights here: copies queued and
        those a step found queued ahead by the step before (ints, read from
        the loop while the worker counts)."""
        progs = [i.prog for i in self.plans.values() if getattr(i.prog, "streamed", None)]
        return {"streamed_copies": sum(p.copies for p in progs),
                "streamed_copies_ahead_used": sum(p.ahead_used for p in progs),
                "streamed_bytes": sum(p.copied_bytes for p in progs)}

    def _plan(self, plan_id: str) -> _Installed:
        try:
            return self.plans[plan_id]
        except KeyError:
            raise KeyError(f"plan {plan_id!r} is not installed on {self.spec.name}") from None

    def _fail_plan(self, inst: _Installed, why: str) -> None:
        if inst.runner is not None:
            inst.runner.cancel()
        while not inst.steps.empty():
            _, fut = inst.steps.get_nowait()
            if not fut.done():
                fut.set_exception(BackendError(f"{self.spec.name}: {why}"))

    # -- steps ----------------------------------------------------------
    @handler(RunStep)
    def run_step(self, msg: RunStep) -> asyncio.Future:
        """Deferred reply: the returned future resolves to ``StepDone``."""
        inst = self._plan(msg.plan_id)
        fut = asyncio.get_running_loop().create_future()
        inst.steps.put_nowait((msg, fut))
        inst.arrived.set()
        return fut

    @handler(Deliver)
    def deliver(self, msg: Deliver) -> None:
        inst = self.plans.get(msg.plan_id)
        if inst is None:
            log.warning("%s: dropped transfer %d of step %d for unknown plan %r",
                        self.spec.name, msg.tag, msg.step, msg.plan_id)
            return
        inst.inbox.put(msg.step, msg.tag, msg.offset, msg.data, msg.error)

    async def _run_steps(self, plan_id: str, inst: _Installed) -> None:
        """Run the plan's steps in arrival order, through the one step path
        (:mod:`tessera_actors.execution.step`).  A local step (no transfer,
        no output bytes, untraced) is done after one worker call that queued
        its inputs, kernels, sampling and the tokens' copy to host memory;
        it is answered when its event has landed, and meanwhile the next
        step, when already here, is launched behind it (its kernels queue on
        the same stream), so the device never idles between the two while
        the host reads tokens and answers.  At most ``AHEAD`` steps are
        launched and not landed; they are answered in order."""
        launched: collections.deque = collections.deque()   # (msg, fut, landed future, run)
        fut = None
        try:
            while True:
                if launched:
                    if (len(launched) >= AHEAD or inst.steps.empty()) and not launched[0][2].done():
                        inst.arrived.clear()   # set by a step that arrives or one that lands
                        await inst.arrived.wait()
                    if launched[0][2].done():
                        self._answer(*launched.popleft())
                        continue
                    if len(launched) >= AHEAD or inst.steps.empty():
                        continue
                    msg, fut = inst.steps.get_nowait()
                else:
                    msg, fut = await inst.steps.get()
                if fut.done():
                    continue
                local = self.runner is not None and inst.step.local(msg)
                if not local:
                    while launched:   # a step with transfers or outputs runs once the launched ones landed
                        await asyncio.wait({launched[0][2]})
                        self._answer(*launched.popleft())
                try:
                    async with inst.ring_lock or contextlib.nullcontext():   # its copies are queued in the step
                        run = await self._drive(plan_id, inst, msg)
                except Exception as exc:  # the asker gets the error; the device keeps serving
                    if not fut.done():
                        fut.set_exception(exc)
                    continue
                landed = self._landing(run)
                if local:
                    landed.add_done_callback(lambda _: inst.arrived.set())
                    launched.append((msg, fut, landed, run))
                    continue
                await asyncio.wait({landed})
                self._answer(msg, fut, landed, run)
        except asyncio.CancelledError:
            for waiting in [f for _, f, *_ in launched] + [fut]:
                if waiting is not None and not waiting.done():
                    waiting.set_exception(BackendError(f"{self.spec.name}: a step of plan {plan_id!r} was cancelled"))
            raise

    async def _drive(self, plan_id: str, inst: _Installed, msg: RunStep) -> StepRun:
        """Run ``msg`` on this device until its program ended: worker calls
        (:meth:`StepRun.advance`) and, between them, the receives that must
        wait on the event loop.  A transfer to or from a device actor of
        this process is handed over thread to thread
        (:mod:`tessera_actors.execution.handoff`): after its kernels the
        worker waits there (up to ``spin_s``, and only while no other worker
        call is queued) and goes on in the same call, so a chain of
        hand-offs between co-located devices never passes through the loop."""
        step = inst.step
        run = step.begin(msg, self.handoff, self.spin_s, lambda: self.worker.pending > 0)
        busy = wait = 0.0
        try:
            while True:
                p = await self._on_worker(run.advance)
                busy += p.busy
                wait += p.waited
                for tag, data in p.ship:
                    await self.transfer.tell(Ship(plan_id, msg.step, tag, step.transfers[tag].dst, data))
                if p.done:
                    break
                wait += await self._receive(plan_id, inst, msg, p.waiting, run)
        finally:
            if step.peers:
                self.handoff.discard(plan_id, msg.step)
        run.busy, run.waited = busy, wait
        return run

    async def _receive(self, plan_id: str, inst: _Installed, msg: RunStep, t, run: StepRun) -> float:
        """Wait on the loop for transfer ``t`` of ``msg`` and stage its bytes
        (whole, or span by span as they arrive); seconds waited."""
        plan = inst.plan
        what = f"{self.spec.name}: transfer {t.tag} from device {t.src} ({plan.devices[t.src]})"
        started = time.time()
        w0 = time.perf_counter()
        if t.src in inst.step.peers:
            try:
                data = await self.handoff.wait((plan_id, msg.step, t.tag), self.recv_timeout)
            except asyncio.TimeoutError:
                raise TransferFailed(f"{what} of step {msg.step}: nothing arrived within "
                                     f"{self.recv_timeout:g} s") from None
            run.stage(t.buffer, t.ranges, data)
            waited = time.perf_counter() - w0
        else:
            async def write(offset, data, t=t):   # one span: the stream bytes from offset on
                # written by the worker call that runs the kernels after it (one thread hop per
                # device change, not one per transfer and span)
                run.stage(t.buffer, sub_ranges(t.ranges, offset, data.numel() * data.element_size()), data)
            waited = await inst.inbox.receive(msg.step, t.tag, t.nbytes, write, self.recv_timeout, what)
        run.received()
        if run.spans is not None:
            run.spans.append([f"recv {t.tag} ({t.nbytes} B from device {t.src})", started, time.time()])
        return waited

    def _landing(self, run: StepRun) -> asyncio.Future:
        """A future done when the step's work on the device has finished
        (its event waited for on the landing thread; at once on a CPU)."""
        loop = asyncio.get_running_loop()
        if run.landing is None:
            landed = loop.create_future()
            landed.set_result(None)
            return landed
        return self._waiter().call(self.runner.backend.host_wait, run.landing)

    def _answer(self, msg: RunStep, fut: asyncio.Future, landed: asyncio.Future, run: StepRun) -> None:
        """Answer a step whose work landed."""
        if fut.done():
            return
        err = landed.exception()
        if err is not None:
            fut.set_exception(err)
            return
        out = run.landed()
        self.steps_run += 1
        self.busy_s += run.busy
        inst = self.plans.get(msg.plan_id)
        copied = getattr(inst.prog, "copied_bytes", 0) if inst is not None else 0
        moved = copied - inst.copied if inst is not None else 0
        if inst is not None:
            inst.copied = copied
        fut.set_result(StepDone(msg.plan_id, msg.step, run.step.device, out.outputs, out.data, run.busy,
                                run.waited, out.tokens, out.logprobs, out.spans, **run.counts,
                                top_logprobs=out.top_logprobs, streamed_bytes=moved,
                                kernel_s=run.kernel_s, host_s=run.host_s))

    def _waiter(self) -> Worker:
        """The thread that waits for launched steps to land (the worker stays
        free to launch the next one meanwhile)."""
        if self.waiter is None:
            self.waiter = Worker(f"land-{self.spec.name}")
        return self.waiter
