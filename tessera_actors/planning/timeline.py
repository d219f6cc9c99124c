"""A PNG timeline (Gantt chart) of a plan's predicted schedule.

matplotlib is optional: :func:`render_png` raises :class:`TimelineUnavailable`
when it is not installed, and callers print that and carry on.
"""
from __future__ import annotations

from tessera_actors.planning.costs import CostTable
from tessera_actors.plan import Plan
from tessera_actors.planning.simulate import simulate


class TimelineUnavailable(RuntimeError):
    """matplotlib is not installed."""


def render_png(plan: Plan, costs: CostTable, path: str, inflight: int | None = None,
               items: int | None = None, title: str | None = None) -> None:
    """Simulate ``plan`` with ``inflight`` micro-batches (default the plan's)
    and draw device runs and link transfers per micro-batch colour to ``path``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise TimelineUnavailable("matplotlib is not installed (pip install matplotlib) - no PNG written") from e
    m = inflight or plan.microbatches or 1
    pred = simulate(plan, costs, inflight=m, items=items or max(2 * m, 2), record=True)
    rows = list(plan.devices) + sorted({e.resource for e in pred.events if e.kind == "xfer"})
    y = {r: i for i, r in enumerate(rows)}
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(rows) + 1.5))
    for e in pred.events:
        ax.barh(y[e.resource], (e.end - e.start) * 1e3, left=e.start * 1e3, height=0.7 if e.kind == "run" else 0.4,
                color=cmap(e.item % 10), edgecolor="black" if e.kind == "run" else "none", linewidth=0.2)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    thr = plan.meta.get("predicted", {}).get("throughput", pred.throughput)   # steady-state figure
    ax.set_title(title or f"{plan.name}: {m} micro-batch(es) in flight, step {pred.step_s * 1e3:.3f} ms, "
                 f"{thr:.1f} steps/s (first {len(set(e.item for e in pred.events))} micro-batches shown)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
