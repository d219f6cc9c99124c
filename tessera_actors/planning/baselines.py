"""The competing policies, as plans of the same type as Tessera's.

Throughput everywhere is in *graph executions per second* (one execution
processes the graph's batch: multiply by its tokens for tokens/s).

* **Homo** (:func:`homo_plan`): every kernel on one device.
* **Request Distribution** (:func:`request_distribution`): one replica per
  device whose memory holds the whole graph, requests routed in proportion
  to speed; throughput = the sum of the replicas' throughputs.  It is several
  plans, one per device, with the request share in ``plan.meta["share"]``.
* **PD**: the prefill graph on one device, the decode graph on the other,
  the prefill graph's state (KV cache) crossing the link per request; it
  is a workload of two graphs, so ``tessera advise`` predicts it
  (``policies.unit_s``, the one formula of prefill and decode sharing
  devices), not a baseline of one graph here.
* **AF** (:func:`af_plan`): attention kernels on one device, everything else
  (FFN/MLP/experts, norms, embeddings) on the other, two micro-batches
  ping-ponging.  A kernel is attention when its ``scope`` has a module path
  part containing ``attn``/``attention`` but not ``norm`` (so
  ``post_attention_layernorm`` is not attention); kernels without scope fall back to
  their name (``attn``, ``attention``, ``sdpa``, ``flash``, ``softmax``,
  ``rope``/``rotary``, ``q/k/v/o_proj``).  With more than two devices it uses
  the two fastest, trying both orientations.
* **Layer split** (:func:`layer_split_plan`): contiguous layer ranges per
  device in the given device order, cut only at legal cut points (at layer
  boundaries when the graph has layers), sized to balance the devices'
  times (a pipeline), micro-batches chosen by simulation.

Assignments are passed through :func:`repair`, which keeps state groups and
indirect neighbourhoods together, so each baseline is a legal plan.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tessera_actors.graph import KernelGraph
from tessera_actors.plan import Plan, PlanError, build_plan, legal_cuts, validate_assignment
from tessera_actors.planning.coarsen import layer_of
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.inflight import annotate, choose_inflight, default_inflight, fits, memory_inflight
from tessera_actors.planning.simulate import simulate
from tessera_actors.planning.symmetry import device_types, least_limit

_ATTN_SCOPE = re.compile(r"attn|attention", re.I)
_ATTN_NAME = re.compile(r"attn|attention|sdpa|flash|softmax|rope|rotary|[qkvo]_proj", re.I)


@dataclass
class BaselineResult:
    """One policy's prediction; ``throughput`` None when it does not apply
    or does not fit (``note`` says why)."""

    name: str
    throughput: float | None
    step_s: float | None
    plans: list[Plan] = field(default_factory=list)
    note: str = ""


def repair(graph: KernelGraph, assignment: Sequence[int]) -> list[int]:
    """Make an assignment legal: every state group moves to the device holding
    most of its kernels, every indirect kernel pulls its neighbours to its
    device; repeated until stable."""
    a = list(assignment)
    groups = graph.state_groups()
    for _ in range(len(graph.kernels) + 1):
        before = list(a)
        for k in graph.kernels:
            if k.indirect:
                for n in (k.id - 1, k.id + 1):
                    if 0 <= n < len(a):
                        a[n] = a[k.id]
        for g in groups:
            devs = [a[k] for k in g]
            d = max(set(devs), key=lambda x: (devs.count(x), -x))
            for k in g:
                a[k] = d
        if a == before:
            return a
    raise PlanError("could not make the assignment legal (conflicting state groups and indirect kernels)")


def homo_plan(graph: KernelGraph, devices: Sequence[str], d: int, costs: CostTable) -> Plan:
    """All kernels on device ``d`` (the plan still lists every device)."""
    p = build_plan(graph, devices, [d] * len(graph.kernels), name=f"homo[{devices[d]}]", mode="throughput")
    return annotate(p, simulate(p, costs, inflight=1), 1)


def _result(name: str, plan: Plan, graph: KernelGraph, costs: CostTable) -> BaselineResult:
    short = fits(graph, plan, costs)
    if any(short):
        worst = int(np.argmax(short))
        return BaselineResult(name, None, None, [plan],
                              f"does not fit: {plan.devices[worst]} short by {short[worst]} bytes")
    pred = plan.meta["predicted"]
    return BaselineResult(name, pred["throughput"], pred["step_s"], [plan])


def request_distribution(graph: KernelGraph, devices: Sequence[str], costs: CostTable) -> BaselineResult:
    """A replica per device that can hold the whole graph; shares ∝ speed."""
    plans = [homo_plan(graph, devices, d, costs) for d in range(len(devices))]
    ok = [p for p in plans if not any(fits(graph, p, costs))]
    if not ok:
        return BaselineResult("request-distribution", None, None, plans, "no device holds the whole model")
    total = sum(p.meta["predicted"]["throughput"] for p in ok)
    for p in ok:
        p.meta["share"] = p.meta["predicted"]["throughput"] / total
    return BaselineResult("request-distribution", total, min(p.predicted_step_s for p in ok), ok,
                          "" if len(ok) == len(plans) else f"{len(plans) - len(ok)} device(s) cannot hold a replica")


def is_attention(kernel) -> bool:
    if kernel.scope:
        return any(_ATTN_SCOPE.search(p) and "norm" not in p.lower() for p in kernel.scope.split("."))
    return bool(_ATTN_NAME.search(kernel.name))


def _fastest_two(costs: CostTable) -> tuple[int, int]:
    order = sorted(range(costs.ndev), key=lambda d: (costs.device_total(d), d))
    return order[0], order[1 if len(order) > 1 else 0]


def af_assignment(graph: KernelGraph, attn_device: int, ffn_device: int) -> list[int]:
    return repair(graph, [attn_device if is_attention(k) else ffn_device for k in graph.kernels])


def af_plan(graph: KernelGraph, devices: Sequence[str], costs: CostTable) -> Plan:
    """Attention on one of the two fastest devices, the rest on the other;
    both orientations simulated with 2 micro-batches, the better returned."""
    a, b = _fastest_two(costs)
    best = None
    for att, ffn in ((a, b), (b, a)):
        p = build_plan(graph, devices, af_assignment(graph, att, ffn), name="af", mode="throughput",
                       microbatches=2)
        annotate(p, simulate(p, costs, inflight=2), 2)
        p.meta["attention_device"] = devices[att]
        if best is None or p.meta["predicted"]["throughput"] > best.meta["predicted"]["throughput"]:
            best = p
    return best


def layer_split_assignment(graph: KernelGraph, costs: CostTable) -> list[int]:
    """Contiguous ranges (device order) with the smallest bottleneck time,
    cut at legal layer boundaries (binary search on the bottleneck with a
    greedy fill, optimal for an ordered partition)."""
    n, ndev = len(graph.kernels), costs.ndev
    ok = legal_cuts(graph)
    layer_cuts = [i for i in range(1, n) if ok[i] and layer_of(graph.kernels[i]) != layer_of(graph.kernels[i - 1])]
    cuts = layer_cuts or [i for i in range(1, n) if ok[i]]
    cand = np.asarray(cuts + [n])
    times = np.asarray(costs.times, dtype=float).reshape(n, ndev)
    cum = np.vstack([np.zeros(ndev), np.cumsum(times, axis=0)])

    def fill(limit: float) -> list[int] | None:
        bounds, start = [0], 0
        for d in range(ndev):
            if start >= n:
                bounds.append(n)
                continue
            reach = cum[cand, d] - cum[start, d] <= limit
            idx = np.nonzero(reach & (cand > start))[0]
            end = int(cand[idx[-1]]) if len(idx) else start
            bounds.append(end)
            start = end
        return bounds if start >= n else None

    bounds = least_limit(fill, float(times.sum(axis=0).min()), 60) or [0] + [n] * ndev
    assignment = [0] * n
    for d in range(ndev):
        for k in range(bounds[d], bounds[d + 1]):
            assignment[k] = d
    return repair(graph, assignment)


def layer_split_plan(graph: KernelGraph, devices: Sequence[str], costs: CostTable,
                     max_inflight: int | None = None) -> Plan:
    """Micro-batches in flight chosen by simulation up to ``max_inflight``
    (default: the planner's default for this many devices)."""
    p = build_plan(graph, devices, layer_split_assignment(graph, costs), name="layer-split", mode="throughput")
    pred = choose_inflight(p, costs, memory_inflight(graph, p, costs, max_inflight or default_inflight(len(devices))))
    return annotate(p, pred)


def candidate_assignments(graph: KernelGraph, costs: CostTable) -> list[tuple[str, list[int]]]:
    """Legal single-plan baselines the MILP planner compares itself with.
    Homo once per type of identical devices (the others predict the same)
    and only where the budget holds the weights and state; AF in one
    orientation when its two devices are identical and their link the same
    both ways (the other is its mirror image)."""
    types = device_types(costs)
    held = sum(b.nbytes for b in graph.buffers.values() if b.role in ("weight", "state"))
    out = [(f"homo[{costs.devices[t[0]]}]", [t[0]] * len(graph.kernels)) for t in types
           if costs.mem[t[0]] is None or held <= costs.mem[t[0]]]
    if costs.ndev > 1:
        out.append(("layer-split", layer_split_assignment(graph, costs)))
        a, b = _fastest_two(costs)
        out.append(("af", af_assignment(graph, a, b)))
        mirror = any(a in t and b in t for t in types) and costs.latency[a][b] == costs.latency[b][a] \
            and costs.bandwidth[a][b] == costs.bandwidth[b][a]
        if not mirror:
            out.append(("af", af_assignment(graph, b, a)))
    for _, a in out:
        validate_assignment(graph, a, costs.ndev)
    return out


def single_graph_baselines(graph: KernelGraph, devices: Sequence[str], costs: CostTable) -> list[BaselineResult]:
    """Homo on every device, request distribution, AF and layer split."""
    out = [_result(f"homo[{devices[d]}]", homo_plan(graph, devices, d, costs), graph, costs)
           for d in range(len(devices))]
    out.append(request_distribution(graph, devices, costs))
    if len(devices) > 1:
        out.append(_result("af", af_plan(graph, devices, costs), graph, costs))
        out.append(_result("layer-split", layer_split_plan(graph, devices, costs), graph, costs))
    return out
