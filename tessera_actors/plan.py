"""Plans: kernel -> device, and for each device an ordered program of steps.

Pure functions over a :class:`KernelGraph`; no actors, no torch.

A *segment* is a maximal run of consecutive kernels (program order) on one
device: the unit a device runs at once.  Each device executes its program in
order: ``Recv`` blocks until the bytes arrived, ``Run`` runs a segment,
``Send`` ships bytes without waiting.  Because segments appear in global
program order on every device and every ``Recv`` follows its producer in that
order, a plan built here cannot deadlock, and every RAW edge that crosses
devices is covered by exactly one transfer (per producer, consumer device and
buffer).  Same-device WAR/WAW edges hold by program order; across devices each
device owns a private copy of every buffer it touches, so they impose nothing.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from tessera_actors.graph import KernelGraph, _IntervalMap, _merge


class PlanError(ValueError):
    """An assignment that violates a placement rule, or an infeasible request."""


@dataclass(frozen=True)
class Segment:
    id: int
    device: int
    kernels: tuple[int, ...]


@dataclass(frozen=True)
class Transfer:
    """Bytes ``ranges`` of ``buffer`` produced by ``src_segment`` on ``src``
    and needed by ``dst_segment`` (its first consumer) on ``dst``."""

    tag: int
    src: int
    dst: int
    buffer: int
    ranges: tuple[tuple[int, int], ...]
    src_segment: int
    dst_segment: int

    @property
    def nbytes(self) -> int:
        return sum(e - s for s, e in self.ranges)


@dataclass(frozen=True)
class Step:
    """One program step: ``op`` is ``run`` (``ref`` = segment id), ``send``
    or ``recv`` (``ref`` = transfer tag)."""

    op: str
    ref: int


@dataclass
class Plan:
    name: str
    devices: list[str]
    assignment: list[int]
    segments: list[Segment]
    transfers: list[Transfer]
    programs: list[list[Step]]
    resident: list[list[int]]                 # buffers each device holds
    inputs: list[list[int]]                   # input buffers each device must be fed per step
    outputs: list[tuple[int, int, int, int]]  # (buffer, start, end, device) where final bytes live
    mode: str = "latency"
    microbatches: int = 1
    predicted_step_s: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def bytes_per_step(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def kernels_per_device(self) -> list[int]:
        counts = [0] * len(self.devices)
        for d in self.assignment:
            counts[d] += 1
        return counts

    def resident_bytes(self, graph: KernelGraph) -> list[int]:
        return [sum(graph.buffers[b].nbytes for b in bufs) for bufs in self.resident]

    def describe(self, graph: KernelGraph) -> str:
        lines = [f"plan {self.name!r} ({self.mode}, {self.microbatches} micro-batch(es)): "
                 f"{len(self.segments)} segments, {len(self.transfers)} transfers, "
                 f"{self.bytes_per_step()} bytes moved per step"]
        res = self.resident_bytes(graph)
        for d, dev in enumerate(self.devices):
            segs = [s for s in self.segments if s.device == d]
            lines.append(f"  {dev:<24} {self.kernels_per_device()[d]:>5} kernels in {len(segs):>3} segments, "
                         f"{res[d] / 2**20:9.2f} MiB resident")
        return "\n".join(lines)


class Planner(Protocol):
    """Anything that turns a graph and devices into a plan."""

    def plan(self, graph: KernelGraph, devices: Sequence[str], mode: str = "latency") -> Plan: ...


def validate_assignment(graph: KernelGraph, assignment: Sequence[int], ndev: int) -> None:
    """Raise :class:`PlanError` unless every kernel has a device and every
    state group and every indirect kernel's neighbourhood stays together."""
    if len(assignment) != len(graph.kernels):
        raise PlanError(f"assignment has {len(assignment)} entries for {len(graph.kernels)} kernels")
    for k, d in enumerate(assignment):
        if not 0 <= d < ndev:
            raise PlanError(f"kernel {k} assigned to device {d}, only {ndev} devices")
    for group in graph.state_groups():
        devs = {assignment[k] for k in group}
        if len(devs) > 1:
            raise PlanError(f"kernels {group[:4]}... share a state buffer but are split over devices {sorted(devs)}")
    for k in graph.kernels:
        if k.indirect:
            for n in (k.id - 1, k.id + 1):
                if 0 <= n < len(assignment) and assignment[n] != assignment[k.id]:
                    raise PlanError(f"indirect kernel {k.id} ({k.name}) separated from neighbour {n}")


def check_device_types(graph: KernelGraph, devices: Sequence[str], assignment: Sequence[int]) -> None:
    """Raise :class:`PlanError` when a kernel that only one device type has
    (``devices.other_device_op``: torch's CPU int4/int8 matmuls of quantized
    weights, the CPU's fused attention, cuDNN) is assigned to a device of
    another type; names that are not device specs are not checked."""
    from tessera_actors.devices import DeviceSpec, DeviceSpecError, other_device_op
    kinds: list[str | None] = []
    for d in devices:
        try:
            kinds.append(DeviceSpec.parse(d).kind)
        except DeviceSpecError:
            kinds.append(None)
    owner = {name: other_device_op(name, "") for name in {k.name for k in graph.kernels}}
    wrong: dict[tuple[str, int], list[int]] = {}
    for k in graph.kernels:
        d = assignment[k.id]
        need = owner[k.name]
        if need is not None and kinds[d] not in (None, need):
            wrong.setdefault((k.name, d), []).append(k.id)
    if wrong:
        (name, d), ks = next(iter(wrong.items()))
        raise PlanError(f"{sum(map(len, wrong.values()))} kernels run on {owner[name]} devices only and are "
                        f"assigned elsewhere: {len(ks)} x {name} (kernels {ks[:3]}...) on {devices[d]}, which has "
                        f"no such kernel: place them on a {owner[name]} device (quantized weights: torch's CPU "
                        f"int4/int8 kernels), or capture the graph without them")


def final_writes(graph: KernelGraph, buffer_ids: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """For each buffer, the byte ranges and the kernel that wrote them last:
    ``(buffer, start, end, kernel)``; ranges never written are omitted."""
    wanted = set(buffer_ids)
    maps: dict[int, _IntervalMap] = {b: _IntervalMap(graph.buffers[b].nbytes) for b in wanted}
    for k in graph.kernels:
        for a in k.accesses:
            if a.buffer in wanted and a.writes and a.end > a.start:
                for seg in maps[a.buffer].overlapping(a.start, a.end):
                    seg[2] = k.id
    out = []
    for b in buffer_ids:
        for s, e, w, _ in maps[b].segs:
            if w is not None and e <= graph.buffers[b].nbytes:
                out.append((b, s, e, w))
    return out


def build_plan(graph: KernelGraph, devices: Sequence[str], assignment: Sequence[int],
               name: str = "plan", mode: str = "latency", microbatches: int = 1,
               breaks: Sequence[int] = ()) -> Plan:
    """Segments, transfers and per-device programs for an assignment.
    ``breaks``: kernels that start a new segment even on the same device
    (finer units for interleaving several slots on one device's stream)."""
    ndev = len(devices)
    validate_assignment(graph, assignment, ndev)
    check_device_types(graph, devices, assignment)
    runs: list[tuple[int, list[int]]] = []      # (device, kernels) of every segment
    seg_of = [0] * len(graph.kernels)
    cut = set(breaks)
    for k, d in enumerate(assignment):
        if not runs or runs[-1][0] != d or k in cut:
            runs.append((d, []))
        runs[-1][1].append(k)
        seg_of[k] = len(runs) - 1
    segments = [Segment(i, d, tuple(ks)) for i, (d, ks) in enumerate(runs)]
    # One transfer per (producer kernel, consumer device, buffer); placed
    # before the first consuming segment.
    need: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    first: dict[tuple[int, int, int], int] = {}
    for e in graph.edges:
        if e.kind != "RAW" or assignment[e.src] == assignment[e.dst]:
            continue
        key = (e.src, assignment[e.dst], e.buffer)
        need[key].extend(e.ranges)
        first[key] = min(first.get(key, seg_of[e.dst]), seg_of[e.dst])
    transfers = [Transfer(i, assignment[src], dd, buf, tuple(_merge(need[(src, dd, buf)])),
                          seg_of[src], first[(src, dd, buf)])
                 for i, (src, dd, buf) in enumerate(sorted(need, key=lambda k: (seg_of[k[0]], k)))]
    sends: dict[int, list[int]] = defaultdict(list)
    recvs: dict[int, list[int]] = defaultdict(list)
    for t in transfers:
        sends[t.src_segment].append(t.tag)
        recvs[t.dst_segment].append(t.tag)
    programs: list[list[Step]] = [[] for _ in range(ndev)]
    for s in segments:
        prog = programs[s.device]
        prog.extend(Step("recv", t) for t in recvs[s.id])
        prog.append(Step("run", s.id))
        prog.extend(Step("send", t) for t in sends[s.id])
    resident: list[set[int]] = [set() for _ in range(ndev)]
    feed: list[set[int]] = [set() for _ in range(ndev)]
    for k in graph.kernels:
        d = assignment[k.id]
        for a in k.accesses:
            resident[d].add(a.buffer)
            if graph.buffers[a.buffer].role == "input":
                feed[d].add(a.buffer)
    for t in transfers:
        resident[t.dst].add(t.buffer)
    outputs = [(b, s, e, assignment[k]) for b, s, e, k in final_writes(graph, graph.outputs)]
    return Plan(name, list(devices), list(assignment), segments, transfers, programs,
                [sorted(r) for r in resident], [sorted(f) for f in feed], outputs,
                mode=mode, microbatches=microbatches)


def legal_cuts(graph: KernelGraph) -> list[bool]:
    """``cuts[i]`` is True when a device boundary between kernel ``i-1`` and
    ``i`` splits no state group and no indirect kernel from a neighbour."""
    n = len(graph.kernels)
    ok = [True] * (n + 1)
    for group in graph.state_groups():
        for i in range(group[0] + 1, group[-1] + 1):
            ok[i] = False
    for k in graph.kernels:
        if k.indirect:
            ok[k.id] = False
            ok[k.id + 1] = False
    ok[0] = ok[n] = True
    return ok


class ContiguousPlanner:
    """The simple rule: contiguous runs of kernels, sized by ``shares``
    (default equal), with cuts moved to the nearest legal position."""

    def __init__(self, shares: Sequence[float] | None = None) -> None:
        self.shares = list(shares) if shares else None

    def plan(self, graph: KernelGraph, devices: Sequence[str], mode: str = "latency") -> Plan:
        ndev = len(devices)
        shares = self.shares or [1.0] * ndev
        if len(shares) != ndev:
            raise PlanError(f"{len(shares)} shares for {ndev} devices")
        n = len(graph.kernels)
        ok = legal_cuts(graph)
        legal = [i for i in range(n + 1) if ok[i]]
        total = sum(shares)
        cuts, acc = [], 0.0
        for s in shares[:-1]:
            acc += s
            target = round(n * acc / total)
            cuts.append(min(legal, key=lambda i: (abs(i - target), i)))
        bounds = [0] + sorted(cuts) + [n]
        assignment = [0] * n
        for d in range(ndev):
            for k in range(bounds[d], bounds[d + 1]):
                assignment[k] = d
        return build_plan(graph, devices, assignment, name="contiguous", mode=mode)


def single_device_plan(graph: KernelGraph, device: str) -> Plan:
    return build_plan(graph, [device], [0] * len(graph.kernels), name=f"homo[{device}]")




def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """A msgpack-able form of a plan (for placement messages)."""
    return {
        "name": plan.name, "devices": plan.devices, "assignment": plan.assignment,
        "segments": [[s.id, s.device, list(s.kernels)] for s in plan.segments],
        "transfers": [[t.tag, t.src, t.dst, t.buffer, [list(r) for r in t.ranges], t.src_segment, t.dst_segment]
                      for t in plan.transfers],
        "programs": [[[s.op, s.ref] for s in prog] for prog in plan.programs],
        "resident": plan.resident, "inputs": plan.inputs, "outputs": [list(o) for o in plan.outputs],
        "mode": plan.mode, "microbatches": plan.microbatches, "predicted_step_s": plan.predicted_step_s,
        "meta": plan.meta,
    }


def plan_from_dict(d: dict[str, Any]) -> Plan:
    return Plan(
        d["name"], list(d["devices"]), list(d["assignment"]),
        [Segment(i, dev, tuple(ks)) for i, dev, ks in d["segments"]],
        [Transfer(tag, s, t, b, tuple(tuple(r) for r in rs), ss, ds) for tag, s, t, b, rs, ss, ds in d["transfers"]],
        [[Step(op, ref) for op, ref in prog] for prog in d["programs"]],
        [list(r) for r in d["resident"]], [list(i) for i in d["inputs"]], [tuple(o) for o in d["outputs"]],
        d["mode"], d["microbatches"], d["predicted_step_s"], dict(d["meta"]))


def token_devices(graph: KernelGraph, plan: Plan) -> tuple[int, int] | None:
    """(the plan device that reads ``input_ids``, the one that holds the
    logits - the graph's first output) when one device each does (they may
    be the same), else None: who feeds a decode step's sampled tokens to
    the next step."""
    ids = graph.meta.get("input_views", {}).get("input_ids")
    outs = graph.meta.get("output_views") or []
    if ids is None or not outs:
        return None
    readers = [d for d, bufs in enumerate(plan.inputs) if ids[0] in bufs]
    holders = {dev for b, _, _, dev in plan.outputs if b == outs[0][0]}
    return (readers[0], next(iter(holders))) if len(readers) == 1 and len(holders) == 1 else None


def program_blocks(plan: Plan, d: int) -> dict[int, tuple[int, list[int], list[int]]]:
    """Per step ``i`` of device ``d``'s program that is not a receive:
    ``(end, kernels, sends)`` - the kernels of the runs from ``i`` on and the
    sends after them, up to the next receive or a run after a send (``end``:
    the program step after them).  A device actor works this out once at
    install; a step's worker calls look it up."""
    program = plan.programs[d]
    out = {}
    for i, st in enumerate(program):
        if st.op == "recv":
            continue
        j, kernels, sends = i, [], []
        while j < len(program) and program[j].op != "recv":
            if program[j].op == "run":
                if sends:
                    break
                kernels.extend(plan.segments[program[j].ref].kernels)
            else:
                sends.append(program[j].ref)
            j += 1
        out[i] = (j, kernels, sends)
    return out


__all__ = ["ContiguousPlanner", "Plan", "PlanError", "Planner", "Segment", "Step", "Transfer", "build_plan",
           "final_writes", "legal_cuts", "plan_from_dict", "plan_to_dict", "program_blocks", "single_device_plan",
           "validate_assignment"]
