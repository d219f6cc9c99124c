"""``AsyncEngine``: continuous batching through the actor system.

Embed it in an asyncio program::

    async with AsyncEngine(model="smollm2", devices="cpu,cpu") as eng:
        async for out in eng.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
            print(out.text, end="")

How prefill and decode share steps: one engine loop keeps prompt-chunk
steps and one decode step per micro-batch group in flight - one prompt
step, or as many as the micro-batches of the prompt plan it runs when the
planner pipelines that plan over several devices (each step then carries
other requests' chunks).  A
request waits (bounded queue) for a free KV slot; its prompt is then fed
chunk by chunk (``prefill_buckets``), never token by token, the last chunk
sampling its first token; from then on it joins its group's decode steps,
which run all the group's decoding rows at once, padded to a decode bucket.
With ``lookahead`` (default 1) a group's next decode step is sent while its
previous one still runs, unless prompt chunks wait (they would queue behind
it): rows that continue take their input token from the previous step's
sampled tokens on the device, which launches the step behind the running
one (the host never holds the device up between steps); a row that the
previous step ends (end of text, a stop string) has one throw-away token
computed, which is never streamed.
The chunk step and the decode steps are independent plans on the same
devices, so on a split deployment one device computes a chunk while another
computes a decode step.  In ``throughput`` mode the rows form ``groups``
groups each with its own step in flight (a pipeline over the devices); in
``latency`` mode one step carries every row; ``auto`` lets the online
monitor (window W, ratio beta) choose between them at step boundaries.

Faults: when the failure detector reports a node lost, the steps in flight
are dropped, the buckets are re-placed on the survivors, and every running
request is prefilled again from its prompt plus the tokens it already
produced, then continues; nothing already streamed is repeated or lost.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
from typing import AsyncIterator, Callable

from tessera_actors.launch import launcher_for
from tessera_actors.planning.monitor import Monitor
from tessera_actors.serving.batch import Sequence, SlotAllocator, smallest_bucket
from tessera_actors.serving.config import EngineConfig
from tessera_actors.serving.buckets import bucket_name, decode_sizes, window_for
from tessera_actors.serving.deploy import capture_kind, load_served_model
from tessera_actors.serving.gpu_capture import keep_compile_state_in_this_thread
from tessera_actors.serving.params import (EngineBusy, EngineDead, EngineError, InvalidRequest, RequestOutput,
                                           SamplingParams, Usage)
from tessera_actors.serving.deployment import Deployment, StepFailed
from tessera_actors.serving.engine_admit import Admitting
from tessera_actors.serving.engine_replace import Replacing
from tessera_actors.serving.inflight import Formed, Request as _Request, Step as _Step
from tessera_actors.serving.engine_report import Reporting
from tessera_actors.serving.engine_stream import Streaming
from tessera_actors.serving.records import Records
from tessera_actors.serving.text import ChatTemplate, Detokenizer, encode_prompt, gguf_tokenizer

log = logging.getLogger("tessera_actors.serving")


class AsyncEngine(Admitting, Streaming, Reporting, Replacing):
    def __init__(self, model: str = "smollm2", devices: str = "cpu,cpu", nodes=None,
                 config: EngineConfig | None = None, **fields) -> None:
        """``config`` or its fields as keywords (``max_seqs=8``, ...);
        ``nodes`` starts one node process per entry instead of in-process
        devices."""
        if config is None:
            config = EngineConfig(model=model, devices=devices, nodes=tuple(nodes or ()), **fields)
        self.cfg = config
        self.model_name = config.model
        self.max_model_len = config.max_model_len
        self.deployment: Deployment | None = None
        self._requests: dict[str, _Request] = {}
        self._waiting: list[_Request] = []
        self._prefill: list[_Request] = []
        self._catchup: set[str] = set()   # re-prefills after a loss: decode waits until they are done
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._lost: list[str] = []
        self._readmit = False   # a restarted or re-admitted node is registered again: place on it
        self._back: set[str] = set()   # the endpoints of those nodes
        # notified after every re-placement (a node lost, a restarted node re-admitted)
        self.placement_changed = asyncio.Condition()
        self._dead: str | None = None
        self._ids = itertools.count()
        self._order = itertools.count()   # launch order of steps: they land in it
        self.counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "steps": 0,
                         "decode_steps": 0, "prefill_steps": 0, "recoveries": 0, "readmissions": 0,
                         "plan_switches": 0, "lookahead_steps": 0, "pipelined_prompt_steps": 0, "discarded_tokens": 0,
                         "prefix_hits": 0, "prefix_tokens": 0}   # prompts (tokens) found in a kept KV row
        self.groups = 1 if config.mode != "throughput" else config.groups
        self.monitor = Monitor(config.monitor_window_s, config.monitor_beta,
                               initial="throughput" if config.mode == "throughput" else "latency")
        self.tokenizer = None
        self.template = None
        self.slots = SlotAllocator(config.group_bounds(self.groups))
        self._slot_freed = asyncio.Event()   # a KV slot was given back (embeddings wait for one)
        self.step_time: dict[str, list[float]] = {}   # bucket -> [steps, seconds]
        self._outbox: list[tuple] = []   # stream pieces, delivered after the next steps are sent (_emit)
        self._switching = False          # a plan switch waits for the decode steps in flight
        self._progress = {"phase": "stopped", "buckets_placed": 0, "buckets": 0}   # start(): what is done
        self.loop_s = 0.0   # CPU seconds the serving loop itself spent (between its waits)
        self._thread = (None, 0.0)
        self._rows_changed = 0   # counts rows joining decode and requests ending (a step's rows as formed: Formed)

    # -- lifecycle ------------------------------------------------------------
    async def __aenter__(self) -> "AsyncEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self, progress: Callable[[str, int, int], None] | None = None) -> None:
        """Build the model, capture and place the core buckets, start the
        loop; the other buckets are captured and placed in the background.
        ``progress(phase, done, total)`` reports "loading" (the model, once)
        and "placing" (buckets placed of all), also after start returns."""
        self._progress = {"phase": "loading", "buckets_placed": 0, "buckets": 0}
        try:
            await self._start(progress)
        finally:
            if self._loop_task is None:   # it failed
                self._progress["phase"] = "stopped"

    async def _start(self, progress: Callable[[str, int, int], None] | None) -> None:
        def placing(done: int, total: int) -> None:
            self._progress.update(phase="placing" if done < total else "placed", buckets_placed=done, buckets=total)
            if progress is not None:
                progress("placing", done, total)
        if progress is not None:
            progress("loading", 0, 1)
        launcher = launcher_for(self.cfg)
        try:
            if launcher is not None:
                self.cfg.launched = tuple(await launcher.prepare() or ())
            if capture_kind(self.cfg) == "inductor":
                keep_compile_state_in_this_thread()
            served = await asyncio.to_thread(load_served_model, self.cfg, True)
        except BaseException:
            if launcher is not None:
                await launcher.stop()
            raise
        self.served, self.cfg = served, served.cfg   # max_seqs fitted to the KV-cache budget
        self.groups = min(self.groups, self.cfg.max_seqs)
        self.slots = SlotAllocator(self.cfg.group_bounds(self.groups))
        if served.gguf_meta is not None:
            self.tokenizer = gguf_tokenizer(served.gguf_meta)
            tpl = served.gguf_meta.get("tokenizer.chat_template")
            if tpl:
                self.template = ChatTemplate(tpl, self.tokenizer.bos_token, self.tokenizer.eos_token)
        self._records = Records(self.tokenizer, served.vocab_size)
        self.trace = None
        if self.cfg.trace_dir:
            from tessera_actors.serving.trace import StepTrace
            self.trace = StepTrace()
        self.deployment = Deployment(self.cfg, served, self._on_lost, self.trace, launcher, self._on_back, placing)
        try:
            await self.deployment.start()
        except BaseException:
            await self.deployment.stop()
            raise
        self._thread = (threading.get_ident(), time.thread_time())   # the loop's thread, its CPU seconds so far
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        self._progress["phase"] = "stopped"
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self._deliver()
        for req in list(self._requests.values()):
            self._finish(req, "abort")
        if self.deployment is not None:
            await self.deployment.stop()
        self.write_trace()

    # -- requests -----------------------------------------------------------------
    def encode_prompt(self, prompt) -> list[int]:
        """Token ids of ``prompt``: a string as it is, a list of chat messages
        through the model's chat template (:func:`.text.encode_prompt`)."""
        return encode_prompt(prompt, self.template, self.tokenizer, self.served.vocab_size, self.model_name)

    def count_tokens(self, prompt) -> int:
        return len(self.encode_prompt(prompt))

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the reply to ``prompt`` (str or chat messages).  Raises
        ``InvalidRequest`` before any work for a bad request, ``EngineBusy``
        when the waiting queue is full, ``EngineDead`` when no device is left.
        Leaving the iteration early aborts the request and frees its slot."""
        if self._dead:
            raise EngineDead(self._dead)
        if self._loop_task is None or self._loop_task.done():
            raise EngineDead("the engine is not running (use `async with AsyncEngine(...)` or `await start()`)")
        params = (params or SamplingParams()).validate()
        ids = [int(t) for t in prompt] if _is_id_list(prompt) else self.encode_prompt(prompt)
        vocab = self.served.vocab_size
        if vocab and any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"token ids must be in [0, {vocab})", "prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} exceeds the "
                                 f"context of {self.max_model_len} tokens", "max_tokens")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequest(f"request id {rid!r} is already in flight", "request_id")
        if len(self._waiting) >= self.cfg.max_queue:
            raise EngineBusy(f"{len(self._waiting)} requests already wait for a KV slot")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(rid, ids, params, seed, arrival=time.monotonic(), context=list(ids))
        if params.shapes_logits:
            seq.record = self._records.make(params, ids)
        detok = Detokenizer(self.tokenizer, params.stop) if self.tokenizer is not None else None
        req = _Request(seq, detok)
        self._requests[rid] = req
        self._waiting.append(req)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(ids)
        self._wake.set()
        stream = req.out
        try:
            while True:
                waiter = stream.wait()
                if waiter is not None:
                    await waiter
                out = stream.take()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            if req.finished is None:
                self._abort(req)

    async def embed(self, prompt) -> tuple[list[float], int]:
        """(the mean-pooled final hidden state of ``prompt``, its token
        count): :mod:`.embeddings`."""
        from tessera_actors.serving.embeddings import embed
        return await embed(self, prompt)

    async def abort(self, request_id: str) -> bool:
        """Abort a request (its stream ends with finish_reason "abort");
        False when it is not in flight."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._abort(req)
        return True

    def _abort(self, req: _Request) -> None:
        if req.finished is None:
            self._finish(req, "abort")

    def _finish(self, req: _Request, reason: str) -> None:
        """End ``req`` now (abort, shutdown): its stream gets a last piece."""
        req.finished = reason
        self._retire(req)
        req.out.put_nowait(RequestOutput(req.seq.rid, "", [], reason,
                                         Usage(len(req.seq.prompt), len(req.seq.generated))))

    def _retire(self, req: _Request) -> None:
        """Bookkeeping of a request that ended: out of the queues and the
        table; its KV slot freed now, or - while a step in flight still
        writes its row - when that step lands (a new request must not get
        the row before the old step's writes are done)."""
        seq = req.seq
        seq.phase = "done"
        self._rows_changed += 1
        self._catchup.discard(seq.rid)
        for lst in (self._waiting, self._prefill):
            if req in lst:
                lst.remove(req)
        self._requests.pop(seq.rid, None)
        if seq.slot >= 0 and not req.in_step:
            self.slots.release(seq.slot, self._kept(req))
            seq.slot = -1
            self._slot_freed.set()
        self._wake.set()

    def _landed(self, step: _Step) -> None:
        """``step`` finished (or was dropped): its tokens are no longer in
        flight; rows of requests that ended meanwhile free their slots."""
        for req in step.reqs:
            req.in_step -= 1
            if step.key != "prefill":
                req.seq.pending -= 1
            if req.finished is not None and req.seq.slot >= 0 and not req.in_step:
                self.slots.release(req.seq.slot, self._kept(req))
                req.seq.slot = -1
                self._slot_freed.set()
                self._wake.set()

    # -- the loop -------------------------------------------------------------------
    async def _loop(self) -> None:
        inflight: dict[asyncio.Future, _Step] = {}   # steps in flight (tasks, or futures of Deployment.step_soon)
        clock = time.thread_time   # CPU seconds: what a loaded machine or the worker holding the GIL adds is not ours
        t0 = clock()
        try:
            while True:
                if self._lost or self._readmit:
                    await self._recover(inflight)
                    t0 = clock()
                    continue
                self._maybe_switch(inflight)
                self._admit()
                self._launch(inflight)
                self._deliver()   # after the launch: the new steps' messages go out before the streams wake
                self.loop_s += clock() - t0
                if not any(t.done() for t in inflight):
                    self._wake.clear()   # set again by a step that ends (_stepped) or by anything new to do
                    await self._wake.wait()
                t0 = clock()
                for t in sorted((t for t in inflight if t.done()), key=lambda t: inflight[t].order):
                    self._complete(t, inflight.pop(t))
        except asyncio.CancelledError:
            for t in inflight:
                t.cancel()
            raise
        except Exception as e:   # the engine cannot go on: every request gets the error
            log.exception("engine loop failed")
            self._deliver()
            self._dead = f"engine failed: {type(e).__name__}: {e}"
            for req in list(self._requests.values()):
                req.finished = "error"
                req.out.put_nowait(EngineDead(self._dead))
            self._requests.clear()

    def _stepped(self, task: asyncio.Future) -> None:
        self._wake.set()   # the loop takes the steps that ended

    def _group_rows(self) -> list[list[_Request]]:
        rows = [[] for _ in self.slots.bounds]
        group = self.slots.groups
        for req in self._requests.values():
            seq = req.seq
            if seq.phase == "decode":
                rows[group[seq.slot]].append(req)
        return rows

    def _launch(self, inflight: dict[asyncio.Future, _Step]) -> None:
        self._launch_prefill(inflight)
        if self._catchup:
            return
        for g, rows in enumerate(self._group_rows()):
            key = f"decode{g}"
            while True:   # the group's next step, and (lookahead) the one after it
                ahead = [s for s in inflight.values() if s.key == key]
                if len(ahead) > self.cfg.lookahead:
                    break
                step = self._decode_step(g, key, rows, ahead[-1] if ahead else None)
                if step is None:
                    break
                task, info = step
                inflight[task] = info

    def _decode_step(self, g: int, key: str, rows: list[_Request], prev: _Step | None):
        """(task, step) of group ``g``'s next decode step, or None; ``prev``:
        the group's latest step in flight, whose sampled tokens the rows it
        carries take on the device (possible only on the same plan, when its
        tokens can feed the next step there)."""
        limit = self.max_model_len
        if self._switching:
            return None   # a plan switch waits for every decode step in flight to land: none starts meanwhile
        if prev is not None and (prev.number is None or prev.generation != self.deployment.generation
                                 or self._prefill):
            return None   # (a step ahead waits while prompt chunks do: it would queue before them on the device)
        formed = self._continued(prev) or self._form(rows, limit)
        if formed is None or (prev is not None and formed.needs_tokens):
            return None   # (penalties and JSON masks are computed from the tokens so far)
        reqs, seqs, last, top = formed.reqs, formed.seqs, formed.end - 1, formed.top
        lo, hi = self.slots.bounds[g]
        size = smallest_bucket(decode_sizes(self.cfg, hi - lo), top - lo + 1)
        bucket = self.deployment.runnable(bucket_name("decode", size, lo, window_for(self.cfg, last)), (lo, hi))
        if prev is not None and bucket != prev.bucket:
            return None   # a different plan: wait for the tokens
        number, step_rows, feeds = self.deployment.decode_rows(bucket, seqs, lo, limit - 1,
                                                               prev.number if formed.continues else None)
        task = self.deployment.step_soon(bucket, formed.rids, number, step_rows)   # (a future)
        task.add_done_callback(self._stepped)
        for r in reqs:
            r.in_step += 1
            r.seq.pending += 1
        if prev is not None:
            self.counters["lookahead_steps"] += 1
        return task, _Step(key, reqs, [], bucket, self.deployment.generation, next(self._order),
                           number if feeds and self.cfg.lookahead else None, formed)

    def _form(self, rows: list[_Request], limit: int) -> Formed | None:
        """The rows of a group's next decode step: those whose tokens in
        flight leave room under ``max_tokens`` and below the context's last
        position (every row, every step that does not continue the rows of
        the one before); None when there are none."""
        reqs, seqs, end, top, horizon = [], [], 0, 0, limit
        needs_tokens = False
        for r in rows:
            s = r.seq
            n = len(s.generated) + s.pending
            at = len(s.prompt) + n
            if r.finished is None and n < s.params.max_tokens and at < limit:
                reqs.append(r)
                seqs.append(s)
                end, top = max(end, at), max(top, s.slot)
                horizon = min(horizon, s.params.max_tokens - n, limit - at)
                if s.record is not None and s.record.needs_tokens:
                    needs_tokens = True
        if not reqs:
            return None
        return Formed(self._rows_changed, self.slots.bounds, reqs, seqs, [s.rid for s in seqs], end, top,
                      horizon - 1, needs_tokens)

    def _continued(self, prev: _Step | None) -> Formed | None:
        """``prev``'s rows, one position on, when the group's next step can
        take them as they are: no row joined decode or ended since (every
        request that ends is retired: ``_rows_changed``), the groups are
        the same, no row's record needs the tokens so far, and every row can
        take one more step."""
        f = prev.formed if prev is not None else None
        if (f is None or f.changes != self._rows_changed or f.bounds is not self.slots.bounds or f.horizon < 1
                or f.needs_tokens):
            return None
        return Formed(f.changes, f.bounds, f.reqs, f.seqs, f.rids, f.end + 1, f.top, f.horizon - 1, continues=True)

    def _complete(self, task: asyncio.Future, info: _Step) -> None:
        key, reqs, n, bucket, generation = info.key, info.reqs, info.chunk, info.bucket, info.generation
        try:
            result = task.result()
        except BaseException as e:
            self._landed(info)   # (a decode step that ran lands its rows as it accepts their tokens)
            if isinstance(e, asyncio.CancelledError):
                return
            if not isinstance(e, StepFailed):
                raise
            if self._lost or generation != self.deployment.generation:
                return   # a loss is pending, or the step belonged to a placement since replaced: recovery redoes it
            self.deployment.restart_rows(bucket)
            log.warning("%s", e, exc_info=e)   # the device's own traceback rides the cause chain (in-process)
            self._lost_or_fail(reqs, e)
            return
        self.counters["steps"] += 1
        acc = self.step_time.setdefault(bucket, [0, 0.0])
        acc[0] += 1
        acc[1] += result.seconds
        self.counters["prefill_steps" if key == "prefill" else "decode_steps"] += 1
        if key == "prefill":
            self._landed(info)
            entry = 0   # the step's sampled entries: one per sequence whose prompt it ended, in row order
            for req, m in zip(reqs, n):
                seq = req.seq
                ends = seq.prefilled + m == len(seq.context)
                if req.finished is not None:
                    entry += ends
                    continue
                seq.prefilled += m
                seq.exec_s += result.seconds
                if not ends:
                    continue
                self._prefill.remove(req)
                self._catchup.discard(seq.rid)
                seq.phase = "decode"
                self._rows_changed += 1
                self._accept(req, result.tokens[entry], result.logprobs[entry], result.top(entry))
                entry += 1
            return
        self._accept_step(reqs, result)   # (the rows land there)

    def _lost_or_fail(self, reqs: list[_Request], err: Exception) -> None:
        for req in reqs:
            if req.finished is None:
                req.finished = "error"
                self._finish_error(req, EngineError(str(err)))

    def _finish_error(self, req: _Request, err: Exception) -> None:
        self._retire(req)
        req.out.put_nowait(err)


def _is_id_list(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                       for t in prompt)
