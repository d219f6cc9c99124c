"""Per-role mixes for the offload planner's packed staging ring
(``ring=bytes``): which of each role's weights (a layer's ``up``, its
``gate``, ...) the CPU computes and which are streamed, searched by counts
per role on the step model of :mod:`~tessera_actors.planning.offload`.
Pure Python."""
from __future__ import annotations

from typing import Sequence

from tessera_actors.planning.offload import Offload


def unit_classes(o: Offload, units: Sequence[int]) -> list[list[int]]:
    """``units`` (program order) by role: the name of a unit's first weight
    with its numbers taken out (``decoder.layers.7.ffn.up.weight`` ->
    ``decoder.layers.#.ffn.up.weight``), so a class is one weight of every
    layer; classes in the order of their first unit."""
    by: dict[str, list[int]] = {}
    for u in units:
        name = o.graph.buffers[o.units[u][0]].name or f"#{u}"
        key = ".".join("#" if part.isdigit() else part for part in name.split("."))
        by.setdefault(key, []).append(u)
    return list(by.values())


def class_chooser(o: Offload, slots: int, limit: int, rounds: int = 3):
    """``resident -> choice``: rounds over the classes of the streamable
    units (:func:`unit_classes`), each time the number of a class's units
    computed on the CPU (spread evenly over its layers, the others streamed)
    that gives the shortest step on the model, the other classes as they
    are; started from the best of one class entirely on the CPU and a
    second one partly (the rest streamed).  It finds mixes a flip of one
    unit cannot reach: the CPU computing a layer's ``up`` everywhere and its ``gate`` in
    every third layer, where one CPU run serves both (two device changes,
    not four)."""
    first = {u: o.kernels[u][0] for u in o.units}

    def step(ch: dict[int, str]) -> float:
        return o.simulate(o.placement(ch, slots, limit)).step_s

    def spread(cls: list[int], k: int, ch: dict[int, str]) -> None:
        n = len(cls)
        on_cpu = {int((i + 0.5) * n / k) for i in range(k)} if k else set()
        for i, u in enumerate(cls):
            ch[u] = "C" if i in on_cpu else "S"

    def descend(ch: dict[int, str], classes: list[list[int]]) -> tuple[dict[int, str], float]:
        t = step(ch)
        for _ in range(rounds):
            improved = False
            for cls in classes:
                now = sum(ch[u] == "C" for u in cls)
                best_k = now
                for k in range(len(cls) + 1):
                    if k == now:
                        continue
                    spread(cls, k, ch)
                    t2 = step(ch)
                    if t2 < t - 1e-12:
                        t, best_k, improved = t2, k, True
                spread(cls, best_k, ch)
            if not improved:
                break
        return ch, t

    def choose(resident: set[int]) -> dict[int, str]:
        base = {u: "R" if u in resident else ("S" if u in o.streamable and o.size[u] <= limit else "C")
                for u in o.units}
        classes = unit_classes(o, sorted((u for u in base if base[u] == "S"), key=first.get))
        # seeds: one class on the CPU, a second one partly (a coarse grid), the rest streamed
        seed, best_t = dict(base), step(base)
        for full in classes:
            for part in classes:
                if part is full:
                    continue
                n = len(part)
                for k in range(0, n + 1, max(1, n // 8)):
                    ch = dict(base)
                    spread(full, len(full), ch)
                    spread(part, k, ch)
                    t = step(ch)
                    if t < best_t:
                        seed, best_t = ch, t
        return descend(dict(seed), classes)[0]
    return choose


__all__ = ["class_chooser", "unit_classes"]
