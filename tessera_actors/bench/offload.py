"""``tessera bench offload``: a model bigger than the GPU's budget, placed
kernel by kernel between the GPU and its CPU, against the coarse policies,
every row measured through ``AsyncEngine`` (what ``tessera serve
--gpu-budget`` runs).

Every row is one serving engine (``EngineConfig(devices="GPU,CPU",
gpu_budget=...)``: in-process device actors, the GPU capped at the budget,
every bucket placed by the ``offload`` planner with one ``policy``): layer
offload (llama.cpp ``-ngl``), weight streaming (accelerate / FlexGen),
expert offload for a mixture of experts (routed experts on the CPU, the
rest resident: ``-ot exps=CPU``), Tessera
(:mod:`tessera_actors.planning.offload`) once per staging ring of
``--ring`` (rows ``tessera_<ring>_ring``; the first is the headline), and
GPU-only when the model fits the budget.  Its buckets: a decode bucket per
``--batch`` and a prompt chunk of ``--prefill`` tokens.  Each workload goes
through ``AsyncEngine.generate``: decode tokens/s of ``B`` concurrent greedy
requests over the window where all decode, prefill tokens/s from the time
to the first token of a ``--prefill``-token prompt.  Also reported: the GPU
allocator's peak, the bytes the engine streamed over PCIe per step (its
``pcie_bytes``), each device's busy fraction, the step model's prediction
with its terms (GPU and CPU kernels, hand-offs, copy waits, the copy
engine) and the ideal bound from the same rates.  ``--probe N``: after
each decode batch's timed window, N more steps are probed - each
resource's intervals, the copy engine's gaps by cause, the step along its
critical path - beside the planner's step model in the same terms (row
``timeline``, :mod:`~tessera_actors.bench.offload_probe`; a trace file per
row and workload in ``--out``).

Correctness at batch 1, from the engines' outputs: a reference engine on the
GPU alone without a budget (same weights; by default with the aten capture
the rows' GPU pieces run, ``--reference-capture``) gives greedy tokens and
their top log probabilities; every row's engine is checked teacher-forced against them
(:func:`~tessera_actors.bench.offload_engine.forced`): argmax flips beyond a
tie (``--tie-nats``), the largest log-probability error and the least cosine
over the top ids.  Rates are measured first: one activation hand-off between
the two device actors through an engine (median of three), and on a GPU the
CPU's GEMV rate beside a pinned copy stream and that copy's rate (best of
three windows); ``--no-measure``: the DESIGN.md numbers.

A mixture of experts (``--model moe``) is built with each layer's routed
experts in ``--expert-parts`` stacked tensors, each placed on its own, and
every row plans with the expert load of a warm-up batch (the router's
choices over 4 x ``warmup_tokens`` tokens on the host model, ATSInfer's
statistics: :func:`warmup_load`), so a part's CPU time is what a step of its
tokens reads of it and Tessera may keep hot parts resident, stream some and
compute the cold ones on the CPU; the load is in the JSON (``expert_load``).

Writes ``offload.json`` (git commit, command line, rates, every number) and
``offload.png`` to ``--out`` (and, after every row, ``offload.partial.json``
with the rows so far: a run cut short keeps them); prints a table.  Runs on CPU only too
(``--devices "cpu?threads=1,cpu"``: the budgeted CPU stands in for the GPU;
functional, for CI on a tiny model).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tessera_actors.provenance import command_line, git_commit
from tessera_actors.bench.offload_engine import PROMPT, TIE_NATS, RowFailed, first_difference, log, serve
from tessera_actors.bench.offload_measure import measure_rates, measure_switch
from tessera_actors.bench.offload_probe import row_timeline
from tessera_actors.devices import DeviceSpec, parse_bytes
from tessera_actors.planning.offload import Offload, estimate_rates, gpu_only, ideal, routed_experts
from tessera_actors.planning.offload.adapt import busy_factors
from tessera_actors.planning.offload.rates import rows_rates
from tessera_actors.serving.config import EngineConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COARSE = ("layer_offload", "streaming", "expert_offload")   # the policies Tessera is compared with


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
    rings: tuple[str, ...] = ("bytes",)   # staging ring modes: the first for every policy, others Tessera again
    tie_nats: float = TIE_NATS
    reference_capture: str = "aten"   # the GPU-only reference's capture: aten (the rows' GPU kernels) or auto
    expert_parts: int = 4             # moe: each layer's routed experts as this many tensors, placed apart
    warmup_tokens: int = 128          # moe: tokens per row of the 4-row warm-up batch whose routing is the load
    probe: int = 0                    # > 0: this many decode steps of each batch probed after its timed window

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


def engine_fields(cfg: OffloadConfig) -> dict:
    """``EngineConfig`` fields every engine of the run shares: one decode
    bucket per ``--batch`` (rows 0..B-1), a short prompt chunk and one of
    ``--prefill`` tokens, no attention windows (each bucket is one graph)."""
    warm = 3
    max_len = max(cfg.prefill + 8, 3 + warm + cfg.steps + 8)
    max_len = -(-max_len // 64) * 64
    chunks = tuple(sorted({32, cfg.prefill} - {0}))
    overrides = {"n_layers": cfg.layers} if cfg.layers else {}
    if cfg.model == "moe":
        overrides["expert_parts"] = cfg.expert_parts
    return dict(model=cfg.model, size=cfg.size, dtype=cfg.dtype, seed=cfg.seed, max_seqs=max(cfg.batches),
                max_model_len=max_len, decode_buckets=tuple(cfg.batches), prefill_buckets=chunks, kv_windows=(),
                mode="latency", overrides=overrides, build_device=cfg.build_device, embeddings=False)


def budget_bytes(cfg: OffloadConfig, graph) -> int:
    text = cfg.gpu_budget.strip()
    try:
        frac = float(text)
    except ValueError:
        return parse_bytes(text)
    held = sum(b.nbytes for b in graph.buffers.values() if b.role in ("weight", "state"))
    return int(frac * held)


def bucket_of(cfg: OffloadConfig, work: str) -> str:
    return "prefill:%d" % cfg.prefill if work == "prefill" else f"decode:{tokens_per_step(cfg, work)}@0"


def tokens_per_step(cfg: OffloadConfig, work: str) -> int:
    """Tokens one step of a workload makes: its batch (``decode_bB``) or the prompt (``prefill``)."""
    return cfg.prefill if work == "prefill" else int(work[len("decode_b"):])


def layer_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """[out, in] of the matrices of the model's first block (its linear layers)."""
    mats = [tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 2 and ".0." in n]
    return mats or [(4096, 4096)]


def matmul_rows(cfg: OffloadConfig) -> tuple[int, ...]:
    """The rows the CPU's matmuls multiply in the run's buckets: each decode
    batch and each prompt chunk (:func:`engine_fields`), and one."""
    return tuple(sorted({1, *cfg.batches, *({32, cfg.prefill} - {0})}))


async def measured_rates(cfg: OffloadConfig, gpu: DeviceSpec, cpu: DeviceSpec, shapes) -> dict:
    rates = {"pcie_bps": 55e9, "cpu_gemv_bps": None, "source": "DESIGN.md"}
    if gpu.kind == "cuda" and cfg.measure:
        rates.update(measure_rates(cpu.threads, gpu.index, shapes=shapes, dtype=DTYPES[cfg.dtype],
                                   rows=matmul_rows(cfg)), source="measured", gemv_shapes=shapes)
        log(f"measured: CPU GEMV {rates['cpu_gemv_bps'] / 1e9:.1f} GB/s on the model's layer shapes beside a "
            f"pinned copy at {rates['pcie_bps'] / 1e9:.1f} GB/s (best of {rates['windows']} windows); by rows "
            + ", ".join(f"{r}: {b / 1e9:.1f}" for r, b in rates["cpu_rows_bps"].items())
            + f" GB/s of weights, {rates['cpu_flops'] / 1e12:.2f} TFLOP/s")
    if cfg.measure:   # before any budget caps the GPU's allocator
        runs = [await measure_switch(cfg.model, cfg.dtype, gpu, cpu) for _ in range(3)]
        rates["switch_runs_s"] = runs
        rates["switch_s"] = sorted(runs)[1]
        log(f"measured: one CPU<->GPU hand-off between device actors {rates['switch_s'] * 1e6:.0f} us "
            f"(median of {[round(r * 1e6) for r in runs]} us, through AsyncEngine)")
    rates["planned_switch_s"] = max(rates["switch_s"], 20e-6) if cfg.measure else cfg.switch_s
    return rates


# -- the run ------------------------------------------------------------------------
def ring_row(ring: str) -> str:
    return f"tessera_{ring}_ring"


async def _engine(cfg: OffloadConfig, conf: EngineConfig, label: str, **kw) -> dict:
    return await serve(conf, cfg.batches, cfg.steps, cfg.prefill, cfg.prefill_steps, label, **kw)


def _rows(cfg: OffloadConfig, plain: str, budgeted: str, cpu: str, budget: int, options: dict, moe: bool,
          fits: bool) -> list[tuple[str, EngineConfig]]:
    """(row name, engine) of every row: GPU-only when the model fits, the
    coarse policies, then Tessera once per staging ring."""
    base = engine_fields(cfg)
    rows = [("gpu_only", EngineConfig(devices=budgeted, **base))] if fits else []
    pols = [p for p in COARSE if moe or p != "expert_offload"]
    rows += [(pol, EngineConfig(devices=f"{plain},{cpu}", gpu_budget=budget, planner_options=dict(
        options, policy=pol, ring=cfg.rings[0]), **base)) for pol in pols]
    rows += [(ring_row(r), EngineConfig(devices=f"{plain},{cpu}", gpu_budget=budget, planner_options=dict(
        options, policy="tessera", ring=r), **base)) for r in cfg.rings]
    return rows


def row_info(cfg: OffloadConfig, w: str, got: dict) -> dict:
    """One row's numbers for workload ``w`` from its engine's run ``got``;
    the predicted terms are the planner's own, on the graph the row ran."""
    bucket = bucket_of(cfg, w)
    plan = got["plans"][bucket]
    g = got["served"].graphs[bucket]
    per = tokens_per_step(cfg, w)
    r = got[w]
    off = plan.meta.get("offload") or {}
    streamed = sum(g.buffers[b].nbytes for b in off.get("streamed", ()))
    busy = list(r["busy_fraction"]) + [0.0, 0.0]
    choices = off.get("choices", "")
    info = {"tok_s": r["tok_s"], "step_s": r["step_s"], "predicted_step_s": plan.predicted_step_s,
            "step_model_error": (r["step_s"] / plan.predicted_step_s - 1) if plan.predicted_step_s else None,
            "predicted_terms": off.get("terms"),
            "planned_pcie_bytes_per_token": streamed / per,
            "pcie_bytes_per_token": r["pcie_bytes_per_step"] / per if "pcie_bytes_per_step" in r else None,
            "activation_bytes_per_token": plan.bytes_per_step() / per,
            "gpu_busy": min(1.0, busy[0]), "cpu_busy": min(1.0, busy[1]) if len(plan.devices) > 1 else 0.0,
            "gpu_peak_bytes": got["gpu_peak_bytes"], "gpu_allocated_bytes": got["gpu_allocated_bytes"],
            "gpu_bytes_before": got["gpu_bytes_before"], "gpu_bytes_after": got["gpu_bytes_after"],
            "gpu_stats": got.get("gpu_stats", {}), "devices": got["devices"], "plan": plan.name,
            "ring": off.get("ring"), "choices": choices,
            "homes": {h: choices.count(h) for h in "RSC"},   # what the placement really is, whatever its policy
            "slots": off.get("slots", 0), "slot_bytes": off.get("slot_bytes", 0),
            "kernels_on_cpu": plan.assignment.count(1) if len(plan.devices) > 1 else 0}
    if w == "decode_b1" and "check" in got:
        info.update(got["check"])
    probed = got.get(w.replace("decode_", "probe_")) if w.startswith("decode_") else None
    if probed is not None and off:
        info["timeline"] = row_timeline(probed, plan, Path(cfg.out), f"{got.get('label', 'row')}_{w}")
    return info


async def bench(cfg: OffloadConfig) -> dict:
    gpu, cpu = cfg.device_pair()
    reserve = parse_bytes(cfg.reserve) if gpu.kind == "cuda" else 0
    plain = DeviceSpec(gpu.kind, gpu.index, gpu.sms, gpu.threads).name
    work = [f"decode_b{b}" for b in cfg.batches] + (["prefill"] if cfg.prefill else [])
    b1 = 1 in cfg.batches

    # the reference first (GPU alone, no budget: before any budget caps the allocator), then the rates
    ref = await _engine(cfg, EngineConfig(devices=plain, capture=cfg.reference_capture, **engine_fields(cfg)),
                        "reference",
                        score=cfg.steps if b1 else 0)
    served = ref.pop("served")
    rates = await measured_rates(cfg, gpu, cpu, layer_shapes(served.model))
    biggest = served.graphs[f"decode:{max(cfg.batches)}@0"]
    budget = budget_bytes(cfg, biggest)
    budgeted = dataclasses.replace(DeviceSpec.parse(plain), mem=budget).name
    devices = [budgeted, cpu.name]
    log(f"reference on {plain} (no budget): " + ", ".join(f"{w} {ref[w]['tok_s']:.1f} tok/s" for w in work)
        + f"; peak {ref['gpu_peak_bytes']} B")

    # the planner's rates; the bound of every workload comes from the same rates (run_rows)
    options = {"pcie_bps": rates["pcie_bps"], "cpu_bps": rates["cpu_gemv_bps"], "switch_s": rates["planned_switch_s"],
               "reserve": reserve}
    load = warmup_load(cfg, served.model)
    if load:   # every row plans with the router's statistics: what each routed part's kernels really read
        options["expert_load"] = load
    if rates.get("cpu_rows_bps"):
        options.update(cpu_rows_bps=rates["cpu_rows_bps"], cpu_flops=rates["cpu_flops"])
    # whether the model fits the budget, on the reference's graph (its capture may differ from the offload
    # rows': only its bytes are read here)
    top = step_model(biggest, devices, options, cfg.rings[0])
    fits = gpu_only(top) is not None
    results: dict = {w: {"gpu_budget_bytes": budget, "ideal_step_s": None, "ideal_tok_s": None, "policies": {},
                         "reference_tok_s": ref[w]["tok_s"], "reference_device": plain,
                         "gpu_only_tok_s": None, "headline": ring_row(cfg.rings[0])} for w in work}
    check = (list(PROMPT), *ref["scored"], cfg.tie_nats) if b1 else None
    rows = _rows(cfg, plain, budgeted, cpu.name, budget, options, bool(routed_experts(top)), fits)
    def save() -> None:   # after every row: what a run cut short (a device's time limit) still leaves
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "offload.partial.json").write_text(json.dumps(
            {"git_commit": git_commit() or "unknown", "command": command_line(), "config": asdict(cfg),
             "rates": rates, "expert_load": load, **results}, indent=1, default=str))
    await run_rows(cfg, rows, results, (devices, options), check, {w: ref[w].get("tokens") for w in work}, save)
    return {"rates": rates, "reference_tokens": ref["scored"][0] if b1 else [], "expert_load": load, **results}


def warmup_load(cfg: OffloadConfig, model: torch.nn.Module) -> dict[str, list[float]]:
    """A mixture of experts' expert load (ATSInfer): the router's choices
    over a warm-up batch (up to 4 rows - the KV rows the model has - of
    ``warmup_tokens`` deterministic ids) on
    the host model (:func:`~tessera_actors.models.moe_load.router_load`);
    {} for a model without routed experts."""
    from tessera_actors.models.moe import MoE
    from tessera_actors.models.moe_load import router_load
    if not isinstance(model, MoE):
        return {}
    vocab, tokens, rows = model.cfg.vocab_size, min(cfg.warmup_tokens, model.cfg.max_seq), min(4, model.cfg.max_batch)
    ids = torch.tensor([[(i * 7919 + r * 104729 + 1) % vocab for i in range(tokens)] for r in range(rows)])
    t0 = time.perf_counter()
    load = router_load(model, ids)
    even = model.cfg.top_k / model.cfg.n_experts   # every expert's share under uniform routing
    shares = [p for ps in load.values() for p in ps]
    log(f"expert load from a warm-up batch of {rows} x {tokens} tokens in {time.perf_counter() - t0:.1f} s: "
        f"{len(load)} routed weights, experts at {min(shares) / even:.2f}x to {max(shares) / even:.2f}x "
        f"a uniform router's share")
    return load


def step_model(graph, devices: list[str], options: dict, ring: str) -> Offload:
    """The offload step model of ``graph`` with the planner's rates ``options``."""
    costs = estimate_rates(graph, devices, options["switch_s"], options["cpu_bps"], options.get("cpu_rows_bps"),
                           options.get("cpu_flops"), options.get("expert_load"))
    return Offload(graph, devices, costs, options["pcie_bps"], options["reserve"], ring=ring)


def set_ideal(cfg: OffloadConfig, results: dict, got: dict, devices: list[str], options: dict) -> None:
    """Every workload's ideal bound, on the graphs an offload row ran (the
    reference's capture may differ: on a GPU alone it is inductor's)."""
    for w, row in results.items():
        bucket = bucket_of(cfg, w)
        if row["ideal_step_s"] is None and got["plans"][bucket].meta.get("offload"):
            row["ideal_step_s"] = ideal(step_model(got["served"].graphs[bucket], devices, options, cfg.rings[0]))
            row["ideal_tok_s"] = tokens_per_step(cfg, w) / row["ideal_step_s"]


async def run_rows(cfg: OffloadConfig, rows: list, results: dict, rated: tuple, check, ref_tokens: dict,
                   save=lambda: None) -> None:
    """Every row's engine (one failing, e.g. out of memory, does not lose
    the others; ``save()`` after each), and one load-aware re-plan of the headline Tessera row;
    ``rated``: the budgeted devices and the planner's rates;
    ``ref_tokens``: per workload the reference's row-0 greedy tokens."""
    work = list(ref_tokens)
    first, head = work[0], ring_row(cfg.rings[0])
    for name, conf in rows:
        try:
            got = await _engine(cfg, conf, name, check=check, probe=cfg.probe)
            got["label"] = name
        except Exception as e:
            why = str(e) if isinstance(e, RowFailed) else f"{type(e).__name__}: {e}"
            log(f"{name}: FAILED: {why}")
            for w in work:
                results[w]["policies"][name] = {"error": why}
                results[w][f"{name}_tok_s"] = None
            save()
            continue
        set_ideal(cfg, results, got, *rated)
        for w in work:
            info = row_info(cfg, w, got)
            if ref_tokens[w] is not None:   # free-running, greedy: row 0 of the decode workload
                info["tokens_equal_reference"] = got[w]["tokens"] == ref_tokens[w]
                info["first_difference"] = first_difference(got[w]["tokens"], ref_tokens[w])
            results[w]["policies"][name] = info
            results[w][f"{name}_tok_s"] = info["tok_s"]
            log(f"{w} {name}: {info['tok_s']:.1f} tok/s (step {info['step_s'] * 1e3:.1f} ms, predicted "
                f"{(info['predicted_step_s'] or 0) * 1e3:.1f}), peak {info['gpu_peak_bytes']} B")
        save()
        if name == head:
            replan = replanned(cfg, got, first, conf)
            if replan is not None:
                rows.append((f"{head}_replanned", replan))
    for w in work:
        row = results[w]
        best = max((row.get(f"{p}_tok_s") or 0 for p in COARSE), default=0)
        runs = {r: row.get(f"{r}_tok_s") or 0 for r in (head, f"{head}_replanned")}
        row["tessera_from"] = max(runs, key=runs.get)   # the headline ring, after one re-plan when that was faster
        t = runs[row["tessera_from"]]
        row["tessera_tok_s"] = t or None
        row["tessera_x_best_coarse"] = t / best if best else None
        row["tessera_of_ideal"] = t / row["ideal_tok_s"] if t and row["ideal_tok_s"] else None
        row["gpu_peak_bytes"] = row["policies"].get(head, {}).get("gpu_peak_bytes")


# a re-plan rescales the CPU's rates by at most this much either way: they were measured on this machine
# minutes before, so a larger gap is a mismeasured busy time (or a plan scored on another graph: 10,575x
# once), not load - and a CPU 4x slower than measured already leaves these plans nothing worth computing there
REPLAN_BOUND = 4.0


def replanned(cfg: OffloadConfig, got: dict, w: str, conf: EngineConfig) -> EngineConfig | None:
    """Load-aware re-plan (ATSInfer's dynamic transfer): the devices' busy
    time in workload ``w`` against the planner's prediction for that plan
    (its ``busy_s``); a CPU slower than planned (by 1.25x to
    :data:`REPLAN_BOUND`) moves its share to streaming in Tessera's next
    plan (None: no change)."""
    plan = got["plans"][bucket_of(cfg, w)]
    r = got[w]
    planned = (plan.meta.get("offload") or {}).get("busy_s")
    if len(plan.devices) < 2 or not conf.planner_options.get("cpu_bps") or not planned:
        return None
    busy = list(r["busy_fraction"]) + [0.0, 0.0]
    factors = busy_factors(planned, [busy[0] * r["step_s"], busy[1] * r["step_s"]], bound=REPLAN_BOUND)
    if factors[1] == 1.0:
        return None
    o = conf.planner_options
    opts = dict(o, cpu_bps=o["cpu_bps"] / factors[1])
    if o.get("cpu_rows_bps"):
        opts["cpu_rows_bps"] = {m: b / factors[1] for m, b in rows_rates(o["cpu_rows_bps"]).items()}
    if o.get("cpu_flops"):
        opts["cpu_flops"] = o["cpu_flops"] / factors[1]
    log(f"tessera: the CPU ran {factors[1]:.2f}x its planned time; re-planning at {opts['cpu_bps'] / 1e9:.1f} GB/s")
    return dataclasses.replace(conf, planner_options=opts)


def table(res: dict) -> str:
    names = [n for n, r in res.items() if isinstance(r, dict) and "ideal_tok_s" in r]
    cols = []
    for n in names:
        for p in res[n]["policies"]:
            if p not in cols:
                cols.append(p)
    lines = [f"{'workload':<11} " + " ".join(f"{c[:18]:>18}" for c in cols) + f" {'ideal':>9} {'x best':>7} "
             f"{'% ideal':>7}  (tok/s)"]
    for n in names:
        row = res[n]

        def f(v, w=18):
            return f"{v:{w}.1f}" if v else f"{'-':>{w}}"
        lines.append(f"{n:<11} " + " ".join(f(row.get(f"{c}_tok_s")) for c in cols) + f" {f(row['ideal_tok_s'], 9)} "
                     f"{row.get('tessera_x_best_coarse') or 0:7.2f} {100 * (row.get('tessera_of_ideal') or 0):6.1f}%")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n, r in res.items() if isinstance(r, dict) and "ideal_tok_s" in r]
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8), squeeze=False)
    for ax, n in zip(axes[0], names):
        pols = [p for p in res[n]["policies"] if p != "gpu_only"] + ["ideal"]
        vals = [res[n].get(f"{p}_tok_s") or 0 for p in pols]
        ax.bar(pols, vals, color=["#c33" if p.startswith("tessera") else "#999" if p != "ideal" else "#ddd"
                                  for p in pols])
        ax.set_title(n)
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_offload_bench(cfg: OffloadConfig, argv: list[str] | None = None) -> dict:
    if cfg.size == "real" and not cfg.layers and not cfg.devices and not torch.cuda.is_available():
        raise RuntimeError("tessera bench offload --size real measures a GPU: no CUDA device is visible "
                           "(on CPU: --size tiny --gpu-budget 0.6 --devices 'cpu?threads=1,cpu' --dtype float32)")
    res = asyncio.run(bench(cfg))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"git_commit": git_commit() or "unknown", "command": command_line(argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(cfg), "config": asdict(cfg), **res}
    (out / "offload.json").write_text(json.dumps(doc, indent=1, default=str))
    print(table(res))
    drew = plot(res, out / "offload.png")
    log(f"wrote {out / 'offload.json'}" + (f" and {out / 'offload.png'}" if drew else " (no matplotlib: no PNG)"))
    return doc


def machine(cfg: OffloadConfig) -> str:
    gpu, _ = cfg.device_pair()
    name = torch.cuda.get_device_name(gpu.index) if gpu.kind == "cuda" else "no GPU"
    return f"{name}, {os.cpu_count()} CPUs"


def rings_of(text: str) -> tuple[str, ...]:
    from tessera_actors.planning.offload.staging import RING_MODES
    rings = tuple(r.strip() for r in text.split(",") if r.strip())
    bad = [r for r in rings if r not in RING_MODES]
    if not rings or bad or len(set(rings)) != len(rings):
        raise SystemExit(f"--ring {text!r}: a list of distinct modes of {', '.join(RING_MODES)}")
    return rings


def main(args) -> int:
    cfg = OffloadConfig(args.model, args.size, args.gpu_budget, tuple(sorted(int(x) for x in args.batch.split(",") if x)),
                        args.prefill, args.devices, args.steps, args.prefill_steps, args.dtype, 0, args.out,
                        args.reserve, args.switch_us * 1e-6, not args.no_measure, args.layers,
                        rings_of(args.ring), args.tie_nats, args.reference_capture, args.expert_parts,
                        probe=args.probe)
    doc = run_offload_bench(cfg)
    ran = [n for n, r in doc.items() if isinstance(r, dict) and any(
        "error" not in pol for pol in r.get("policies", {}).values())]
    if not ran:   # the table is all dashes: say so, and fail the command
        print("tessera bench offload: no policy ran any workload (the errors are in the log above and in "
              f"{Path(cfg.out) / 'offload.json'})", file=sys.stderr)
        return 1
    return 0


__all__ = ["OffloadConfig", "main", "run_offload_bench", "table"]
