"""One engine of ``tessera bench offload``: the workloads through
``AsyncEngine.generate`` and the teacher-forced check from the engine's own
outputs (its greedy tokens and their top log probabilities).

Contract: :func:`serve` builds one ``AsyncEngine`` from an ``EngineConfig``,
waits for every bucket, times each decode batch and the prompt chunk,
optionally scores a batch-1 continuation teacher-forced against a
reference (:func:`forced`), and returns the numbers, the placed plans and
the budgeted device's counters; the GPU allocator's peak when the engine's
first device is a GPU.  Before an engine starts and after it stopped, failed
or not, what it allocated on the GPU is released and the bytes left are
recorded (``gpu_bytes_before``, ``gpu_bytes_after``): a failed engine is
:class:`RowFailed` with its error's text only, its memory gone.  Nothing here deploys plans or steps devices itself:
what is measured is what ``tessera serve`` runs."""
from __future__ import annotations

import asyncio
import gc
import time

import torch

from tessera_actors.bench.offload_probe import probe_decode
from tessera_actors.devices import DeviceSpec
from tessera_actors.runtime.messages import GetStats
from tessera_actors.serving import AsyncEngine, SamplingParams
from tessera_actors.serving.config import EngineConfig

PROMPT = (1, 2, 3)   # the prompt of the checked batch-1 continuation (row 0 of the decode workloads)
TOP = 20          # top log probabilities per token the check asks for (OpenAI's most)
TIE_NATS = 0.0625 # a flip within this many nats of the reference's best is a tie (4 bf16 ulps of logits in [2, 4))

# the budgeted device's counters a result row carries (GetStats): how its segments and streamed pieces ran
GPU_STATS = ("captures", "replays", "eager_runs", "capture_failures", "last_capture_error", "capture_pool_bytes",
             "step_state_bytes", "staging_bytes", "streamed_copies",
             "streamed_copies_ahead_used", "streamed_bytes", "direct_transfers", "taken_on_worker", "taken_on_loop",
             "mapped_reads")


def log(msg: str) -> None:
    print(f"[offload {time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def _stream(eng: AsyncEngine, prompt: list[int], tokens: int, top: int = 0
                  ) -> tuple[list[int], list[float], list[dict[int, float]]]:
    """Greedy tokens of one request, the time each arrived and (``top``) each
    token's top log probabilities as ``{id: logprob}``."""
    ids, times, tops = [], [], []
    async for out in eng.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, top_logprobs=top)):
        ids += out.token_ids
        times += [time.perf_counter()] * len(out.token_ids)
        tops += [{int(i): float(lp) for i, lp in t} for t in out.top_logprobs]
    return ids, times, tops


async def time_decode(eng: AsyncEngine, batch: int, steps: int, warm: int = 3) -> dict:
    """``batch`` concurrent greedy requests of ``warm + steps`` tokens: the
    tokens/s over the window where all of them decode (after each one's
    ``warm``-th token, before the first one ends); row 0's tokens; the
    bytes each step streamed to the budgeted device (PCIe)."""
    busy0, moved0, steps0 = dict(eng.deployment.busy_s), *_pcie(eng)
    prompts = [[1 + r, 2 + r, 3 + r] for r in range(batch)]
    t0 = time.perf_counter()
    got = await asyncio.gather(*(_stream(eng, p, warm + steps) for p in prompts))
    called = time.perf_counter() - t0
    start = max(t[warm - 1] for _, t, _ in got)
    end = min(t[-1] for _, t, _ in got)
    n = sum(sum(1 for x in t if start < x <= end) for _, t, _ in got)
    wall = max(end - start, 1e-9)
    busy = [(eng.deployment.busy_s.get(d, 0.0) - busy0.get(d, 0.0)) / called for d in sorted(eng.deployment.busy_s)]
    moved, stepped = _pcie(eng)
    return {"tok_s": n / wall, "step_s": wall / max(n / batch, 1e-9), "tokens": got[0][0],
            "busy_fraction": busy, "window_s": wall,
            "pcie_bytes_per_step": (moved - moved0) / max(stepped - steps0, 1)}


def _pcie(eng: AsyncEngine) -> tuple[int, int]:
    """(host-to-device bytes streamed so far, steps so far) from the engine's stats."""
    st = eng.stats()
    return int(st.get("pcie_bytes", 0)), int(st.get("steps", 0))


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


# -- the teacher-forced check -----------------------------------------------------
async def scored(eng: AsyncEngine, prompt: list[int], tokens: int) -> tuple[list[int], list[dict[int, float]]]:
    """``tokens`` greedy tokens after ``prompt`` and each one's top log probabilities."""
    ids, _, tops = await _stream(eng, prompt, tokens, TOP)
    return ids, tops


async def forced(eng: AsyncEngine, prompt: list[int], ref_tokens: list[int]
                 ) -> tuple[list[int], list[dict[int, float]]]:
    """The engine's greedy token and top log probabilities at each of
    ``len(ref_tokens)`` steps, every step scoring the reference's context:
    while the tokens agree the engine's own continuation is that context;
    after a step that picks another token, a new request goes on from the
    prompt and the reference's tokens so far (its first token comes from a
    prompt chunk, the rest from decode steps).  A free-running comparison
    would turn one argmax flip on a near tie (bf16 logits of random weights
    are often an ulp apart) into a different continuation with nothing
    wrong in the placement."""
    toks: list[int] = []
    tops: list[dict[int, float]] = []
    while len(toks) < len(ref_tokens):
        i = len(toks)
        got, got_tops = await scored(eng, prompt + ref_tokens[:i], len(ref_tokens) - i)
        j = first_difference(got, ref_tokens[i:])
        keep = len(got) if j is None else j + 1
        toks += got[:keep]
        tops += got_tops[:keep]
    return toks, tops


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare(tokens: list[int], tops: list[dict], ref_tokens: list[int], ref_tops: list[dict],
            tie_nats: float = TIE_NATS) -> dict:
    """Teacher-forced agreement with the reference: steps whose argmax
    differs by more than a tie (the token taken scores below the reference's
    best by more than ``tie_nats`` in the reference's log probabilities; a
    token outside its top ``TOP`` always does), and per step over the ids in
    both top lists the largest log-probability difference and the cosine of
    the two log-probability vectors about their means."""
    flips, worst, cos, shared = 0, 0.0, 1.0, TOP
    for t, r, mine, ref in zip(tokens, ref_tokens, tops, ref_tops):
        if t != r:
            lp = ref.get(t)   # None: below the reference's top list
            if lp is None or max(ref.values()) - lp > tie_nats:
                flips += 1
        ids = [i for i in ref if i in mine]
        shared = min(shared, len(ids))
        if len(ids) < 2:
            continue
        a = torch.tensor([mine[i] for i in ids], dtype=torch.float64)
        b = torch.tensor([ref[i] for i in ids], dtype=torch.float64)
        worst = max(worst, float((a - b).abs().max()))
        cos = min(cos, float(torch.nn.functional.cosine_similarity(a - a.mean(), b - b.mean(), dim=0)))
    return {"forced_tokens_equal_reference": tokens == ref_tokens, "argmax_flips_beyond_ties": flips,
            "tie_nats": tie_nats, "max_top_logprob_error": worst, "min_top_logprobs_cosine": cos,
            "min_top_ids_shared": shared}


# -- one engine --------------------------------------------------------------------
async def serve(conf: EngineConfig, batches, steps: int, prefill: int, prefill_steps: int, label: str,
                check: tuple | None = None, score: int = 0, probe: int = 0) -> dict:
    """One engine (``conf``): every workload through ``AsyncEngine.generate``,
    then (``check``: prompt, reference tokens, their top log probabilities
    and the tie in nats) the teacher-forced comparison, or (``score``) that
    many greedy tokens after :data:`PROMPT` with their top log
    probabilities (a reference's); the GPU allocator's peak, the plans,
    the budgeted device's counters; ``probe``: after each decode batch's
    timed window, that many of its steps probed
    (:func:`~tessera_actors.bench.offload_probe.probe_decode`: the records
    in ``probe_b<batch>``)."""
    gpu = DeviceSpec.parse(conf.devices.split(",")[0])
    cuda = gpu.kind == "cuda"
    before = await settle_gpu(gpu, label)
    if cuda:
        torch.cuda.reset_peak_memory_stats(gpu.index)
    t0 = time.perf_counter()
    out: dict = {"gpu_bytes_before": before}
    failed = ""
    try:
        await _run(conf, batches, steps, prefill, prefill_steps, label, check, score, out, t0, probe)
    except Exception as e:
        # the error's traceback holds the failed step's frames and through them its plan's device memory:
        # only its text leaves here, so that memory goes with the engine before the next one starts
        failed = f"{type(e).__name__}: {e}"
    left = await settle_gpu(gpu, label, after=True)
    if failed:
        raise RowFailed(failed)
    out["gpu_bytes_after"] = left
    return out


class RowFailed(RuntimeError):
    """An engine of the benchmark failed (its error's text; nothing of the engine is kept)."""


async def _run(conf: EngineConfig, batches, steps: int, prefill: int, prefill_steps: int, label: str,
               check: tuple | None, score: int, out: dict, t0: float, probe: int = 0) -> None:
    gpu = DeviceSpec.parse(conf.devices.split(",")[0])
    cuda = gpu.kind == "cuda"
    async with AsyncEngine(config=conf) as eng:
        await eng.wait_placed()
        log(f"{label}: engine on {eng.cfg.devices} ({eng.cfg.planner} planner) placed "
            f"{len(eng.deployment.placed)} buckets in {time.perf_counter() - t0:.1f} s")
        gc.collect()
        gc.freeze()   # CUDA graph capture runs gc.collect() each time: keep it to the new objects
        try:
            for b in batches:
                out[f"decode_b{b}"] = await time_decode(eng, b, steps)
                if probe:
                    out[f"probe_b{b}"] = await probe_decode(eng, b, probe)
            if prefill:
                out["prefill"] = await time_prefill(eng, prefill, prefill_steps, eng.served.vocab_size)
            if check is not None:
                prompt, ref_tokens, ref_tops, tie = check
                tokens, tops = await forced(eng, prompt, ref_tokens)
                out["check"] = compare(tokens, tops, ref_tokens, ref_tops, tie)
            if score:
                out["scored"] = await scored(eng, list(PROMPT), score)
        finally:
            gc.unfreeze()
        out["plans"] = {name: p.plan for name, p in eng.deployment.placed.items()}
        out["served"] = eng.served
        out["devices"] = eng.cfg.devices
        st = (await eng.deployment.system.ref("device0").ask(GetStats())).values
        out["gpu_allocated_bytes"] = st["allocated_bytes"]   # the budgeted device: every byte it holds, all buckets
        out["gpu_stats"] = {k: st[k] for k in GPU_STATS if k in st}
    out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(gpu.index) if cuda else None


def free_gpu(gpu: DeviceSpec) -> int:
    """Drop what a finished engine left (its actors are gone); returns
    the bytes still allocated.  cuBLAS keeps a workspace per stream it ran
    on (32 MiB on an H200), and every engine has new streams: those go too."""
    gc.collect()
    if gpu.kind != "cuda":
        return 0
    torch.cuda.synchronize(gpu.index)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(gpu.index)


async def settle_gpu(gpu: DeviceSpec, label: str = "", after: bool = False, wait_s: float = 5.0) -> int:
    """:func:`free_gpu`, again every 0.1 s for up to ``wait_s`` while more
    than 64 MiB stay allocated (a stopped engine's worker threads let go of
    their arenas a moment after the actors stopped: on an H200 the
    unbudgeted reference's 15 GB once outlived its actor system into the
    next policy's budget), and say if anything stays: it would count
    against the next budget.  Returns the bytes still allocated."""
    left, t0 = free_gpu(gpu), time.perf_counter()
    while left > 64 << 20 and time.perf_counter() - t0 < wait_s:
        await asyncio.sleep(0.1)
        left = free_gpu(gpu)
    if left > 64 << 20:
        when = f"after {label}'s engine" if after else f"before {label}'s engine"
        log(f"warning: {left / 2**20:.0f} MiB still allocated on {gpu.name} {when}")
    return left


__all__ = ["RowFailed", "compare", "forced", "scored", "serve", "settle_gpu", "time_decode", "time_prefill"]
