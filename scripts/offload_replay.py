"""Replay the offload planner of a ``tessera bench offload`` result on a CPU.

Captures the run's buckets on the meta device (the aten graphs the offload
rows ran; seconds, no weights), plans each policy again from the rates the
JSON recorded (the plans come out as the run's: the script checks each
row's choices), and scores the placement each row ran on the step model,
with other CPU rates if given: a what-if of the model against the measured
steps without device time.

    python scripts/offload_replay.py benchmarks/results/offload_h200/offload_21a0de0_run1.json \\
        [--cpu-rows-bps 1:3.58e10,8:3.1e10] [--cpu-flops 1.6e13]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICIES = {"layer_offload": "layer_offload", "streaming": "streaming", "tessera": None}   # row: first ring's


def captured(doc: dict) -> tuple:
    """(the run's OffloadConfig, bucket name -> aten graph, the rows' EngineConfig)."""
    from tessera_actors.bench.offload import OffloadConfig, engine_fields
    from tessera_actors.serving.buckets import buckets_for, capture_aten
    from tessera_actors.serving.config import EngineConfig
    from tessera_actors.serving.deploy import fitted
    c = doc["config"]
    cfg = OffloadConfig(model=c["model"], size=c["size"], gpu_budget=c["gpu_budget"], batches=tuple(c["batches"]),
                        prefill=c["prefill"], devices=c["devices"], steps=c["steps"], dtype=c["dtype"],
                        layers=c.get("layers", 0), rings=tuple(c.get("rings", ("bytes",))))
    budget = next(v["gpu_budget_bytes"] for v in doc.values() if isinstance(v, dict) and "gpu_budget_bytes" in v)
    conf, meta = fitted(EngineConfig(devices=c["devices"], gpu_budget=budget,
                                     **{**engine_fields(cfg), "build_device": "cpu"}))
    return cfg, {b.name: capture_aten(meta, b) for b in buckets_for(conf)}, conf


def replay(doc: dict, over: dict) -> None:
    from tessera_actors.bench.offload import bucket_of, ring_row
    from tessera_actors.planning.offload import OffloadPlanner, Placement
    cfg, graphs, conf = captured(doc)
    r = doc["rates"]
    devices = conf.devices.split(",")   # the budgeted GPU, the CPU
    ref = f"decode:{conf.max_seqs}@0"
    base = dict(pcie_bps=r["pcie_bps"], cpu_bps=r["cpu_gemv_bps"], switch_s=r["planned_switch_s"],
                reserve=conf.planner_options.get("reserve", 0), ring=cfg.rings[0])
    if r.get("cpu_rows_bps"):
        base.update(cpu_rows_bps={int(k): v for k, v in r["cpu_rows_bps"].items()}, cpu_flops=r["cpu_flops"])
    work = [w for w in doc if isinstance(doc[w], dict) and "policies" in doc[w]]
    for policy, row in POLICIES.items():
        row = row or ring_row(cfg.rings[0])
        ran = OffloadPlanner(**base, policy=policy)
        ran.expect([g for n, g in graphs.items() if n != ref])
        plans = {ref: ran.plan(graphs[ref], devices)}
        plans.update({n: ran.plan(g, devices) for n, g in graphs.items() if n != ref})
        what_if = OffloadPlanner(**{**base, **over}, policy=policy)
        for w in work:
            got = doc[w]["policies"].get(row)
            if not got or "error" in got:
                continue
            plan = plans[bucket_of(cfg, w)]
            off = plan.meta["offload"]
            st = what_if.offload(graphs[bucket_of(cfg, w)], devices).simulate(Placement(
                list(plan.assignment), list(off["streamed"]), off["slots"], off["slot_bytes"], ring=off["ring"],
                breaks=list(off.get("breaks", ()))))
            t = st.terms()
            same = "" if off["choices"] == got["choices"] else "  (replayed plan differs from the run's)"
            print(f"{row:22s} {w:10s} measured {got['step_s'] * 1e3:7.1f} ms  model {st.step_s * 1e3:7.1f} "
                  f"({st.step_s / got['step_s'] - 1:+6.1%})  gpu {t['gpu_kernels_s'] * 1e3:5.1f} cpu "
                  f"{t['cpu_kernels_s'] * 1e3:6.1f} hand-offs {t['handoffs']:3d} {t['handoff_s'] * 1e3:5.1f} "
                  f"copy wait {t['copy_wait_s'] * 1e3:5.1f} copy engine {t['copy_engine_s'] * 1e3:6.1f}{same}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="an offload.json of tessera bench offload")
    ap.add_argument("--cpu-rows-bps", default=None, help="the CPU's matmul weight rate by rows (1:3.6e10,8:3e10)")
    ap.add_argument("--cpu-flops", type=float, default=None, help="the CPU's GEMM rate (flop/s)")
    a = ap.parse_args()
    over = {k: v for k, v in (("cpu_rows_bps", a.cpu_rows_bps), ("cpu_flops", a.cpu_flops)) if v is not None}
    replay(json.loads(Path(a.result).read_text()), over)
    return 0


if __name__ == "__main__":
    sys.exit(main())
