"""``tessera capture``: record a reference model's forward pass as a graph file.

``--device cpu`` uses the aten capture (any machine), ``--device cuda`` the
inductor capture (generated Triton kernels with their PTX). Prints kernels by
kind, buffers, edges by kind, indirect/pinned kernels and bytes by role; a
progress line runs on stderr while the model is built, compiled and recorded.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

from tessera_actors.graph import KernelGraph


class Progress:
    """A one-line spinner on stderr (plain phase lines when stderr is not a tty)."""

    def __init__(self, label: str, stream=None) -> None:
        self.label, self.phase, self.stream = label, "starting", stream or sys.stderr
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._thread = threading.Thread(target=self._spin, daemon=True) if self._tty else None

    def __enter__(self) -> "Progress":
        if self._thread:
            self._thread.start()
        return self

    def __call__(self, phase: str) -> None:
        self.phase = phase
        if not self._tty:
            print(f"[{self.label}] {phase} ({time.perf_counter() - self.t0:.1f} s)", file=self.stream, flush=True)

    def _spin(self) -> None:
        chars = "|/-\\"
        i = 0
        while not self._stop.wait(0.2):
            self.stream.write(f"\r[{self.label}] {chars[i % 4]} {self.phase} "
                              f"{time.perf_counter() - self.t0:6.1f} s ")
            self.stream.flush()
            i += 1

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
            self.stream.write(f"\r[{self.label}] done in {time.perf_counter() - self.t0:.1f} s{' ' * 20}\n")


def summarize(graph: KernelGraph) -> dict[str, Any]:
    """The numbers ``tessera capture`` prints (also used by the GPU scripts)."""
    s = graph.summary()
    kinds: dict[str, int] = {}
    for k in graph.kernels:
        kinds[k.kind] = kinds.get(k.kind, 0) + 1
    s["kernels_by_kind"] = kinds
    s["edges_total"] = sum(s["edges"].values())
    s["indirect_kernels"] = sorted({k.name for k in graph.kernels if k.indirect})
    s["pinned"] = list(graph.meta.get("pinned", []))
    s["disagreements"] = sum(bool((k.payload or {}).get("meta", {}).get("disagreements"))
                             for k in graph.kernels if k.kind == "ptx" and isinstance(k.payload, dict))
    return s


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_summary(graph: KernelGraph, path: str | None = None) -> str:
    s = summarize(graph)
    lines = [f"kernels  {s['kernels']}  (" + ", ".join(f"{k} {v}" for k, v in sorted(s["kernels_by_kind"].items())) + ")",
             f"buffers  {s['buffers']}",
             f"edges    {s['edges_total']}  (" + ", ".join(f"{k} {v}" for k, v in sorted(s["edges"].items())) + ")",
             f"indirect {s['indirect']}" + (f"  ({', '.join(s['indirect_kernels'][:8])})" if s["indirect_kernels"] else "")]
    if s["pinned"]:
        lines.append(f"pinned   {len(s['pinned'])} kernels whose PTX could not be analysed (kept indirect): "
                     + ", ".join(s["pinned"][:8]))
    if s["disagreements"]:
        lines.append(f"ptx/inductor access disagreements in {s['disagreements']} launches (writes unioned)")
    lines.append("bytes    " + ", ".join(f"{r} {_mib(b)}" for r, b in s["bytes_by_role"].items()))
    guards = graph.meta.get("guards") or []
    if guards:
        lines.append(f"guards   {len(guards)} host reads checked at replay (first at {guards[0]['site']})")
    if graph.meta.get("constants"):
        lines.append(f"consts   {graph.meta['constants']}")
    if graph.meta.get("regions_reason"):
        lines.append(f"regions  {graph.meta['regions']}: {graph.meta['regions_reason']}")
    times = graph.meta.get("capture_times")
    if times:
        lines.append("time     " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
    if path:
        lines.append(f"file     {path}  ({_mib(os.path.getsize(path))})")
    return "\n".join(lines)


def _dtype(name: str):
    import torch
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (e.g. float32, bfloat16, float16)")
    return dt


def build_model(name: str, size: str, bucket: str, dtype_name: str, device: str, **extra):
    """The reference model sized so that ``bucket`` fits its static caches, and the bucket's inputs."""
    from tessera_actors import models
    from tessera_actors.capture.inductor_buckets import bucket_inputs, bucket_overrides, parse_bucket
    kind, batch, seq = parse_bucket(bucket)
    if name.startswith("hf:"):  # a transformers model: inputs as a user passes them (models/hf.py)
        from tessera_actors.models import hf
        loaded = hf.load(name, dtype=_dtype(dtype_name), device=device, **extra)
        return loaded.model, loaded.example_inputs(batch, seq), (kind, batch, seq)
    cfg = models.config(name, size, **extra)
    overrides = dict(extra, **bucket_overrides(cfg, kind, batch, seq, pos=16 if kind == "decode" else 0))
    model = models.get(name, size, dtype=_dtype(dtype_name), seed=0, device=device, **overrides)
    return model, bucket_inputs(model, kind, batch, seq), (kind, batch, seq)


def profile_to_costs(res, inputs, devices: list[str], graph_path: str) -> str:
    """Time every kernel on every device and every device-to-device copy,
    and save the cost table next to the graph (``tessera plan`` reads it)."""
    from tessera_actors.execution.backends import backend_for
    from tessera_actors.planning.costs import CostTable, costs_path_for
    from tessera_actors.execution.profile import measured_links, profile_kernels
    from tessera_actors.capture.pytree import flatten_inputs
    backends = [backend_for(d) for d in devices]
    tensors = flatten_inputs(inputs)[0]   # the step's tensors; constants (use_cache=False) stay in the graph
    program_cls = None
    if any(k.kind == "ptx" for k in res.graph.kernels):
        from tessera_actors.execution.triton import TritonProgram as program_cls
    else:
        from tessera_actors.execution.program import AtenProgram as program_cls
    profiles = [profile_kernels(res.graph, res.values, {k: v.to(be.device) for k, v in tensors.items()}, be,
                                program_cls=program_cls) for be in backends]
    costs = CostTable.from_profiles(res.graph, devices, profiles, measured_links(backends))
    path = costs_path_for(graph_path)
    costs.save(path)
    return str(path)


def main(args: argparse.Namespace) -> int:
    """Run ``tessera capture`` with parsed ``args`` (.model .size .bucket .dtype .device .out)."""
    import torch
    from tessera_actors.capture.aten import CaptureError, capture_module
    from tessera_actors.capture.inductor_buckets import bucket_name
    device = getattr(args, "device", "cpu") or "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("tessera capture: error: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 2
    with Progress(f"capture {args.model}/{args.size} {args.bucket}") as progress:
        try:
            progress("building model")
            model, inputs, (kind, batch, seq) = build_model(args.model, args.size, args.bucket, args.dtype, device)
            meta = {"model": args.model, "size": args.size, "bucket": bucket_name(kind, batch, seq),
                    "dtype": args.dtype, "device": device,
                    "state_names": list(getattr(model, "state_names", list)())}
            if device.startswith("cuda"):
                from tessera_actors.capture.inductor import capture_inductor
                res = capture_inductor(model, inputs, meta=meta, progress=progress,
                                       regions=getattr(args, "regions", "auto"))
            else:
                progress("recording aten ops")
                res = capture_module(model, inputs, meta=meta)
            progress("saving")
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            res.graph.save(args.out)
            profiled = getattr(args, "profile", None)
            if profiled:
                progress("profiling kernels and links")
                costs_file = profile_to_costs(res, inputs, profiled.split(","), args.out)
        except (CaptureError, KeyError, ValueError) as e:
            print(f"\ntessera capture: error: {e}", file=sys.stderr)
            return 2
    print(format_summary(res.graph, args.out))
    if getattr(args, "profile", None):
        print(f"costs    {costs_file}  (kernels and links profiled on {args.profile})")
    return 0
