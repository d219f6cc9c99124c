"""Where one activation hand-off between two device actors spends its time
(a diagnostic for the offload planner's ``switch_s``): the tiny model served
by ``AsyncEngine``, split by the ``af`` planner (attention on one device, the
rest on the other), one decode step traced.

Each line is one worker call of a device actor: when the event loop
submitted it, when the worker thread started and ended it, when the loop
had the result back (microseconds from the step's start); ``recv`` lines:
waiting for a transfer (from the receive's start to its bytes arriving).
Co-located device actors hand transfers over thread to thread
(``tessera_actors/execution/handoff.py``): a receive the worker took itself has no line of its
own, it is inside the worker call; the devices' ``GetStats`` count them.

    python scripts/switch_trace.py --devices "cuda:0,cpu?threads=12" [--dtype bfloat16]
(the step timed is the engine's whole request: its host turnaround included)
"""
from __future__ import annotations

import argparse
import asyncio
import time

from tessera_actors.execution import inbox as inbox_mod
from tessera_actors.execution.worker import Worker
from tessera_actors.serving import AsyncEngine, SamplingParams

EVENTS: list[tuple] = []


def instrument() -> None:
    call = Worker.call

    def traced(self, fn, *args):
        device = self._thread.name.removeprefix("dev-")
        if device == self._thread.name:   # not a device's worker (a landing thread)
            return call(self, fn, *args)
        submitted, box = time.perf_counter(), {}

        def run(*a):
            box["start"] = time.perf_counter()
            try:
                return fn(*a)
            finally:
                box["end"] = time.perf_counter()
        fut = call(self, run, *args)
        fut.add_done_callback(lambda _: EVENTS.append((device, "hop", submitted, box.get("start", submitted),
                                                       box.get("end", submitted), time.perf_counter())))
        return fut
    Worker.call = traced
    receive = inbox_mod.Inbox.receive

    async def traced_receive(self, *a, **k):
        t = time.perf_counter()
        out = await receive(self, *a, **k)
        EVENTS.append(("", "recv", t, time.perf_counter()))
        return out
    inbox_mod.Inbox.receive = traced_receive


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="cpu?threads=1,cpu?threads=1")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    instrument()
    async with AsyncEngine(model="llama", size="tiny", devices=a.devices, planner="af", dtype=a.dtype, max_seqs=1,
                           max_model_len=64, decode_buckets=(1,), prefill_buckets=(8,), kv_windows=(),
                           mode="latency", embeddings=False) as eng:
        await eng.wait_placed()
        plan = eng.deployment.placed["decode:1@0"].plan
        assign = list(plan.assignment)
        switches = sum(assign[k] != assign[k - 1] for k in range(1, len(assign)))
        async for _ in eng.generate([1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True)):
            pass
        EVENTS.clear()
        t0 = time.perf_counter()
        async for _ in eng.generate([4], SamplingParams(max_tokens=1)):   # one prompt step: a decode-sized step
            pass
        step = time.perf_counter() - t0
    hops = [e for e in EVENTS if e[1] == "hop"]
    print(f"{len(assign)} kernels, {switches} device changes, step {step * 1e6:.0f} us "
          f"({step / max(switches, 1) * 1e6:.0f} us per change, kernels included)")
    wake = [e[3] - e[2] for e in hops]
    back = [e[5] - e[4] for e in hops]
    work = [e[4] - e[3] for e in hops]
    print(f"worker calls {len(hops)}: loop->worker {sum(wake) / len(hops) * 1e6:.0f} us, work "
          f"{sum(work) / len(hops) * 1e6:.0f} us, worker->loop {sum(back) / len(hops) * 1e6:.0f} us (means)")
    for e in sorted(EVENTS, key=lambda e: e[2])[:40]:
        print(f"{e[0]:<16} {e[1]:<5}", " ".join(f"{(x - t0) * 1e6:7.0f}" for x in e[2:]))


if __name__ == "__main__":
    asyncio.run(main())
