"""Every policy of ``tessera advise`` on a group of GPUs, each at its best
decode batch within memory, and the placement bound beside them.

A GPU group is a list of GPU names (``A100,L40S``; ``8xB200,8xH100``), the
first type ``L``, the other ``R``.  Costs come from the what-if model
(:mod:`.whatif`) and simulated links (:mod:`.specs`).  For each decode
bucket (:func:`.reference.decode_buckets`) a policy is predicted where its
memory holds it, and the batch with the most tokens/s is kept; ``batch`` is
the number of sequences a policy decodes at once (a plan's batch times its
micro-batches in flight; the replicas' batches summed).

Workload: a batch of ``b`` requests costs ``b`` prefills and ``out_tokens``
decode steps (:func:`unit_s`: time sharing on one GPU, PD on two, the one
formula of both).  Policies: Homo-L / Homo-R (every GPU of one
type alone, a replica each), Request Distribution (a replica on every GPU
that holds one, its own best batch each), PD (prefill on one GPU, decode on
another, the prompt's KV cache crossing the link), AF (attention on one GPU,
the rest on another, two micro-batches; prefill on the better GPU), Layer
split (a pipeline over every GPU, prefill too) and Tessera (the MILP
planner's throughput plan of each graph - one plan per bucket, as the
engine serves; it falls back to a baseline plan when that is predicted
faster, and says so; the prompt's plan is served under the decode plan's
state and weight homes, as the scheduler serves it, pinned when it breaks
them, with its micro-batches in flight as the engine keeps its prompt
steps (:func:`.inflight.prompt_inflight`): a pair that keeps the KV cache
or the weights in two places is not a Tessera row).  ``bound``: :func:`.bound.placement_bound` over the
same graphs, the best batch's.  DiT: one request is an image of
``denoise_steps`` steps at a batch of 16; its tokens are the latent tokens;
PD and AF do not apply (nor AF to the SSM), as in the paper.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan, PlanError, build_plan
from tessera_actors.planning.baselines import af_plan, layer_split_plan
from tessera_actors.planning.bound import placement_bound
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.inflight import fits, prompt_inflight
from tessera_actors.planning.pinning import served_plan, state_homes, weight_homes
from tessera_actors.planning.planner import MilpPlanner, PlannerConfig
from tessera_actors.planning.reference import Workload, batch_of, decode_buckets, graph_path, load_graph, load_params
from tessera_actors.planning.simulate import simulate
from tessera_actors.planning.specs import get_spec
from tessera_actors.planning.symmetry import device_types, type_table
from tessera_actors.planning.whatif import Fitted

POLICIES = ("Homo-L", "Homo-R", "Request Distribution", "PD", "AF", "Layer split", "Tessera")


def parse_gpus(text: str) -> list[str]:
    """``A100,L40S`` or ``8xB200,8xH100`` -> one name per GPU (spec names)."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        count, _, name = part.rpartition("x") if "x" in part and part.split("x")[0].isdigit() else ("1", "", part)
        if int(count) < 1:
            raise ValueError(f"bad GPU count in {part!r}")
        out += [get_spec(name).name] * int(count)
    if len(out) < 2 or len(set(out)) > 2:
        raise ValueError("--gpus takes two GPU types (L,R), optionally with counts (8xB200,8xH100)")
    return out


def _homo_plan(graph: KernelGraph, costs: CostTable, d: int) -> Plan | None:
    """The whole graph on device ``d``; None when it does not fit."""
    held = sum(b.nbytes for b in graph.buffers.values() if b.role in ("weight", "state"))
    if costs.mem[d] is not None and held > costs.mem[d]:
        return None
    plan = build_plan(graph, costs.devices, [d] * len(graph.kernels), name=f"homo[{costs.devices[d]}]")
    return None if any(fits(graph, plan, costs)) else plan


def _holds(graph: KernelGraph, costs: CostTable) -> bool:
    """The budgets together can hold the graph's weights and state at all."""
    need = sum(b.nbytes for b in graph.buffers.values() if b.role in ("weight", "state"))
    return all(m is not None for m in costs.mem) and need <= sum(costs.mem) or None in costs.mem


@dataclass(frozen=True)
class Option:
    """One way to run a bucket: ``rate`` executions/s on its own, ``busy[d]``
    compute seconds per execution on device ``d``, micro-batches in flight,
    and the plan (None: a rate without one)."""

    rate: float
    busy: tuple[float, ...]
    inflight: int
    label: str
    plan: Plan | None = field(default=None, compare=False)


def _busy(plan: Plan, costs: CostTable) -> tuple[float, ...]:
    busy = [0.0] * costs.ndev
    for k, d in enumerate(plan.assignment):
        busy[d] += costs.times[k][d]
    return tuple(busy)


def _homo(graph: KernelGraph, costs: CostTable, d: int) -> Option | None:
    plan = _homo_plan(graph, costs, d)
    t = costs.device_total(d)
    return None if plan is None else Option(1 / t, tuple(t if e == d else 0.0 for e in range(costs.ndev)), 1,
                                            f"on {costs.devices[d]}", plan)


def _planned(graph: KernelGraph, costs: CostTable, planner: str) -> Option | None:
    """The throughput plan of ``planner`` (``layers``, ``af`` or ``milp``) as an option."""
    try:
        if planner == "layers":
            p, label = layer_split_plan(graph, costs.devices, costs, _inflight(costs)), "pipeline"
        elif planner == "af":
            p = af_plan(graph, costs.devices, costs)
            label = f"attention on {p.meta.get('attention_device')}"
        else:
            p = MilpPlanner(costs, PlannerConfig(time_limit_s=2.0 if costs.ndev <= 4 else 30.0,
                                                 max_inflight=_inflight(costs))).plan(graph, costs.devices, "throughput")
            label = "MILP plan" if p.meta["source"] == "milp" else f"fell back to {p.meta['source']}"
    except PlanError:
        return None
    if any(fits(graph, p, costs, p.microbatches)):
        return None
    return Option(p.meta["predicted"]["throughput"], _busy(p, costs), p.microbatches, label, p)


def served_prefill(gp: KernelGraph, cp: CostTable, pres: Sequence[Option], g: KernelGraph,
                   dec: Option) -> list[Option]:
    """The prompt's plans ``pres`` (of ``gp`` on ``cp``) as the engine serves
    them beside decode plan ``dec`` (of ``g``): as planned where they keep
    its state and weight homes, else pinned to them
    (:func:`.pinning.served_plan`, the scheduler's rule), each with the
    prompt-chunk steps in flight the engine keeps on it
    (:func:`.inflight.prompt_inflight`); pinned plans that do not fit are
    left out."""
    pins, weights = state_homes(g, dec.plan.assignment), weight_homes(g, dec.plan.assignment)
    out, seen = [], set()
    for o in pres:
        plan = served_plan(gp, o.plan, cp.devices, pins, weights)
        m = prompt_inflight(plan)
        if plan is o.plan and m == o.inflight:
            out.append(o)
        elif (tuple(plan.assignment), m) not in seen:
            seen.add((tuple(plan.assignment), m))
            label = o.label if plan is o.plan else f"pinned to decode's homes (planned {o.label})"
            if not any(fits(gp, plan, cp, m)):
                out.append(Option(simulate(plan, cp, inflight=m).throughput, _busy(plan, cp), m, label, plan))
    return out


def _inflight(costs: CostTable) -> int | None:
    """Micro-batches in flight a plan may use: the planner's default, at most
    16 (past that a pipeline over 16 GPUs gains little and simulating it
    costs the advisor its minute)."""
    return None if costs.ndev <= 8 else 16


def unit_s(parts: Sequence[tuple[Option, float]], link_s: float = 0.0) -> float:
    """Seconds of a unit of work that runs each option ``n`` times
    (``parts``: (option, n)), their steps in flight together as the engine
    runs buckets: at least each option's own time, each device's compute of
    all of them, and the link's ``link_s``.  One device for everything is
    time sharing (the sum); prefill and decode on different devices is PD."""
    own = max(n / o.rate for o, n in parts)
    dev = max(sum(n * o.busy[d] for o, n in parts) for d in range(len(parts[0][0].busy)))
    return max(own, dev, link_s)


class _Cell:
    """Per batch, the graphs and costs of one model on one GPU group."""

    def __init__(self, model: str, gpus: Sequence[str], wl: Workload, params, data: str | None) -> None:
        self.model, self.gpus, self.wl, self.data = model, list(gpus), wl, data
        self.params = params
        self.ssm, self.dit = model == "mamba2", model == "dit"
        self.prefill: tuple[KernelGraph, CostTable] | None = None
        if not (self.ssm or self.dit):
            gp = load_graph(model, "prefill-b1-t1024", data)
            self.prefill = (gp, Fitted(params).table(gp, self.gpus))

    def decode(self):
        """(batch, graph, costs) of every decode bucket there is a graph of
        and whose weights and state the GPUs can hold together."""
        have = [b for b in decode_buckets(self.model) if graph_path(self.model, b, self.data).exists()]
        if not have:
            raise FileNotFoundError(f"no decode graph of {self.model} under {self.data or 'the committed data'} "
                                    "(run scripts/capture_advise_graphs.py)")
        for bucket in have:
            g = load_graph(self.model, bucket, self.data)
            c = Fitted(self.params).table(g, self.gpus)
            if _holds(g, c):
                yield batch_of(bucket), g, c

    def tokens_per_s(self, b: int, pre: Option | None, dec: Option, link_s: float = 0.0) -> float | None:
        """Output tokens/s of units of ``b`` requests: ``b`` prefills (the SSM:
        prompt / b decode steps each) and ``out_tokens`` decode steps (DiT:
        latent tokens/s of images of ``denoise_steps`` steps)."""
        if self.dit:
            return b * self.wl.image_tokens / unit_s([(dec, self.wl.denoise_steps)])
        if self.ssm:
            return b * self.wl.out_tokens / unit_s([(dec, self.wl.out_tokens + self.wl.prompt)])
        if pre is None:
            return None
        return b * self.wl.out_tokens / unit_s([(pre, b), (dec, self.wl.out_tokens)], b * link_s)

    def bound(self, b: int, g: KernelGraph, c: CostTable) -> float:
        work = [(g, c, float(self.wl.denoise_steps if self.dit else self.wl.out_tokens))]
        if self.prefill:
            work.append((self.prefill[0], self.prefill[1], float(b)))
        elif self.ssm:
            work = [(g, c, float(self.wl.out_tokens + self.wl.prompt))]
        mult = None
        if len(self.gpus) > 4:
            types = device_types(c)
            work = [(gg, type_table(cc, types), n) for gg, cc, n in work]
            mult = [len(t) for t in types]
        tau = placement_bound(work, mult).tau_s
        return (b * self.wl.image_tokens if self.dit else b * self.wl.out_tokens) / tau


def evaluate(model: str, gpus: Sequence[str], workload: Workload | None = None, params=None,
             data: str | None = None) -> dict[str, Any]:
    """Predicted tokens/s, tokens/$, batch and notes of every applicable
    policy on ``gpus`` (see the module docstring), with ``bound``."""
    wl = workload or Workload()
    cell = _Cell(model, list(gpus), wl, params or load_params(), data)
    gpus = cell.gpus
    kinds = list(dict.fromkeys(gpus))
    groups = {"Homo-L": [i for i, g in enumerate(gpus) if g == kinds[0]],
              "Homo-R": [i for i, g in enumerate(gpus) if g == kinds[-1]]}
    pre: dict[str, Option | None] = {}
    if cell.prefill:
        pre = {f"homo{d}": _homo(*cell.prefill, d) for d in range(len(gpus))}
        pre.update({k: _planned(*cell.prefill, k) for k in ("layers", "milp")})
    found: dict[str, tuple[float, int, str]] = {}
    replica: dict[int, tuple[float, int]] = {}
    bound: tuple[float, int] | None = None

    def keep(policy: str, tps: float | None, batch: int, note: str) -> None:
        if tps and tps > 0 and (policy not in found or tps > found[policy][0]):
            found[policy] = (tps, batch, note)

    for b, g, c in cell.decode():
        homo = [_homo(g, c, d) for d in range(len(gpus))]
        for d, o in enumerate(homo):
            r = cell.tokens_per_s(b, pre.get(f"homo{d}"), o) if o else None
            if r and (d not in replica or r > replica[d][0]):
                replica[d] = (r, b)
        _split_policies(cell, keep, pre, homo, b, g, c)
        v = cell.bound(b, g, c)
        if bound is None or v > bound[0]:
            bound = (v, b)
    for pol, devs in groups.items():
        if devs and all(d in replica for d in devs):
            keep(pol, sum(replica[d][0] for d in devs), sum(replica[d][1] for d in devs),
                 f"a replica on each of {len(devs)} {gpus[devs[0]]}, batch {replica[devs[0]][1]} each")
    if replica:
        keep("Request Distribution", sum(r for r, _ in replica.values()), sum(b for _, b in replica.values()),
             "a replica per GPU that holds one, batches " + "/".join(str(replica[d][1]) for d in sorted(replica)))
    return _result(cell, groups, found, bound)


def _result(cell: _Cell, groups: dict, found: dict, bound) -> dict[str, Any]:
    price = {g: get_spec(g).price_per_h for g in cell.gpus}
    out = {}
    for pol in POLICIES:
        if pol in found:
            tps, batch, note = found[pol]
            used = [cell.gpus[d] for d in groups[pol]] if pol in groups else cell.gpus
            cost = sum(price[x] for x in used)
            out[pol] = {"tokens_per_s": tps, "tokens_per_dollar": tps * 3600 / cost, "price_per_h": cost,
                        "batch": batch, "note": note}
    res = {"model": cell.model, "gpus": cell.gpus, "policies": out,
           "unit": "latent tokens" if cell.dit else "output tokens"}
    if bound is not None:
        res["bound"] = {"tokens_per_s": bound[0], "batch": bound[1]}
    return res


def _split_policies(cell: _Cell, keep, pre: dict, homo: list, b: int, g: KernelGraph, c: CostTable) -> None:
    """PD, AF, Layer split and Tessera at decode batch ``b``.  Tessera picks,
    for each bucket, the MILP's plan, the pipeline or one GPU alone,
    whichever pair of plans makes the most tokens/s together (plans of one
    bucket at a time: the MILP does not see the other bucket's load)."""
    two = len(cell.gpus) == 2
    if two and not cell.dit:
        _pd(cell, keep, pre, homo, b, g, c)
    single = [o for k, o in pre.items() if k.startswith("homo") and o]
    best_pre = max(single, key=lambda o: o.rate, default=None)
    if two and not (cell.ssm or cell.dit):
        af = _planned(g, c, "af")
        if af:
            keep("AF", cell.tokens_per_s(b, best_pre, af), af.inflight * b,
                 f"decode {af.label} x{af.inflight}; prefill {best_pre.label if best_pre else '-'}")
    ls = _planned(g, c, "layers")
    if ls:
        keep("Layer split", cell.tokens_per_s(b, pre.get("layers"), ls), ls.inflight * b,
             f"decode pipeline x{ls.inflight}; prefill pipeline")
    milp = _planned(g, c, "milp")
    # the planner's own candidates: its MILP plan, the pipeline, one GPU alone (per bucket); the prompt's
    # plan as the engine serves it beside the decode plan
    decs = [o for o in [milp, ls, *homo] if o]
    pres = [o for o in [pre.get("milp"), pre.get("layers"), *single] if o]
    best = None
    for d in decs:
        for p in (served_prefill(*cell.prefill, pres, g, d) if cell.prefill else []) or [None]:
            v = cell.tokens_per_s(b, p, d)
            if v and (best is None or v > best[0]):
                best = (v, d, p)
    if best:
        v, d, p = best
        keep("Tessera", v, d.inflight * b,
             f"decode {d.label} x{d.inflight}" + (f"; prefill {p.label} x{p.inflight}" if p else ""))


def _pd(cell: _Cell, keep, pre: dict, homo: list, b: int, g: KernelGraph, c: CostTable) -> None:
    """PD at decode batch ``b``: :func:`unit_s` of the prefills on one GPU
    (an SSM's: its prompt's decode steps) and the decode steps on the other,
    the prompt's state (per-token KV bytes of the decode graph, or an SSM's
    fixed state) crossing the link per request."""
    state = sum(x.nbytes for x in g.buffers.values() if x.role == "state")
    kv = state / b if cell.ssm else state / (b * cell.wl.cache) * (cell.wl.prompt + (576 if cell.model == "vlm" else 0))
    for p, d in ((0, 1), (1, 0)):
        if homo[d] is None:
            continue
        if cell.ssm:
            t = c.device_total(p)
            prefill, n = Option(1 / t, tuple(t if e == p else 0.0 for e in range(c.ndev)), 1, ""), cell.wl.prompt
        else:
            prefill, n = pre.get(f"homo{p}"), b
        if prefill:
            out = cell.wl.out_tokens
            keep("PD", b * out / unit_s([(prefill, n), (homo[d], out)], b * c.comm_s(p, d, kv)), b,
                 f"prefill on {cell.gpus[p]}, decode on {cell.gpus[d]}, KV {kv / 2**20:.0f} MiB/request")
