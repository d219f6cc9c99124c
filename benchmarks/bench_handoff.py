"""One activation hand-off between two device actors of one process, as the
offload planner measures it (``tessera_actors.bench.offload_measure.measure_switch``:
the tiny model's decode step served by ``AsyncEngine`` split by the ``af``
planner, its extra time over each device alone, per device change).  Prints each repetition and the
median; JSON (git commit, command line, machine) to ``--json``.

    python benchmarks/bench_handoff.py --devices "cpu?threads=1,cpu?threads=1"   # CPU box
    python benchmarks/bench_handoff.py --devices "cuda:0,cpu?threads=12" --dtype bfloat16   # GPU + its CPU
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys

from tessera_actors.devices import DeviceSpec
from tessera_actors.bench.offload_measure import measure_switch
from tessera_actors.provenance import provenance


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu?threads=1,cpu?threads=1", help="two device specs")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default="llama")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    first, second = (DeviceSpec.parse(d) for d in a.devices.split(","))
    runs = [asyncio.run(measure_switch(a.model, a.dtype, first, second, a.steps)) for _ in range(a.reps)]
    med = statistics.median(runs)
    print(f"{'devices':32} {'hand-off (median)':>18}  runs (us)")
    print(f"{a.devices:32} {med * 1e6:15.0f} us  {[round(r * 1e6) for r in runs]}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"devices": a.devices, "dtype": a.dtype, "model": a.model, "steps": a.steps,
                       "handoff_s_runs": runs, "handoff_s_median": med, **provenance()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
