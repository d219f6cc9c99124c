"""``tessera bench offload``: a model bigger than the GPU's budget, placed
kernel by kernel between the GPU and its CPU, against the coarse policies.

For each workload (decode at each ``--batch``, prefill of ``--prefill``
tokens) it plans four ways from the same rates - GPU-only (when it fits),
layer offload (llama.cpp ``-ngl``), weight streaming, Tessera
(:mod:`tessera_actors.planning.offload`) - and the ideal bound, deploys
each plan on device actors (``tessera_actors.offload_run``; the serving
engine is not used: its bucket plans share one copy of the weights per
device, which the streamed host homes do not join yet), and measures
tokens/s, the GPU allocator's peak, bytes over PCIe per token and each
device's busy fraction.  Batch-1 greedy tokens are checked against a
GPU-only run of the same graph and weights without a budget (logits
cosine).  The check is teacher-forced: every policy is fed the reference's
greedy tokens, so each step compares the logits of the same context (a
free-running comparison turns one argmax flip on a near tie - bf16 logits
of random weights are often 1 ulp apart - into cosines near 0 for every
later step, with nothing wrong in the placement).  Rates measured first:
the cost of one activation hand-off between the two device actors (a
tiny model split into many runs) and, on a GPU, CPU GEMV at the thread
count beside a pinned copy stream and that copy's rate; ``--no-measure``:
the DESIGN.md numbers.

Writes ``offload.json`` (git commit, command line, rates, every number) and
``offload.png`` to ``--out``; prints a table.  Runs on CPU only too
(``--devices "cpu?threads=1,cpu"``: functional, for CI on a tiny model).
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import models
from .capture import capture_module
from .capture.aten import storage_bytes
from .devices import DeviceSpec, parse_bytes
from .offload_measure import measure_rates, measure_switch
from .offload_run import adapt, deploy, predicted_busy
from .plan import single_device_plan
from .planning.offload import (Offload, estimate_rates, gpu_only, ideal, layer_offload, streaming, tessera,
                               to_plan)
from tessera_actors.runtime.system import ActorSystem

POLICIES = ("gpu_only", "layer_offload", "streaming", "tessera")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class OffloadConfig:
    model: str = "llama"
    size: str = "real"
    gpu_budget: str = "8GiB"          # bytes (8GiB) or a fraction of weights + KV cache (0.5)
    batches: tuple[int, ...] = (1, 8)
    prefill: int = 512
    devices: str = ""                 # "GPU,CPU"; default cuda:0,cpu?threads=12 (cpu?threads=1,cpu without cuda)
    steps: int = 32
    prefill_steps: int = 3
    dtype: str = "bfloat16"
    seed: int = 0
    out: str = "benchmarks/results/offload"
    reserve: str = "320MiB"           # GPU bytes kept for transient op results
    switch_s: float = 200e-6
    measure: bool = True              # measure CPU GEMV and PCIe rates on a GPU machine
    layers: int = 0                   # > 0: the model with this many layers (a quick check of a real-size run)
    adapt: bool = False               # re-plan Tessera once from the measured busy times and run that too

    def device_pair(self) -> tuple[DeviceSpec, DeviceSpec]:
        text = self.devices or ("cuda:0,cpu?threads=12" if torch.cuda.is_available() else "cpu?threads=1,cpu")
        parts = [p for p in text.split(",") if p.strip()]
        if len(parts) != 2:
            raise ValueError(f"--devices takes two devices, GPU,CPU; got {text!r}")
        return DeviceSpec.parse(parts[0]), DeviceSpec.parse(parts[1])


def git_commit() -> str:
    if os.environ.get("TESSERA_GIT_COMMIT"):
        return os.environ["TESSERA_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def log(msg: str) -> None:
    print(f"[offload {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- model, graphs, values --------------------------------------------------
def build(cfg: OffloadConfig, gpu: DeviceSpec):
    """Weights by name (CPU tensors, flat bytes) and one captured graph per
    workload: ``decode_b{B}`` (KV rows = B) and ``prefill`` (one row)."""
    dtype = DTYPES[cfg.dtype]
    max_seq = max(cfg.prefill, 3 + cfg.steps + 8)
    max_seq = -(-max_seq // 64) * 64
    init = f"cuda:{gpu.index}" if gpu.kind == "cuda" else "cpu"
    t0 = time.perf_counter()
    extra = {"n_layers": cfg.layers} if cfg.layers else {}
    real = models.get(cfg.model, cfg.size, dtype=dtype, seed=cfg.seed, device=init,
                      max_batch=max(cfg.batches), max_seq=max_seq, **extra)
    named = {n: storage_bytes(t).cpu() for n, t in list(real.named_parameters()) + list(real.named_buffers())}
    vocab = real.cfg.vocab_size
    del real
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(f"model {cfg.model}/{cfg.size} {cfg.dtype}: {sum(v.numel() for v in named.values()) / 1e9:.2f} GB "
        f"of weights and buffers in {time.perf_counter() - t0:.1f} s")
    work = [(f"decode_b{b}", "decode", b, 1) for b in cfg.batches]
    if cfg.prefill:
        work.append(("prefill", "prefill", 1, cfg.prefill))
    graphs = {}
    for name, kind, batch, seq in work:
        meta = models.get(cfg.model, cfg.size, dtype=dtype, device="meta", max_batch=batch, max_seq=max_seq,
                          **extra)
        cap = capture_module(meta, meta.example_inputs(kind, batch=batch, seq=seq))
        vals = {b.id: named[b.name] for b in cap.graph.buffers.values() if b.role == "weight"}
        cap.graph.meta["vocab"] = vocab
        graphs[name] = (kind, batch, seq, cap.graph, vals)
    return graphs, vocab


def budget_bytes(cfg: OffloadConfig, graph) -> int:
    text = cfg.gpu_budget.strip()
    try:
        frac = float(text)
    except ValueError:
        return parse_bytes(text)
    held = sum(b.nbytes for b in graph.buffers.values() if b.role in ("weight", "state"))
    return int(frac * held)


# -- one policy ---------------------------------------------------------------
def step_inputs(kind: str, batch: int, seq: int, pos: int, tokens: list[int], vocab: int) -> dict:
    if kind == "decode":
        return {"input_ids": torch.tensor(tokens, dtype=torch.int64).reshape(batch, 1),
                "positions": torch.full((batch,), pos, dtype=torch.int64)}
    ids = (torch.arange(seq, dtype=torch.int64) * 7919 + 1) % vocab
    return {"input_ids": ids[None], "positions": torch.arange(seq, dtype=torch.int64)[None]}


async def run_plan(cfg: OffloadConfig, name: str, kind: str, batch: int, seq: int, graph, plan, values,
                   gpu: DeviceSpec, forced: list[int] | None = None) -> dict:
    """Deploy ``plan``, warm up on the prompt, time the steps; greedy tokens
    (decode) and the last logits of each step for the check.  ``forced``
    (decode): row 0's next input at each step is ``forced[step]`` (the
    reference's greedy token) instead of its own argmax."""
    cuda = gpu.kind == "cuda"
    await settle_gpu(gpu, quiet=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats(gpu.index)
    tokens, logits = [], []
    async with ActorSystem(f"offload-{name}") as system:
        dep = await deploy(system, graph, plan, values)
        gc.collect()
        gc.freeze()   # CUDA graph capture runs gc.collect() each time: keep it to the new objects
        try:
            prompt = [[1 + r, 2 + r, 3 + r] for r in range(batch)]
            pos = 0
            out = None
            warm = 3 if kind == "decode" else 2
            for i in range(warm):
                t0 = time.perf_counter()
                inputs = step_inputs(kind, batch, seq, pos, [p[i] for p in prompt], graph.meta["vocab"])
                out, _ = await dep.step(inputs)
                pos += 1 if kind == "decode" else 0
                if kind == "prefill" and time.perf_counter() - t0 > 5.0:
                    break   # a slow (CPU-bound) prefill: one warm-up is enough
            dep.reset_counters()
            n = cfg.steps if kind == "decode" else cfg.prefill_steps
            for _ in range(n):
                if kind == "prefill" and dep.wall_s > 20.0:
                    break   # enough seconds measured; keeps a CPU-bound baseline within the run's time
                last = out[0].reshape(batch, -1, out[0].shape[-1])[:, -1].float()
                nxt = [int(t) for t in last.argmax(-1)]
                if kind == "decode":
                    tokens.append(nxt[0])
                    logits.append(last[0].cpu())
                    if forced is not None and len(tokens) <= len(forced):
                        nxt[0] = forced[len(tokens) - 1]
                out, _ = await dep.step(step_inputs(kind, batch, seq, pos, nxt, graph.meta["vocab"]))
                pos += 1 if kind == "decode" else 0
            wall = dep.wall_s / max(dep.counted, 1)
            busy = [b / max(dep.wall_s, 1e-12) for b in dep.busy_s]
            arena = [i.resident_bytes for i in dep.installed]
            await dep.close()
        finally:
            gc.unfreeze()
    peak = torch.cuda.max_memory_allocated(gpu.index) if cuda else None
    await settle_gpu(gpu)
    per_step = batch if kind == "decode" else seq
    return {"step_s": wall, "tok_s": per_step / wall, "busy": busy, "arena_bytes": arena,
            "gpu_peak_bytes": peak, "tokens": tokens, "logits": logits}


def free_gpu(gpu: DeviceSpec) -> int:
    """Drop what a finished deployment left (its actors are gone); returns
    the bytes still allocated.  cuBLAS keeps a workspace per stream it ran
    on (32 MiB on an H200), and every deployment has new streams: those go
    too."""
    gc.collect()
    if gpu.kind != "cuda":
        return 0
    torch.cuda.synchronize(gpu.index)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(gpu.index)


async def settle_gpu(gpu: DeviceSpec, quiet: bool = False, wait_s: float = 5.0) -> None:
    """:func:`free_gpu`, again every 0.1 s for up to ``wait_s`` while more
    than 64 MiB stay allocated (a stopped deployment's worker threads let go
    of their arenas a moment after the actors stopped: on an H200 the
    unbudgeted reference's 15 GB once outlived its actor system into the
    next policy's budget), and say if anything stays: it would count
    against the next budget."""
    left, t0 = free_gpu(gpu), time.perf_counter()
    while left > 64 << 20 and time.perf_counter() - t0 < wait_s:
        await asyncio.sleep(0.1)
        left = free_gpu(gpu)
    if left > 64 << 20 and not quiet:
        log(f"warning: {left / 2**20:.0f} MiB still allocated on {gpu.name} after a deployment")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def real_flips(tokens: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor], rel: float = 1e-2) -> int:
    """Steps whose argmax differs from the reference's by more than a near
    tie: the token taken scores below the reference's best by more than
    ``rel`` of the reference's logit range (bf16 logits differ by an ulp
    between CPU and GPU kernels, and ties at one ulp are common)."""
    n = 0
    for t, r, lg in zip(tokens, ref_tokens, ref_logits):
        if t != r and float(lg[r] - lg[t]) > rel * float(lg.max() - lg.min()):
            n += 1
    return n


async def bench(cfg: OffloadConfig) -> dict:
    gpu, cpu = cfg.device_pair()
    graphs, _ = build(cfg, gpu)
    rates = {"pcie_bps": 55e9, "cpu_gemv_bps": None, "source": "DESIGN.md"}
    if gpu.kind == "cuda" and cfg.measure:
        rates.update(measure_rates(cpu.threads, gpu.index), source="measured")
        log(f"measured: CPU GEMV {rates['cpu_gemv_bps'] / 1e9:.1f} GB/s beside a pinned copy at "
            f"{rates['pcie_bps'] / 1e9:.1f} GB/s")
    if cfg.measure:   # before any budget caps the GPU's allocator
        rates["switch_s"] = await measure_switch(cfg.model, DTYPES[cfg.dtype], gpu, cpu)
        log(f"measured: one CPU<->GPU hand-off between device actors {rates['switch_s'] * 1e6:.0f} us")
    switch_s = max(rates["switch_s"], 20e-6) if cfg.measure else cfg.switch_s
    rates["planned_switch_s"] = switch_s
    reserve = parse_bytes(cfg.reserve) if gpu.kind == "cuda" else 0
    results: dict = {}
    for name, (kind, batch, seq, graph, values) in graphs.items():
        budget = budget_bytes(cfg, graph)
        gspec = DeviceSpec(gpu.kind, gpu.index, gpu.sms, gpu.threads, budget, gpu.price, gpu.label)
        devices = [gspec.name, cpu.name]
        costs = estimate_rates(graph, devices, switch_s, rates["cpu_gemv_bps"])
        # transients beside the reserve, in proportion to the outputs: an output's op result, its snapshot
        # and the CUDA graphs' pools (prefill 512 on an H200: 320 MiB + 2 x the 131 MB of logits ran out
        # of memory allocating a third; 768 MiB + 2 x 131 MB ran)
        outs = sum(b.nbytes for b in graph.buffers.values() if b.role == "output")
        o = Offload(graph, devices, costs, rates["pcie_bps"], reserve + (4 * outs if reserve else 0))
        t0 = time.perf_counter()
        chosen = {"gpu_only": gpu_only(o), "layer_offload": layer_offload(o), "streaming": streaming(o),
                  "tessera": tessera(o)}
        bound = ideal(o)
        per_step = batch if kind == "decode" else seq
        log(f"{name}: planned in {time.perf_counter() - t0:.1f} s; budget {budget / 2**30:.2f} GiB; predicted "
            + ", ".join(f"{k} {v[1].step_s * 1e3:.1f} ms" for k, v in chosen.items() if v) + f", ideal {bound * 1e3:.1f} ms")
        row: dict = {"gpu_budget_bytes": budget, "ideal_tok_s": per_step / bound, "ideal_step_s": bound,
                     "policies": {}}
        if kind == "decode" and batch == 1:   # the reference: the whole graph on the GPU, no budget
            ref_dev = DeviceSpec(gpu.kind, gpu.index, gpu.sms).name if gpu.kind == "cuda" else cpu.name
            ref = await run_plan(cfg, f"{name}-ref", kind, batch, seq, graph, single_device_plan(graph, ref_dev),
                                 values, gpu)
            row["reference_tok_s"] = ref["tok_s"]
            row["reference_device"] = ref_dev
            log(f"{name} reference on {ref_dev} (no budget): {ref['tok_s']:.1f} tok/s, "
                f"peak {ref['gpu_peak_bytes']} B")
        queue = list(chosen.items())
        for pol, got in queue:
            if got is None:
                row[f"{pol}_tok_s"] = None
                continue
            p, st = got
            plan = to_plan(o, p, pol, st)
            forced = ref["tokens"] if kind == "decode" and batch == 1 else None   # same contexts as the reference
            error = None
            try:
                r = await run_plan(cfg, f"{name}-{pol}", kind, batch, seq, graph, plan, values, gpu, forced)
            except Exception as e:   # one policy failing (e.g. out of memory) must not lose the others
                error = f"{type(e).__name__}: {e}"
            if error is not None:
                # out of the except clause: the exception's frames (holding the failed deployment's
                # tensors) are gone, so the next policy gets the whole budget
                log(f"{name} {pol}: FAILED: {error}")
                row["policies"][pol] = {"error": error, "predicted_step_s": st.step_s,
                                        "planned_gpu_bytes": o.gpu_bytes(p)}
                row[f"{pol}_tok_s"] = None
                await settle_gpu(gpu)
                continue
            streamed = sum(graph.buffers[b].nbytes for b in p.streamed)
            info = {"tok_s": r["tok_s"], "step_s": r["step_s"], "predicted_step_s": st.step_s,
                    "pcie_bytes_per_token": streamed / per_step,
                    "activation_bytes_per_token": plan.bytes_per_step() / per_step, "gpu_busy": r["busy"][o.gpu],
                    "cpu_busy": r["busy"][o.cpu], "gpu_peak_bytes": r["gpu_peak_bytes"],
                    "gpu_arena_bytes": r["arena_bytes"][o.gpu], "planned_gpu_bytes": o.gpu_bytes(p),
                    "choices": plan.meta["offload"]["choices"], "slots": p.slots, "slot_bytes": p.slot_bytes,
                    "kernels_on_cpu": p.assignment.count(o.cpu)}
            if kind == "decode" and batch == 1:
                info["tokens_equal_reference"] = r["tokens"] == ref["tokens"]   # argmax per step, teacher-forced
                info["argmax_flips_beyond_ties"] = real_flips(r["tokens"], ref["tokens"], ref["logits"])
                info["min_logits_cosine"] = min((cosine(a, b) for a, b in zip(r["logits"], ref["logits"])),
                                                default=None)
            row["policies"][pol] = info
            row[f"{pol}_tok_s"] = r["tok_s"]
            if pol == "tessera" and cfg.adapt:   # re-plan once on what the devices measured
                busy = [b * r["step_s"] for b in r["busy"]]
                costs2, factors = adapt(o.costs, predicted_busy(o, plan), busy)
                p2, st2 = tessera(Offload(graph, devices, costs2, rates["pcie_bps"], o.reserve))
                info["adapt_factors"] = factors
                if (p2.assignment, p2.streamed) != (p.assignment, p.streamed):
                    queue.append(("tessera_adapted", (p2, st2)))
            if pol == "tessera_adapted" and r["tok_s"] > (row.get("tessera_tok_s") or 0):
                row["tessera_tok_s"] = r["tok_s"]   # Tessera's next re-plan, from this run's measurements
                row["tessera_from"] = "tessera_adapted"
            log(f"{name} {pol}: {r['tok_s']:.1f} tok/s (step {r['step_s'] * 1e3:.1f} ms, predicted "
                f"{st.step_s * 1e3:.1f}), peak {info['gpu_peak_bytes'] or info['gpu_arena_bytes']} B")
        t = row["policies"].get(row.get("tessera_from", "tessera"), {})
        row["gpu_peak_bytes"] = t.get("gpu_peak_bytes") if t.get("gpu_peak_bytes") is not None else t.get("gpu_arena_bytes")
        results[name] = row
    return {"rates": rates, **results}


def table(res: dict) -> str:
    lines = [f"{'workload':<11} {'gpu-only':>9} {'layer':>9} {'stream':>9} {'tessera':>9} {'ideal':>9} "
             f"{'x best':>7} {'% ideal':>7}  (tok/s)"]
    for name, row in res.items():
        if not isinstance(row, dict) or "ideal_tok_s" not in row:
            continue

        def f(v):
            return f"{v:9.1f}" if v else f"{'-':>9}"
        best = max(row.get("layer_offload_tok_s") or 0, row.get("streaming_tok_s") or 0)
        t = row.get("tessera_tok_s") or 0
        lines.append(f"{name:<11} {f(row.get('gpu_only_tok_s'))} {f(row.get('layer_offload_tok_s'))} "
                     f"{f(row.get('streaming_tok_s'))} {f(t)} {f(row['ideal_tok_s'])} "
                     f"{t / best if best else 0:7.2f} {100 * t / row['ideal_tok_s']:6.1f}%")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n, r in res.items() if isinstance(r, dict) and "ideal_tok_s" in r]
    pols = ["layer_offload", "streaming", "tessera", "ideal"]
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), squeeze=False)
    for ax, n in zip(axes[0], names):
        vals = [res[n].get(f"{p}_tok_s") or 0 for p in pols]
        ax.bar(pols, vals, color=["#999", "#69c", "#c33", "#ddd"])
        ax.set_title(n)
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_offload_bench(cfg: OffloadConfig, argv: list[str] | None = None) -> dict:
    res = asyncio.run(bench(cfg))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"git_commit": git_commit(), "command": " ".join(argv if argv is not None else sys.argv),
           "config": asdict(cfg), **res}
    (out / "offload.json").write_text(json.dumps(doc, indent=1, default=str))
    print(table(res))
    drew = plot(res, out / "offload.png")
    log(f"wrote {out / 'offload.json'}" + (f" and {out / 'offload.png'}" if drew else " (no matplotlib: no PNG)"))
    return doc


def add_arguments(b) -> None:
    b.add_argument("--model", default="llama")
    b.add_argument("--size", default="real")
    b.add_argument("--gpu-budget", default="8GiB", help="bytes (8GiB) or a fraction of weights + KV (0.5)")
    b.add_argument("--batch", default="1,8", help="decode batch sizes")
    b.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: skip)")
    b.add_argument("--devices", default="", help="GPU,CPU (default cuda:0,cpu?threads=12; CPU-only: cpu?threads=1,cpu)")
    b.add_argument("--steps", type=int, default=32)
    b.add_argument("--prefill-steps", type=int, default=3)
    b.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    b.add_argument("--reserve", default="320MiB", help="GPU bytes kept for transient op results")
    b.add_argument("--switch-us", type=float, default=200.0,
                   help="planned cost of one CPU<->GPU hand-off with --no-measure")
    b.add_argument("--no-measure", action="store_true",
                   help="DESIGN.md rates and --switch-us instead of measuring them")
    b.add_argument("--layers", type=int, default=0, help="only this many layers (a quick real-size check)")
    b.add_argument("--adapt", action="store_true",
                   help="re-plan Tessera once from the devices' measured busy times and run that plan too")
    b.add_argument("--out", default="benchmarks/results/offload")


def main(args) -> int:
    # batch 1 first: its unbudgeted GPU-only reference must run before a budget caps the allocator
    cfg = OffloadConfig(args.model, args.size, args.gpu_budget, tuple(sorted(int(x) for x in args.batch.split(",") if x)),
                        args.prefill, args.devices, args.steps, args.prefill_steps, args.dtype, 0, args.out,
                        args.reserve, args.switch_us * 1e-6, not args.no_measure, args.layers, args.adapt)
    run_offload_bench(cfg)
    return 0


__all__ = ["OffloadConfig", "add_arguments", "main", "measure_rates", "run_offload_bench", "table"]
