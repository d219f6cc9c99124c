"""The device actor: owns one device (its memory and its worker) and runs its
part of installed plans, step by step.  It is a thin actor around the
execution core: an install is :func:`~tessera_actors.execution.plans.install_plan`,
a plan's steps run in :class:`~tessera_actors.execution.driver.Driver`'s
step loop through the one step path (:mod:`tessera_actors.execution.step`);
the actor holds the mailbox, the worker thread and the co-located hand-off.

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
import logging

import torch

from tessera_actors.devices import DeviceSpec
from tessera_actors.execution.backends.cpu import device_threads
from tessera_actors.execution.allow import warm_meta
from tessera_actors.execution.driver import Driver
from tessera_actors.execution.handoff import Handoff, hub_for
from tessera_actors.execution.plans import DevicePlan, device_stats, install_plan
from tessera_actors.execution.segments import SegmentRunner, graphs_from_env
from tessera_actors.execution.sharing import Shares
from tessera_actors.execution.worker import Worker
from tessera_actors.runtime.actor import Actor, handler
from tessera_actors.runtime.messages import (Deliver, GetStats, Installed, InstallPlan, LoadValues, Ok, RunStep, Stats,
                                             Uninstall)

log = logging.getLogger("tessera_actors.device")

STOP_WAIT_S = 10.0   # how long a stopping device waits for its worker's running call to end
SPIN_S = 0.05   # a worker's longest wait for a co-located peer's transfer (it stops early for other work)




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
        self.plans: dict[str, DevicePlan] = {}
        self.shares = Shares(spec.name)   # what the share groups hold across plans
        self.driver: Driver | None = None

    async def on_start(self) -> None:
        threads = device_threads(self.spec)

        def init() -> None:
            torch.get_num_threads()          # this thread's lazy intra-op init first (it would reset the count
            torch.set_num_threads(threads)   # to the process's latest one at the thread's first op)
        self.worker = Worker(f"dev-{self.spec.name}", init)
        self.handoff: Handoff = hub_for(self.system).register(self.name, asyncio.get_running_loop())
        # streams and green contexts belong to the thread that uses them: open the device there
        self.runner: SegmentRunner | None = None
        self.open_error = ""
        try:
            self.runner = await self.worker.call(SegmentRunner, self.spec, self.graphs)
            # installs size their kernels on meta tensors (execution/allow.py): torch's first meta run imports
            # for seconds - started now, on the worker, so the first install does not wait for all of it
            self.worker.call(warm_meta)
        except Exception as e:   # reported by every install, so the node itself keeps serving
            self.open_error = f"{type(e).__name__}: {e}"
            log.error("%s: cannot open the device: %s", self.spec.name, self.open_error)
        self.driver = Driver(self.spec.name, self.worker, self.runner, self.handoff,
                             self.system.ref(self.transfer_name), self.spin_s, self.recv_timeout)

    async def on_stop(self) -> None:
        if getattr(self, "handoff", None) is not None and self.system is not None:
            hub_for(self.system).unregister(self.name, self.handoff)
        for inst in self.plans.values():
            inst.fail(f"{self.spec.name}: device stopped")
        self.worker.shutdown()
        if self.driver is not None:
            self.driver.shutdown()
        if not await asyncio.to_thread(self.worker.join, STOP_WAIT_S):
            log.warning("%s: the device's worker is still running a call %.0f s after the stop",
                        self.spec.name, STOP_WAIT_S)
        if self.runner is not None:
            self.runner.backend.release()   # a budgeted GPU's cap on the process's allocator
        # a stopped actor may still be referenced (a ref kept by a caller): keep no device memory alive
        self.plans.clear()
        self.shares.clear()
        self.runner = self.driver = None

    # -- installation ---------------------------------------------------
    @handler(InstallPlan)
    async def install(self, msg: InstallPlan) -> Installed:
        if msg.plan_id in self.plans:
            raise ValueError(f"plan {msg.plan_id!r} is already installed on {self.spec.name}")
        inst, answer = await install_plan(msg, self.spec, self.runner, self.shares, self.worker,
                                          self._peers(msg.routes, msg.device), self.open_error)
        inst.task = asyncio.get_running_loop().create_task(self.driver.run_steps(msg.plan_id, inst))
        self.plans[msg.plan_id] = inst
        return answer

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
        await self.worker.call(inst.prog.load, dict(zip(msg.buffers, msg.data)))
        self.shares.loaded.update(inst.loaded(msg.buffers))
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
            inst.fail(f"{self.spec.name}: plan uninstalled")
            if self.runner is not None:
                done = self.worker.call(self.runner.forget, msg.plan_id, inst.prog)
                if msg.wait:
                    await done
            inst.prog = None
        return Ok()

    @handler(GetStats)
    def stats(self, msg: GetStats) -> Stats:
        steps, busy = (self.driver.steps_run, self.driver.busy_s) if self.driver is not None else (0, 0.0)
        return Stats({"steps": steps, "busy_s": busy, "plans": list(self.plans),
                      **device_stats(self.runner, self.shares, self.plans, self.handoff.counts)})

    def _plan(self, plan_id: str) -> DevicePlan:
        try:
            return self.plans[plan_id]
        except KeyError:
            raise KeyError(f"plan {plan_id!r} is not installed on {self.spec.name}") from None

    # -- steps ----------------------------------------------------------
    @handler(RunStep)
    def run_step(self, msg: RunStep) -> asyncio.Future:
        """Deferred reply: the returned future resolves to ``StepDone``, in
        the plan's step order (:mod:`tessera_actors.execution.driver`)."""
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
