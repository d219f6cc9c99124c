"""The offload problem's model (ATSInfer's problem: a model bigger than the
GPU's memory budget): the rates, the weight *units* of a graph, the homes
each heavy unit may get per step and the step model that scores them -

* ``R``: resident on the GPU (counts against the budget);
* ``S``: homed in pinned host memory and streamed into the GPU's staging
  ring on the copy stream ahead of its (single) reader, which then runs on
  the GPU; where a copy lands and which read it waits for is the ring
  layout of :mod:`.staging`;
* ``C``: homed on the CPU, whose kernels read it there.

The budget is a hard constraint on everything the GPU device allocates:
resident weights, KV cache, activations, the staging ring and ``reserve``
bytes for transient op results.  Light kernels (no heavy weight, no state)
run on the CPU only between two CPU kernels; state kernels (KV cache) stay on
the GPU.  Choices come from measured rates: a :class:`CostTable` (kernel
times on both devices, activation links) and ``pcie_bps``, the pinned
host-to-device rate while the CPU computes; :mod:`.rates` estimates them
(:func:`~.rates.estimate_rates`: a roofline with the CPU's measured rates, or
the DESIGN.md numbers when nothing was measured).

The step model (:meth:`Offload.simulate`) is the one step-time model
(:mod:`~tessera_actors.planning.timing`) over a chain in program order: a
kernel starts when the previous one ended (plus a link latency and the bytes
of its inputs when the device changes) and, if it reads a streamed weight,
when that copy ended; the copy engine runs copies one at a time in order.
How the homes are chosen is :mod:`.choose`; the baselines are
:mod:`.baselines`.  Pure Python; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tessera_actors.devices import DeviceSpec
from tessera_actors.graph import KernelGraph
from tessera_actors.plan import PlanError
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.offload.rates import PCIE_BPS
from tessera_actors.planning.offload.staging import RING_MODES, ring_layout, slot_pitch
from tessera_actors.planning.offload.timeline import path_of, union
from tessera_actors.planning.timing import Programs, run


@dataclass
class Placement:
    """An offload decision: ``choice[u]`` in R/S/C per heavy unit, the kernel
    assignment it implies, the streamed buffers in copy order, the slots."""

    assignment: list[int]
    streamed: list[int]
    slots: int
    slot_bytes: int
    choice: dict[int, str] = field(default_factory=dict)
    ring: str = "slots"   # how copies fill the staging ring (``staging.ring_layout``)
    breaks: list[int] = field(default_factory=list)   # kernels that start a segment (``Offload.send_breaks``)


@dataclass(frozen=True)
class StepTime:
    """One step on the model, and its terms: ``step_s`` is the step's end;
    ``busy_s`` every kernel's time on its device (the GPU's and the CPU's
    kernels), ``overlap_s`` of it the time both devices computed at once
    (bytes sent as soon as they were made: :meth:`Offload.send_breaks`);
    along the step's critical path, ``handoff_s`` over ``handoffs``
    hand-offs (latency plus activation bytes over the link, and host time
    between kernels) and ``copy_wait_s``, the time kernels waited for their
    streamed weight's copy; the copy engine ran ``pcie_s`` (``pcie_bytes``
    at the PCIe rate), overlapped with the kernels except for those waits."""
    step_s: float
    busy_s: tuple[float, ...]     # per device
    pcie_s: float
    pcie_bytes: int
    handoffs: int = 0
    handoff_s: float = 0.0
    copy_wait_s: float = 0.0
    overlap_s: float = 0.0

    def terms(self, gpu: int = 0) -> dict:
        """The step's terms by name (``gpu``: the budgeted device's index);
        the kernels less their overlap, hand-offs and copy waits add up to ``step_s``."""
        return {"gpu_kernels_s": self.busy_s[gpu], "cpu_kernels_s": self.busy_s[1 - gpu], "handoff_s": self.handoff_s,
                "handoffs": self.handoffs, "copy_wait_s": self.copy_wait_s, "kernel_overlap_s": self.overlap_s,
                "copy_engine_s": self.pcie_s, "pcie_bytes": self.pcie_bytes, "step_s": self.step_s}


class Offload:
    """The graph's units and the budget of one (gpu, cpu) pair."""

    def __init__(self, graph: KernelGraph, devices: Sequence[str], costs: CostTable,
                 pcie_bps: float = PCIE_BPS, reserve: int = 0, heavy_fraction: float = 0.01,
                 ring: str = "slots") -> None:
        if ring not in RING_MODES:
            raise PlanError(f"unknown staging ring mode {ring!r}; known: {', '.join(RING_MODES)}")
        self.graph, self.devices, self.costs, self.pcie_bps, self.reserve = graph, list(devices), costs, pcie_bps, reserve
        self.ring = ring
        specs = [DeviceSpec.parse(d) for d in devices]
        budgeted = [i for i, s in enumerate(specs) if s.mem is not None]
        if len(specs) != 2 or len(budgeted) != 1 or specs[1 - budgeted[0]].kind != "cpu":
            raise PlanError(f"offload needs one budgeted device (mem=) and one cpu device, got {list(devices)}")
        self.gpu, self.cpu = budgeted[0], 1 - budgeted[0]
        self.budget = specs[self.gpu].mem
        weights: dict[int, int] = {}       # weight buffer -> unit (union of weights read by one kernel)
        self.readers: dict[int, list[int]] = {}
        parent: dict[int, int] = {}

        def find(b: int) -> int:
            while parent[b] != b:
                parent[b] = parent[parent[b]]
                b = parent[b]
            return b
        for k in graph.kernels:
            ws = sorted({a.buffer for a in k.accesses if graph.buffers[a.buffer].role == "weight"})
            for b in ws:
                parent.setdefault(b, b)
                self.readers.setdefault(b, []).append(k.id)
            for b in ws[1:]:
                parent[find(b)] = find(ws[0])
        for b in parent:
            weights[b] = find(b)
        units: dict[int, list[int]] = {}
        for b, u in sorted(weights.items()):
            units.setdefault(u, []).append(b)
        size = {u: sum(graph.buffers[b].nbytes for b in bs) for u, bs in units.items()}
        top = max(size.values(), default=0)
        self.units = {u: bs for u, bs in units.items() if size[u] >= heavy_fraction * top and size[u] > 0}
        self.size = {u: size[u] for u in self.units}
        self.kernels = {u: sorted({k for b in bs for k in self.readers[b]}) for u, bs in self.units.items()}
        self.unit_of = {k: u for u, ks in self.kernels.items() for k in ks}
        self.state = {k.id for k in graph.kernels
                      if any(graph.buffers[a.buffer].role == "state" for a in k.accesses)}
        self.streamable = {u for u, ks in self.kernels.items() if len(ks) == 1 and not self.state.intersection(ks)}
        self.groups = graph.state_groups()
        # the state buffer of each group (state_groups orders them by buffer id)
        self.group_names = [graph.buffers[b].name for b in sorted(
            {a.buffer for k in graph.kernels for a in k.accesses if graph.buffers[a.buffer].role == "state"})]
        self.state_home: dict[str, int] = {}   # state name -> device, kept from another graph of the model
        self.in_edges: list[list] = [[] for _ in graph.kernels]
        for e in graph.edges:
            if e.kind == "RAW":
                self.in_edges[e.dst].append(e)

    # -- unit costs ------------------------------------------------------
    def t(self, u: int, d: int) -> float:
        return sum(self.costs.times[k][d] for k in self.kernels[u])

    def stream_s(self, u: int) -> float:
        return self.size[u] / self.pcie_bps

    # -- from choices to kernels ----------------------------------------
    def assignment(self, choice: dict[int, str]) -> list[int]:
        g, gpu, cpu = self.graph, self.gpu, self.cpu
        n = len(g.kernels)
        fixed = [None] * n
        for u, c in choice.items():
            for k in self.kernels[u]:
                fixed[k] = cpu if c == "C" else gpu
        out = [gpu] * n
        prev = None
        nxt = [None] * (n + 1)
        for k in range(n - 1, -1, -1):
            nxt[k] = fixed[k] if fixed[k] is not None else nxt[k + 1]
        for k in range(n):
            if fixed[k] is not None:
                out[k] = prev = fixed[k]
            else:
                out[k] = cpu if (prev == cpu and nxt[k + 1] == cpu) else gpu
        for k in g.kernels:   # an indirect kernel keeps its neighbours
            if k.indirect:
                for m in (k.id - 1, k.id + 1):
                    if 0 <= m < n:
                        out[m] = out[k.id]
        for group, name in zip(self.groups, self.group_names):   # a state buffer (KV cache) lives on one device
            home = self.state_home.get(name)
            if home is not None or len({out[k] for k in group}) > 1:
                for k in group:
                    out[k] = gpu if home is None else home
        return out

    def placement(self, choice: dict[int, str], slots: int, slot_bytes: int | None = None) -> Placement:
        """The kernels' devices and streamed weights of ``choice``; the ring's
        ``slots`` hold the largest streamed weight each, or in ``bytes`` mode
        ``slot_bytes`` each when given (the ring the budget was charged for)."""
        streamed = sorted((b for u, c in choice.items() if c == "S" for b in self.units[u]),
                          key=lambda b: self.readers[b][0])
        biggest = max((self.graph.buffers[b].nbytes for b in streamed), default=0)
        slot_bytes = slot_bytes if self.ring == "bytes" and slot_bytes else biggest
        a = self.assignment(choice)
        return Placement(a, streamed, slots if streamed else 0, slot_bytes, dict(choice), self.ring,
                         self.send_breaks(a, streamed))

    def gpu_bytes(self, p: Placement) -> int:
        """Bytes the GPU device allocates for placement ``p`` (as the streaming
        program does: its resident buffers but the streamed ones, the slots
        at their aligned pitch), and the reserve."""
        g, gpu = self.graph, self.gpu
        held = {a.buffer for k in g.kernels if p.assignment[k.id] == gpu for a in k.accesses}
        for k in g.kernels:   # bytes received from the cpu
            if p.assignment[k.id] == gpu:
                held.update(e.buffer for e in self.in_edges[k.id] if p.assignment[e.src] != gpu)
        held -= set(p.streamed)
        return sum(g.buffers[b].nbytes for b in held) + p.slots * slot_pitch(p.slot_bytes) + self.reserve

    # -- the step model --------------------------------------------------
    def send_breaks(self, assignment: Sequence[int], streamed: Sequence[int]) -> list[int]:
        """Kernels that start a new segment (``build_plan``'s ``breaks``) so
        that bytes for the other device leave right after the kernel that
        made them: the kernel after such a producer, when the producer's
        device would otherwise first run a streamed weight's reader before
        the bytes' reader needs them (the other device would wait for that
        copy too)."""
        a, g = assignment, self.graph
        reads = {self.readers[b][0] for b in streamed}
        out: set[int] = set()
        for e in g.edges:
            nxt = e.src + 1
            if e.kind != "RAW" or a[e.src] == a[e.dst] or nxt >= e.dst or a[nxt] != a[e.src] or nxt in out:
                continue
            if any(a[k] == a[e.src] and k in reads for k in range(nxt, e.dst)):
                out.add(nxt)
        return sorted(out)

    def _segments(self, p: Placement) -> list[tuple[int, list[int]]]:
        """(device, kernels) of each segment, as ``build_plan`` cuts them."""
        segs: list[tuple[int, list[int]]] = []
        cut = set(p.breaks)
        for k, d in enumerate(p.assignment):
            if not segs or segs[-1][0] != d or k in cut:
                segs.append((d, []))
            segs[-1][1].append(k)
        return segs

    def programs(self, p: Placement) -> Programs:
        """Placement ``p`` as the step-time model's programs, the plan's own:
        each device runs its segments in order; the bytes a segment needs
        from the other device arrive as one hand-off (a link's latency and
        the bytes, sent once the last segment making them ended: the plan
        sends after a segment); a streamed weight is a copy on the GPU's
        copy engine, in order, each sent once the reader of the bytes it
        overwrites has run (the ring layout of :mod:`.staging`) and received
        by its own reader."""
        g, costs, gpu, a = self.graph, self.costs, self.gpu, p.assignment
        streamed = p.streamed
        idx = {b: i for i, b in enumerate(streamed)}
        nbytes = [g.buffers[b].nbytes for b in streamed]
        after = ring_layout(nbytes, p.slots, p.slot_bytes, p.ring).after if streamed else ()
        segs = self._segments(p)
        seg_of = {k: i for i, (_, ks) in enumerate(segs) for k in ks}
        need: dict[int, list] = {}   # receiving segment -> [last sending segment, bytes, keys seen]
        for k in g.kernels:
            for e in self.in_edges[k.id]:
                if a[e.src] != a[k.id]:
                    n = need.setdefault(seg_of[k.id], [0, 0, set()])
                    key = (e.src, e.buffer)
                    n[0] = max(n[0], seg_of[e.src])
                    if key not in n[2]:
                        n[2].add(key)
                        n[1] += e.nbytes
        xfer = {i: ("copy", gpu, nbytes[i] / self.pcie_bps) for i in range(len(after))}
        sends: dict[int, list[int]] = {}
        recvs: dict[int, int] = {}
        for ds, (ss, moved, _) in sorted(need.items()):
            tag = recvs[ds] = len(xfer)
            src, dst = segs[ss][0], segs[ds][0]
            xfer[tag] = ((src, dst), dst, costs.comm_s(src, dst, moved))
            sends.setdefault(ss, []).append(tag)
        issued = sum(1 for j in after if j < 0)   # the first copies go at the step's start
        progs: list[list[tuple[str, int]]] = [[], []]
        progs[gpu] += [("send", i) for i in range(issued)]
        for s, (d, ks) in enumerate(segs):
            if s in recvs:
                progs[d].append(("recv", recvs[s]))
            for k in ks:
                u = self.unit_of.get(k) if d == gpu else None
                mine = [idx[b] for b in self.units[u] if b in idx] if u is not None else ()
                progs[d] += [("recv", i) for i in mine]
                progs[d].append(("run", k))
                while issued < len(after) and after[issued] <= max(mine, default=-1):
                    progs[gpu].append(("send", issued))
                    issued += 1
            progs[d] += [("send", t) for t in sends.get(s, ())]
        names = {i: name for i, name in enumerate(self.devices)}
        names.update({(0, 1): f"{self.devices[0]}->{self.devices[1]}", (1, 0): f"{self.devices[1]}->{self.devices[0]}",
                      "copy": f"{self.devices[gpu]} copy engine"})
        seconds = [costs.times[k.id][a[k.id]] for k in g.kernels]
        return Programs(progs, seconds, xfer, names)

    def simulate(self, p: Placement) -> StepTime:
        """The step time of placement ``p`` (:meth:`programs`, one step) and
        its terms: the step cut along its critical path
        (:func:`~.timeline.critical_path`: the kernels of each device, the
        waits for streamed copies, the hand-offs) and the overlap of the two
        devices' kernels."""
        if len(p.assignment) != len(self.graph.kernels):
            raise PlanError(f"a placement of {len(p.assignment)} kernels scored on a graph of "
                            f"{len(self.graph.kernels)}: another capture of the model")
        progs = self.programs(p)
        r = run([(progs, 1)], [1], record=True)
        gpu, n = self.gpu, len(p.streamed)
        copy_end = {e.ref: e.end for e in r.events if e.kind == "xfer" and e.ref < n and e.resource == progs.names["copy"]}
        idx = {b: i for i, b in enumerate(p.streamed)}
        runs, into = [], {0: [], 1: []}
        for e in r.events:
            if e.kind == "run":
                d = p.assignment[e.ref]
                u = self.unit_of.get(e.ref) if d == gpu else None
                done = max((copy_end[idx[b]] for b in self.units[u] if b in idx), default=None) if u is not None else None
                runs.append((e.start, e.end, d, done))
            elif e.resource != progs.names["copy"]:
                into[progs.transfers[e.ref][1]].append((e.start, e.end))
        path = path_of(sorted(runs), gpu, {d: union(v) for d, v in into.items()}, 0.0, r.finish[0])
        pcie_bytes = sum(self.graph.buffers[b].nbytes for b in p.streamed)
        overlap = r.busy[gpu] + r.busy[self.cpu] - path["gpu"] - path["cpu"]
        handoffs = sum(1 for e in r.events if e.kind == "xfer" and e.resource != progs.names["copy"])
        return StepTime(r.finish[0], tuple(r.busy), pcie_bytes / self.pcie_bps, pcie_bytes, handoffs,
                        path["handoff"] + path["other"], path["copy_wait"], max(overlap, 0.0))

    def timeline(self, p: Placement) -> list[list]:
        """The predicted step of placement ``p`` as timeline records (step 0,
        the model's clock), the resources the executor's probe measures
        (:mod:`.timeline`): each kernel (with the copies it waits for), each
        copy (issued when the reader of the bytes it overwrites ended), each
        hand-off (a ``recv`` on the receiving device), the step."""
        progs = self.programs(p)
        r = run([(progs, 1)], [1], record=True)
        g, gpu, streamed = self.graph, self.gpu, p.streamed
        idx = {b: i for i, b in enumerate(streamed)}
        ended = {e.ref: e.end for e in r.events if e.kind == "run"}
        after = ring_layout([g.buffers[b].nbytes for b in streamed], p.slots, p.slot_bytes, p.ring).after \
            if streamed else ()
        freed = [ended[self.readers[streamed[j]][0]] if j >= 0 else None for j in after]
        out: list[list] = [[gpu, "step", "step 0", 0, 0.0, r.finish[0], {}]]
        for e in r.events:
            if e.kind == "run":
                d = p.assignment[e.ref]
                u = self.unit_of.get(e.ref) if d == gpu else None
                waits = [idx[b] for b in self.units[u] if b in idx] if u is not None else []
                out.append([d, "kernels", f"k{e.ref}", 0, e.start, e.end, {"waits": waits}])
            elif e.ref < len(after):
                out.append([gpu, "copy", f"copy {e.ref}", 0, e.start, e.end,
                            {"copy": e.ref, "bytes": g.buffers[streamed[e.ref]].nbytes,
                             "issued": freed[e.ref] or 0.0, "freed": freed[e.ref]}])
            else:
                out.append([progs.transfers[e.ref][1], "recv", f"hand-off {e.ref}", 0, e.start, e.end, {}])
        return out

    # -- choosing --------------------------------------------------------
    def resident_fill(self, capacity: int, order: Sequence[int] | None = None,
                      limit: int | None = None) -> set[int]:
        """Units made resident greedily (by time saved per byte, or in
        ``order``) while they fit in ``capacity`` bytes.  A unit can be
        streamed only when it fits a slot (``limit`` bytes; None: any), so
        one bigger than that (an LM head) saves its CPU time, not its copy's."""
        gpu, cpu = self.gpu, self.cpu
        if order is None:
            def gain(u: int) -> float:
                movable = u in self.streamable and (limit is None or self.size[u] <= limit)
                away = min(self.t(u, cpu), self.t(u, gpu) + self.stream_s(u)) if movable else self.t(u, cpu)
                return (away - self.t(u, gpu)) / max(self.size[u], 1)
            order = sorted(self.units, key=lambda u: (-gain(u), u))
        out, used = set(), 0
        for u in order:
            if used + self.size[u] <= capacity:
                out.add(u)
                used += self.size[u]
        return out

    def fixed_bytes(self) -> int:
        """GPU bytes of the placement with every heavy unit on the CPU."""
        return self.gpu_bytes(self.placement({u: "C" for u in self.units}, 0))

    def fit(self, choose, slots: int, staging: int = 0, order: Sequence[int] | None = None,
            limit: int | None = None) -> tuple[Placement, StepTime] | None:
        """Shrink the resident capacity (from the budget less the fixed bytes
        and ``staging``) until ``choose(resident) -> choice`` gives a
        placement within the budget (``limit``: the slot size, for
        :meth:`resident_fill`)."""
        capacity = self.budget - self.fixed_bytes() - staging
        if capacity < 0:
            return None
        for _ in range(50):
            choice = choose(self.resident_fill(capacity, order, limit))
            p = self.placement(choice, slots, limit)
            over = self.gpu_bytes(p) - self.budget
            if over <= 0:
                return p, self.simulate(p)
            if capacity == 0:
                return None
            # residents can bring more than their own bytes (a KV cache that follows its kernels):
            # shrink by the excess, down to no resident weight at all
            capacity = max(capacity - over, 0)
        return None


def fastest(cands) -> tuple[Placement, StepTime] | None:
    """The candidate ``(placement, step time)`` with the shortest step; None
    entries (placements that did not fit) are skipped, None when none is left."""
    cands = [c for c in cands if c is not None]
    return min(cands, key=lambda c: c[1].step_s) if cands else None


def cpu_runs(o: Offload, units: Sequence[int]) -> list[list[int]]:
    """``units`` (program order) cut where the kernels between two of them
    cannot join one CPU run: a state kernel (the KV cache stays with its
    attention) or an indirect one.  A block of a run computed on the CPU
    costs two device changes, not two per unit (a layer's MLP: gate, up and
    down with the light kernels between them)."""
    runs: list[list[int]] = []
    last = None
    for u in units:
        first = o.kernels[u][0]
        joins = last is not None and not any(
            k in o.state or o.graph.kernels[k].indirect for k in range(last + 1, first))
        if joins:
            runs[-1].append(u)
        else:
            runs.append([u])
        last = o.kernels[u][-1]
    return runs
