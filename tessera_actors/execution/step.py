"""One device's share of one step: the one step path of the execution core.

:class:`DeviceStep` is a plan's program on one device, made once at install:
its blocks of kernels, the views of every transfer it sends or receives,
its outputs, the inputs it reads.  :meth:`DeviceStep.begin` starts a step
(a :class:`StepRun`); the device actor then drives it:

* :meth:`StepRun.advance` (on the device's worker thread) writes what was
  staged, runs blocks of kernels and their sends, takes receives from
  co-located peers in place, and returns a :class:`Progress`: either the
  receive the event loop must wait for (``waiting``), or ``done``: the
  program ended, the step's tokens were sampled on the device and their
  copy to host memory is queued behind an event (``landing``);
* :meth:`StepRun.stage` and :meth:`StepRun.received` (on the loop) keep
  the received bytes for the next ``advance``;
* :meth:`StepRun.landed` (after ``landing`` completed) gives the answer.

Where the device that samples a decode step is not the one that reads
``input_ids`` (a split plan: the embedding on one device, the LM head on
another), the sampler hands the landed step's tokens (or its failure) to
the reader thread to thread (``TOKENS``, :meth:`DeviceStep.hand_tokens`),
so the next step needs no host round trip and the engine can send it
before this one lands.  The reader waits for them as for a hand-off: on
its worker while nothing else wants it, then on its loop (``Progress``
waiting on a :class:`TokensWanted`).

A step without transfers or outputs is one ``advance`` call that is done at
once: the device actor may then *launch* the next step behind it before this
one has landed (decode lookahead) - the same code, not a second path.

A decode step names its rows as a change of the plan's previous step
(``RunStep.rows``): positions, input tokens and sampling parameters are
kept on the device (:mod:`.rows`); inputs go up and tokens come down
through pinned memory made once per plan (:mod:`.hostbuf`).

A GPU that streams weights reads what a co-located CPU hands it straight
from pinned host memory with its SMs (:mod:`.mapped`): its copy engine is
busy with the weights.  Sends go out through callables the actor passes
(``send``: a co-located peer's hand-off or the transfer actor), so tests
drive a step with plain dicts.  Blocking: ``advance`` and ``landed`` run torch work on the calling
thread (the actor's worker); nothing here is thread-safe.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from tessera_actors.execution.held import kept_tensors
from tessera_actors.execution.hostbuf import Landings, Uploads
from tessera_actors.execution.inputs import chunk_inputs, write_inputs
from tessera_actors.execution.mapped import MappedWriter
from tessera_actors.execution.probe import Probe
from tessera_actors.execution.program import AtenProgram, BackendError
from tessera_actors.execution.rows import PlanRows
from tessera_actors.execution.sampling import SampleBatch, as_sample_row
from tessera_actors.execution.sampling_extras import pack, unpack
from tessera_actors.execution.segments import SegmentRunner
from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan, program_blocks, token_devices

AHEAD = 2   # steps of one plan launched and not yet answered, at most (the device actor's launch-ahead)
TOKENS = "tokens"   # the hand-off tag of a decode step's sampled tokens, between co-located devices


@dataclass
class SampledTokens:
    """A landed step's sampled token ids, handed to the co-located device
    that reads ``input_ids``: ``host`` is :func:`~.sampling_extras.pack`'s
    tensor in host memory (ids in its first row); ``why``: instead, why
    there are none (the sampling device's step failed)."""
    host: torch.Tensor | None = None
    why: str = ""

    def ids(self) -> torch.Tensor:
        if self.host is None:
            raise BackendError(self.why)
        return self.host[0].to(torch.int64)


@dataclass
class PeerFailed:
    """In place of a hand-off's bytes: the co-located device sending them failed the step."""
    why: str


def received(data):
    """A hand-off's bytes as taken; ``BackendError`` when the sender failed instead."""
    if isinstance(data, PeerFailed):
        raise BackendError(data.why)
    return data


@dataclass
class TokensWanted:
    """What :meth:`StepRun.advance` waits for on the event loop when the
    tokens its rows continue from have not come: hand-off ``key``."""
    key: tuple
    base: int


@dataclass
class Progress:
    """What one ``advance`` did.  ``waiting``: the plan transfer the event
    loop must receive before the next ``advance`` (None when ``done``);
    ``ship``: ``(tag, bytes)`` for the transfer actor; ``busy``: host seconds
    spent on the worker, ``waited``: of them, waiting for co-located peers."""
    done: bool
    waiting: Any = None
    ship: list = field(default_factory=list)
    busy: float = 0.0
    waited: float = 0.0


@dataclass
class Landed:
    """The device's answer to a step: sampled tokens and their log
    probabilities, output byte ranges and their bytes, trace spans, and each
    sampled entry's top log probabilities when its record asked for them."""
    tokens: list
    logprobs: list
    outputs: list
    data: list
    spans: list
    top_logprobs: list = field(default_factory=list)


class DeviceStep:
    def __init__(self, plan_id: str, graph: KernelGraph, plan: Plan, device: int, prog: AtenProgram,
                 runner: SegmentRunner, peers: dict) -> None:
        """``peers``: plan device -> hand-off of the co-located device actors;
        a transfer to or from one of them crosses PCIe when one side is a GPU
        and the other not, and then leaves in pinned host memory."""
        self.plan_id, self.graph, self.plan, self.device = plan_id, graph, plan, device
        self.prog, self.runner, self.peers = prog, runner, peers
        here = plan.devices[device].startswith("cuda")
        self.transfers = {t.tag: t for t in plan.transfers}
        self.readers, self.writers = {}, {}
        self.mapped: list[MappedWriter] = []   # writers whose bytes the GPU's SMs read from pinned host memory
        streams = bool(getattr(prog, "streamed", None))
        for t in plan.transfers:
            if t.src == device:
                crosses = t.dst in peers and plan.devices[t.dst].startswith("cuda") != here
                self.readers[t.tag] = prog.reader(t.buffer, t.ranges, pinned=crosses)
            if t.dst == device:
                self.writers[t.tag] = prog.writer(t.buffer, t.ranges)
                if here and streams and t.src in peers and not plan.devices[t.src].startswith("cuda"):
                    # pinned bytes from a co-located CPU: read by the SMs, not queued behind weight copies
                    self.writers[t.tag] = MappedWriter(prog.arena[t.buffer], t.ranges, self.writers[t.tag])
                    self.mapped.append(self.writers[t.tag])
        self.blocks = program_blocks(plan, device)
        self.program = plan.programs[device]
        self.outputs = [(b, s, e, prog.reader(b, [(s, e)])) for b, s, e, dev in plan.outputs if dev == device]
        self.feed = plan.inputs[device]
        logits = graph.meta["output_views"][0] if graph.meta.get("output_views") else None
        self.logits = logits
        self.holds_logits = logits is not None and any(b == logits[0] and dev == device
                                                       for b, _, _, dev in plan.outputs)
        self.sampled: tuple[int, torch.Tensor] | None = None   # (step, its token ids on the device)
        # a decode step's tokens between co-located devices: where another device reads input_ids, the one
        # that samples hands it each step's tokens (``tokens_to``: that reader's hand-off), and the reader's
        # rows take them from its own (``tokens_from``), so the engine may launch the next step ahead
        pair = token_devices(graph, plan)
        reader, holder = pair if pair is not None and pair[0] != pair[1] else (None, None)
        self.tokens_to = peers.get(reader) if device == holder else None
        self.tokens_from = device == reader and holder in peers
        self.only_kernels = all(st.op == "run" for st in self.program)
        # made once: the pinned memory inputs go up and tokens come down through, the decode rows kept here
        self.uploads = Uploads(runner.device, runner.backend, runner.compute)
        self.landings = Landings(runner.device, AHEAD + 1)
        self.rows: PlanRows | None = None
        self.logits_view: torch.Tensor | None = None
        # the argmax and log-sum-exp the graph computes beside the logits (a GPU bucket's), when they end here
        views = graph.meta.get("output_views") or []
        here = {b for b, _, _, dev in plan.outputs if dev == device}
        self.greedy_refs = [views[i] for i in graph.meta.get("greedy_outputs") or ()]
        if not self.holds_logits or any(ref[0] not in here for ref in self.greedy_refs):
            self.greedy_refs = []
        self.greedy_views: tuple[torch.Tensor, torch.Tensor] | None = None
        self.threads: int | None = None   # the intra-op threads of this plan's steps (None: as they are)
        self.probe: Probe | None = None   # made at the first probed step (``RunStep.probe``), kept after

    def probe_for(self, msg) -> Probe | None:
        """The device's probe when ``msg`` is probed (numbered for its step), else None."""
        if not getattr(msg, "probe", False):
            return None
        if self.probe is None:
            self.probe = Probe(self.runner.backend, self.device)
        self.probe.step = msg.step
        return self.probe

    def local(self, msg) -> bool:
        """Whether a step may be launched ahead: this device's program runs
        kernels only, and the step wants no output bytes from it and no trace."""
        if msg.trace or not self.only_kernels:
            return False
        return not (msg.outputs and self.outputs)

    def samples(self, msg) -> bool:
        """Whether this device samples ``msg``: it asks for tokens and the
        logits (the graph's first output) end here."""
        return (bool(msg.sample) or msg.rows is not None) and self.holds_logits

    def hand_tokens(self, msg, run: "StepRun | None", err: BaseException | None = None) -> None:
        """Step ``msg`` landed here (``run``) or failed (``err``): hand its
        tokens, or the failure, to the co-located device that reads
        ``input_ids`` (none: this device does, or samples nothing)."""
        if self.tokens_to is None or msg.rows is None:
            return
        got = SampledTokens(run.host) if err is None and run is not None and run.host is not None else \
            SampledTokens(why=f"the tokens of step {msg.step} were not sampled: "
                              f"{type(err).__name__ if err else 'no sampling'}: {err or ''}")
        self.tokens_to.put((self.plan_id, TOKENS, msg.step), got)

    def failed(self, msg, err: BaseException) -> None:
        """Step ``msg`` failed here: the co-located devices waiting for its
        hand-offs or its tokens learn so at once (else they would wait out
        their receive timeout)."""
        why = f"device {self.device} ({self.plan.devices[self.device]}) failed step {msg.step}: " \
              f"{type(err).__name__}: {err}"
        for t in self.plan.transfers:
            peer = self.peers.get(t.dst) if t.src == self.device else None
            if peer is not None:
                peer.put((self.plan_id, msg.step, t.tag), PeerFailed(why))
        self.hand_tokens(msg, None, err)

    def plan_rows(self) -> PlanRows:
        """The decode rows kept on this device (made at the first step that names them)."""
        if self.rows is None:
            self.rows = PlanRows(self.graph, self.prog, self.feed, self.holds_logits, self.uploads)
        return self.rows

    def kept(self) -> Iterator[torch.Tensor]:
        """The tensors this plan's steps keep here from step to step (the
        decode rows, their sampling batch, the ids sampled last), device or
        host: :mod:`.held` counts those on the device."""
        yield from kept_tensors(self.rows)
        if self.rows is not None:
            yield from kept_tensors(self.rows.batch)
        if self.sampled is not None:
            yield self.sampled[1]

    def begin(self, msg, handoff, spin: float = 0.0, busy_elsewhere: Callable[[], bool] = lambda: False
              ) -> "StepRun":
        return StepRun(self, msg, handoff, spin, busy_elsewhere)


class StepRun:
    """One step of one :class:`DeviceStep` in progress (module docstring)."""

    def __init__(self, step: DeviceStep, msg, handoff, spin: float, busy_elsewhere: Callable[[], bool]) -> None:
        self.step, self.msg, self.handoff = step, msg, handoff
        self.spin = 0.0 if msg.trace else spin   # a traced step records every worker call and receive
        self.busy_elsewhere = busy_elsewhere
        self.i = 0
        self.staged: list[tuple[int, list, Any, Callable | None]] = []
        self.prelude = self._inputs_writer()
        self.spans: list | None = [] if msg.trace else None
        self.landing: Any = None      # the event behind the step's work (None: done when queued, CPU)
        self.host: torch.Tensor | None = None   # sampled ids and log probabilities, in host memory
        self.data: list = []
        self.busy = self.waited = 0.0
        self.kernel_s = 0.0           # of ``busy``: inside the runs of kernels (a CPU computes there)
        self.kernel_cpu = 0.0         # the worker thread's CPU seconds in them
        self.host_s = 0.0             # its CPU seconds on the step outside them: the step path's own work
        self.counts = {"replays": 0, "eager_runs": 0, "capture_failures": 0}   # of this step's runs here
        self.probe = step.probe_for(msg)
        self.began: float | None = None   # probed: when the first call started
        self.tokens: tuple[int, torch.Tensor] | None = None   # (step, ids) another device sampled (``wanted``)

    def stage(self, buffer: int, ranges: list, data: Any, write: Callable | None = None) -> None:
        """Received bytes (a whole transfer, or one span of it) the next
        :meth:`advance` writes before its kernels (``write``: the
        transfer's writer, for a whole one; else into ``ranges``)."""
        self.staged.append((buffer, ranges, data, write))

    def received(self) -> None:
        """The receive :meth:`advance` stopped at has all its bytes staged."""
        self.i += 1

    def advance(self) -> Progress:
        """On the worker: from the current program step on, until the
        program ends (then the step is finished here: sampling, outputs,
        the landing event) or a receive must wait on the event loop."""
        st, msg = self.step, self.msg
        t0 = time.perf_counter()
        c0, k0 = time.thread_time(), self.kernel_cpu
        waited = 0.0
        ship: list = []
        if st.threads is not None and torch.get_num_threads() != st.threads:
            torch.set_num_threads(st.threads)   # on a CPU: a prompt chunk's count, or a decode step's
        probe = self.probe
        if self.began is None:
            self.began = t0
            if hasattr(st.prog, "probe"):   # a streaming program records its copies in this step's probe
                st.prog.probe = probe
        if self.prelude is not None:
            want = self._take_tokens()
            if want is not None:   # the sampling device has not landed them: wait on the loop
                busy = time.perf_counter() - t0
                self.busy += busy
                return Progress(False, want, [], busy, 0.0)
            self.prelude()
            self.prelude = None
        if self.staged:
            self._write_staged()
        program, key = st.program, (st.plan_id, msg.step)
        before = [st.runner.counts[k] for k in self.counts]
        while self.i < len(program):
            op = program[self.i]
            if op.op == "recv":
                t = st.transfers[op.ref]
                if t.src not in st.peers or self.spin <= 0:
                    break
                w0 = time.perf_counter()
                data = self.handoff.take((*key, t.tag), self.spin, self.busy_elsewhere)
                waited += time.perf_counter() - w0
                if not self._took(t, data, w0):
                    break   # the peer is slow: wait on the loop, the worker stays free meanwhile
                self.i += 1
                continue
            self._block(ship)
        for k, b in zip(self.counts, before):
            self.counts[k] += st.runner.counts[k] - b
        busy = time.perf_counter() - t0 - waited
        self.busy += busy
        self.waited += waited
        if self.i < len(program):
            self.host_s += time.thread_time() - c0 - (self.kernel_cpu - k0)
            return Progress(False, st.transfers[program[self.i].ref], ship, busy, waited)
        t1 = time.perf_counter()
        self._finish()
        if probe is not None:
            probe.add("step", f"step {msg.step}", self.began, probe.mark(st.runner.compute))
        busy += time.perf_counter() - t1
        self.busy += time.perf_counter() - t1
        self.host_s += time.thread_time() - c0 - (self.kernel_cpu - k0)
        return Progress(True, None, ship, busy, waited)

    def _took(self, t, data, w0: float) -> bool:
        """Write the bytes of hand-off ``t`` taken on the worker (``data``;
        None: not there, False); probed, the wait since ``w0`` and the write
        are recorded."""
        st, probe = self.step, self.probe
        if probe is not None:
            probe.add("wait", f"wait {t.tag}", w0, time.perf_counter(), tag=t.tag, src=t.src, on="worker",
                      got=data is not None)
        if data is None:
            return False
        s0 = probe.mark(st.runner.compute) if probe is not None else None
        st.writers[t.tag](received(data))
        if probe is not None:
            probe.add("recv", f"recv {t.tag}", s0, probe.mark(st.runner.compute), tag=t.tag, bytes=t.nbytes)
        return True

    def _write_staged(self) -> None:
        """Write the bytes received on the loop (probed: each between two stamps)."""
        st, probe = self.step, self.probe
        for buffer, ranges, data, write in self.staged:
            s0 = probe.mark(st.runner.compute) if probe is not None else None
            if write is not None:
                write(data)
            else:
                st.prog.write(buffer, ranges, data)
            if probe is not None:
                probe.add("recv", f"recv b{buffer}", s0, probe.mark(st.runner.compute), buffer=buffer)
        self.staged = []

    def _block(self, ship: list) -> None:
        """Program step ``i`` (a run): its block of kernels, then its sends."""
        st, probe = self.step, self.probe
        b0 = time.time()
        j, kernels, sends = st.blocks[self.i]
        if kernels:
            k0, c0 = time.perf_counter(), time.thread_time()
            st.runner.run((st.plan_id, self.i), st.prog, kernels, probe)
            self.kernel_s += time.perf_counter() - k0
            self.kernel_cpu += time.thread_time() - c0
        r0 = time.perf_counter() if probe is not None else 0.0
        out = st.runner.read([st.readers[tag] for tag in sends]) if sends else []   # settled: peers may read them
        if probe is not None and sends:
            probe.add("send", f"send {','.join(map(str, sends))}", r0, time.perf_counter(), tags=list(sends))
        for tag, data in zip(sends, out):
            peer = st.peers.get(st.transfers[tag].dst)
            if peer is not None:
                peer.put((st.plan_id, self.msg.step, tag), data)
            else:
                ship.append((tag, data))
        if self.spans is not None:
            label = f"run k{kernels[0]}-k{kernels[-1]}" if kernels else "stage"
            sent = sum(st.transfers[tag].nbytes for tag in sends)
            self.spans.append([label + (f", send {len(sends)} ({sent} B)" if sends else ""), b0, time.time()])
        self.i = j

    def _finish(self) -> None:
        """The program ended: sample here (tokens queued to host memory),
        read the outputs, record the event the step lands on."""
        st, msg = self.step, self.msg
        runner = st.runner
        if st.samples(msg):
            s0 = time.time()
            if st.logits_view is None:
                st.logits_view = st.prog.view(st.logits)   # the arena never moves: one view for every step
            logits = st.logits_view
            if st.greedy_refs and st.greedy_views is None:
                st.greedy_views = tuple(st.prog.view(ref) for ref in st.greedy_refs)
            if msg.rows is not None:
                ids, lps, top = st.plan_rows().sample(logits, msg.rows.records, st.greedy_views)
            else:
                ids, lps, top = SampleBatch([as_sample_row(e) for e in msg.sample], logits.device,
                                            st.uploads.put).sample(logits, (), st.greedy_views)
            st.sampled = (msg.step, ids)
            self.host = st.landings.land(pack(ids, lps, top))   # one copy: ids, log probabilities, top ones
            if self.spans is not None:
                self.spans.append([f"sample {len(ids)} rows", s0, time.time()])
        if msg.outputs and st.outputs:
            self.data = runner.read([r for *_, r in st.outputs])
        self.landing = runner.backend.record(runner.compute)

    def landed(self) -> Landed:
        """The answer, once ``landing`` completed (the host copy is settled)."""
        tokens, logprobs, top = unpack(self.host) if self.host is not None else ([], [], [])
        outs = [[b, s, e] for b, s, e, _ in self.step.outputs] if self.msg.outputs else []
        return Landed(tokens, logprobs, outs, self.data, self.spans or [], top)

    def wanted(self) -> TokensWanted | None:
        """The tokens this step's rows continue from, when another device
        samples them and they have not been taken yet (None: none needed)."""
        st, rows = self.step, self.msg.rows
        if not st.tokens_from or rows is None or self.tokens is not None or rows.base < 0 or rows.tokens:
            return None
        new = {int(e.row) for e in rows.new}
        order = rows.order if rows.order is not None else st.plan_rows().order
        if all(r in new for r in order):
            return None   # every row starts here: the engine gave their tokens
        return TokensWanted((st.plan_id, TOKENS, rows.base), rows.base)

    def got_tokens(self, want: TokensWanted, got: SampledTokens) -> None:
        """The tokens ``want`` named arrived (taken on the worker, or on the loop)."""
        self.tokens = (want.base, got.ids())

    def _take_tokens(self) -> TokensWanted | None:
        """On the worker, before the inputs are written: the tokens the rows
        continue from, waited for as a hand-off is (up to ``spin`` while no
        other work wants the thread); what is still wanted (None: nothing)."""
        want = self.wanted()
        if want is None:
            return None
        w0 = time.perf_counter()
        got = self.handoff.take(want.key, self.spin, self.busy_elsewhere) if self.spin > 0 else None
        if self.probe is not None:
            self.probe.add("wait", f"wait tokens {want.base}", w0, time.perf_counter(), tag=TOKENS, on="worker",
                           got=got is not None)
        if got is None:
            return want
        self.got_tokens(want, got)
        return None

    def _inputs_writer(self) -> Callable[[], None] | None:
        """The worker-side writing of the step's inputs (None: this device
        reads none): the tensors of ``inputs``, and a decode step's rows
        (:mod:`.rows`) or a prompt chunk's (``RunStep.chunk``)."""
        st, msg = self.step, self.msg
        if msg.rows is not None:
            def write() -> None:
                if msg.inputs:
                    write_inputs(st.prog, st.graph, msg.inputs, st.feed, st.uploads, partial=True)
                st.plan_rows().apply(msg.step, msg.rows, self.tokens if st.tokens_from else st.sampled)
                if st.tokens_from:   # tokens of earlier steps that no step took (their rows ended or were given)
                    base = msg.rows.base
                    self.handoff.prune(st.plan_id, TOKENS, base if base >= 0 else msg.step - 1)
            return write
        if st.feed and msg.chunk is not None:
            return lambda: write_inputs(st.prog, st.graph, {**msg.inputs, **chunk_inputs(msg.chunk)}, st.feed,
                                        st.uploads)
        if st.feed:
            return lambda: write_inputs(st.prog, st.graph, msg.inputs, st.feed, st.uploads)
        return None


__all__ = ["DeviceStep", "Landed", "Progress", "StepRun"]
