"""How a ``Deployment`` runs steps: one ``RunStep`` to every device of a
bucket's plan, their answers gathered into the sampled tokens (a failure
raises ``StepFailed`` naming the device), and a decode step's rows as the
change of the plan's latest step (``StepRows``: the devices keep the rest).
A part of :class:`~tessera_actors.serving.deployment.Deployment` (its state
is the deployment's)."""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence

from tessera_actors.runtime.errors import ActorError
from tessera_actors.runtime.messages import ChunkRows, RunStep, StepRows
from tessera_actors.serving.batch import decode_rows
from tessera_actors.serving.inflight import StepFailed, StepResult

# a step's runs of kernels over its devices, and the weight bytes streamed host -> device (PCIe)
RUN_COUNTS = ("replays", "eager_runs", "capture_failures", "streamed_bytes")


class Stepping:
    """Steps (mixed into ``Deployment``)."""

    probe_left = 0             # decode steps still to probe (``RunStep.probe``)
    timeline: list | None = None   # the probed steps' records (``StepDone.timeline``), all devices

    def probe_steps(self, steps: int) -> list:
        """Probe the next ``steps`` decode steps: each device answers with its
        timeline records (:mod:`tessera_actors.planning.offload.timeline`),
        gathered into the list returned (``self.timeline``, new)."""
        self.probe_left, self.timeline = steps, []
        return self.timeline

    def reserve(self, bucket: str) -> int | None:
        """The number of the next step of ``bucket`` (None: not placed yet),
        taken now: pass it to :meth:`step` as ``number``."""
        p = self.placed.get(bucket)
        if p is None:
            return None
        p.steps += 1
        return p.steps - 1

    def decode_rows(self, bucket: str, seqs: Sequence, lo: int, pad: int, continues: int | None = None
                    ) -> tuple[int | None, StepRows, bool]:
        """(the step number, the rows, whether the step's tokens can feed the
        next step on the device) of the next decode step of ``seqs`` on
        ``bucket``: :func:`~tessera_actors.serving.batch.decode_rows` as a
        change of the bucket's latest step sent with rows; ``continues``:
        ``seqs`` are the rows of that step number, as they were (no row
        needs looking at when it is the bucket's latest)."""
        p = self.placed.get(bucket)
        number = self.reserve(bucket)
        base = p.rows_at if p is not None and p.rows_at is not None else -1
        rows = decode_rows(seqs, lo, p.plan_id if p is not None else None, base, number,
                           p.order if p is not None else None, pad, p is None or p.feeds is None,
                           same=continues is not None and base >= 0 and continues == base)
        if p is not None:
            p.rows_at = number
            if rows.order is not None:
                p.order = rows.order
        return number, rows, p is not None and p.feeds is not None

    def restart_rows(self, bucket: str) -> None:
        """A step of ``bucket`` failed: its next decode step gives every row."""
        p = self.placed.get(bucket)
        if p is not None:
            p.rows_at = None

    async def step(self, bucket: str, inputs: dict, sample: list, rows: Sequence[str] = (),
                   number: int | None = None, outputs: bool = False, decode: StepRows | None = None,
                   chunk: ChunkRows | None = None) -> StepResult:
        """Run one step of ``bucket``; ``number``: a step number from
        :meth:`reserve` or :meth:`decode_rows`; ``decode``: a decode step's
        rows (``RunStep.rows``; from :meth:`decode_rows`) instead of
        ``sample`` and the token inputs; ``chunk``: a prompt-chunk step's
        rows (``RunStep.chunk``) instead of the inputs; ``rows``: the requests it carries
        (for the trace); ``outputs``: the graph's output bytes come back too
        (``StepResult.outputs``).  A decode step not numbered by
        :meth:`decode_rows` (its bucket was not placed then) gives every row
        (``base`` -1), and the next one too."""
        try:
            p = await self._placed(bucket)
        except ActorError as e:
            raise StepFailed(f"bucket {bucket} could not be placed: {e}") from e
        if number is None:
            step = p.steps
            p.steps += 1
        else:
            step = number
        t0, wall = time.perf_counter(), time.time()
        asks = self._asks(p, step, inputs, sample, outputs, decode, chunk)
        if len(asks) == 1:   # one device: no gather (a task per ask)
            try:
                results = [await asks[0]]
            except Exception as e:   # noqa: BLE001 - as gather(return_exceptions=True): reported below
                results = [e]
        else:
            results = await asyncio.gather(*asks, return_exceptions=True)
        return self._result(p, bucket, step, results, rows, len(rows) if decode is not None else len(sample), t0, wall)

    def step_soon(self, bucket: str, rows: Sequence[str], number: int | None, decode: StepRows) -> asyncio.Future:
        """:meth:`step` of a decode step (its ``decode`` rows, numbered by
        :meth:`decode_rows`) as a future, without a task when ``bucket`` is
        placed: the ``RunStep`` messages leave now (``ActorRef.ask_soon``)
        and the answers are gathered in their callbacks."""
        p = self.placed.get(bucket)
        if p is None:
            return asyncio.ensure_future(self.step(bucket, {}, [], rows, number, decode=decode))
        t0, wall = time.perf_counter(), time.time()
        asks = self._asks(p, number, {}, [], False, decode)
        done = asyncio.get_running_loop().create_future()
        results: list = [None] * len(asks)
        left = [len(asks)]

        def answered(i: int, fut: asyncio.Future) -> None:
            if fut.cancelled():
                results[i] = asyncio.CancelledError()
            else:
                results[i] = fut.exception() or fut.result()
            left[0] -= 1
            if left[0] or done.done():
                return
            try:
                done.set_result(self._result(p, bucket, number, results, rows, len(rows), t0, wall))
            except Exception as e:   # noqa: BLE001 - the step's failure, to whoever waits for it
                done.set_exception(e)
        for i, a in enumerate(asks):
            a.add_done_callback(functools.partial(answered, i))
        # giving up the step gives up its asks (a device not reached yet skips the message)
        done.add_done_callback(lambda d: [a.cancel() for a in asks] if d.cancelled() else None)
        return done

    def _asks(self, p, step: int, inputs: dict, sample: list, outputs: bool, decode: StepRows | None,
              chunk: ChunkRows | None = None) -> list:
        """One ``RunStep`` per plan device, sent (inputs only to the devices that read them)."""
        traced, timeout = self.trace is not None, self.cfg.step_timeout
        probe = decode is not None and self.probe_left > 0
        self.probe_left -= probe
        return [ref.ask_soon(RunStep(p.plan_id, step, inputs if p.plan.inputs[d] else {}, sample, outputs, traced,
                                     decode, chunk if p.plan.inputs[d] else None, probe), timeout)
                for d, ref in enumerate(p.refs)]

    def _result(self, p, bucket: str, step: int, results: list, rows: Sequence[str], want: int, t0: float,
                wall: float) -> StepResult:
        """The devices' answers to one step (or their errors: ``StepFailed``
        naming the first device that failed) as its result; counts, busy
        times and the trace updated."""
        for d, r in enumerate(results):
            if isinstance(r, BaseException):
                raise StepFailed(f"{bucket} step {step}: device {d} ({p.plan.devices[d]}) failed: "
                                 f"{type(r).__name__}: {r}") from r
        if self.trace is not None:
            self.trace.step(bucket, rows, wall, time.time(), [f"{d}: {spec}" for d, spec in enumerate(p.plan.devices)],
                            [r.spans for r in results])
        if self.timeline is not None:
            self.timeline.extend(rec for r in results for rec in r.timeline)
        counts = self.bucket_counts.get(bucket)
        if counts is None:
            counts = self.bucket_counts[bucket] = dict.fromkeys(RUN_COUNTS, 0)
        worker, busy = self.worker_s, self.busy_s
        for d, r in enumerate(results):
            busy[d] = busy.get(d, 0.0) + r.busy_s
            worker["busy"] += r.busy_s
            worker["kernels"] += r.kernel_s
            worker["host"] += r.host_s
            for k in RUN_COUNTS:
                counts[k] += getattr(r, k, 0)
        self._note_busy()
        holder = next((r for r in results if r.tokens), None)
        tokens = holder.tokens if holder else []
        if want and len(tokens) != want:
            raise StepFailed(f"{bucket} step {step}: {len(tokens)} tokens for {want} sampled rows")
        return StepResult(tokens, time.perf_counter() - t0, holder.logprobs if holder else [],
                          [r.busy_s for r in results], top_logprobs=holder.top_logprobs if holder else [],
                          outputs=[[*rng, data] for r in results for rng, data in zip(r.ranges, r.data)])
