"""How the offload planner chooses every heavy unit's home (R, S or C; see
:mod:`.model`): :func:`choose_homes` for the first graph of a model,
:func:`follow` for the model's other graphs (which keep the first one's
residents and staging ring), :class:`OffloadPlanner` as the ``offload``
planner of the registry.  Pure Python; no torch.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from tessera_actors.devices import DeviceSpec
from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan, PlanError, build_plan
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.pinning import state_homes
from tessera_actors.planning.offload.baselines import expert_offload, layer_offload, streaming
from tessera_actors.planning.offload.mixes import class_chooser
from tessera_actors.planning.offload.model import Offload, Placement, StepTime, cpu_runs, fastest
from tessera_actors.planning.offload.load import check_load
from tessera_actors.planning.offload.rates import PCIE_BPS, SWITCH_S, HostRoofline, rows_rates
from tessera_actors.planning.offload.staging import RING_MODES
from tessera_actors.planning.offload.timeline import summarize_step


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


def choose_homes(o: Offload, slot_options: Sequence[int] = (2, 3, 4, 6, 8), runs: Sequence[int] = (1, 2, 3, 4, 6),
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
    # the coarse plans are candidates too
    return fastest([o.fit(_chooser(o, s, b, polish, runs), s, s * b, limit=b), *(r for _, r in tried), *mixes,
                  layer_offload(o), streaming(o, slot_options), expert_offload(o)])


POLICIES = ("tessera", "layer_offload", "streaming", "expert_offload")

# bytes a budgeted GPU holds that no graph names, kept from the budget: the one memory pool of its captured
# graphs (the transient results of its largest one), eager transient results (sampling reads the logits in
# float32), the cuBLAS workspace of its stream (32 MiB on an H200), the decode rows' state and the allocator's
# rounding; the budgeted GPU's own accounting is GetStats allocated_bytes (execution/held.py)
GPU_RESERVE = 320 << 20


def default_reserve(devices: Sequence[str]) -> int:
    """The ``reserve`` an engine with a GPU budget plans with unless told
    (``EngineConfig.gpu_budget``): :data:`GPU_RESERVE` when the budgeted
    device of ``devices`` is a GPU, 0 when a CPU stands in for one (its
    transient results come and go on the host)."""
    specs = [DeviceSpec.parse(d) for d in devices]
    return GPU_RESERVE if any(s.mem is not None and s.kind != "cpu" for s in specs) else 0
BASELINES = {"layer_offload": layer_offload, "expert_offload": expert_offload}   # placements of no ring


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
    ``streaming`` every one that fits a slot, ``layer_offload`` and
    ``expert_offload`` none."""
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
        if o.ring == "bytes" and slots:   # class mixes too (see choose_homes)
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
    weights it streams (``actors/streaming.py``) and, with ``st``, holds the
    step model's terms of it (``terms``: :meth:`~.model.StepTime.terms`) and
    each device's busy seconds (``busy_s``): what the planner predicted, for
    whoever compares a run with it (the offload bench, a re-plan)."""
    plan = build_plan(o.graph, o.devices, p.assignment, name=name, breaks=p.breaks)
    plan.predicted_step_s = st.step_s if st else None
    plan.meta["offload"] = {"device": o.gpu, "streamed": list(p.streamed), "slots": p.slots,
                            "slot_bytes": p.slot_bytes, "ring": p.ring, "breaks": list(p.breaks),
                            "gpu_bytes": o.gpu_bytes(p), "budget": o.budget,
                            "choices": "".join(p.choice[u] for u in sorted(p.choice))}
    if st is not None:   # the prediction's terms and each device's busy seconds, on the graph this plan runs
        plan.meta["offload"].update(terms=st.terms(o.gpu), busy_s=list(st.busy_s),
                                    timeline=summarize_step(o.timeline(p), o.gpu, 0.0, st.step_s))
    return plan


class OffloadPlanner:
    """``Planner`` for a budgeted GPU beside a CPU.  ``costs``: a measured
    table (None: :class:`~.rates.HostRoofline` (:func:`~.rates.estimate_rates`) per graph, with ``cpu_bps`` - the
    CPU's measured DRAM rate -, ``cpu_rows_bps`` - its matmuls' weight rate
    by rows, ``{rows: bytes/s}`` or ``"1:3.6e10,8:3e10"`` -, ``cpu_flops``,
    ``switch_s`` and ``expert_load`` - a mixture of experts' router
    statistics, the share of a step each routed part reads,
    :mod:`~tessera_actors.planning.offload.load`); ``policy``: ``tessera``
    (:func:`choose_homes`), ``layer_offload``, ``streaming`` or
    ``expert_offload`` (the baselines); ``ring``: how streamed weights fill
    the staging ring, ``bytes`` (packed, the default) or ``slots`` (one
    weight per slot; :mod:`~tessera_actors.planning.offload.staging`);
    ``reserve``: budget bytes kept for what no graph names (a GPU's
    transient results: :data:`GPU_RESERVE` is what ``gpu_budget`` engines
    keep).

    A served model is several graphs (batch sizes, prompt chunks) in one
    share group: the first graph planned decides which weights are resident
    on the GPU and the staging ring; every later graph with those weight
    names follows them (:func:`follow`), so the GPU holds one copy.  Call
    :meth:`expect` first with the other graphs: the first plan leaves room
    in the budget for their own buffers."""

    def __init__(self, costs: CostTable | None = None, pcie_bps: float = PCIE_BPS, reserve: int = 0,
                 slot_options: Sequence[int] = (2, 3, 4, 6, 8), cpu_bps: float | None = None,
                 switch_s: float = SWITCH_S, policy: str = "tessera", ring: str = "bytes",
                 cpu_rows_bps: Mapping | str | None = None, cpu_flops: float | None = None,
                 expert_load: Mapping | None = None) -> None:
        if policy not in POLICIES:
            raise PlanError(f"unknown offload policy {policy!r}; known: {', '.join(POLICIES)}")
        if ring not in RING_MODES:
            raise PlanError(f"unknown staging ring mode {ring!r}; known: {', '.join(RING_MODES)}")
        self.ring = ring
        self.costs, self.pcie_bps, self.reserve, self.slot_options = costs, pcie_bps, int(reserve), tuple(slot_options)
        self.cpu_bps, self.switch_s, self.policy = cpu_bps, switch_s, policy
        self.cpu_rows_bps, self.cpu_flops = rows_rates(cpu_rows_bps), cpu_flops
        self.expert_load = check_load(expert_load)
        self.extra = 0                              # bytes of the other graphs' own buffers (expect)
        self.homes: dict[str, str] | None = None    # weight name -> R/S/C, from the first graph planned
        self.state_homes: dict[str, int] = {}       # state name -> device, from the first graph planned
        self.staging = (0, 0)                       # (slots, slot_bytes) of the first graph

    def expect(self, graphs: Sequence[KernelGraph]) -> None:
        """Graphs to be planned after the first: their own buffers (all but
        weights and state, which are shared) are kept free of the budget."""
        self.extra = sum(b.nbytes for g in graphs for b in g.buffers.values() if b.role not in ("weight", "state"))

    def offload(self, graph: KernelGraph, devices: Sequence[str], reserve: int = 0) -> Offload:
        costs = self.costs if self.costs is not None else HostRoofline(
            self.switch_s, self.cpu_bps, self.cpu_rows_bps, self.cpu_flops, self.expert_load).table(graph, devices)
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
            got = choose_homes(o, self.slot_options)
        else:
            base = BASELINES.get(self.policy)
            got = base(o) if base is not None else streaming(o, self.slot_options)
            if got is None:
                raise PlanError(f"offload: no {self.policy} placement fits {o.devices[o.gpu]} "
                                f"(budget {o.budget} bytes)")
        p, st = got
        self.homes, self.staging = homes_of(o, p), (p.slots, p.slot_bytes)
        self.state_homes = state_homes(graph, p.assignment)
        return to_plan(o, p, f"offload-{self.policy}", st)
