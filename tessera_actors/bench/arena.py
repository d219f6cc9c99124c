"""``tessera bench arena``: every placement policy serving the same requests,
side by side, through the serving engine (DESIGN.md, "the arena").

L and R default to ``cuda:0`` and ``cuda:1?sms=32`` (two H200s, R limited to
32 SMs); on one GPU ``cuda:0?sms=100`` + ``cuda:0?sms=32`` (shared HBM:
functional only); on a CPU box two CPU devices (functional only).

Per model, every policy is an ``AsyncEngine`` configuration with the same KV
slots (``--seqs`` sequences in flight in total, so the same KV bytes):
Homo-L and Homo-R (one device), Request Distribution (two engines, one per
device with half the slots each, and a join-the-shortest-queue router),
layer split (``planner=layers``), AF (``planner=af``), Tessera (the MILP on
profiled kernel costs, online switching between its latency and throughput
layouts).  Each serves two traces: a conversation trace (Poisson arrivals,
prompts around ``--prompt`` tokens, outputs around ``--out-tokens``, fixed
seed) and a saturating offline trace (every request at once); ``--reps``
repetitions give the median and the spread.  Rows are named by the plan the
engine actually placed (a planner that fell back says so, e.g. ``af,
state-pinned``).  PD is not run: the engine does not move a KV cache
between engines yet.  The bound is the zero-communication split of the
decode bucket's profiled kernel times at the slots used (decode only, so
above every served row).  Writes JSON (git commit, command line) and, with
matplotlib, a PNG to ``--out``.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tessera_actors.serving import AsyncEngine, EngineConfig
from tessera_actors.serving.loadgen import EngineClient, TraceRequest, replay
from tessera_actors.provenance import provenance
from tessera_actors.serving.loadgen_report import summarize


@dataclass
class ArenaConfig:
    models: tuple[str, ...] = ("llama",)
    devices: tuple[str, str] = ("cuda:0", "cuda:1?sms=32")
    layers: int = 4
    size: str = "real"
    dtype: str = "bfloat16"
    seqs: int = 64
    context: int = 2048
    prompt: int = 1024
    out_tokens: int = 128
    requests: int = 64
    rate: float = 8.0
    reps: int = 3
    out: str = "benchmarks/results/arena_served"
    policies: tuple[str, ...] = ("Homo-L", "Homo-R", "Request Distribution", "layer split", "AF", "Tessera")
    log: Callable[[str], None] = print
    prefill_chunk: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seqs < 2 or self.seqs % 2:
            raise ValueError("--seqs must be an even number >= 2 (Request Distribution halves it)")
        if self.prompt + 2 * self.out_tokens > self.context:
            raise ValueError(f"--prompt {self.prompt} + outputs up to {2 * self.out_tokens} exceed --cache {self.context}")


def default_devices() -> tuple[str, str]:
    if torch.cuda.is_available():
        return ("cuda:0", "cuda:1?sms=32") if torch.cuda.device_count() > 1 else ("cuda:0?sms=100", "cuda:0?sms=32")
    return ("cpu", "cpu?threads=1")


def price_of(spec: str) -> float:
    """$/hour: ``price=`` of the spec, else 1.0 for a full device and the SM
    share of 132 for a partition (R at 32 SMs: 0.24)."""
    from tessera_actors.devices import DeviceSpec
    s = DeviceSpec.parse(spec)
    if "price=" in spec:
        return s.price
    return (s.sms / 132.0) if s.sms else 1.0


def ideal_split(profiles: list[list[float]]) -> float:
    """Zero-communication kernel split over devices: the smallest makespan
    when every kernel may go to any device and transfers are free (the LP
    relaxation: per-kernel fractions), for two devices exact by sorting on
    the time ratio."""
    if len(profiles) == 1:
        return sum(profiles[0])
    a, b = profiles
    order = sorted(range(len(a)), key=lambda k: a[k] / max(b[k], 1e-12))
    left, right = 0.0, sum(b)
    best = right
    for k in order:   # move kernels to device 0 in the order they favour it; a fraction of the one that balances
        if left + a[k] >= right - b[k]:
            f = (right - left) / max(a[k] + b[k], 1e-30)
            return min(best, left + f * a[k])
        left += a[k]
        right -= b[k]
        best = min(best, max(left, right))
    return best


class Router:
    """Request Distribution: each request goes to the replica with the fewest
    requests in flight per KV slot (ties: the first)."""
    name = "router"

    def __init__(self, engines: list[AsyncEngine]) -> None:
        self.clients = [EngineClient(e) for e in engines]
        self.load = [0] * len(engines)
        self.slots = [e.cfg.max_seqs for e in engines]

    async def count(self, prompt) -> int:
        return await self.clients[0].count(prompt)

    async def run(self, prompt, max_tokens, rec, t0):
        i = min(range(len(self.clients)), key=lambda j: (self.load[j] / self.slots[j], j))
        self.load[i] += 1
        try:
            return await self.clients[i].run(prompt, max_tokens, rec, t0)
        finally:
            self.load[i] -= 1


def traces(cfg: ArenaConfig) -> dict[str, list[TraceRequest]]:
    rng = random.Random(cfg.seed)
    lo, hi = int(cfg.prompt * 0.9), int(cfg.prompt * 1.1)
    olo, ohi = max(1, cfg.out_tokens // 2), cfg.out_tokens * 3 // 2
    lengths = [(rng.randint(lo, hi), rng.randint(olo, ohi)) for _ in range(cfg.requests)]
    t, conv = 0.0, []
    for i, (p, o) in enumerate(lengths):
        conv.append(TraceRequest(i, t, p, o))
        t += rng.expovariate(cfg.rate)
    offline = [TraceRequest(i, 0.0, p, o) for i, (p, o) in enumerate(lengths)]
    return {"conversation": conv, "offline": offline}


def engine_configs(cfg: ArenaConfig, model: str, policy: str) -> list[EngineConfig]:
    L, R = cfg.devices
    common = dict(model=model, size=cfg.size, dtype=cfg.dtype, max_model_len=cfg.context,
                  prefill_buckets=(32, cfg.prefill_chunk), overrides={"n_layers": cfg.layers} if cfg.layers else {},
                  seed=cfg.seed)
    if policy == "Request Distribution":
        return [EngineConfig(devices=d, max_seqs=cfg.seqs // 2, mode="latency", **common) for d in (L, R)]
    one = {"Homo-L": (L, "contiguous", "latency"), "Homo-R": (R, "contiguous", "latency"),
           "layer split": (f"{L},{R}", "layers", "throughput"), "AF": (f"{L},{R}", "af", "throughput"),
           "Tessera": (f"{L},{R}", "milp", "auto")}
    devices, planner, mode = one[policy]
    return [EngineConfig(devices=devices, planner=planner, mode=mode, max_seqs=cfg.seqs, profile=True, **common)]


async def run_policy(cfg: ArenaConfig, model: str, policy: str, runs: dict[str, list[TraceRequest]]) -> dict:
    engines = [AsyncEngine(config=c) for c in engine_configs(cfg, model, policy)]
    try:
        for e in engines:
            await e.start()
            await e.wait_placed()
        vocab = engines[0].served.vocab_size
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        client = Router(engines) if len(engines) > 1 else EngineClient(engines[0])
        out: dict[str, Any] = {"policy": policy, "traces": {}}
        for name, trace in runs.items():
            prompts = [torch.randint(0, vocab, (r.prompt_tokens,), generator=gen).tolist() for r in trace]
            reps = []
            for _ in range(cfg.reps):
                records = await replay(trace, prompts, client)
                reps.append(summarize(records, 0.05, 10.0))
            tok_s = [s["output_tok_s"] for s in reps]
            out["traces"][name] = {"output_tok_s_median": statistics.median(tok_s), "output_tok_s_reps": tok_s,
                                   "ttft_p50_s": statistics.median(s["ttft_s"]["p50"] or 0 for s in reps),
                                   "ttft_p99_s": statistics.median(s["ttft_s"]["p99"] or 0 for s in reps),
                                   "tpot_p50_s": statistics.median(s["tpot_s"]["p50"] or 0 for s in reps),
                                   "tpot_p99_s": statistics.median(s["tpot_s"]["p99"] or 0 for s in reps),
                                   "finished": min(s["finished"] for s in reps), "requests": len(trace)}
        plans, devices, busy = [], [], []
        for e in engines:
            st = e.stats()
            placed = e.deployment.placed
            plans.append(st["placement"].get("plan", "?"))
            pinned = sum("state-pinned" in p.plan.name for p in placed.values())
            if pinned:
                plans[-1] += f" ({pinned} of {len(placed)} buckets state-pinned)"
            devices += st["placement"].get("devices", [])
            busy += [d["busy_fraction"] for d in st["devices"]]
            out.setdefault("plan_switches", 0)
            out["plan_switches"] += st["plan_switches"]
            out["bytes_per_step"] = st["placement"].get("bytes_per_step", 0)
        out.update(ran=" + ".join(plans), devices=devices, busy=busy,
                   price_per_hour=sum(price_of(d) for d in set(devices)))
        if policy == "Tessera" and getattr(engines[0].deployment, "profiles", None):
            out["profiles"] = engines[0].deployment.profiles
        return out
    finally:
        for e in engines:
            await e.stop()


async def run_model(cfg: ArenaConfig, model: str) -> dict:
    runs = traces(cfg)
    rows = []
    for policy in cfg.policies:
        cfg.log(f"  {model}: {policy} ...")
        try:
            rows.append(await run_policy(cfg, model, policy, runs))
        except Exception as e:   # a policy that cannot run here is a row saying why
            rows.append({"policy": policy, "error": f"{type(e).__name__}: {e}"})
        cfg.log("    " + _row_text(rows[-1]))
    rows.append({"policy": "PD", "error": "not run: the engine does not move KV caches between engines yet"})
    bound = None
    tess = next((r for r in rows if r["policy"] == "Tessera" and "profiles" in r), None)
    if tess is not None:
        step = ideal_split(tess.pop("profiles"))
        bound = {"name": f"decode-only zero-communication kernel split at {cfg.seqs} rows (profiled)",
                 "step_s": step, "output_tok_s": cfg.seqs / step}
    for r in rows:
        for t in r.get("traces", {}).values():
            if bound:
                t["of_bound"] = t["output_tok_s_median"] / bound["output_tok_s"]
            if r.get("price_per_hour"):
                t["tokens_per_dollar"] = t["output_tok_s_median"] * 3600 / r["price_per_hour"]
    return {"model": model, "rows": rows, "bound": bound}


def _row_text(r: dict) -> str:
    if "error" in r:
        return f"{r['policy']}: {r['error']}"
    parts = [f"{k} {v['output_tok_s_median']:.1f} tok/s (TTFT p50 {v['ttft_p50_s'] * 1e3:.0f} ms, TPOT p50 "
             f"{v['tpot_p50_s'] * 1e3:.1f} ms)" for k, v in r["traces"].items()]
    return f"{r['policy']} [{r['ran']}]: " + "; ".join(parts)


def print_table(results: list[dict], cfg: ArenaConfig) -> str:
    label = "one GPU, shared HBM: functional" if cfg.devices[0].split("?")[0] == cfg.devices[1].split("?")[0] \
        and cfg.devices[0].startswith("cuda") else ("CPU: functional" if cfg.devices[0].startswith("cpu") else "")
    lines = [f"served arena: L={cfg.devices[0]} R={cfg.devices[1]} {label}; {cfg.seqs} KV slots per policy, "
             f"prompts ~{cfg.prompt}, outputs ~{cfg.out_tokens}, {cfg.requests} requests, {cfg.reps} reps",
             "| model | policy | ran | trace | out tok/s (median) | spread | TTFT p50/p99 ms | TPOT p50/p99 ms | of bound | tok/$ | busy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            if "error" in r:
                lines.append(f"| {res['model']} | {r['policy']} | {r['error']} | | | | | | | | |")
                continue
            for name, t in r["traces"].items():
                spread = f"{min(t['output_tok_s_reps']):.0f}-{max(t['output_tok_s_reps']):.0f}"
                ofb = f"{t['of_bound'] * 100:.1f}%" if "of_bound" in t else "-"
                busy = "/".join(f"{b * 100:.0f}%" for b in r["busy"])
                lines.append(f"| {res['model']} | {r['policy']} | {r['ran']} | {name} | {t['output_tok_s_median']:.1f} | "
                             f"{spread} | {t['ttft_p50_s'] * 1e3:.0f}/{t['ttft_p99_s'] * 1e3:.0f} | "
                             f"{t['tpot_p50_s'] * 1e3:.1f}/{t['tpot_p99_s'] * 1e3:.1f} | {ofb} | "
                             f"{t.get('tokens_per_dollar', 0):.3g} | {busy} |")
        if res["bound"]:
            b = res["bound"]
            lines.append(f"| {res['model']} | bound | {b['name']} | | {b['output_tok_s']:.1f} | | | | 100% | | |")
    return "\n".join(lines)


def run_arena(cfg: ArenaConfig) -> list[dict]:
    results = [asyncio.run(run_model(cfg, m)) for m in cfg.models]
    text = print_table(results, cfg)
    cfg.log(text)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    conf = {k: v for k, v in cfg.__dict__.items() if k != "log"}
    (out / "arena.json").write_text(json.dumps({"config": conf, "results": results, "table": text, **provenance()},
                                               indent=2, default=str))
    (out / "arena.md").write_text(text + "\n")
    return results
