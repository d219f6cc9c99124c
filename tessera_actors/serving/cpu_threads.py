"""The intra-op thread count of ``tessera serve``'s default CPU device
(issue #33): every core but one, and where that leaves a choice, a quick
measurement among the counts below it.

A CPU step is hundreds of small kernels; with more intra-op threads each
pays an OpenMP fork and barrier, and the serving loop and the device's
worker thread run on the same cores, so a barrier waits on any thread the
loop displaced.  Served on the shared 2-core box, two threads fell to ~1
tok/s in two rounds of five, one thread never did, and per round one
thread decoded a stream a median 1.6x faster, 16 streams 1.15x
(``benchmarks/results/serve_cpu/README.md``, "Default thread count"),
while a probe with the cores to itself could not tell the two apart: its
choice flipped between runs, and another process's load swung one count's
time 7x.  Hence the rule: one core is left to the serving loop
(:func:`candidates`).  With more cores than that, :func:`measure_threads`
times a decode-shaped probe (the model's layer shapes at 1 and 16 rows,
int4 weights with bfloat16 activations as the CPU default serves, or
dense weights) at each candidate count, on a fresh thread each, in
alternating rounds within a time budget, best of its runs (interference
only adds time); :func:`choose_threads` (pure) picks the fewest threads
within ``margin`` of the best.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

MARGIN = 0.10     # more threads only where the probe runs more than 10% faster
BUDGET_S = 1.5    # measuring stops starting rounds after this (a round at 16 cores: ~0.1-0.3 s)
PROBE_LAYERS = 8  # decoder layers of the probe (and the LM head once)


@dataclass(frozen=True)
class ThreadTimes:
    """Best-of-runs milliseconds of one probe step at ``threads`` intra-op threads,
    with 1 row (batch-1 decode) and 16 rows."""
    threads: int
    batch1_ms: float
    batch16_ms: float


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str            # one line: what was measured and the rule that chose
    times: tuple[ThreadTimes, ...] = ()


def candidates(cores: int) -> tuple[int, ...]:
    """Thread counts to choose from on ``cores`` cores, most first: every
    core but one (left to the serving loop and the device's worker), half
    (hyper-threads) and one; one core alone: one."""
    return tuple(sorted({c for c in (cores - 1, cores // 2, 1) if c >= 1}, reverse=True))


def choose_threads(times: list[ThreadTimes] | tuple[ThreadTimes, ...], margin: float = MARGIN) -> ThreadChoice:
    """The fewest threads whose probe score is within ``margin`` of the best
    score; a score is the geometric mean of the count's batch-1 and 16-row
    times, each relative to the fastest count at that batch."""
    if not times:
        raise ValueError("choose_threads: no measured thread counts")
    b1 = min(t.batch1_ms for t in times)
    b16 = min(t.batch16_ms for t in times)
    score = {t.threads: ((t.batch1_ms / b1) * (t.batch16_ms / b16)) ** 0.5 for t in times}
    best = min(score.values())
    chosen = min(n for n, s in score.items() if s <= best * (1 + margin))
    shown = ", ".join(f"{t.threads}: {t.batch1_ms:.1f}/{t.batch16_ms:.1f}" for t in sorted(times, key=lambda t: -t.threads))
    why = (f"a decode-shaped probe, best ms at 1/16 rows by threads {shown}: the fewest threads within "
           f"{margin:.0%} of the fastest, one core left to the serving loop")
    return ThreadChoice(chosen, why, tuple(times))


def _probe(hidden: int, inter: int, vocab: int, quantized: bool, dtype) -> Callable[[int], float]:
    """A function timing one probe step of ``rows`` rows (seconds): ``PROBE_LAYERS``
    layers of RMSNorm, q/k/v/o, residual add, RMSNorm, gate/up, SiLU * up, down,
    add, then the RMSNorm'd LM head (attention left out: a few kernels a layer)."""
    import torch
    aten = torch.ops.aten
    shapes = [(hidden, hidden), (hidden // 3, hidden), (hidden // 3, hidden), (hidden, hidden),
              (inter, hidden), (inter, hidden), (hidden, inter)]
    if quantized:
        mats = [(aten._convert_weight_to_int4pack_for_cpu(torch.full((o, i), 5, dtype=torch.int32), 1),
                 torch.full((i // 32, o, 2), 0.01, dtype=dtype)) for o, i in shapes]
        head, head_s = torch.full((vocab, hidden), 3, dtype=torch.int8), torch.full((vocab,), 0.01, dtype=dtype)

        def mm(x, w):
            return aten._weight_int4pack_mm_for_cpu(x, w[0], 32, w[1])

        def lm_head(x):
            return aten._weight_int8pack_mm(x, head, head_s)
    else:
        mats = [torch.full((o, i), 0.01, dtype=dtype) for o, i in shapes]
        head = torch.full((vocab, hidden), 0.01, dtype=dtype)

        def mm(x, w):
            return torch.nn.functional.linear(x, w)

        def lm_head(x):
            return torch.nn.functional.linear(x, head)
    norm = torch.ones(hidden, dtype=dtype)
    q, k, v, o, gate, up, down = mats

    def step(rows: int) -> float:
        x = torch.full((rows, hidden), 0.5, dtype=dtype)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(PROBE_LAYERS):
                h = torch.rms_norm(x, (hidden,), norm, 1e-5)
                mm(h, k), mm(h, v)
                x = x + mm(mm(h, q), o)
                h = torch.rms_norm(x, (hidden,), norm, 1e-5)
                x = x + mm(torch.nn.functional.silu(mm(h, gate)) * mm(h, up), down)
            lm_head(torch.rms_norm(x, (hidden,), norm, 1e-5))
        return time.perf_counter() - t0
    return step


def measure_threads(counts: tuple[int, ...], quantized: bool = True, dtype: str = "bfloat16",
                    shape: tuple[int, int, int] = (576, 1536, 49152), budget_s: float = BUDGET_S,
                    reps: int = 2) -> list[ThreadTimes]:
    """Probe times at each of ``counts`` intra-op threads, each on a fresh
    thread (as a device's worker sets its count), the counts alternating in
    rounds until ``budget_s`` has passed (at least one round). ``shape``:
    hidden, intermediate and vocabulary sizes (default: SmolLM2-135M's).
    Blocks the calling thread for about ``budget_s``."""
    import torch
    step = _probe(*shape, quantized, getattr(torch, dtype))
    got: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in counts}

    def run(n: int) -> None:
        torch.get_num_threads()        # this thread's lazy intra-op init first (actors/device.py)
        torch.set_num_threads(n)
        step(1), step(16)              # warm: first-call paths, this thread's OpenMP pool
        for _ in range(reps):
            got[n][0].append(step(1))
            got[n][1].append(step(16))
    t0 = last = time.perf_counter()
    while True:
        for n in counts:
            t = threading.Thread(target=run, args=(n,), name=f"threads-probe-{n}")
            t.start()
            t.join()
        now = time.perf_counter()
        if now + (now - last) - t0 > budget_s:   # another round would pass the budget
            break
        last = now
    return [ThreadTimes(n, min(b1) * 1e3, min(b16) * 1e3)
            for n, (b1, b16) in got.items()]
