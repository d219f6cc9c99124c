"""``tessera_actors.check``: is a model's captured program right, split or not?

``check(model, inputs, devices=["cpu", "cpu"], orders=20)`` takes a module
and the keyword inputs a user passes to ``model(**inputs)`` (any pytree;
plain keywords are constants of the bucket), captures one forward pass and
replays it through the product's :class:`~tessera_actors.execution.reference.PlanRunner`:

=====================  ==============================================
case                   compared with
=====================  ==============================================
single-device          the eager model (program order, ``devices[0]``)
random orders (N)      single-device: N random topological orders
random splits (K)      single-device: K random legal placements on
                       ``devices``, device programs interleaved at random
contiguous split       single-device and the eager model
planner split          single-device and the eager model (``planner``)
=====================  ==============================================

A row is ``ok`` when every run of it is bitwise equal to its reference,
except where the two sides ran on different kinds of device (a CPU and a
GPU do not round alike) or a program ran a device's own variant of an op
(:mod:`tessera_actors.execution.variants`: the eager model runs torch's
plain kernels) against the eager model: then language-model tokens (argmax of outputs
named ``logits``, or of a lone [B, T, vocab] output) must be identical and the cosine similarity >= 0.9999.
``CheckReport.ok`` is True only when every row is.  Every device's program
runs in this process on the torch device its spec names (CPU thread options
such as ``cpu?threads=1`` are not applied: same threads on both sides).
Blocking; runs on the calling thread; the model's state (if any) is left as
it was.
"""
from __future__ import annotations

import random
import sys
import types
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from tessera_actors.capture.aten import capture_module, module_roles
from tessera_actors.capture.pytree import flatten_outputs
from tessera_actors.devices import DeviceSpec
from tessera_actors.plan import Plan, Segment, build_plan, single_device_plan
from tessera_actors.planning.registry import get_planner
from tessera_actors.execution.reference import PlanRunner
from tessera_actors.testing import random_assignment, random_topological_order

_COSINE_MIN = 0.9999


@dataclass
class CheckReport:
    """``rows``: one dict per case (``case``, ``reference``, ``runs``,
    ``mismatches``, ``bitwise``, ``max_abs``, ``cosine``, ``tokens``, ``ok``);
    ``info``: what was captured (kernels, guards, constants, output names)."""

    rows: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r["ok"] for r in self.rows)

    def table(self) -> str:
        head = f"{'case':<32} {'reference':<14} {'runs':>4} {'bitwise':>8} {'max abs':>10} {'cosine':>10} {'tokens':>7}  verdict"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            tok = "-" if r["tokens"] is None else ("same" if r["tokens"] else "DIFF")
            lines.append(f"{r['case']:<32} {r['reference']:<14} {r['runs']:>4} "
                         f"{('yes' if r['bitwise'] else 'NO'):>8} {r['max_abs']:>10.3g} {r['cosine']:>10.7f} "
                         f"{tok:>7}  {'ok' if r['ok'] else 'FAIL'}")
        i = self.info
        for r in self.rows:
            if "kernels_per_device" in r and r["reference"] == "eager":
                lines.append(f"{r['case']}: kernels per device {r['kernels_per_device']}, "
                             f"{r['bytes_moved']} bytes moved per step")
        lines.append(f"{i.get('kernels', 0)} kernels, {len(i.get('guards', []))} host-read guards, constants "
                     f"{i.get('constants', {})}, outputs {', '.join(i.get('output_names', []))}")
        lines.append("verdict: " + ("OK - every comparison holds" if self.ok else "FAILED"))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _vocab(model: torch.nn.Module) -> int | None:
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    return getattr(cfg, "vocab_size", None)


def _compare(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], names: Sequence[str],
             vocab: int | None = None) -> dict[str, Any]:
    bitwise, max_abs, cosine, tokens = True, 0.0, 1.0, None
    for name, g, w in zip(names, got, want):
        g, w = g.detach().cpu(), w.detach().cpu()
        if g.shape != w.shape:
            return {"bitwise": False, "max_abs": float("inf"), "cosine": 0.0, "tokens": False if tokens is not None else None}
        bitwise &= torch.equal(g, w)
        gf, wf = g.double().reshape(-1), w.double().reshape(-1)
        if gf.numel():
            max_abs = max(max_abs, float((gf - wf).abs().max()))
            denom = float(gf.norm() * wf.norm())
            cosine = min(cosine, float(gf @ wf) / denom if denom else float(torch.equal(gf, wf)))
        logits = name.split(".")[-1] == "logits" or (name == "output" and g.dim() == 3 and g.shape[-1] == vocab)
        if logits and g.is_floating_point():
            tokens = (tokens is not False) and torch.equal(g.argmax(-1), w.argmax(-1))
    return {"bitwise": bool(bitwise), "max_abs": max_abs, "cosine": cosine, "tokens": tokens}


def _row(case: str, reference: str, results: list[dict[str, Any]], same_kind: bool) -> dict[str, Any]:
    def passes(r: dict[str, Any]) -> bool:
        if same_kind:
            return r["bitwise"]
        return r["tokens"] is not False and r["cosine"] >= _COSINE_MIN
    bad = sum(not passes(r) for r in results)
    return {"case": case, "reference": reference, "runs": len(results), "mismatches": bad,
            "bitwise": all(r["bitwise"] for r in results), "max_abs": max(r["max_abs"] for r in results),
            "cosine": min(r["cosine"] for r in results),
            "tokens": None if all(r["tokens"] is None for r in results) else all(r["tokens"] is not False for r in results),
            "ok": bad == 0}


def _torch_device(spec: str) -> torch.device:
    d = DeviceSpec.parse(spec)
    return torch.device("cpu") if d.kind == "cpu" else torch.device("cuda", d.index)


def check(model: torch.nn.Module, inputs: dict[str, Any], devices: Sequence[str] = ("cpu", "cpu"),
          orders: int = 20, splits: int = 5, planner: str = "milp", seed: int = 0,
          verbose: bool = True) -> CheckReport:
    """Capture ``model(**inputs)`` and compare every way of running it (see
    the module docstring); print the verdict table when ``verbose``."""
    devices = [str(d) for d in devices]
    if len(devices) < 2:
        raise ValueError("check needs at least two devices to split over (e.g. ['cpu', 'cpu'])")
    _, state = module_roles(model, None)
    saved = {n: t.clone() for n, t in state.items()}

    def restore() -> None:
        with torch.no_grad():
            for n, t in state.items():
                t.copy_(saved[n])
    res = capture_module(model, inputs)
    g = res.graph
    names = g.meta["output_names"]
    vocab = _vocab(model)
    with torch.no_grad():
        eager = [t.detach().clone() for _, t in flatten_outputs(model(**inputs))]
    restore()
    kinds = [DeviceSpec.parse(d).kind for d in devices]
    model_kind = next((p.device.type for p in model.parameters()), "cpu")
    rng = random.Random(seed)

    def run(plan: Plan, policy: Any = "order", runner: PlanRunner | None = None) -> list[torch.Tensor]:
        runner = runner or PlanRunner(g, plan, res.values, lambda d: _torch_device(plan.devices[d]))
        runner.plan = plan
        for p in runner.progs:  # every run starts from the captured state
            p.load(res.values)
        return runner.step(inputs, policy)

    home = single_device_plan(g, devices[0])
    home_runner = PlanRunner(g, home, res.values, lambda d: _torch_device(devices[0]))
    single = run(home, runner=home_runner)
    # a program that ran a device's own variant of an op (execution/variants.py) is compared with
    # the eager model as another kind of device is: same tokens, cosine; never with itself
    plain = not any(p.variants for p in home_runner.progs)
    rows = [_row("single-device", "eager", [_compare(single, eager, names, vocab)], kinds[0] == model_kind and plain)]
    reordered = []
    for _ in range(orders):
        order = tuple(random_topological_order(g, rng))
        plan = replace(home, segments=[Segment(0, 0, order)], name="homo[random order]")
        reordered.append(_compare(run(plan, runner=home_runner), single, names, vocab))
    if orders:
        rows.append(_row(f"random orders ({orders})", "single-device", reordered, True))
    same = len(set(kinds)) == 1
    split_runs = []
    for _ in range(splits):
        plan = build_plan(g, devices, random_assignment(g, len(devices), rng), name="random")
        split_runs.append(_compare(run(plan, rng), single, names, vocab))
    if splits:
        rows.append(_row(f"random splits ({splits})", "single-device", split_runs, same))
    named = [("contiguous split", get_planner("contiguous").plan(g, devices))]
    if planner != "contiguous":
        named.append((f"planner split ({planner})", get_planner(planner).plan(g, devices)))
    for case, plan in named:
        out = run(plan)
        if len(set(plan.assignment)) < 2:  # named by what ran
            case = case.replace(" split (", " (one device, ")
        used = {kinds[d] for d in set(plan.assignment)}
        split = {"kernels_per_device": plan.kernels_per_device(), "bytes_moved": plan.bytes_per_step()}
        rows.append(dict(_row(case, "single-device", [_compare(out, single, names, vocab)], used <= {kinds[0]}), **split))
        rows.append(dict(_row(case, "eager", [_compare(out, eager, names, vocab)], used <= {model_kind} and plain),
                         **split))
    report = CheckReport(rows, {"kernels": len(g.kernels), "guards": g.meta["guards"],
                                "constants": g.meta["constants"], "output_names": names,
                                "devices": devices, "planner": planner})
    if verbose:
        print(report.table())
    return report


class _CallableModule(types.ModuleType):
    """``tessera_actors.check`` is both this module and the function: the
    package attribute becomes the module once it is imported, so the module
    itself is made callable."""

    def __call__(self, *args: Any, **kwargs: Any) -> CheckReport:
        return check(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
