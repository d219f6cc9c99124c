"""The served step of one bucket, measured through the public ``AsyncEngine``.

What a user gets at a bucket: an engine whose only decode bucket is
``batch`` rows over the whole ``cache`` (``kv_windows=()``: every decode
step reads the whole KV cache, as ``torch.compile`` of the model with that
cache does), fed a saturating trace - ``batch`` requests at once, short
prompts, ``ignore_eos`` - and timed from the moment every row decodes
until the first request finishes: wall seconds per decode step, engine loop,
sampling on the device and the token feed included, and the host seconds per
step over the same window (``AsyncEngine.host_times``: the serving loop, the
event loop's thread, the devices' workers and of those the runs of kernels).  A prefill bucket is the
time to the first token of a prompt of exactly that chunk, one request at a
time (median after warm-up: the first steps of a bucket run eagerly, the
second captures it as a CUDA graph).

Used by ``tessera bench roofline`` and ``benchmarks/bench_engine_step.py``.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServedCase:
    model: str
    size: str = "real"
    layers: int = 4
    dtype: str = "bfloat16"
    device: str = "cuda:0"
    batch: int = 64
    cache: int = 2048
    prompt: int = 1024        # prefill: the chunk's tokens
    regions: str = "auto"
    gqa: str = "auto"
    capture: str = "auto"
    decode_prompt: int = 8    # decode: each request's prompt, then ``decode_tokens`` out
    decode_tokens: int = 48
    reps: int = 5
    overrides: dict = field(default_factory=dict)
    window_hook: Any = None   # decode: called with "start" and "end" at the window's ends (a profiler, say)


def engine_for(case: ServedCase, kind: str):
    """The engine of one case: one decode bucket (``kind="decode"``) or one
    prefill chunk (``"prefill"``), the whole cache as the attention window."""
    from tessera_actors import AsyncEngine
    overrides = dict(case.overrides)
    if case.layers:
        overrides["n_layers"] = case.layers
    seqs = case.batch if kind == "decode" else 1
    chunk = case.prompt if kind == "prefill" else 32
    return AsyncEngine(model=case.model, size=case.size, devices=case.device, dtype=case.dtype, max_seqs=seqs,
                       max_model_len=case.cache, decode_buckets=(seqs,), prefill_buckets=(chunk,), kv_windows=(),
                       mode="latency", overrides=overrides, capture=case.capture, regions=case.regions,
                       gqa=case.gqa, embeddings=False)


async def _started(case: ServedCase, kind: str):
    """The case's engine for ``kind``, started, and the seconds its start took."""
    eng = engine_for(case, kind)
    t0 = time.perf_counter()
    await eng.start()
    return eng, time.perf_counter() - t0


async def served_decode(case: ServedCase) -> dict[str, Any]:
    """Seconds per served decode step of ``batch`` rows (module docstring)."""
    from tessera_actors import SamplingParams
    from tessera_actors.serving.buckets import bucket_name
    eng, started = await _started(case, "decode")
    try:
        bucket = bucket_name("decode", case.batch, 0, 0)
        vocab = eng.served.vocab_size
        # requests are admitted over up to ``batch`` prefill steps while the first ones decode: each asks for
        # ``decode_tokens`` more than that, so the window (every row decoding, until the first finishes) is there
        out_tokens = min(case.decode_tokens + 2 * case.batch, case.cache - case.decode_prompt)
        params = SamplingParams(max_tokens=out_tokens, ignore_eos=True, temperature=0.0)
        first = [asyncio.Event() for _ in range(case.batch)]
        done = asyncio.Event()
        marks: dict[str, tuple[float, int]] = {}

        async def one(i: int) -> int:
            prompt = [(7 * i + j) % vocab for j in range(case.decode_prompt)]
            n = 0
            async for out in eng.generate(prompt, params):
                n += len(out.token_ids)
                if n == 1:
                    first[i].set()
            if not done.is_set():
                marks["end"] = (time.perf_counter(), eng.counters["decode_steps"], eng.host_times())
                done.set()
                if case.window_hook is not None:
                    case.window_hook("end")
            return n

        async def window() -> None:
            await asyncio.gather(*(e.wait() for e in first))
            marks["start"] = (time.perf_counter(), eng.counters["decode_steps"], eng.host_times())
            if case.window_hook is not None:
                case.window_hook("start")
        t1 = time.perf_counter()
        made, _ = await asyncio.gather(asyncio.gather(*(one(i) for i in range(case.batch))), window())
        wall = time.perf_counter() - t1
        (ts, ns, hs), (te, ne, he) = marks["start"], marks["end"]
        steps = ne - ns
        if steps <= 0:
            raise RuntimeError(f"{bucket}: no decode step ran with all {case.batch} rows (the first request ended "
                               f"before the last one started); raise decode_tokens")
        step_s = (te - ts) / steps
        host = {k: (he[k] - hs[k]) / steps for k in he if k in hs}
        return {"bucket": bucket, "served_step_s": step_s, "host_s": host, "window_steps": steps, "served_tok_s": case.batch / step_s,
                "trace_tok_s": sum(made) / wall, "out_tokens": out_tokens, "start_s": started, "capture": eng.served.captures.get(bucket),
                "bucket_stats": eng.stats()["bucket_stats"].get(bucket, {}), "graph": eng.served.graphs[bucket]}
    finally:
        await eng.stop()


async def served_prefill(case: ServedCase) -> dict[str, Any]:
    """Seconds from a ``prompt``-token request to its first token (median)."""
    from tessera_actors import SamplingParams
    from tessera_actors.serving.buckets import bucket_name
    eng, started = await _started(case, "prefill")
    try:
        bucket = bucket_name("prefill", case.prompt, 0, 0)
        vocab = eng.served.vocab_size
        params = SamplingParams(max_tokens=1, temperature=0.0)
        times = []
        for r in range(3 + case.reps):   # eager, capture, first replay, then the measured ones
            prompt = [(11 * r + j) % vocab for j in range(case.prompt)]
            t = time.perf_counter()
            async for _ in eng.generate(prompt, params):
                pass
            times.append(time.perf_counter() - t)
        step_s = statistics.median(times[3:])
        return {"bucket": bucket, "served_step_s": step_s, "served_tok_s": case.prompt / step_s, "start_s": started,
                "capture": eng.served.captures.get(bucket), "bucket_stats": eng.stats()["bucket_stats"].get(bucket, {}),
                "graph": eng.served.graphs[bucket]}
    finally:
        await eng.stop()


__all__ = ["ServedCase", "engine_for", "served_decode", "served_prefill"]
