#!/usr/bin/env python3
"""Generate real Triton PTX fixtures (with ground truth) from torch inductor.

Run on a GPU machine (torch + triton + CUDA):

    python3 scripts/gen_triton_fixtures.py --out OUT_DIR

Each small torch function below is compiled with ``torch.compile`` in its own
subprocess (fresh TRITON_CACHE_DIR and inductor cache, so kernel names and PTX
files map one to one). For every Triton kernel that ran we record:

* the PTX text (from the Triton cache dir, matched by kernel name and
  num_warps of the launch),
* ground truth from inductor's own metadata: ``triton_meta['signature']``
  names (``in_ptrN`` read, ``out_ptrN`` write, ``in_out_ptrN`` written, and
  read when the source loads it: a reduction may only overwrite it),
  ``inductor_meta['mutated_arg_names']`` (write), and the kernel's Triton
  source (``tl.load(name`` read, ``tl.store(name`` write, ``tl.atomic_*(name``
  read-write); the union is the truth,
* the real launch: grid/block/shared memory from the torch profiler trace and
  the argument values/sizes from the first ``CachingAutotuner.run`` call.

Everything goes into ONE file, ``OUT_DIR/triton_fixtures.json``. Unpack it
into the test corpus with::

    python3 scripts/gen_triton_fixtures.py --unpack OUT_DIR/triton_fixtures.json \
        --dest tests/data/ptx/triton

which writes ``<case>__<kernel>.ptx`` files plus ``truth.json``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

CASES = {}


def case(fn):
    """Register a case: a function returning (callable, example args)."""
    CASES[fn.__name__] = fn
    return fn


# -- the torch functions (all imports inside, so --unpack needs no torch) ----------
@case
def pointwise():
    import torch
    x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    return (lambda a, b: (a * 2 + b).relu() + torch.sin(a)), (x, y)


@case
def broadcast_bf16():
    import torch
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    return (lambda a, c: torch.nn.functional.gelu(a + c) * 0.5), (x, b)


@case
def row_sum():
    import torch
    return (lambda a: a.sum(-1) + a.amax(-1)), (torch.randn(64, 512, device="cuda"),)


@case
def full_sum():
    import torch
    return (lambda a: a.sum()), (torch.randn(200000, device="cuda"),)


@case
def softmax():
    import torch
    return (lambda a: torch.softmax(a, -1)), (torch.randn(32, 1000, device="cuda"),)


@case
def softmax_wide():
    import torch
    return (lambda a: torch.softmax(a * 0.1, -1)), (torch.randn(8, 50000, device="cuda"),)


@case
def layernorm():
    import torch
    x = torch.randn(16, 768, device="cuda")
    w, b = torch.randn(768, device="cuda"), torch.randn(768, device="cuda")
    return (lambda a, ww, bb: torch.nn.functional.layer_norm(a, (768,), ww, bb)), (x, w, b)


@case
def rmsnorm():
    import torch
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)

    def f(a, ww):
        af = a.float()
        return (af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + 1e-6)).to(a.dtype) * ww
    return f, (x, w)


@case
def embedding_gather():
    import torch
    table = torch.randn(1000, 64, device="cuda")
    idx = torch.randint(0, 1000, (32,), device="cuda")
    g = torch.randint(0, 64, (32, 8), device="cuda")
    return (lambda t, i, gg: torch.gather(t[i], 1, gg) * 2), (table, idx, g)


@case
def index_add_scatter():
    import torch
    out = torch.zeros(100, 16, device="cuda")
    idx = torch.randint(0, 100, (64,), device="cuda")
    src = torch.randn(64, 16, device="cuda")

    def f(o, i, s):
        o.index_add_(0, i, s)
        return o
    return f, (out, idx, src)


@case
def scatter_add():
    import torch
    src = torch.randn(4, 256, device="cuda")
    idx = torch.randint(0, 32, (4, 256), device="cuda")
    return (lambda s, i: torch.zeros(4, 32, device="cuda").scatter_add(1, i, s)), (src, idx)


@case
def cumsum():
    import torch
    return (lambda a: a.cumsum(-1)), (torch.randn(8, 256, device="cuda"),)


@case
def inplace_copy():
    import torch
    x, y = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")

    def f(a, b):
        a.copy_(b * 3)
        b.add_(1)
        return a.sum()
    return f, (x, y)


@case
def index_copy():
    import torch
    x = torch.zeros(64, 32, device="cuda")
    idx = torch.randperm(64, device="cuda")[:16]
    src = torch.randn(16, 32, device="cuda")

    def f(a, i, s):
        a.index_copy_(0, i, s)
        return a * 1
    return f, (x, idx, src)


@case
def mm_epilogue():
    import torch
    a, b = torch.randn(128, 256, device="cuda"), torch.randn(256, 64, device="cuda")
    bias = torch.randn(64, device="cuda")
    return (lambda x, y, z: torch.relu(torch.mm(x, y) + z) * 2), (a, b, bias)


@case
def mlp_block():
    import torch
    x = torch.randn(8, 64, 256, device="cuda", dtype=torch.bfloat16)
    m = torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 512), torch.nn.GELU(),
                            torch.nn.Linear(512, 256)).to("cuda", torch.bfloat16)
    return (lambda a: a + m(a)), (x,)


@case
def var_mean_max():
    import torch
    return (lambda a: torch.var_mean(a, -1)[0] + a.max(-1).indices), (torch.randn(64, 300, device="cuda"),)


@case
def transpose_2d():
    import torch
    return (lambda a: (a.t() * 2).contiguous() + 1), (torch.randn(300, 200, device="cuda"),)


# -- worker: one case in a fresh process -----------------------------------
ROLE = re.compile(r"^(in_out_ptr|in_ptr|out_ptr)\d+$")


def _truth_for(name: str, ptype: str, mutated: set, src: str) -> str:
    if not str(ptype).startswith("*"):
        return "none"
    read = write = False
    m = ROLE.match(name)
    if m:
        # in_out_ptr names a reused buffer: written for sure, read only if the
        # source loads it (a reduction may just overwrite it)
        read = m.group(1) == "in_ptr"
        write = m.group(1) in ("out_ptr", "in_out_ptr")
    if name in mutated:
        write = True
    tok = re.escape(name)
    if re.search(r"tl\.load\(\s*" + tok + r"\b", src) or re.search(r"make_block_ptr\(\s*(base=)?" + tok + r"\b", src):
        read = True
    if re.search(r"tl\.store\(\s*" + tok + r"\b", src):
        write = True
    if re.search(r"tl\.atomic_\w+\(\s*" + tok + r"\b", src):
        read = write = True
    return "readwrite" if read and write else "read" if read else "write" if write else "none"


def _describe(arg):
    import torch
    if isinstance(arg, torch.Tensor):
        st = arg.untyped_storage()
        return {"kind": "ptr", "nbytes": int(st.nbytes()), "offset": int(arg.storage_offset() * arg.element_size()),
                "dtype": str(arg.dtype)}
    if isinstance(arg, bool):
        return {"kind": "int", "value": int(arg)}
    if isinstance(arg, int):
        return {"kind": "int", "value": int(arg)}
    if isinstance(arg, float):
        return {"kind": "float", "value": float(arg)}
    return {"kind": "other", "repr": repr(arg)[:80]}


def _ptx_entry(text: str) -> str | None:
    m = re.search(r"\.entry\s+([A-Za-z_$][\w$]*)", text)
    return m.group(1) if m else None


def worker(case_name: str, out_path: str) -> None:
    import torch
    from torch._inductor.runtime import triton_heuristics as th

    torch._dynamo.reset()
    records: dict[str, dict] = {}
    orig_run = th.CachingAutotuner.run

    def run(self, *args, **kwargs):
        fn = getattr(self, "fn", None)
        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "?")
        if name not in records:
            arg_names = list(getattr(fn, "arg_names", []) or [])[:len(args)]
            records[name] = {"tuner": self, "args": [dict(_describe(a), name=arg_names[i] if i < len(arg_names) else None)
                                                     for i, a in enumerate(args)]}
        return orig_run(self, *args, **kwargs)

    th.CachingAutotuner.run = run
    fn, args = CASES[case_name]()
    compiled = torch.compile(fn)
    compiled(*[a.clone() for a in args])
    torch.cuda.synchronize()
    trace = os.path.join(os.environ["TESSERA_TMP"], "trace.json")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        compiled(*[a.clone() for a in args])
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace)
    launches: dict[str, dict] = {}
    with open(trace) as fh:
        for ev in json.load(fh).get("traceEvents", []):
            if ev.get("cat") == "kernel" and ev.get("name") in records and ev["name"] not in launches:
                a = ev.get("args", {})
                launches[ev["name"]] = {"grid": a.get("grid"), "block": a.get("block"),
                                        "shared": a.get("shared memory", 0)}
    ptx_files: dict[str, list[str]] = {}
    # inductor redirects Triton's cache under its own cache dir: search both
    for path in glob.glob(os.path.join(os.environ["TESSERA_TMP"], "**", "*.ptx"), recursive=True):
        with open(path) as fh:
            text = fh.read()
        entry = _ptx_entry(text)
        if entry:
            ptx_files.setdefault(entry, []).append(path)
    out = {}
    for name, rec in records.items():
        tuner = rec["tuner"]
        meta = getattr(tuner, "triton_meta", {}) or {}
        imeta = getattr(tuner, "inductor_meta", {}) or {}
        sig = meta.get("signature", {})
        consts = set((meta.get("constants") or {}).keys())
        params = [(k, v) for k, v in sig.items() if v != "constexpr" and k not in consts]
        mutated = set(imeta.get("mutated_arg_names", []) or [])
        src = getattr(getattr(tuner, "fn", None), "src", "") or ""
        launch = launches.get(name)
        cands = ptx_files.get(name, [])
        chosen, meta_json = None, {}
        for path in sorted(cands):
            mpath = path[:-4] + ".json"
            mj = json.load(open(mpath)) if os.path.exists(mpath) else {}
            if launch and launch.get("block") and mj.get("num_warps") and \
                    mj["num_warps"] * 32 != launch["block"][0]:
                continue
            if launch and "shared" in mj and launch.get("shared") not in (None, mj["shared"]):
                continue
            chosen, meta_json = path, mj
            break
        if chosen is None and cands:
            chosen = sorted(cands)[0]
        entry = {"kernel": name, "case": case_name, "names": [k for k, _ in params],
                 "types": [str(v) for _, v in params],
                 "access": [_truth_for(k, v, mutated, src) for k, v in params],
                 "mutated_arg_names": sorted(mutated), "launch": launch, "args": rec["args"],
                 "ptx_candidates": len(cands),
                 "meta": {k: meta_json.get(k) for k in ("num_warps", "shared", "global_scratch_size",
                                                          "profile_scratch_size", "target")},
                 "ptx": open(chosen).read() if chosen else None, "source": src}
        out[f"{case_name}__{name}"] = entry
    with open(out_path, "w") as fh:
        json.dump(out, fh)


def _run_case(name: str, timeout: float) -> tuple[str, dict | None, str]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                   TESSERA_TMP=tmp)
        result = os.path.join(tmp, "result.json")
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name, result],
                                  env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return name, None, f"timeout after {timeout}s"
        if proc.returncode != 0 or not os.path.exists(result):
            return name, None, f"rc={proc.returncode}: {proc.stderr[-3000:]}"
        with open(result) as fh:
            return name, json.load(fh), ""


def generate(out_dir: str, cases: list[str], timeout: float, jobs: int) -> int:
    """Run every case (``jobs`` at a time) and write one bundle JSON."""
    from concurrent.futures import ThreadPoolExecutor

    os.makedirs(out_dir, exist_ok=True)
    fixtures: dict[str, dict] = {}
    errors: dict[str, str] = {}
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for name, got, err in pool.map(lambda c: _run_case(c, timeout), cases):
            if got is None:
                errors[name] = err
                last = err.strip().splitlines()[-1:] if err.strip() else []
                print(f"{name:20s} FAILED {last}", flush=True)
                continue
            fixtures.update(got)
            print(f"{name:20s} {len(got)} kernels (t={time.time() - t0:.0f}s): "
                  + ", ".join(f"{v['kernel']}{'' if v['ptx'] else '(NO PTX)'}" for v in got.values()),
                  flush=True)
    with open(os.path.join(out_dir, "triton_fixtures.json"), "w") as fh:
        json.dump({"fixtures": fixtures, "errors": errors}, fh, indent=1)
    print(f"wrote {len(fixtures)} kernels ({len(errors)} failed cases) to {out_dir}/triton_fixtures.json")
    return 0 if fixtures else 1


def unpack(bundle: str, dest: str) -> int:
    data = json.load(open(bundle))
    os.makedirs(dest, exist_ok=True)
    truth = {}
    for key, fx in sorted(data["fixtures"].items()):
        if not fx.get("ptx"):
            continue
        fname = f"{key}.ptx"
        if fx.get("source"):
            fx["access"] = [_truth_for(n, t, set(fx.get("mutated_arg_names", [])), fx["source"])
                            for n, t in zip(fx["names"], fx["types"])]
        with open(os.path.join(dest, fname), "w") as fh:
            fh.write(fx["ptx"])
        truth[fname] = {k: fx[k] for k in ("kernel", "case", "names", "types", "access",
                                           "mutated_arg_names", "launch", "args", "meta")}
        with open(os.path.join(dest, f"{key}.triton_src"), "w") as fh:
            fh.write(fx.get("source") or "")
    with open(os.path.join(dest, "truth.json"), "w") as fh:
        json.dump(truth, fh, indent=1, sort_keys=True)
    print(f"unpacked {len(truth)} fixtures into {dest}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for triton_fixtures.json")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    ap.add_argument("--jobs", type=int, default=8, help="cases compiled in parallel")
    ap.add_argument("--worker", nargs=2, metavar=("CASE", "RESULT"), help=argparse.SUPPRESS)
    ap.add_argument("--unpack", metavar="BUNDLE", help="expand a bundle into --dest")
    ap.add_argument("--dest", default="tests/data/ptx/triton")
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return 0
    if a.unpack:
        return unpack(a.unpack, a.dest)
    if not a.out:
        ap.error("--out is required")
    return generate(a.out, [c for c in a.cases.split(",") if c], a.timeout, a.jobs)


if __name__ == "__main__":
    sys.exit(main())
