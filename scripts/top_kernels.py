"""Where a GPU step's time goes: the top kernels of one model step, eager and
under ``torch.compile(mode="reduce-overhead")``, and of the engine's served
decode step (``AsyncEngine`` serving a saturating trace), from
``torch.profiler`` (a diagnostic for ``tessera bench roofline``).

    python scripts/top_kernels.py --model llama --case decode [--layers 4]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from tessera_actors.bench.roofline import RooflineConfig, build


def top(fn, steps: int, n: int) -> list[tuple[str, float]]:
    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / steps) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    rows.sort(key=lambda r: -r[1])
    return rows


def served_rows(a) -> tuple[list[tuple[str, float]], dict]:
    """The same, for the engine's decode step while it serves a saturating
    trace (``AsyncEngine``, ``tessera_actors.bench.served``): the profiler
    runs over the window in which every row decodes; also the window's wall
    time per step, so GPU idle time shows as the difference."""
    import asyncio

    from tessera_actors.bench.served import ServedCase, served_decode
    prof = profile(activities=[ProfilerActivity.CUDA])

    def hook(mark: str) -> None:
        if mark == "start":
            prof.start()
        else:
            torch.cuda.synchronize()
            prof.stop()
    case = ServedCase(a.model, layers=a.layers, batch=a.batch, cache=a.cache, gqa=a.gqa, regions=a.regions,
                      window_hook=hook)
    res = asyncio.run(served_decode(case))
    steps = res["window_steps"]
    rows = [(e.key, e.device_time_total / steps) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    rows.sort(key=lambda r: -r[1])
    return rows, {"steps": steps, "served_step_us": res["served_step_s"] * 1e6, "capture": res["capture"],
                  "host_us": {k: round(v * 1e6) for k, v in res["host_s"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    ap.add_argument("--case", default="decode")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--paths", default="eager,compile,served")
    ap.add_argument("--batch", type=int, default=64, help="served: decode rows")
    ap.add_argument("--cache", type=int, default=2048, help="served: the KV window")
    ap.add_argument("--regions", default="auto", help="served: the capture's regions")
    ap.add_argument("--gqa", default=RooflineConfig().gqa, choices=["fold", "enable_gqa"])
    a = ap.parse_args()
    cfg = RooflineConfig(models=(a.model,), layers=a.layers, gqa=a.gqa)
    make, label = build(a.model, a.case, cfg, torch.device("cuda:0"))
    model, inputs = make()
    for name in a.paths.split(","):
        extra = {}
        if name == "served":
            rows, extra = served_rows(a)
        else:
            fn = model if name == "eager" else torch.compile(model, mode="reduce-overhead", fullgraph=True)
            rows = top(lambda: fn(**inputs), a.steps, a.top)
        total = sum(t for _, t in rows)
        print(f"== {a.model} {label} {name}: {len(rows)} kernels, {total:.0f} us of GPU time per step {extra}; the top {a.top}:")
        for key, t in rows[:a.top]:
            print(f"{t:9.1f} us  {key[:110]}")


if __name__ == "__main__":
    main()
