"""Placement of a model bigger than the GPU's memory budget (ATSInfer's
problem): every *heavy* weight gets one of three homes per step -

* ``R``: resident on the GPU (counts against the budget);
* ``S``: homed in pinned host memory and streamed into one of ``slots``
  GPU staging buffers on the copy stream ahead of its (single) reader,
  which then runs on the GPU; copy ``i`` goes to slot ``i % slots`` and
  starts once the reader of copy ``i - slots`` has finished (double
  buffering for ``slots = 2``);
* ``C``: homed on the CPU, whose kernels read it there.

The budget is a hard constraint on everything the GPU device allocates:
resident weights, KV cache, activations, the staging slots and ``reserve``
bytes for transient op results.  Light kernels (no heavy weight, no state)
run on the CPU only between two CPU kernels; state kernels (KV cache) stay on
the GPU.  Choices come from measured rates: a :class:`CostTable` (kernel
times on both devices, activation links) and ``pcie_bps``, the pinned
host-to-device rate while the CPU computes.  :func:`estimate_rates` gives the
DESIGN.md numbers when nothing was measured.

The step model (:func:`simulate`) is a chain in program order: a kernel
starts when the previous one ended (plus a link latency and the bytes of
its inputs when the device changes) and, if it reads a streamed weight, when
that copy ended; the copy engine runs copies one at a time in order.

Baselines from the same rates and the same model live in
``offload_baselines.py`` (GPU-only, layer offload, streaming, the ideal);
per-role mixes for the packed staging ring in ``offload_mixes.py``.
Pure Python; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tessera_actors.devices import DeviceSpec
from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan, PlanError, build_plan
from tessera_actors.planning.costs import CostTable, DeviceModel, device_model
from tessera_actors.planning.pinning import state_homes
from tessera_actors.planning.staging import RING_MODES, ring_layout

# DESIGN.md (one H200 + 16 cores): bf16 GEMV from DRAM with a copy stream running
# beside it (12 threads 46 GB/s, 16 collapse to 14.5 GB/s); pinned H2D 55 GB/s.
CPU_GEMV_BPS = {1: 6e9, 2: 11e9, 4: 22e9, 8: 47e9, 12: 46e9, 16: 14.5e9}
PCIE_BPS = 55e9


def host_model(threads: int | None) -> DeviceModel:
    """CPU rates at ``threads`` (None: 16) while a copy stream runs beside it."""
    t = min(threads or 16, 16)
    known = sorted(CPU_GEMV_BPS)
    lo = max(k for k in known if k <= t)
    hi = min(k for k in known if k >= t)
    bw = CPU_GEMV_BPS[lo] if lo == hi else (
        CPU_GEMV_BPS[lo] + (t - lo) / (hi - lo) * (CPU_GEMV_BPS[hi] - CPU_GEMV_BPS[lo]))
    return DeviceModel(f"cpu-t{t}", 1.0e12 * t / 16, bw, 5e-6)


SWITCH_S = 200e-6   # one activation hand-off between two device actors (messages, not the wire)
GATHERS = ("embedding", "index", "index_select", "gather")


def estimate_rates(graph: KernelGraph, devices: Sequence[str], switch_s: float = SWITCH_S,
                   cpu_bps: float | None = None) -> CostTable:
    """Roofline kernel times: cuda devices from the H200 preset, cpu devices
    from :func:`host_model` at their thread count (``cpu_bps``: a measured
    DRAM rate of the unbudgeted cpu device instead); a gather (embedding)
    reads what it writes, not its whole table.  Links: ``switch_s`` latency."""
    specs = [DeviceSpec.parse(d) for d in devices]
    models = [host_model(s.threads) if s.kind == "cpu" else device_model(s) for s in specs]
    if cpu_bps:
        for i, s in enumerate(specs):
            if s.kind == "cpu" and s.mem is None:
                models[i] = DeviceModel(f"cpu-measured-t{s.threads}", models[i].flops_per_s, cpu_bps,
                                        models[i].launch_s)
    costs = CostTable.estimate(graph, list(devices), models)
    for k in graph.kernels:
        if k.name in GATHERS:
            nb = 2.0 * sum(a.nbytes for a in k.accesses if a.writes)
            costs.times[k.id] = [m.launch_s + nb / m.bytes_per_s for m in models]
    n = len(specs)
    costs.latency = [[0.0 if a == b else max(costs.latency[a][b], switch_s) for b in range(n)] for a in range(n)]
    return costs


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


@dataclass(frozen=True)
class StepTime:
    step_s: float
    busy_s: tuple[float, ...]     # per device
    pcie_s: float
    pcie_bytes: int


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
        self.streamable = {u for u, ks in self.kernels.items() if len(ks) == 1 and u_not_state(ks, self.state)}
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
        return Placement(self.assignment(choice), streamed, slots if streamed else 0, slot_bytes, dict(choice),
                         self.ring)

    def gpu_bytes(self, p: Placement) -> int:
        """Bytes the GPU device allocates for placement ``p`` (as the streaming
        program does: its resident buffers but the streamed ones, the slots)."""
        g, gpu = self.graph, self.gpu
        held = {a.buffer for k in g.kernels if p.assignment[k.id] == gpu for a in k.accesses}
        for k in g.kernels:   # bytes received from the cpu
            if p.assignment[k.id] == gpu:
                held.update(e.buffer for e in self.in_edges[k.id] if p.assignment[e.src] != gpu)
        held -= set(p.streamed)
        return sum(g.buffers[b].nbytes for b in held) + p.slots * p.slot_bytes + self.reserve

    # -- the step model --------------------------------------------------
    def simulate(self, p: Placement) -> StepTime:
        g, costs, gpu = self.graph, self.costs, self.gpu
        unit_of, units = self.unit_of, self.units
        a, streamed = p.assignment, p.streamed
        idx = {b: i for i, b in enumerate(streamed)}
        nbytes = [g.buffers[b].nbytes for b in streamed]
        after = ring_layout(nbytes, p.slots, p.slot_bytes, p.ring).after if streamed else ()
        copy_end: dict[int, float] = {}
        engine = [0.0]
        queued = [0]   # copies issued so far, in order

        def issue(upto: int, t: float) -> None:
            # every copy whose overwritten bytes were read by copy ``upto``'s reader (at ``t``) goes out
            while queued[0] < len(after) and after[queued[0]] <= upto:
                i = queued[0]
                start = max(engine[0], t)
                engine[0] = copy_end[i] = start + nbytes[i] / self.pcie_bps
                queued[0] += 1
        issue(-1, 0.0)
        busy = [0.0, 0.0]
        arrived: set = set()
        end, prev = 0.0, None
        for k in g.kernels:
            d = a[k.id]
            t = end
            moved = 0
            for e in self.in_edges[k.id]:
                if a[e.src] != d and (e.src, d, e.buffer) not in arrived:
                    arrived.add((e.src, d, e.buffer))
                    moved += e.nbytes
            if moved or (prev is not None and prev != d):
                t += costs.comm_s(1 - d, d, moved)
            u = unit_of.get(k.id) if d == gpu else None
            mine = [idx[b] for b in units[u] if b in idx] if u is not None else ()
            for i in mine:
                t = max(t, copy_end[i])
            end = t + costs.times[k.id][d]
            busy[d] += costs.times[k.id][d]
            for i in mine:
                issue(i, end)
            prev = d
        pcie_bytes = sum(nbytes)
        return StepTime(end, tuple(busy), pcie_bytes / self.pcie_bps, pcie_bytes)

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


def u_not_state(kernels: Sequence[int], state: set[int]) -> bool:
    return not any(k in state for k in kernels)


def _best(cands) -> tuple[Placement, StepTime] | None:
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


def _pattern(o: Offload, rest: Sequence[int], frac: float, run: int, limit: int) -> dict[int, str]:
    """Error diffusion over ``rest`` (program order): blocks of streamable
    units (of at most ``limit`` bytes) - ``run`` units each, or with
    ``run=0`` whole CPU runs (:func:`cpu_runs`) - are streamed while the
    streamed bytes stay within ``frac`` of the bytes seen, else computed on
    the CPU."""
    choice = {u: "C" for u in rest if u not in o.streamable or o.size[u] > limit}
    movable = [u for u in rest if u not in choice]
    blocks = cpu_runs(o, movable) if run == 0 else [movable[i:i + run] for i in range(0, len(movable), run)]
    seen = sent = 0
    for block in blocks:
        nb = sum(o.size[u] for u in block)
        go = sent + nb <= frac * (seen + nb) + nb / 2
        for u in block:
            choice[u] = "S" if go else "C"
        seen += nb
        sent += nb if go else 0
    return choice


def _best_split(o: Offload, slots: int, limit: int, resident: set[int],
                runs: Sequence[int] = (1, 2, 3, 4, 6)) -> tuple[dict[int, str], float]:
    """The non-resident units (program order) split between CPU and
    streaming by error diffusion at the fraction where both finish together
    (and a few around it, in blocks of 1..6 units or of whole CPU runs):
    the best choice on the step model and its step time."""
    first = {u: o.kernels[u][0] for u in o.units}
    rest = sorted((u for u in o.units if u not in resident), key=first.get)
    st = [u for u in rest if u in o.streamable and o.size[u] <= limit]
    g_s = sum(o.t(u, o.gpu) for u in st)
    c_s = sum(o.t(u, o.cpu) for u in st)
    p_s = sum(o.stream_s(u) for u in st)
    other = sum(o.t(u, o.gpu) for u in resident) + sum(o.t(u, o.cpu) for u in rest if u not in o.streamable)
    bal = min(1.0, (other + c_s) / max(p_s + c_s - g_s, 1e-12)) if st else 0.0
    fracs = sorted({0.0, 1.0, *(min(1.0, max(0.0, bal * m)) for m in (0.85, 0.92, 1.0, 1.08, 1.15))})
    best = None
    for run in (0, *runs):   # 0: whole CPU runs
        for f in fracs:
            ch = {u: "R" for u in resident}
            ch.update(_pattern(o, rest, f, run, limit))
            t = o.simulate(o.placement(ch, slots, limit)).step_s
            if best is None or t < best[1]:
                best = (ch, t)
    return best


def _chooser(o: Offload, slots: int, limit: int, rounds: int, runs: Sequence[int] = (1, 2, 3, 4, 6)):
    """``resident -> choice``: :func:`_best_split`, then ``rounds`` of flips
    of single units and of whole CPU runs between C and S that shorten the
    step on the model."""
    first = {u: o.kernels[u][0] for u in o.units}

    def choose(resident: set[int]) -> dict[int, str]:
        ch, t = _best_split(o, slots, limit, resident, runs)
        movable = sorted((u for u in ch if ch[u] != "R" and u in o.streamable and o.size[u] <= limit),
                         key=first.get)
        # flips of single units, then of whole CPU runs set to one home (one run computed on the CPU
        # costs two device changes however many units it holds)
        blocks = [[u] for u in movable] + [r for r in cpu_runs(o, movable) if len(r) > 1]
        for _ in range(rounds):
            improved = False
            for block in blocks:
                old = [ch[u] for u in block]
                for home in ("S", "C"):
                    if all(h == home for h in old):
                        continue
                    for u in block:
                        ch[u] = home
                    t2 = o.simulate(o.placement(ch, slots, limit)).step_s
                    if t2 < t - 1e-12:
                        t, improved = t2, True
                        break
                    for u, h in zip(block, old):
                        ch[u] = h
            if not improved:
                break
        return ch
    return choose


def tessera(o: Offload, slot_options: Sequence[int] = (2, 3, 4, 6, 8), runs: Sequence[int] = (1, 2, 3, 4, 6),
            polish: int = 3) -> tuple[Placement, StepTime]:
    """The three-way choice: residents by time saved per byte; the rest
    split between CPU and streaming (:func:`_best_split`); the best on the
    step model is then polished by flipping single units and whole CPU runs
    between C and S (:func:`_chooser`).  The layer-offload and streaming
    plans are candidates too, so the result is never worse than them on the
    model."""
    # a slot holds the largest streamed weight: try the three largest sizes
    sizes = sorted({o.size[u] for u in o.streamable}, reverse=True)[:3]
    options = [(0, 0)] + [(s, b) for s in slot_options for b in sizes]   # (0, 0): nothing streamed
    tried = [((s, b), o.fit(_chooser(o, s, b, 0, runs), s, s * b, limit=b)) for s, b in options]
    tried = [(sb, r) for sb, r in tried if r is not None]
    if not tried:
        raise PlanError(f"offload: {o.devices[o.gpu]} cannot hold even the KV cache, activations and reserve "
                        f"({o.fixed_bytes()} bytes, of which {o.reserve} are kept for transient results and the "
                        f"other buckets' own buffers; budget {o.budget})")
    s, b = min(tried, key=lambda x: x[1][1].step_s)[0]
    # a ring filled by bytes holds more small weights than it has slots: class mixes, every ring size
    # (slots of the best split's slot size b)
    mixes = ([o.fit(class_chooser(o, n, b), n, n * b, limit=b) for n in slot_options]
             if o.ring == "bytes" and b else [])
    # the coarse plans are candidates too (offload_baselines, imported at the end of this module)
    return _best([o.fit(_chooser(o, s, b, polish, runs), s, s * b, limit=b), *(r for _, r in tried), *mixes,
                  layer_offload(o), streaming(o, slot_options)])


POLICIES = ("tessera", "layer_offload", "streaming")


def _effective(o: Offload, p: Placement) -> dict[int, str]:
    """Unit -> where its weights really live under ``p``: S when streamed,
    R when a kernel reading them runs on the GPU (a rule of the assignment -
    an indirect kernel's neighbours, a state group - may move a unit's
    kernel off the device its choice gave it), else C."""
    streamed = set(p.streamed)
    out = {}
    for u, ks in o.kernels.items():
        if any(b in streamed for b in o.units[u]):
            out[u] = "S"
        elif any(p.assignment[k] == o.gpu for k in ks):
            out[u] = "R"
        else:
            out[u] = "C"
    return out


def homes_of(o: Offload, p: Placement) -> dict[str, str]:
    """Weight name -> where it lives (R, S or C, :func:`_effective`) for
    every heavy weight of ``p``."""
    eff = _effective(o, p)
    return {o.graph.buffers[b].name: eff[u] for u, bs in o.units.items() for b in bs if o.graph.buffers[b].name}


def follow(o: Offload, homes: dict[str, str], slots: int, slot_bytes: int, policy: str = "tessera",
           polish: int = 3) -> tuple[Placement, StepTime]:
    """A placement of another graph of the same model (another batch size,
    a prompt chunk) that keeps the GPU-resident weights of ``homes`` (by
    name: GPU memory holds one copy for all graphs) and the staging ring
    (``slots`` of ``slot_bytes``), and splits the other weights between CPU
    and streaming for this graph: by ``policy`` - ``tessera`` on the step
    model (a prompt chunk streams what decode computes on the CPU),
    ``streaming`` every one that fits a slot, ``layer_offload`` none."""
    if policy not in POLICIES:
        raise PlanError(f"unknown offload policy {policy!r}; known: {', '.join(POLICIES)}")
    resident = set()
    for u, bs in o.units.items():
        hs = {homes.get(o.graph.buffers[b].name) for b in bs}
        if "R" in hs and hs != {"R"}:
            names = sorted(o.graph.buffers[b].name for b in bs)
            raise PlanError(f"offload: weights {names[:4]} are read by one kernel but only some are resident")
        if hs == {"R"}:
            resident.add(u)
    limit = slot_bytes if slots else 0
    if policy == "tessera":
        choice = _chooser(o, slots, limit, polish)(resident)
        if o.ring == "bytes" and slots:   # class mixes too (see tessera)
            mix = class_chooser(o, slots, limit)(resident)
            if (o.simulate(o.placement(mix, slots, slot_bytes)).step_s
                    < o.simulate(o.placement(choice, slots, slot_bytes)).step_s):
                choice = mix
    else:
        stream = policy == "streaming"
        choice = {u: "R" if u in resident else
                  ("S" if stream and u in o.streamable and o.size[u] <= limit else "C") for u in o.units}
    p = o.placement(choice, slots, slot_bytes)
    for _ in range(len(o.units)):
        # a unit the assignment put on the GPU though it is not resident there is streamed instead;
        # one that cannot be is reported by the device when the plan does not fit its budget
        eff = _effective(o, p)
        moved = [u for u, h in eff.items() if h == "R" and u not in resident and choice.get(u) != "S"
                 and u in o.streamable and o.size[u] <= limit]
        if not moved:
            break
        for u in moved:
            choice[u] = "S"
        p = o.placement(choice, slots, slot_bytes)
    if p.streamed:
        p.slot_bytes = slot_bytes
    return p, o.simulate(p)


def to_plan(o: Offload, p: Placement, name: str, st: StepTime | None = None) -> Plan:
    """A plan whose ``meta["offload"]`` tells the budgeted device which
    weights it streams (``tessera_actors/execution/streaming.py``)."""
    plan = build_plan(o.graph, o.devices, p.assignment, name=name)
    plan.predicted_step_s = st.step_s if st else None
    plan.meta["offload"] = {"device": o.gpu, "streamed": list(p.streamed), "slots": p.slots,
                            "slot_bytes": p.slot_bytes, "ring": p.ring, "gpu_bytes": o.gpu_bytes(p), "budget": o.budget,
                            "choices": "".join(p.choice[u] for u in sorted(p.choice))}
    return plan


class OffloadPlanner:
    """``Planner`` for a budgeted GPU beside a CPU.  ``costs``: a measured
    table (None: :func:`estimate_rates` per graph, with ``cpu_bps`` - the
    CPU's measured DRAM rate - and ``switch_s``); ``policy``: ``tessera``
    (:func:`tessera`), ``layer_offload`` or ``streaming`` (the baselines);
    ``ring``: how streamed weights fill the staging ring, ``slots`` (one per
    slot) or ``bytes`` (packed; :mod:`~tessera_actors.planning.staging`).

    A served model is several graphs (batch sizes, prompt chunks) in one
    share group: the first graph planned decides which weights are resident
    on the GPU and the staging ring; every later graph with those weight
    names follows them (:func:`follow`), so the GPU holds one copy.  Call
    :meth:`expect` first with the other graphs: the first plan leaves room
    in the budget for their own buffers."""

    def __init__(self, costs: CostTable | None = None, pcie_bps: float = PCIE_BPS, reserve: int = 0,
                 slot_options: Sequence[int] = (2, 3, 4, 6, 8), cpu_bps: float | None = None,
                 switch_s: float = SWITCH_S, policy: str = "tessera", ring: str = "slots") -> None:
        if policy not in POLICIES:
            raise PlanError(f"unknown offload policy {policy!r}; known: {', '.join(POLICIES)}")
        if ring not in RING_MODES:
            raise PlanError(f"unknown staging ring mode {ring!r}; known: {', '.join(RING_MODES)}")
        self.ring = ring
        self.costs, self.pcie_bps, self.reserve, self.slot_options = costs, pcie_bps, int(reserve), tuple(slot_options)
        self.cpu_bps, self.switch_s, self.policy = cpu_bps, switch_s, policy
        self.extra = 0                              # bytes of the other graphs' own buffers (expect)
        self.homes: dict[str, str] | None = None    # weight name -> R/S/C, from the first graph planned
        self.state_homes: dict[str, int] = {}       # state name -> device, from the first graph planned
        self.staging = (0, 0)                       # (slots, slot_bytes) of the first graph

    def expect(self, graphs: Sequence[KernelGraph]) -> None:
        """Graphs to be planned after the first: their own buffers (all but
        weights and state, which are shared) are kept free of the budget."""
        self.extra = sum(b.nbytes for g in graphs for b in g.buffers.values() if b.role not in ("weight", "state"))

    def offload(self, graph: KernelGraph, devices: Sequence[str], reserve: int = 0) -> Offload:
        costs = self.costs if self.costs is not None else estimate_rates(graph, devices, self.switch_s, self.cpu_bps)
        costs.check_graph(graph)
        return Offload(graph, devices, costs, self.pcie_bps, self.reserve + reserve, ring=self.ring)

    def plan(self, graph: KernelGraph, devices: Sequence[str], mode: str = "latency") -> Plan:
        names = {b.name for b in graph.buffers.values() if b.role == "weight" and b.name}
        if self.homes is not None and names & set(self.homes):   # another graph of the same model
            o = self.offload(graph, devices)
            o.state_home = self.state_homes   # the KV cache stays where the first graph put it
            p, st = follow(o, self.homes, *self.staging, policy=self.policy)
            return to_plan(o, p, f"offload-{self.policy}", st)
        o = self.offload(graph, devices, self.extra)
        if self.policy == "tessera":
            got = tessera(o, self.slot_options)
        else:
            got = layer_offload(o) if self.policy == "layer_offload" else streaming(o, self.slot_options)
            if got is None:
                raise PlanError(f"offload: no {self.policy} placement fits {o.devices[o.gpu]} "
                                f"(budget {o.budget} bytes)")
        p, st = got
        self.homes, self.staging = homes_of(o, p), (p.slots, p.slot_bytes)
        self.state_homes = state_homes(graph, p.assignment)
        return to_plan(o, p, f"offload-{self.policy}", st)


from tessera_actors.planning.offload_baselines import gpu_only, ideal, layer_offload, streaming  # noqa: E402  (re-exported)
from tessera_actors.planning.offload_mixes import class_chooser, unit_classes  # noqa: E402  (re-exported)

__all__ = ["CPU_GEMV_BPS", "Offload", "OffloadPlanner", "PCIE_BPS", "POLICIES", "Placement", "StepTime",
           "estimate_rates", "follow", "gpu_only", "homes_of", "host_model", "ideal", "layer_offload", "streaming",
           "tessera", "to_plan", "unit_classes"]
