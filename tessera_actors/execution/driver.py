"""The event-loop side of a device's steps: each installed plan's steps, in
arrival order, through the one step path (:mod:`.step`).

:meth:`Driver.run_steps` is a plan's step loop.  A step runs as worker
calls (:meth:`~.step.StepRun.advance`) and, between them, the receives that
must wait on the event loop: a transfer from a device actor of this process
is handed over thread to thread (:mod:`.handoff`; after its kernels the
worker waits there, up to ``spin_s`` and only while no other worker call is
queued, and goes on in the same call, so a chain of hand-offs between
co-located devices never passes through the loop), one from another
process arrives in the plan's inbox (:mod:`.inbox`), whole or span by span.
Sends to other processes go to the node's transfer actor (``Ship``).

Launch-ahead is a case of the same path: a *local* step (no transfer, no
output bytes, untraced) is done after one worker call that queued its
inputs, kernels, sampling and the tokens' copy to host memory; it is
answered when its event has landed (waited for on a second thread, so the
worker stays free), and meanwhile the next step, when already queued, is
launched behind it (its kernels queue on the same stream): the device never
idles between the two while the host reads tokens and answers.  At most
``AHEAD`` steps are launched and not landed; they are answered in order.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import Any

from tessera_actors.execution.handoff import Handoff
from tessera_actors.execution.inbox import TransferFailed
from tessera_actors.execution.plans import DevicePlan
from tessera_actors.execution.program import BackendError
from tessera_actors.execution.spans import sub_ranges
from tessera_actors.execution.step import AHEAD, TOKENS, StepRun, TokensWanted, received
from tessera_actors.execution.worker import Worker
from tessera_actors.runtime.messages import RunStep, Ship, StepDone


class Driver:
    def __init__(self, name: str, worker: Worker, runner: Any, handoff: Handoff, transfer: Any,
                 spin_s: float, recv_timeout: float) -> None:
        """``name``: the device's, in errors; ``runner``: its
        :class:`~.segments.SegmentRunner` (None: not opened, nothing runs);
        ``transfer``: the node's transfer actor (a ref)."""
        self.name, self.worker, self.runner, self.handoff, self.transfer = name, worker, runner, handoff, transfer
        self.spin_s, self.recv_timeout = spin_s, recv_timeout
        self.steps_run = 0
        self.busy_s = 0.0
        self.waiter: Worker | None = None

    def shutdown(self) -> None:
        if self.waiter is not None:
            self.waiter.shutdown()

    async def run_steps(self, plan_id: str, inst: DevicePlan) -> None:
        """Run the plan's steps as they arrive (module docstring)."""
        launched: collections.deque = collections.deque()   # (msg, fut, landed future, run)
        fut = None
        try:
            while True:
                if launched:
                    if (len(launched) >= AHEAD or inst.steps.empty()) and not launched[0][2].done():
                        inst.arrived.clear()   # set by a step that arrives or one that lands
                        await inst.arrived.wait()
                    if launched[0][2].done():
                        self._answer(inst, *launched.popleft())
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
                        self._answer(inst, *launched.popleft())
                try:
                    async with inst.ring_lock or contextlib.nullcontext():   # its copies are queued in the step
                        run = await self._drive(plan_id, inst, msg)
                except Exception as exc:  # the asker gets the error; the device keeps serving
                    inst.step.failed(msg, exc)
                    if not fut.done():
                        fut.set_exception(exc)
                    continue
                landed = self._landing(run)
                if local:
                    landed.add_done_callback(lambda _: inst.arrived.set())
                    launched.append((msg, fut, landed, run))
                    continue
                await asyncio.wait({landed})
                inst.step.hand_tokens(msg, run, landed.exception())
                self._answer(inst, msg, fut, landed, run)
        except asyncio.CancelledError:
            for waiting in [f for _, f, *_ in launched] + [fut]:
                if waiting is not None and not waiting.done():
                    waiting.set_exception(BackendError(f"{self.name}: a step of plan {plan_id!r} was cancelled"))
            raise

    async def _drive(self, plan_id: str, inst: DevicePlan, msg: RunStep) -> StepRun:
        """Run ``msg`` on this device until its program ended."""
        step = inst.step
        run = step.begin(msg, self.handoff, self.spin_s, lambda: self.worker.pending > 0)
        busy = wait = 0.0
        try:
            while True:
                p = await self.worker.call(run.advance)
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

    async def _receive(self, plan_id: str, inst: DevicePlan, msg: RunStep, t, run: StepRun) -> float:
        """Wait on the loop for transfer ``t`` of ``msg`` and stage its bytes
        (whole, or span by span as they arrive), or for the tokens another
        device sampled (``t`` a :class:`~.step.TokensWanted`); seconds waited."""
        if isinstance(t, TokensWanted):
            return await self._tokens(msg, t, run)
        what = f"{self.name}: transfer {t.tag} from device {t.src} ({inst.plan.devices[t.src]})"
        started = time.time()
        w0 = time.perf_counter()
        if t.src in inst.step.peers:
            try:
                data = await self.handoff.wait((plan_id, msg.step, t.tag), self.recv_timeout)
            except asyncio.TimeoutError:
                raise TransferFailed(f"{what} of step {msg.step}: nothing arrived within "
                                     f"{self.recv_timeout:g} s") from None
            run.stage(t.buffer, t.ranges, received(data), inst.step.writers.get(t.tag))
            waited = time.perf_counter() - w0
            if run.probe is not None:
                run.probe.add("wait", f"wait {t.tag}", w0, w0 + waited, tag=t.tag, src=t.src, on="loop")
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

    async def _tokens(self, msg: RunStep, want: TokensWanted, run: StepRun) -> float:
        w0 = time.perf_counter()
        try:
            got = await self.handoff.wait(want.key, self.recv_timeout)
        except asyncio.TimeoutError:
            raise TransferFailed(f"{self.name}: step {msg.step} continues the rows of step {want.base}, whose tokens "
                                 f"did not come from the device that samples them within {self.recv_timeout:g} s"
                                 ) from None
        run.got_tokens(want, got)
        waited = time.perf_counter() - w0
        if run.probe is not None:
            run.probe.add("wait", f"wait tokens {want.base}", w0, w0 + waited, tag=TOKENS, on="loop")
        return waited

    def _landing(self, run: StepRun) -> asyncio.Future:
        """A future done when the step's work on the device has finished
        (its event waited for on the landing thread; at once on a CPU)."""
        if run.landing is None:
            landed = asyncio.get_running_loop().create_future()
            landed.set_result(None)
            return landed
        if self.waiter is None:   # the worker stays free to launch the next step meanwhile
            self.waiter = Worker(f"land-{self.name}")
        return self.waiter.call(self.runner.backend.host_wait, run.landing)

    def _answer(self, inst: DevicePlan, msg: RunStep, fut: asyncio.Future, landed: asyncio.Future,
                run: StepRun) -> None:
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
        copied = getattr(inst.prog, "copied_bytes", 0)
        moved, inst.copied = (copied - inst.copied, copied) if inst.prog is not None else (0, inst.copied)
        fut.set_result(StepDone(msg.plan_id, msg.step, run.step.device, out.outputs, out.data, run.busy,
                                run.waited, out.tokens, out.logprobs, out.spans, **run.counts,
                                top_logprobs=out.top_logprobs, streamed_bytes=moved,
                                kernel_s=run.kernel_s, host_s=run.host_s,
                                timeline=run.probe.take() if run.probe is not None else []))


__all__ = ["Driver"]
