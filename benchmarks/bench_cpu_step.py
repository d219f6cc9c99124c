"""Where a CPU step goes, and which CPU deployment is faster (issue #33).

Through ``AsyncEngine`` (what ``tessera serve`` runs), SmolLM2-135M in
float32, for each deployment of ``--deployments`` in alternating rounds (the
box is shared: ratios within a round are what count):

* batch-1 decode: one stream of ``--tokens`` greedy tokens, time per output
  token after the first;
* 16 streams: ``--streams`` prompts of 40 tokens sent at once, ``--tokens``
  tokens each: output tok/s, TTFT p50/p99.

Then, for the one-device deployment, the batch-1 decode step taken apart:
its bucket's kernels run in program order on this thread (``AtenProgram``,
the executor the device actor runs), timed as a whole, and under
``torch.profiler`` the time inside the aten kernels; the rest of the loop
is per-kernel dispatch (Python call, views, out= variants).  A split's cost
over one device at equal total work is its hand-offs (and its lost cores).

Each row also carries the engine's own account of the step (``stats()``):
the mean step time of the decode buckets each phase ran, the host seconds
per decode step (serving loop, the workers' step path, inside runs of
kernels), and the kernels of the batch-1 decode bucket by op name, per
layer and outside the layers.

``--forms 'decode:1@0~512;decode:16@0~512'`` compares instead, on this
thread, the graph a CPU deployment captures (``use_fewest_ops``) with the
model's default form, run in turns at one intra-op thread.

``--checkouts before=PATH;after=.`` compares trees: every round runs each
deployment once per checkout, one after the other, each in a process of
its own that imports that checkout (``PYTHONPATH``); the rows carry the
checkout's name and commit.

    PYTHONPATH=. python benchmarks/bench_cpu_step.py --out benchmarks/results/serve_cpu/cpu_step.json
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from tessera_actors import AsyncEngine
from tessera_actors.provenance import git_commit, provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_serve import _pct, _stream  # noqa: E402


def _steps(eng) -> dict:
    """The engine's decode step count and seconds by bucket, and its host seconds, now."""
    return {"steps": {b: tuple(v) for b, v in eng.step_time.items() if b.startswith("decode")},
            "host": dict(eng.stats()["host_s"]), "decode_steps": eng.stats()["decode_steps"]}


def _phase(before: dict, after: dict) -> dict:
    """Decode step time (ms, by bucket) and host ms per decode step between two ``_steps``."""
    steps = {}
    for b, (n, t) in after["steps"].items():
        n0, t0 = before["steps"].get(b, (0, 0.0))
        if n > n0:
            steps[b] = {"steps": n - n0, "step_ms": (t - t0) / (n - n0) * 1e3}
    n = max(after["decode_steps"] - before["decode_steps"], 1)
    host = {k: (after["host"].get(k, 0.0) - before["host"].get(k, 0.0)) / n * 1e3
            for k in ("loop", "worker", "kernels")}
    return {"decode_steps": steps, "host_ms_per_decode_step": host}


def kernels_by_layer(graph) -> dict:
    """The kernels of a bucket by op name: in total, in one layer (the
    second: the first also makes what the layers share) and outside the
    layers."""
    layer = collections.Counter(k.name for k in graph.kernels if k.layer == 1)
    outside = collections.Counter(k.name for k in graph.kernels if k.layer < 0)
    return {"kernels": len(graph.kernels), "per_layer": sum(layer.values()),
            "layer_1": dict(layer.most_common()), "outside_layers": dict(outside.most_common())}


async def serve_round(devices: str, tokens: int, streams: int) -> dict:
    t0 = time.perf_counter()
    async with AsyncEngine(model="smollm2", devices=devices, max_seqs=16, max_model_len=1024,
                           kv_cache_memory=None) as eng:
        await eng.wait_placed()
        start_s = time.perf_counter() - t0
        prompt = list(range(1000, 1040))
        await _stream(eng, prompt, 4)   # warm
        s0 = _steps(eng)
        first, total, got = await _stream(eng, prompt, tokens)
        s1 = _steps(eng)
        tpot1 = (total - first) / max(got - 1, 1)
        t1 = time.perf_counter()
        rs = await asyncio.gather(*(_stream(eng, [t + 50 * i for t in prompt], tokens) for i in range(streams)))
        wall = time.perf_counter() - t1
        s2 = _steps(eng)
        ttft = [r[0] for r in rs]
        stats = eng.stats()
        one = _phase(s0, s1)
        bucket = max(one["decode_steps"], key=lambda b: one["decode_steps"][b]["steps"])
        return {"devices": devices, "start_s": start_s, "batch1_tpot_s": tpot1, "batch1_tok_s": 1 / tpot1,
                "streams": streams, "streams_tok_s": sum(r[2] for r in rs) / wall,
                "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
                "batch1": one, "streams_phase": _phase(s1, s2),
                "batch1_bucket": bucket, "batch1_bucket_kernels": kernels_by_layer(eng.deployment.served.graph(bucket)),
                "kernels_per_device": stats["placement"]["kernels_per_device"],
                "bytes_per_step": stats["placement"]["bytes_per_step"],
                "prefill_steps": stats["prefill_steps"], "decode_steps": stats["decode_steps"],
                "load_avg_1m": os.getloadavg()[0]}


def _in(checkout: str, *args: str) -> dict:
    """This program's JSON answer to ``args``, from a process of its own that imports ``checkout``."""
    env = dict(os.environ, PYTHONPATH=str(Path(checkout).resolve()))
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{checkout}: {' '.join(cmd)} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def serve_in(checkout: str, devices: str, tokens: int, streams: int) -> dict:
    """:func:`serve_round` in a process of its own that imports ``checkout``."""
    return _in(checkout, "--serve-one", devices, "--tokens", str(tokens), "--streams", str(streams))


def breakdown_in(checkout: str, reps: int) -> dict:
    """:func:`kernel_breakdown` of the batch-1 decode bucket, likewise."""
    return _in(checkout, "--breakdown-one", "decode:1@0~512", "--reps", str(reps))


def kernel_breakdown(bucket: str, reps: int) -> dict:
    """The batch-1 decode bucket's kernels on this thread: loop time vs time inside aten."""
    from torch.profiler import ProfilerActivity, profile

    from tessera_actors.execution.program import AtenProgram
    from tessera_actors.serving.config import EngineConfig
    from tessera_actors.serving.deploy import load_served_model
    served = load_served_model(EngineConfig(model="smollm2", devices="cpu", max_seqs=16, max_model_len=1024,
                                            kv_cache_memory=None, embeddings=False), core_only=True)
    graph = served.graph(bucket)
    prog = AtenProgram(graph, torch.device("cpu"), graph.buffers)
    prog.load(served.values[bucket])
    order = [k.id for k in graph.kernels]   # program order
    prog.run_kernels(order)   # bind and warm
    t0 = time.perf_counter()
    for _ in range(reps):
        prog.run_kernels(order)
    loop = (time.perf_counter() - t0) / reps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            prog.run_kernels(order)
    top = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    inside = sum(e.cpu_time_total for e in top) / 1e6 / reps
    by_op: dict[str, float] = {}
    for e in top:
        by_op[e.name] = by_op.get(e.name, 0.0) + e.cpu_time_total / 1e6 / reps
    split = cpu_split(prog, graph, order, reps)
    weights = sum(t.numel() * t.element_size() for t in served.weights.values())
    wsum = [t for t in served.weights.values() if t.is_floating_point()]
    t0 = time.perf_counter()
    for _ in range(reps):
        for t in wsum:
            t.sum()
    read = (time.perf_counter() - t0) / reps
    return {"bucket": bucket, "kernels": len(order), "loop_s": loop, "in_aten_s": inside,
            "dispatch_s": max(loop - inside, 0.0), "dispatch_per_kernel_us": max(loop - inside, 0.0) / len(order) * 1e6,
            "top_ops_s": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:6]),
            "weight_bytes": weights, "weight_read_s": read, "threads": torch.get_num_threads(), "one_thread_cpu": split}


def cpu_split(prog, graph, order: list[int], reps: int) -> dict:
    """At one intra-op thread, the CPU seconds of this thread per run of the
    bucket's kernels (what a loaded box's other processes do not add): all
    of them, only the matmuls, only the attention calls, and the rest (every
    other kernel and the executor's work around each kernel) as their
    difference.  The subsets run after a whole run, on its values."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def cpu(ids: list[int]) -> float:
            prog.run_kernels(ids)
            t0 = time.thread_time()
            for _ in range(reps):
                prog.run_kernels(ids)
            return (time.thread_time() - t0) / reps
        prog.run_kernels(order)
        total = cpu(order)
        mm = cpu([k.id for k in graph.kernels if k.name in ("mm", "addmm", "bmm")])
        attn = cpu([k.id for k in graph.kernels if k.name == "scaled_dot_product_attention"])
    finally:
        torch.set_num_threads(threads)
    others = len(order) - sum(k.name in ("mm", "addmm", "bmm", "scaled_dot_product_attention") for k in graph.kernels)
    return {"total_s": total, "matmuls_s": mm, "attention_s": attn, "rest_s": total - mm - attn, "rest_kernels": others,
            "rest_per_kernel_us": (total - mm - attn) / max(others, 1) * 1e6}


def forms_compared(buckets: list[str], reps: int) -> dict:
    """Per decode bucket, the graph a CPU deployment captures (the
    fewest-ops form) against the model's default form, run on this thread
    at one intra-op thread in turns (``reps`` runs of each, interleaved: a
    loaded box slows both alike): kernels, CPU ms and wall ms per run."""
    from tessera_actors.execution.program import AtenProgram
    from tessera_actors.serving.buckets import capture_aten
    from tessera_actors.serving.config import EngineConfig
    from tessera_actors.serving.deploy import fitted, load_served_model, weight_values
    from tessera_actors.serving.gpu_capture import set_attention_form
    cfg = EngineConfig(model="smollm2", devices="cpu", max_seqs=16, max_model_len=1024, kv_cache_memory=None,
                       embeddings=False)
    served = load_served_model(cfg, core_only=True)
    _, meta = fitted(cfg)   # the same model on the meta device, in its default form
    set_attention_form(meta, "fold")
    state = set(served.model.state_names())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for name in buckets:
            default = capture_aten(meta, served.buckets[name])
            progs = {}
            for form, g in (("default", default), ("fewest_ops", served.graph(name))):
                prog = AtenProgram(g, torch.device("cpu"), g.buffers)
                prog.load(weight_values(name, g, served.weights, state))
                ids = [k.id for k in g.kernels]
                prog.run_kernels(ids)
                progs[form] = (prog, ids, [])
            for _ in range(reps):
                for prog, ids, times in progs.values():
                    c0, w0 = time.thread_time(), time.perf_counter()
                    prog.run_kernels(ids)
                    times.append(((time.thread_time() - c0) * 1e3, (time.perf_counter() - w0) * 1e3))
            out[name] = {form: {"kernels": len(ids), "cpu_ms_median": statistics.median(c for c, _ in times),
                                "cpu_ms_min": min(c for c, _ in times),
                                "wall_ms_median": statistics.median(w for _, w in times)}
                         for form, (_, ids, times) in progs.items()}
    finally:
        torch.set_num_threads(threads)
    return out


def _rows(a) -> list[list[dict]]:
    """Every round's rows: each deployment, for each checkout (one after the other)."""
    deps = [d for d in a.deployments.split(";") if d]
    trees = [tuple(c.split("=", 1)) for c in a.checkouts.split(";") if c] if a.checkouts else []
    rounds = []
    for r in range(a.rounds):
        rows = []
        for d in deps:
            for name, path in trees or [("", "")]:
                row = serve_in(path, d, a.tokens, a.streams) if path else asyncio.run(serve_round(d, a.tokens, a.streams))
                row.update(checkout=name, git_commit=git_commit(path) if path else git_commit())
                rows.append(row)
                print(f"round {r + 1} {name:8} {d:10} batch-1 {row['batch1_tok_s']:5.1f} tok/s "
                      f"(step {row['batch1']['decode_steps'][row['batch1_bucket']]['step_ms']:.1f} ms)  "
                      f"{a.streams} streams {row['streams_tok_s']:5.1f} tok/s  TTFT p50 {row['ttft_p50_s']:.2f} s "
                      f"p99 {row['ttft_p99_s']:.2f} s  {row['batch1_bucket_kernels']['kernels']} kernels  "
                      f"load {row['load_avg_1m']:.1f}", flush=True)
        rounds.append(rows)
    return rounds


def _summary(rounds: list[list[dict]]) -> dict:
    """Per row name (checkout and deployment): the median of each measure
    over the rounds and the median of its ratio to the first row of each round."""
    keys = ("batch1_tok_s", "streams_tok_s", "ttft_p99_s")
    out = {}
    for i, row in enumerate(rounds[0] if rounds else []):
        name = f"{row['checkout']} {row['devices']}".strip()
        out[name] = {"git_commit": row["git_commit"],
                     **{k: statistics.median(rd[i][k] for rd in rounds) for k in keys},
                     **{f"{k}_ratio": statistics.median(rd[i][k] / rd[0][k] for rd in rounds) for k in keys}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployments", default="cpu;cpu,cpu", help="';' between deployments (device lists)")
    ap.add_argument("--checkouts", default="", help="name=path;name=path: trees to compare, alternating")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10, help="kernel breakdown: repetitions (0: none)")
    ap.add_argument("--serve-one", default="", help=argparse.SUPPRESS)   # one row, as JSON (--checkouts)
    ap.add_argument("--breakdown-one", default="", help=argparse.SUPPRESS)   # one bucket's breakdown, as JSON
    ap.add_argument("--forms", default="", help="';' between decode buckets: only compare the fewest-ops graph "
                    "with the default form's on this thread (forms_compared)")
    ap.add_argument("--out", default="benchmarks/results/serve_cpu/cpu_step.json")
    a = ap.parse_args()
    if a.serve_one:
        print(json.dumps(asyncio.run(serve_round(a.serve_one, a.tokens, a.streams))))
        return 0
    if a.breakdown_one:
        print(json.dumps(kernel_breakdown(a.breakdown_one, a.reps)))
        return 0
    if a.forms:
        forms = forms_compared([b for b in a.forms.split(";") if b], a.reps)
        for name, row in forms.items():
            for form, m in row.items():
                print(f"{name:16} {form:11} {m['kernels']:5d} kernels  CPU {m['cpu_ms_median']:6.1f} ms (min "
                      f"{m['cpu_ms_min']:.1f})  wall {m['wall_ms_median']:6.1f} ms  (median of {a.reps}, one thread)")
        Path(a.out).write_text(json.dumps({"provenance": provenance(), "forms": forms}, indent=1))
        print(f"wrote {a.out}")
        return 0
    rounds = _rows(a)
    summary = _summary(rounds)
    first = next(iter(summary), "")
    print(f"\n{'row':24} {'batch-1 tok/s':>14} {'streams tok/s':>14} {'TTFT p99':>12}   (median, ratio to {first})")
    for name, m in summary.items():
        print(f"{name:24} {m['batch1_tok_s']:8.1f} x{m['batch1_tok_s_ratio']:.2f} {m['streams_tok_s']:8.1f} "
              f"x{m['streams_tok_s_ratio']:.2f} {m['ttft_p99_s']:6.2f} s x{m['ttft_p99_s_ratio']:.2f}")
    trees = [tuple(c.split("=", 1)) for c in a.checkouts.split(";") if c] if a.checkouts else []
    breakdowns = {name: breakdown_in(path, a.reps) for name, path in trees} if a.reps else {}
    parts = kernel_breakdown("decode:1@0~512", a.reps) if a.reps and not trees else {}
    for name, b in breakdowns.items():
        c = b["one_thread_cpu"]
        print(f"{name}: batch-1 decode step at one thread, CPU ms: {c['total_s'] * 1e3:.1f} = matmuls "
              f"{c['matmuls_s'] * 1e3:.1f} + attention {c['attention_s'] * 1e3:.1f} + {c['rest_kernels']} other "
              f"kernels {c['rest_s'] * 1e3:.1f} ({c['rest_per_kernel_us']:.1f} us each)")
    if parts:
        print(f"\nbatch-1 decode step, one device ({parts['threads']} threads): {parts['kernels']} kernels, loop "
              f"{parts['loop_s'] * 1e3:.1f} ms = in aten {parts['in_aten_s'] * 1e3:.1f} ms + dispatch "
              f"{parts['dispatch_s'] * 1e3:.1f} ms ({parts['dispatch_per_kernel_us']:.1f} us a kernel); reading the "
              f"{parts['weight_bytes'] / 2**20:.0f} MiB of weights once: {parts['weight_read_s'] * 1e3:.1f} ms")
        print("  top aten ops (s/step):", {k: round(v * 1e3, 1) for k, v in parts["top_ops_s"].items()})
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance(), "rounds": rounds, "summary": summary,
                               "decode_step_breakdown": parts or breakdowns}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
