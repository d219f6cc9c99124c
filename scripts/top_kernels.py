"""Where a GPU step's time goes: the top kernels of one model step, eager and
under ``torch.compile(mode="reduce-overhead")``, from ``torch.profiler``
(a diagnostic for ``tessera bench roofline``).

    python scripts/top_kernels.py --model llama --case decode [--layers 4]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from tessera_actors.roofline import RooflineConfig, build


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
    return rows[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    ap.add_argument("--case", default="decode")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    cfg = RooflineConfig(models=(a.model,), layers=a.layers)
    make, label = build(a.model, a.case, cfg, torch.device("cuda:0"))
    model, inputs = make()
    for name, fn in (("eager", model), ("compile", torch.compile(model, mode="reduce-overhead", fullgraph=True))):
        rows = top(lambda: fn(**inputs), a.steps, a.top)
        total = sum(t for _, t in rows)
        print(f"== {a.model} {label} {name}: top {len(rows)} kernels {total:.0f} us per step")
        for key, t in rows:
            print(f"{t:9.1f} us  {key[:110]}")


if __name__ == "__main__":
    main()
