#!/usr/bin/env python3
"""Check the static PTX analysis against instrumented runs on a real GPU.

Run on a GPU machine with cupy (cupy-cuda13x) from the repository root::

    python3 scripts/ptx_gpu_check.py --out OUT_DIR/gpu_check.json \
        [--triton-bundle OUT_DIR/triton_fixtures.json]

For every kernel of the corpus (``tests/data/ptx/cuda/*.ptx`` with
``launch.json``; Triton fixtures from ``tests/data/ptx/triton`` or from a
bundle written by ``gen_triton_fixtures.py``) it instruments the PTX
(:mod:`ptx.instrument`), loads it with the CUDA driver (through cupy),
launches it with real buffers, reads the probe slots back and turns them into
byte ranges per parameter (:func:`ptx.ranges.param_ranges`). Verdict per
kernel:

* FAIL ``missed write``: a parameter observed written is classified read/none
  (the unforgivable error), or ``missed read`` likewise for reads;
* FAIL ``unconfirmed write``: a non-indirect kernel's parameter classified as
  written was never seen written in any of its runs;
* FAIL ``truth``: a Triton kernel's static answer differs from inductor's.

Kernels run in a worker subprocess; a kernel that hangs longer than
``--timeout`` seconds or crashes the CUDA context is recorded as such and the
worker restarts at the next kernel, so the script always finishes.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import select
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# -- job list (parent side, no GPU needed) ------------------------------------
def _cuda_jobs(corpus: str) -> list[dict]:
    specs = json.load(open(os.path.join(corpus, "cuda", "launch.json")))
    jobs = []
    from ptx import parse
    for path in sorted(glob.glob(os.path.join(corpus, "cuda", "*.ptx"))):
        text = open(path).read()
        for fn in parse(text).entries:
            spec = specs.get(fn.name)
            jobs.append({"label": f"cuda/{os.path.basename(path)}:{fn.name}", "kernel": fn.name, "ptx": text,
                         "spec": spec, "truth": None})
    return jobs


def _triton_spec(fx: dict) -> dict:
    launch = fx.get("launch") or {}
    by_name = {a.get("name"): a for a in fx.get("args", []) if a.get("name")}
    args = []
    for name, ptype in zip(fx["names"], fx["types"]):
        a = by_name.get(name, {})
        if ptype.startswith("*"):
            nbytes = int(a.get("nbytes", 1 << 20)) + int(a.get("offset", 0))
            fill = "i64:0" if ptype in ("*i64", "*i32", "*i16", "*i8", "*u8", "*i1") else "f32:1" \
                if ptype == "*fp32" else "u8:0"
            args.append({"buf": 2 * nbytes + 65536, "fill": fill, "name": name})
        else:
            key = "i64" if ptype in ("i64", "u64") else "f32" if ptype.startswith("fp") else "i32"
            args.append({key: a.get("value", 1), "name": name})
    return {"grid": launch.get("grid") or [1], "block": launch.get("block") or [128],
            "shared": launch.get("shared") or 0, "args": args, "extra": {"buf": 1 << 20}}


def _triton_jobs(corpus: str, bundle: str | None) -> list[dict]:
    fixtures = {}
    if bundle:
        for key, fx in json.load(open(bundle))["fixtures"].items():
            if fx.get("ptx"):
                fixtures[key + ".ptx"] = fx
    else:
        tdir = os.path.join(corpus, "triton")
        truth_path = os.path.join(tdir, "truth.json")
        if os.path.exists(truth_path):
            for fname, fx in json.load(open(truth_path)).items():
                fx = dict(fx, ptx=open(os.path.join(tdir, fname)).read())
                fixtures[fname] = fx
    return [{"label": f"triton/{k}", "kernel": fx["kernel"], "ptx": fx["ptx"], "spec": _triton_spec(fx),
             "truth": fx["access"]} for k, fx in sorted(fixtures.items())]


# -- worker (GPU side) ----------------------------------------------------------
def _fill(cp, np, nbytes: int, spec: dict):
    buf = cp.zeros(nbytes, dtype=cp.uint8)
    fill = spec.get("fill")
    if not fill:
        return buf
    dtype, _, val = fill.partition(":")
    npdt = {"f32": np.float32, "i32": np.int32, "i64": np.int64, "u8": np.uint8}[dtype]
    count = nbytes // np.dtype(npdt).itemsize
    pattern = spec.get("pattern") or [float(val) if dtype == "f32" else int(val)]
    host = np.resize(np.array(pattern, dtype=npdt), count)
    buf[: count * np.dtype(npdt).itemsize] = cp.asarray(host.view(np.uint8))
    return buf


def _scalar(ctypes, key: str, value):
    return {"i32": ctypes.c_int32, "u32": ctypes.c_uint32, "i64": ctypes.c_int64, "u64": ctypes.c_uint64,
            "f32": ctypes.c_float, "f64": ctypes.c_double}[key](value)


def _build_args(cp, np, ctypes, fn, spec_args: list[dict], extra: dict | None):
    """ctypes objects per PTX param (+ probe), and the buffers by name."""
    objs, buffers, keep = [], {}, []
    for i, p in enumerate(fn.params):
        s = spec_args[i] if i < len(spec_args) else (extra or {"buf": 1 << 20})
        name = p.name
        if "buf" in s:
            b = _fill(cp, np, int(s["buf"]), s)
            keep.append(b)
            buffers[name] = (b.data.ptr, b.nbytes)
            objs.append(ctypes.c_uint64(b.data.ptr))
        elif "ptrtable" in s:
            target = cp.zeros(int(s["target"]), dtype=cp.uint8)
            table = cp.asarray(np.array([target.data.ptr + k * int(s.get("stride", 4))
                                         for k in range(int(s["ptrtable"]))], dtype=np.uint64))
            keep += [target, table]
            buffers[name] = (table.data.ptr, table.nbytes)
            buffers[name + ".target"] = (target.data.ptr, target.nbytes)
            objs.append(ctypes.c_uint64(table.data.ptr))
        elif "struct" in s:
            raw = bytearray(int(s["struct"]))
            for off, fs in s.get("fields", {}).items():
                off = int(off)
                if "buf" in fs:
                    b = _fill(cp, np, int(fs["buf"]), fs)
                    keep.append(b)
                    buffers[f"{name}+{off}"] = (b.data.ptr, b.nbytes)
                    raw[off:off + 8] = int(b.data.ptr).to_bytes(8, "little")
                else:
                    (key, val), = [(k, v) for k, v in fs.items() if k != "name"]
                    raw[off:off + ctypes.sizeof(_scalar(ctypes, key, val))] = bytes(_scalar(ctypes, key, val))
            objs.append((ctypes.c_char * len(raw)).from_buffer_copy(bytes(raw)))
        else:
            (key, val), = [(k, v) for k, v in s.items() if k != "name"]
            if p.type in (".u64", ".s64", ".b64") and key in ("i32", "u32"):
                key = "i64"
            if p.type in (".u32", ".s32", ".b32") and key in ("i64", "u64"):
                key = "i32"
            objs.append(_scalar(ctypes, key, val))
    return objs, buffers, keep


def _run_job(job: dict) -> dict:
    import ctypes

    import cupy as cp
    import numpy as np
    from cupy.cuda import driver

    from ptx import analyze, decode_slots, initial_slots, instrument, param_ranges, parse

    spec = job["spec"]
    out = {"label": job["label"], "kernel": job["kernel"], "truth": job["truth"]}
    static = analyze(job["ptx"])[job["kernel"]]
    out["static"] = {p.name: p.access for p in static.params}
    out["indirect"] = static.indirect
    if not spec or "skip" in spec:
        out.update(status="skipped", reason=(spec or {}).get("skip", "no launch spec"))
        return out
    inst = instrument(job["ptx"])
    cp.zeros(1)  # make sure the runtime's primary context exists before driver calls
    fn = parse(job["ptx"]).functions[job["kernel"]]
    module = driver.moduleLoadData(inst.text.encode() + b"\0")
    try:
        func = driver.moduleGetFunction(module, job["kernel"])
        shared = int(spec.get("shared", 0))
        if shared > 48 * 1024:
            driver.funcSetAttribute(func, 8, shared)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        grid = (list(spec["grid"]) + [1, 1])[:3]
        block = (list(spec["block"]) + [1, 1])[:3]
        observed: dict[str, dict] = {}
        stray: set[int] = set()
        variants = [spec["args"]] + [[(o.get(str(i)) or a) for i, a in enumerate(spec["args"])]
                                     for o in spec.get("runs", [])]
        for args in variants:
            objs, buffers, keep = _build_args(cp, np, ctypes, fn, args, spec.get("extra"))
            probe = cp.asarray(np.frombuffer(initial_slots(len(inst.sites)), dtype=np.uint8))
            objs.append(ctypes.c_uint64(probe.data.ptr))
            params = (ctypes.c_void_p * len(objs))(*[ctypes.addressof(o) for o in objs])
            driver.launchKernel(func, *grid, *block, shared, 0, ctypes.addressof(params), 0)
            cp.cuda.runtime.deviceSynchronize()
            slots = decode_slots(probe.get().tobytes(), len(inst.sites))
            mine = set(inst.kernels[job["kernel"]])
            sites = [s for s in inst.sites if s.index in mine]
            ranges, lost = param_ranges(sites, [slots[s.index] for s in sites], buffers)
            stray.update(lost)
            for name, r in ranges.items():
                o = observed.setdefault(name, {"read": None, "write": None, "exact": True})
                o["exact"] = o["exact"] and r.exact
                for kind in ("read", "write"):
                    got = getattr(r, kind)
                    if got:
                        o[kind] = list(got) if o[kind] is None else [min(o[kind][0], got[0]), max(o[kind][1], got[1])]
            del keep
        out["observed"] = observed
        out["stray_sites"] = sorted(stray)
        out.update(_verdict(static, observed, job["truth"]))
    finally:
        driver.moduleUnload(module)
    return out


def _verdict(static, observed: dict, truth: list | None) -> dict:
    problems = []
    for i, p in enumerate(static.params):
        seen_w = seen_r = False
        for name, o in observed.items():
            if name == p.name or name.startswith(p.name + "+"):
                seen_w |= o["write"] is not None
                seen_r |= o["read"] is not None
        if seen_w and p.access not in ("write", "readwrite"):
            problems.append(f"missed write: {p.name} is {p.access}")
        if seen_r and p.access not in ("read", "readwrite"):
            problems.append(f"missed read: {p.name} is {p.access}")
        if not static.indirect and p.access in ("write", "readwrite") and not seen_w:
            problems.append(f"unconfirmed write: {p.name}")
        if truth and i < len(truth) and truth[i] != p.access:
            problems.append(f"truth: {p.name} static={p.access} inductor={truth[i]}")
    return {"status": "fail" if problems else "ok", "problems": problems}


def worker(jobs_path: str, start: int) -> None:
    jobs = json.load(open(jobs_path))
    for i in range(start, len(jobs)):
        try:
            res = _run_job(jobs[i])
        except Exception as exc:  # report and let the parent restart us on a fresh context
            res = {"label": jobs[i]["label"], "kernel": jobs[i]["kernel"], "status": "error",
                   "error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(json.dumps({"index": i, "result": res}), flush=True)
            sys.exit(3)
        print(json.dumps({"index": i, "result": res}), flush=True)


# -- parent: run the worker with timeouts and restarts ----------------------------
def run_all(jobs: list[dict], timeout: float, tmpdir: str) -> list[dict]:
    path = os.path.join(tmpdir, "jobs.json")
    with open(path, "w") as fh:
        json.dump(jobs, fh)
    results: dict[int, dict] = {}
    start = 0
    while start < len(jobs):
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", path, str(start)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        deadline = time.time() + timeout + 30  # first job also pays context creation
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.time()))
            if not ready:
                proc.kill()
                proc.wait()
                results[start] = {"label": jobs[start]["label"], "kernel": jobs[start]["kernel"],
                                  "status": "timeout", "error": f"no answer within {timeout}s"}
                start += 1
                break
            line = proc.stdout.readline()
            if not line:
                rc = proc.wait()
                if rc not in (0, 3) and start < len(jobs):
                    # crashed inside job `start` without reporting: record it, skip it
                    err = proc.stderr.read()[-2000:]
                    results[start] = {"label": jobs[start]["label"], "kernel": jobs[start]["kernel"],
                                      "status": "error", "error": f"worker died rc={rc}: {err}"}
                    _print_row(results[start])
                    start += 1
                break
            msg = json.loads(line)
            results[msg["index"]] = msg["result"]
            _print_row(msg["result"])
            start = msg["index"] + 1
            deadline = time.time() + timeout
            if start >= len(jobs):
                proc.wait()
                break
    return [results[i] for i in sorted(results)]


def _print_row(r: dict) -> None:
    obs = r.get("observed", {})
    seen = " ".join(f"{k.rsplit('_', 1)[-1]}:{'R' if v['read'] else ''}{'W' if v['write'] else ''}"
                    for k, v in obs.items())
    static = " ".join(f"{k.rsplit('_', 1)[-1]}:{v}" for k, v in r.get("static", {}).items() if v != "none")
    extra = "; ".join(r.get("problems", [])) or r.get("error", "") or r.get("reason", "")
    print(f"{r['status'].upper():8s} {r['label'][:70]:70s} static[{static}] seen[{seen}] {extra}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON result path")
    ap.add_argument("--corpus", default=os.path.join(ROOT, "tests", "data", "ptx"))
    ap.add_argument("--triton-bundle", help="triton_fixtures.json from gen_triton_fixtures.py")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per kernel")
    ap.add_argument("--only", default="", help="substring filter on kernel labels")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]))
        return 0
    if not a.out:
        ap.error("--out is required")
    import tempfile
    jobs = _cuda_jobs(a.corpus) + _triton_jobs(a.corpus, a.triton_bundle)
    jobs = [j for j in jobs if a.only in j["label"]]
    print(f"{len(jobs)} kernels", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = run_all(jobs, a.timeout, tmp)
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    missed = [r["label"] for r in results if any(p.startswith("missed write") for p in r.get("problems", []))]
    summary = {"counts": counts, "missed_writes": missed, "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(summary, fh, indent=1)
    print("summary:", json.dumps(counts), "missed writes:", len(missed))
    return 0 if not missed and counts.get("fail", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
