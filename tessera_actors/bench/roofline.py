"""``tessera bench roofline``: how close what a user is served on one GPU is
to the physical limit (a GPU program; prints a table, writes JSON).

For each reference model (real layer shapes, ``--layers`` layers, random
weights) and each case - decode (``--batch`` rows over a ``--cache``-token
KV cache) and prefill (one ``--prompt``-token chunk) - three numbers:

* **tessera**: the served step of that bucket through ``AsyncEngine``
  (``tessera_actors.bench.served``: the deployment's own capture - inductor
  on a GPU - placed, replayed as CUDA graphs by the device actor, sampling
  on the device, the engine loop around it);
* **compile**: the same model under ``torch.compile(mode="reduce-overhead")``
  (built afresh, same seed, same shapes): mean seconds per step;
* **floor**: ``max(bytes / bandwidth, flops / gemm_rate)``, where ``bytes``
  is what the step's kernels must move - every weight and state byte range
  they read plus every state/output range they write, from the served
  graph's access sets - at the copy bandwidth measured here (read + write
  bytes of a 1 GiB device copy), and ``flops`` is counted by
  ``torch.utils.flop_counter`` on the eager model, at the bf16 GEMM rate
  measured here (8192^3).

Ratios: ``tessera / compile`` (what the product costs over compiling the
model yourself) and ``floor / tessera`` (fraction of the physical limit).
Every language model is served: Llama, the MoE, Mamba-2 (its SSM state
addressed by the engine's rows, ``models.mamba2``) and the VLM's Llama
decoder.  The VLM's prefill case is **text only** for both columns (``prefill
1x{prompt} (text)``): the engine's prompt chunks are token ids, it takes no
image, so the compiled baseline gets the same ``prompt`` text tokens (no
``pixel_values``, no ViT) - an image prefix through the engine is not
measured here.  The diffusion transformer is a row that says why it is not
served: it has no tokens to prompt or decode.  Runs split by
``--models`` (GPU time limits) into one ``--out`` folder of the same commit
add up to one ``roofline.json``.  Each row carries the served bucket's
capture kind and its CUDA-graph replays, eager runs and capture failures.
"""
from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tessera_actors.provenance import git_commit

MODELS = ("llama", "moe", "mamba2", "vlm", "dit")


@dataclass
class RooflineConfig:
    models: tuple[str, ...] = MODELS
    layers: int = 4
    batch: int = 64
    cache: int = 2048
    prompt: int = 1024
    dtype: str = "bfloat16"
    steps: int = 20
    device: str = "cuda:0"
    out: str = "benchmarks/results/roofline"
    gqa: str = "enable_gqa"    # CachedAttention.gqa of the attention models: fold | enable_gqa (H200: cuDNN 127 vs 180 us)
    regions: str = "auto"      # the served capture's regions: per repeated block (auto, blocks) or whole


def measured_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def measured_gemm_rate(device: torch.device, dtype: torch.dtype, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(device)
    return 2.0 * n ** 3 * reps / (time.perf_counter() - t0)


def build(name: str, case: str, cfg: RooflineConfig, device: torch.device) -> tuple[Callable[[], Any], str]:
    """(factory of (model, inputs), case label) for ``case`` in decode | prefill."""
    from tessera_actors import models
    from tessera_actors.models.llama import LlamaConfig
    dtype = getattr(torch, cfg.dtype)
    if name == "dit":
        batch = cfg.batch if case == "decode" else 1
        label = f"denoise b{batch}"
        kw = dict(depth=cfg.layers)
        kind, seq, pos = "denoise", 1, 0
    else:
        batch, seq = (cfg.batch, 1) if case == "decode" else (1, cfg.prompt)
        label = f"decode b{batch} c{cfg.cache}" if case == "decode" else f"prefill 1x{cfg.prompt}"
        if name == "mamba2" and case == "decode":
            label = f"decode b{batch}"  # an SSM state, no KV cache
        pos = cfg.cache - 2 if case == "decode" else 0
        kind = case
        # the served engine's sizes: max_batch rows of max_seq = the cache (an SSM: positions below it)
        kw = dict(n_layers=cfg.layers, max_batch=batch, max_seq=max(cfg.cache, seq))
        if name == "vlm":   # the decoder as served; the ViT as deep (it runs in neither column: text prompts)
            kw = dict(vis_layers=cfg.layers, text=LlamaConfig.llama_2_7b(**kw))
            label += " (text)" if case == "prefill" else ""
    extra = {"image": False} if name == "vlm" and case == "prefill" else {}

    def make():
        from tessera_actors.models.attention import CachedAttention
        model = models.get(name, "real", dtype=dtype, seed=0, device=device, **kw)
        for mod in model.modules():
            if isinstance(mod, CachedAttention):
                mod.gqa = cfg.gqa
        inputs = model.example_inputs(kind, batch=batch, seq=seq, pos=pos, **extra)
        return model, {k: v.to(device) for k, v in inputs.items()}
    return make, label


SCATTERS = ("index_put", "scatter", "index_copy")


def step_bytes(graph) -> int:
    """Bytes the step's kernels must move: the union of weight/state ranges
    read plus state/output ranges written (temporaries excluded: an ideal
    fused step keeps them on chip).  A scatter into state (a KV-cache write,
    ``index_put``; any indirect kernel) moves the values it writes, not the
    whole range its access set allows: its write counts the bytes of its
    other inputs, at most that range."""
    from tessera_actors.graph import _merge
    read: dict[int, list[tuple[int, int]]] = {}
    written: dict[int, list[tuple[int, int]]] = {}
    scattered = 0
    for k in graph.kernels:
        scatter = k.indirect or any(s in k.name for s in SCATTERS)
        values = sum(a.end - a.start for a in k.accesses
                     if "r" in a.mode and graph.buffers[a.buffer].role not in ("state", "weight"))
        for a in k.accesses:
            role = graph.buffers[a.buffer].role
            if "r" in a.mode and role in ("weight", "state"):
                read.setdefault(a.buffer, []).append((a.start, a.end))
            if "w" in a.mode and role in ("state", "output"):
                if scatter and role == "state":
                    scattered += min(values, a.end - a.start)
                else:
                    written.setdefault(a.buffer, []).append((a.start, a.end))
    return scattered + sum(e - s for ranges in list(read.values()) + list(written.values()) for s, e in _merge(ranges))


def _sdpa_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    """q @ k^T and p @ v of attention, any head grouping (q [B, Hq, T, d])."""
    b, h, t, d = q
    return 2 * b * h * t * k[-2] * d + 2 * b * h * t * k[-2] * v[-1]


def _grouped_mm_flops(a, b, *args, out_shape=None, **kwargs) -> int:
    """Rows of ``a`` [M, K] each multiplied by one expert matrix of ``b`` [E, K, N]."""
    return 2 * a[0] * a[1] * b[-1]


def step_flops(model: torch.nn.Module, inputs: dict[str, Any]) -> float:
    """FLOPs of one eager step (torch's flop counter, with GQA-aware attention
    and grouped-GEMM formulas: torch's own count neither)."""
    from torch.utils.flop_counter import FlopCounterMode
    aten = torch.ops.aten
    mapping = {getattr(aten, n): _sdpa_flops for n in (  # keyed by op packet, as the counter looks up
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
        if hasattr(aten, n)}
    mapping[aten._grouped_mm] = _grouped_mm_flops
    counter = FlopCounterMode(display=False, custom_mapping=mapping)
    with torch.no_grad(), counter:
        model(**inputs)
    return float(counter.get_total_flops())


def compiled_baseline(model, inputs, steps: int = 20) -> float | None:
    """Seconds per step of the same model and batch under plain
    ``torch.compile(mode="reduce-overhead")`` (CUDA graphs)."""
    if not torch.cuda.is_available():
        return None
    fn = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            fn(**inputs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn(**inputs)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


# the models the engine does not serve, and why (the others take the engine's forward(input_ids, positions,
# rows, last) with per-row state: a KV cache, an SSM's state)
NOT_SERVED = {"dit": "not served by the engine: a diffusion transformer denoises latents, it has no tokens to "
                     "prompt or decode"}


def run_case(name: str, case: str, cfg: RooflineConfig, bandwidth: float, gemm: float) -> dict[str, Any]:
    import torch._dynamo as dynamo   # (a bare "import torch._dynamo" would make torch local to this function)
    from tessera_actors.bench.served import ServedCase, served_decode, served_prefill
    device = torch.device(cfg.device)
    make, label = build(name, case, cfg, device)
    if name in NOT_SERVED:
        return {"model": name, "case": label, "error": NOT_SERVED[name]}
    model, inputs = make()
    flops = step_flops(model, inputs)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    sc = ServedCase(name, "real", cfg.layers, cfg.dtype, cfg.device, cfg.batch, cfg.cache, cfg.prompt,
                    cfg.regions, cfg.gqa, overrides={"vis_layers": cfg.layers} if name == "vlm" else {})
    served = asyncio.run(served_decode(sc) if case == "decode" else served_prefill(sc))
    graph = served.pop("graph")
    nbytes = step_bytes(graph)
    del graph
    dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    model, inputs = make()
    t_compile = compiled_baseline(model, inputs, cfg.steps)
    del model
    dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    t_tessera = served["served_step_s"]
    floor = max(nbytes / bandwidth, flops / gemm)
    row = {"model": name, "case": label, "tessera_us": t_tessera * 1e6, "compile_us": t_compile * 1e6,
           "floor_us": floor * 1e6, "bytes": nbytes, "flops": flops, "bytes_floor_us": nbytes / bandwidth * 1e6,
           "flops_floor_us": flops / gemm * 1e6, "tessera_over_compile": t_tessera / t_compile,
           "floor_fraction": floor / t_tessera, "regions": cfg.regions, "gqa": cfg.gqa,
           "ran": f"AsyncEngine {served['bucket']} ({served['capture']})", **served}
    host = served.get("host_s", {})   # decode: the host's CPU per step, event loop thread and workers
    busy = f"host {(host['loop_thread'] + host['worker']) * 1e6:6.0f} us  " if "loop_thread" in host else ""
    print(f"  {name:<7} {label:<22} tessera {row['tessera_us']:9.0f} us  compile {row['compile_us']:9.0f} us  "
          f"floor {row['floor_us']:9.0f} us  {busy}[{row['ran']}; {served['bucket_stats']}]", flush=True)
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':<7} {'case':<22} {'tessera us':>11} {'compile us':>11} {'floor us':>9} "
            f"{'GB':>7} {'TFLOP':>7} {'t/compile':>9} {'floor/t':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:<7} {r['case']:<22} error: {r['error'][:80]}")
            continue
        lines.append(f"{r['model']:<7} {r['case']:<22} {r['tessera_us']:>11.0f} {r['compile_us']:>11.0f} "
                     f"{r['floor_us']:>9.0f} {r['bytes'] / 1e9:>7.2f} {r['flops'] / 1e12:>7.2f} "
                     f"{r['tessera_over_compile']:>9.3f} {r['floor_fraction']:>8.3f}")
    return "\n".join(lines)


def main(args) -> int:
    run_roofline(RooflineConfig(tuple(args.models.split(",")), args.layers, args.batch, args.cache, args.prompt,
                                args.dtype, args.steps, args.device, args.out, args.gqa, args.regions))
    return 0


def run_roofline(cfg: RooflineConfig) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        raise RuntimeError("tessera bench roofline measures a GPU: no CUDA device is visible")
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    bandwidth, gemm = measured_bandwidth(device), measured_gemm_rate(device, dtype)
    print(f"measured on {torch.cuda.get_device_name(device)}: copy {bandwidth / 1e12:.2f} TB/s, "
          f"{cfg.dtype} GEMM {gemm / 1e12:.0f} TFLOP/s", flush=True)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"git_commit": git_commit() or "unknown", "command": sys.argv, "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": asdict(cfg), "bandwidth_Bps": bandwidth, "gemm_flops": gemm}
    path = out / "roofline.json"
    rows: list[dict[str, Any]] = []
    if path.exists():  # runs split by model (GPU time limits) add up to one table of the same commit
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}
        same = old.get("meta", {}).get("git_commit") == meta["git_commit"] and all(
            old["meta"].get("config", {}).get(k) == getattr(cfg, k) for k in ("gqa", "regions"))
        if same:
            rows = [r for r in old.get("rows", []) if r.get("model") not in cfg.models]
            meta["runs"] = old["meta"].get("runs", [old["meta"]["command"]]) + [meta["command"]]
    for name in cfg.models:
        for case in ("decode", "prefill"):
            try:
                rows.append(run_case(name, case, cfg, bandwidth, gemm))
            except Exception as e:  # one model failing must not lose the others' numbers
                import traceback
                rows.append({"model": name, "case": case, "error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()[-3000:]})
                print(f"  {name} {case}: {rows[-1]['error']}\n{rows[-1]['traceback']}", flush=True)
            path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(format_table(rows))
    print(f"wrote {path}")
    return rows
