"""``tessera bench offload``: a model bigger than the GPU's budget, placed
kernel by kernel between the GPU and its CPU, against the coarse policies,
served by ``AsyncEngine``.

Every policy is one serving engine (in-process device actors: the GPU with
its ``mem=`` budget and the CPU) whose buckets - a decode bucket per
``--batch`` and a prompt chunk of ``--prefill`` tokens - the offload
planner places (planner ``offload``, option ``policy``): layer offload
(llama.cpp ``-ngl``), weight streaming (accelerate / FlexGen), Tessera
(:mod:`tessera_actors.planning.offload`), and GPU-only when the model fits
the budget.  The first bucket decides the GPU-resident weights and the
staging ring; the others keep them and split the rest between CPU and
streaming for their own shape.  Each workload goes through
``AsyncEngine.generate``: decode tokens/s of ``B`` concurrent greedy
requests over the window where all decode, prefill tokens/s from the time
to the first token of a ``--prefill``-token prompt.  Also reported: the
GPU allocator's peak, bytes over PCIe per token, each device's busy
fraction (the engine's busy seconds over the workload's requests), the step model's
prediction and the ideal bound from the same rates.

Correctness at batch 1: greedy tokens against an engine on the GPU alone
without a budget (same weights), free-running; and, for Tessera, the
logits of its engine's own batch-1 decode plan, teacher-forced with the
reference's tokens on device actors (each step scores the same context as
the reference's: a free-running comparison turns one argmax flip on a near
tie - bf16 logits of random weights are often 1 ulp apart - into a
different continuation, with nothing wrong in the placement): cosine and
flips beyond a near tie.  Rates are measured first: one activation
hand-off between the two device actors (median of three), and on a GPU the
CPU's GEMV rate beside a pinned copy stream and that copy's rate (best of
three windows); ``--no-measure``: the DESIGN.md numbers.

Writes ``offload.json`` (git commit, command line, rates, every number) and
``offload.png`` to ``--out``; prints a table.  Runs on CPU only too
(``--devices "cpu?threads=1,cpu"``: functional, for CI on a tiny model).
"""
from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tessera_actors.devices import DeviceSpec, parse_bytes
from tessera_actors.bench.offload_measure import measure_rates, measure_switch
from tessera_actors.bench.offload_run import adapt, deploy, predicted_busy
from tessera_actors.plan import single_device_plan
from tessera_actors.serving import AsyncEngine, SamplingParams
from tessera_actors.serving.config import EngineConfig
from tessera_actors.provenance import git_commit
from tessera_actors.bench.offload_report import cosine, first_difference, plot, real_flips, table
from tessera_actors.planning.offload import Offload, estimate_rates, gpu_only, ideal
from tessera_actors.runtime.messages import GetStats
from transport.system import ActorSystem

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
    rings: tuple[str, ...] = ("slots",)   # staging ring modes: the first for every policy, others Tessera again

    @property
    def build_device(self) -> str:
        """The random weights are generated on the GPU when there is one (seconds, not minutes)."""
        gpu, _ = self.device_pair()
        return f"cuda:{gpu.index}" if gpu.kind == "cuda" else "cpu"

    def device_pair(self) -> tuple[DeviceSpec, DeviceSpec]:
        text = self.devices or ("cuda:0,cpu?threads=12" if torch.cuda.is_available() else "cpu?threads=1,cpu")
        parts = [p for p in text.split(",") if p.strip()]
        if len(parts) != 2:
            raise ValueError(f"--devices takes two devices, GPU,CPU; got {text!r}")
        return DeviceSpec.parse(parts[0]), DeviceSpec.parse(parts[1])


def log(msg: str) -> None:
    print(f"[offload {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- engines -------------------------------------------------------------------
def engine_fields(cfg: OffloadConfig) -> dict:
    """``EngineConfig`` fields every engine of the run shares: one decode
    bucket per ``--batch`` (rows 0..B-1), a short prompt chunk and one of
    ``--prefill`` tokens, no attention windows (each bucket is one graph)."""
    warm = 3
    max_len = max(cfg.prefill + 8, 3 + warm + cfg.steps + 8)
    max_len = -(-max_len // 64) * 64
    chunks = tuple(sorted({32, cfg.prefill} - {0}))
    return dict(model=cfg.model, size=cfg.size, dtype=cfg.dtype, seed=cfg.seed, max_seqs=max(cfg.batches),
                max_model_len=max_len, decode_buckets=tuple(cfg.batches), prefill_buckets=chunks, kv_windows=(),
                mode="latency", overrides={"n_layers": cfg.layers} if cfg.layers else {},
                build_device=cfg.build_device, embeddings=False)


def budget_bytes(cfg: OffloadConfig, graph) -> int:
    text = cfg.gpu_budget.strip()
    try:
        frac = float(text)
    except ValueError:
        return parse_bytes(text)
    held = sum(b.nbytes for b in graph.buffers.values() if b.role in ("weight", "state"))
    return int(frac * held)


async def _stream(eng: AsyncEngine, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of one request and the time each arrived."""
    ids, times = [], []
    async for out in eng.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)):
        ids += out.token_ids
        times += [time.perf_counter()] * len(out.token_ids)
    return ids, times


async def time_decode(eng: AsyncEngine, batch: int, steps: int, warm: int = 3) -> dict:
    """``batch`` concurrent greedy requests of ``warm + steps`` tokens: the
    tokens/s over the window where all of them decode (after each one's
    ``warm``-th token, before the first one ends); row 0's tokens."""
    busy0 = dict(eng.deployment.busy_s)
    prompts = [[1 + r, 2 + r, 3 + r] for r in range(batch)]
    t0 = time.perf_counter()
    got = await asyncio.gather(*(_stream(eng, p, warm + steps) for p in prompts))
    called = time.perf_counter() - t0
    start = max(t[warm - 1] for _, t in got)
    end = min(t[-1] for _, t in got)
    n = sum(sum(1 for x in t if start < x <= end) for _, t in got)
    wall = max(end - start, 1e-9)
    busy = [(eng.deployment.busy_s.get(d, 0.0) - busy0.get(d, 0.0)) / called for d in sorted(eng.deployment.busy_s)]
    return {"tok_s": n / wall, "step_s": wall / max(n / batch, 1e-9), "tokens": got[0][0],
            "busy_fraction": busy, "window_s": wall}


async def time_prefill(eng: AsyncEngine, tokens: int, reps: int, vocab: int) -> dict:
    """Time to the first token of a ``tokens``-token prompt (one chunk),
    after one warm-up; the median over ``reps``."""
    ids = [int((i * 7919 + 1) % vocab) for i in range(tokens)]
    times, busy = [], []
    for i in range(reps + 1):
        busy0 = dict(eng.deployment.busy_s)
        t0 = time.perf_counter()
        await _stream(eng, ids[:-1] + [int((ids[-1] + i) % vocab)], 1)
        if i:
            times.append(time.perf_counter() - t0)
            busy.append([eng.deployment.busy_s.get(d, 0.0) - busy0.get(d, 0.0) for d in sorted(eng.deployment.busy_s)])
    ttft = sorted(times)[len(times) // 2]
    return {"tok_s": tokens / ttft, "step_s": ttft, "ttft_runs_s": times,
            "busy_fraction": [sum(b[d] for b in busy) / sum(times) for d in range(len(busy[0]))] if busy else []}


# the budgeted device's counters a result row carries (GetStats): how its segments and streamed pieces ran
GPU_STATS = ("captures", "replays", "eager_runs", "capture_failures", "last_capture_error", "streamed_copies",
             "streamed_copies_ahead_used", "direct_transfers", "taken_on_worker", "taken_on_loop")


async def serve(cfg: OffloadConfig, devices: str, planner: str, options: dict, gpu: DeviceSpec,
                label: str) -> dict:
    """One engine (``devices``, ``planner``): every workload of the run
    through ``AsyncEngine.generate``, the GPU allocator's peak, the plans."""
    cuda = gpu.kind == "cuda"
    await settle_gpu(gpu, quiet=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats(gpu.index)
    t0 = time.perf_counter()
    out: dict = {}
    conf = EngineConfig(devices=devices, planner=planner, planner_options=options, **engine_fields(cfg))
    async with AsyncEngine(config=conf) as eng:
        await eng.wait_placed()
        log(f"{label}: engine on {devices} placed {len(eng.deployment.placed)} buckets in "
            f"{time.perf_counter() - t0:.1f} s")
        gc.collect()
        gc.freeze()   # CUDA graph capture runs gc.collect() each time: keep it to the new objects
        try:
            for b in cfg.batches:
                out[f"decode_b{b}"] = await time_decode(eng, b, cfg.steps)
            if cfg.prefill:
                out["prefill"] = await time_prefill(eng, cfg.prefill, cfg.prefill_steps, eng.served.vocab_size)
        finally:
            gc.unfreeze()
        out["plans"] = {name: p.plan for name, p in eng.deployment.placed.items()}
        out["served"] = eng.served
        st = (await eng.deployment.system.ref("device0").ask(GetStats())).values
        out["gpu_allocated_bytes"] = st["allocated_bytes"]   # the budgeted device: all buckets' buffers
        out["gpu_stats"] = {k: st[k] for k in GPU_STATS if k in st}
    out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(gpu.index) if cuda else None
    await settle_gpu(gpu)
    return out


def bucket_of(cfg: OffloadConfig, work: str) -> str:
    return "prefill:%d" % cfg.prefill if work == "prefill" else f"decode:{tokens_per_step(cfg, work)}@0"


def tokens_per_step(cfg: OffloadConfig, work: str) -> int:
    """Tokens one step of a workload makes: its batch (``decode_bB``) or the prompt (``prefill``)."""
    return cfg.prefill if work == "prefill" else int(work[len("decode_b"):])


# -- the teacher-forced check -----------------------------------------------------
def step_inputs(pos: int, token: int) -> dict:
    return {"input_ids": torch.tensor([[token]], dtype=torch.int64), "positions": torch.tensor([pos])}


async def forced_logits(graph, plan, values, prompt: list[int], tokens: list[int], gpu: DeviceSpec) -> list:
    """The last logits of each of ``len(tokens)`` greedy steps of ``plan``
    (a batch-1 decode graph) on device actors, fed ``tokens`` (the
    reference's) whatever it would pick: every step scores the same context
    as the reference's."""
    logits = []
    async with ActorSystem("offload-check") as system:
        dep = await deploy(system, graph, plan, values, prefix="check-")
        out = None
        pos = 0
        for tok in prompt + tokens[:-1]:
            out, _ = await dep.step(step_inputs(pos, tok))
            pos += 1
            if pos >= len(prompt):
                logits.append(out[0].reshape(-1, out[0].shape[-1])[-1].float().cpu())
        await dep.close()
    await settle_gpu(gpu)
    return logits


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


# -- the run ------------------------------------------------------------------------
def layer_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """[out, in] of the matrices of the model's first block (its linear layers)."""
    mats = [tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 2 and ".0." in n]
    return mats or [(4096, 4096)]


async def measured_rates(cfg: OffloadConfig, gpu: DeviceSpec, cpu: DeviceSpec, shapes) -> dict:
    rates = {"pcie_bps": 55e9, "cpu_gemv_bps": None, "source": "DESIGN.md"}
    if gpu.kind == "cuda" and cfg.measure:
        rates.update(measure_rates(cpu.threads, gpu.index, shapes=shapes, dtype=DTYPES[cfg.dtype]),
                     source="measured", gemv_shapes=shapes)
        log(f"measured: CPU GEMV {rates['cpu_gemv_bps'] / 1e9:.1f} GB/s on the model's layer shapes beside a "
            f"pinned copy at {rates['pcie_bps'] / 1e9:.1f} GB/s (best of {rates['windows']} windows)")
    if cfg.measure:   # before any budget caps the GPU's allocator
        runs = [await measure_switch(cfg.model, DTYPES[cfg.dtype], gpu, cpu) for _ in range(3)]
        rates["switch_runs_s"] = runs
        rates["switch_s"] = sorted(runs)[1]
        log(f"measured: one CPU<->GPU hand-off between device actors {rates['switch_s'] * 1e6:.0f} us "
            f"(median of {[round(r * 1e6) for r in runs]} us)")
    rates["planned_switch_s"] = max(rates["switch_s"], 20e-6) if cfg.measure else cfg.switch_s
    return rates


async def _policy_row(cfg: OffloadConfig, pol: str, is_b1: bool, plan, g, r: dict, got: dict, ref_tokens: list[int],
                      ref_logits: list, gpu: DeviceSpec, busy: list[float], per: int) -> dict:
    """One policy's row of one workload: what it served against its plan's
    prediction, and at decode batch 1 its tokens against the reference's
    (free-running, and teacher-forced logits for Tessera's plans)."""
    off = plan.meta.get("offload") or {}
    streamed = sum(g.buffers[b].nbytes for b in off.get("streamed", ()))
    info = {"tok_s": r["tok_s"], "step_s": r["step_s"], "predicted_step_s": plan.predicted_step_s,
            "pcie_bytes_per_token": streamed / per,
            "activation_bytes_per_token": plan.bytes_per_step() / per,
            "gpu_busy": min(1.0, busy[0]), "cpu_busy": min(1.0, busy[1]) if len(plan.devices) > 1 else 0.0,
            "gpu_peak_bytes": got["gpu_peak_bytes"], "gpu_allocated_bytes": got["gpu_allocated_bytes"],
            "gpu_stats": got.get("gpu_stats", {}),
            "plan": plan.name,
            "choices": off.get("choices", ""), "slots": off.get("slots", 0),
            "slot_bytes": off.get("slot_bytes", 0),
            "kernels_on_cpu": plan.assignment.count(1) if len(plan.devices) > 1 else 0}
    if is_b1:
        info["tokens_equal_reference"] = r["tokens"] == ref_tokens   # free-running, greedy
        info["first_difference"] = first_difference(r["tokens"], ref_tokens)
        if pol.startswith("tessera"):
            values = got["served"].values[bucket_of(cfg, "decode_b1")]
            lg = await forced_logits(g, plan, values, [1, 2, 3], ref_tokens, gpu)
            forced = [int(x.argmax()) for x in lg]
            info["forced_tokens_equal_reference"] = forced == ref_tokens
            info["argmax_flips_beyond_ties"] = real_flips(forced, ref_tokens, ref_logits)
            info["min_logits_cosine"] = min((cosine(a, b) for a, b in zip(lg, ref_logits)), default=None)
    return info


def _peaks_and_observed_bound(cfg: OffloadConfig, results: dict, work: list[str], runs: list, graphs: dict,
                              devices: list[str], switch_s: float, rates: dict, reserve: int) -> None:
    """Each workload's memory peak of the Tessera row reported, and (after a
    re-plan) the bound again at the CPU rate the devices showed."""
    replanned = next((o for p, _, _, o in runs if p == "tessera_replanned"), None)
    for w in work:
        t = results[w]["policies"].get(results[w].get("tessera_from", "tessera"), {})
        results[w]["gpu_peak_bytes"] = t.get("gpu_peak_bytes")
        results[w]["gpu_allocated_bytes"] = t.get("gpu_allocated_bytes")
        if replanned is not None:   # the bound again at the CPU rate the devices showed
            costs = estimate_rates(graphs[w], devices, switch_s, replanned["cpu_bps"])
            per = tokens_per_step(cfg, w)
            step = ideal(Offload(graphs[w], devices, costs, rates["pcie_bps"], reserve))
            results[w]["ideal_at_observed_cpu_step_s"] = step
            results[w]["ideal_at_observed_cpu_tok_s"] = per / step


def _models_and_bounds(cfg: OffloadConfig, graphs: dict, devices: list[str], switch_s: float, rates: dict,
                       reserve: int, budget: int, ref: dict, plain: str) -> tuple[dict, dict]:
    """(the step model of every workload from the measured rates, the
    results with each workload's bound and reference row)."""
    models_of = {}
    for w, g in graphs.items():
        costs = estimate_rates(g, devices, switch_s, rates["cpu_gemv_bps"])
        models_of[w] = Offload(g, devices, costs, rates["pcie_bps"], reserve)
    results: dict = {w: {"gpu_budget_bytes": budget, "ideal_step_s": ideal(models_of[w]), "policies": {},
                         "reference_tok_s": ref[w]["tok_s"], "reference_device": plain} for w in graphs}
    for w in graphs:
        results[w]["ideal_tok_s"] = tokens_per_step(cfg, w) / results[w]["ideal_step_s"]
    return models_of, results


def _replan(model: Offload, plan, busy: list[float], step_s: float, info: dict, opts: dict,
            rates: dict) -> dict | None:
    """The planner options of a re-plan at the CPU rate the devices showed
    (``info["adapt_factors"]``: measured against planned busy time), None
    when the CPU ran as planned."""
    want = predicted_busy(model, plan)
    seen = [busy[0] * step_s, busy[1] * step_s]
    _, factors = adapt(model.costs, want, seen)
    info["adapt_factors"] = factors
    if factors[1] == 1.0 or not rates["cpu_gemv_bps"]:
        return None
    slower = {**opts, "cpu_bps": rates["cpu_gemv_bps"] / factors[1]}
    log(f"tessera: the CPU ran {factors[1]:.2f}x its planned time; re-planning at {slower['cpu_bps'] / 1e9:.1f} GB/s")
    return slower


async def bench(cfg: OffloadConfig) -> dict:
    gpu, cpu = cfg.device_pair()
    reserve = parse_bytes(cfg.reserve) if gpu.kind == "cuda" else 0
    plain = DeviceSpec(gpu.kind, gpu.index, gpu.sms, gpu.threads).name if gpu.kind == "cuda" else cpu.name
    work = [f"decode_b{b}" for b in cfg.batches] + (["prefill"] if cfg.prefill else [])

    # the reference first (GPU alone, no budget: before any budget caps the allocator), then the rates
    ref = await serve(cfg, plain, "contiguous", {}, gpu, "reference")
    served = ref.pop("served")
    rates = await measured_rates(cfg, gpu, cpu, layer_shapes(served.model))
    switch_s = rates["planned_switch_s"]
    graphs = {w: served.graphs[bucket_of(cfg, w)] for w in work}
    ref_bucket = f"decode:{max(cfg.batches)}@0"
    budget = budget_bytes(cfg, served.graphs[ref_bucket])
    gspec = DeviceSpec(gpu.kind, gpu.index, gpu.sms, gpu.threads, budget, gpu.price, gpu.label)
    devices = [gspec.name, cpu.name]
    b1 = "decode_b1" if 1 in cfg.batches else None
    ref_logits = []
    if b1:
        g1 = graphs[b1]
        ref_logits = await forced_logits(g1, single_device_plan(g1, plain), served.values[bucket_of(cfg, b1)],
                                         [1, 2, 3], ref[b1]["tokens"], gpu)
    log(f"reference on {plain} (no budget): " + ", ".join(f"{w} {ref[w]['tok_s']:.1f} tok/s" for w in work)
        + f"; peak {ref['gpu_peak_bytes']} B")

    # the step model and the bound of every workload, from the same rates
    options = {"pcie_bps": rates["pcie_bps"], "cpu_bps": rates["cpu_gemv_bps"], "switch_s": switch_s,
               "reserve": reserve}
    models_of, results = _models_and_bounds(cfg, graphs, devices, switch_s, rates, reserve, budget, ref, plain)
    fits = gpu_only(models_of[f"decode_b{max(cfg.batches)}"]) is not None

    runs = [("gpu_only", gspec.name, "contiguous", {})] if fits else []
    runs += [(pol, ",".join(devices), "offload", {**options, "policy": pol, "ring": cfg.rings[0]})
             for pol in ("layer_offload", "streaming", "tessera")]
    # Tessera with another staging ring, side by side in the same run (its own row, not the headline)
    runs += [(f"tessera_ring_{r}", ",".join(devices), "offload", {**options, "policy": "tessera", "ring": r})
             for r in cfg.rings[1:]]
    first = work[0]
    if not fits:
        for w in work:
            results[w]["gpu_only_tok_s"] = None
    for pol, devs, planner, opts in runs:
        try:
            got = await serve(cfg, devs, planner, opts, gpu, pol)
        except Exception as e:   # one policy failing (e.g. out of memory) must not lose the others
            error = f"{type(e).__name__}: {e}"
        else:
            error = None
        if error is not None:
            log(f"{pol}: FAILED: {error}")
            for w in work:
                results[w]["policies"][pol] = {"error": error}
                results[w][f"{pol}_tok_s"] = None
            await settle_gpu(gpu)
            continue
        plans = got["plans"]
        for w in work:
            plan = plans[bucket_of(cfg, w)]
            g = graphs[w]
            per = tokens_per_step(cfg, w)
            r = got[w]
            busy = list(r["busy_fraction"]) + [0.0, 0.0]
            info = await _policy_row(cfg, pol, w == b1, plan, g, r, got, ref[w].get("tokens"), ref_logits, gpu, busy,
                                     per)
            results[w]["policies"][pol] = info
            results[w][f"{pol}_tok_s"] = r["tok_s"]
            if pol == "tessera" and w == first and len(plan.devices) > 1:
                # load-aware re-plan (ATSInfer's dynamic transfer): the devices' busy time against the step
                # model's; a CPU slower than planned moves its share to streaming in Tessera's next plan
                slower = _replan(models_of[w], plan, busy, r["step_s"], info, opts, rates)
                if slower is not None:
                    runs.append(("tessera_replanned", devs, planner, slower))
            if pol == "tessera_replanned" and r["tok_s"] > (results[w].get("tessera_tok_s") or 0):
                results[w]["tessera_tok_s"] = r["tok_s"]   # Tessera after one re-plan from this run's measurements
                results[w]["tessera_from"] = pol
            log(f"{w} {pol}: {r['tok_s']:.1f} tok/s (step {r['step_s'] * 1e3:.1f} ms, predicted "
                f"{(plan.predicted_step_s or 0) * 1e3:.1f}), peak {got['gpu_peak_bytes']} B")
    _peaks_and_observed_bound(cfg, results, work, runs, graphs, devices, switch_s, rates, reserve)
    return {"rates": rates, **results}


def run_offload_bench(cfg: OffloadConfig, argv: list[str] | None = None) -> dict:
    res = asyncio.run(bench(cfg))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"git_commit": git_commit() or "unknown", "command": " ".join(argv if argv is not None else sys.argv),
           "config": asdict(cfg), **res}
    (out / "offload.json").write_text(json.dumps(doc, indent=1, default=str))
    print(table(res))
    drew = plot(res, out / "offload.png")
    log(f"wrote {out / 'offload.json'}" + (f" and {out / 'offload.png'}" if drew else " (no matplotlib: no PNG)"))
    return doc


def rings_of(text: str) -> tuple[str, ...]:
    from tessera_actors.planning.offload.staging import RING_MODES
    rings = tuple(r.strip() for r in text.split(",") if r.strip())
    bad = [r for r in rings if r not in RING_MODES]
    if not rings or bad or len(set(rings)) != len(rings):
        raise SystemExit(f"--ring {text!r}: a list of distinct modes of {', '.join(RING_MODES)}")
    return rings


def main(args) -> int:
    # batch 1 first: its unbudgeted GPU-only reference must run before a budget caps the allocator
    cfg = OffloadConfig(args.model, args.size, args.gpu_budget, tuple(sorted(int(x) for x in args.batch.split(",") if x)),
                        args.prefill, args.devices, args.steps, args.prefill_steps, args.dtype, 0, args.out,
                        args.reserve, args.switch_us * 1e-6, not args.no_measure, args.layers,
                        rings_of(args.ring))
    run_offload_bench(cfg)
    return 0


__all__ = ["OffloadConfig", "main", "measure_rates", "run_offload_bench", "table"]
