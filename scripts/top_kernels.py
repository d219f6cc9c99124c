"""Where a GPU step's time goes: the top kernels of one model step, eager and
under ``torch.compile(mode="reduce-overhead")``, from ``torch.profiler``
(a diagnostic for ``tessera bench roofline``).

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


def tessera_rows(model, inputs, steps: int, n: int) -> list[tuple[str, float]]:
    """The same, for the inductor capture run by a device actor (CUDA graphs)."""
    import asyncio

    import msgpack

    from actors.device import DeviceActor
    from actors.transfer import TransferActor
    from tessera_actors.capture.inductor import capture_inductor
    from tessera_actors.devices import DeviceSpec
    from tessera_actors.plan import plan_to_dict, single_device_plan
    from tessera_actors.runtime.messages import InstallPlan, LoadValues, RunStep
    from transport.system import ActorSystem
    res = capture_inductor(model, inputs)
    plan = single_device_plan(res.graph, "cuda:0")
    feed = {k: v.cpu() for k, v in inputs.items()}

    async def go():
        async with ActorSystem("top") as system:
            await system.spawn(TransferActor(), "transfer")
            dev = await system.spawn(DeviceActor(DeviceSpec.parse("cuda:0")), "device0")
            await dev.ask(InstallPlan("p", 0, msgpack.packb(res.graph.to_dict(), use_bin_type=True),
                                      msgpack.packb(plan_to_dict(plan), use_bin_type=True), [[0, "", "device0"]]),
                          timeout=900)
            held = [b for b in plan.resident[0] if b in res.values]
            await dev.ask(LoadValues("p", held, [res.values[b] for b in held]), timeout=900)
            for i in range(4):
                await dev.ask(RunStep("p", i, feed, [], True), timeout=900)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(steps):
                    await dev.ask(RunStep("p", 4 + i, feed, [], True), timeout=900)
                torch.cuda.synchronize()
            return prof
    prof = asyncio.run(go())
    rows = [(e.key, e.device_time_total / steps) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    rows.sort(key=lambda r: -r[1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    ap.add_argument("--case", default="decode")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--paths", default="eager,compile,tessera")
    ap.add_argument("--gqa", default=RooflineConfig().gqa, choices=["fold", "enable_gqa"])
    a = ap.parse_args()
    cfg = RooflineConfig(models=(a.model,), layers=a.layers, gqa=a.gqa)
    make, label = build(a.model, a.case, cfg, torch.device("cuda:0"))
    model, inputs = make()
    for name in a.paths.split(","):
        if name == "tessera":
            rows = tessera_rows(model, inputs, a.steps, a.top)
        else:
            fn = model if name == "eager" else torch.compile(model, mode="reduce-overhead", fullgraph=True)
            rows = top(lambda: fn(**inputs), a.steps, a.top)
        total = sum(t for _, t in rows)
        print(f"== {a.model} {label} {name}: {len(rows)} kernels, {total:.0f} us of GPU time per step; the top {a.top}:")
        for key, t in rows[:a.top]:
            print(f"{t:9.1f} us  {key[:110]}")


if __name__ == "__main__":
    main()
