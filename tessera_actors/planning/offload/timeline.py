"""A step's timeline by resource, measured (the executor's probe) or
predicted (:meth:`~.model.Offload.timeline`), and one summary of both, so the
two compare term by term.

A *record* is ``[device, resource, name, step, start_s, end_s, args]``
(plain lists and dicts: it crosses the actor boundary in
``StepDone.timeline``); ``device`` is the plan's device index, times are
seconds on one clock (the host's ``perf_counter`` for a probe, the model's
step clock for a prediction).  Resources:

* ``kernels``: a run of kernels on ``device`` (a CPU segment on the thread
  that runs it, a GPU piece between CUDA events); ``args.waits``: the
  streamed copies the piece waited for;
* ``copy``: weight copy ``args.copy`` on the copy stream (``args.bytes``;
  ``args.issued``: when the host queued it; ``args.freed``: when the reader
  of the bytes it overwrites ended, None when it overwrote none);
* ``wait``: ``device``'s worker waiting for a hand-off (``args.tag``,
  ``args.src``: the device it waits for; ``args.on``: ``worker`` or
  ``loop``); ``send`` / ``recv``: a hand-off's bytes leaving (the host
  waits for them) or written into the device (``recv`` on the device's
  stream);
* ``step``: the device's share of step ``step``, first call to landing.

:func:`summarize` gives per step: each resource's busy seconds, the copy
engine's overlap with the kernels, its idle gaps by cause and the step's
wall time cut along its critical path (``path_s``: CPU kernels, GPU
kernels, waits for copies, hand-offs, other host time; they add up to
``step_s``).  Pure Python; no torch.
"""
from __future__ import annotations

from typing import Iterable, Sequence

EPS = 2e-6   # seconds: closer than this is "at the same time" (CUDA events resolve ~0.5 us)
HANDOFF = ("wait", "send", "recv")


def union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering ``spans``."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(spans: Sequence[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def intersect(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two unions (:func:`union`)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(spans: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return union((max(s, lo), min(e, hi)) for s, e in spans)


def windows(records: Sequence[Sequence]) -> dict[int, tuple[float, float]]:
    """Step -> (start, end): from the earliest ``step`` record of the step to
    the latest; a timeline without them (a prediction) is one window per
    step over all its records."""
    out: dict[int, list[float]] = {}
    steps = [r for r in records if r[1] == "step"]
    for r in steps or records:
        w = out.setdefault(r[3], [r[4], r[5]])
        w[0], w[1] = min(w[0], r[4]), max(w[1], r[5])
    return {n: (s, e) for n, (s, e) in sorted(out.items())}


def copy_gaps(copies: Sequence[Sequence], lo: float, hi: float) -> dict[str, float]:
    """The copy engine's idle seconds in ``[lo, hi]`` by cause: before the
    first copy (``step_start``); until the bytes of the next copy were freed
    (``ring_full``: the reader of what it overwrites ran late); from then
    until the host queued it (``issued_late``: only the time a copy queued
    earlier would have run); what is left before it started (``other``);
    and after the last copy (``no_copy_left``)."""
    gaps = dict.fromkeys(("step_start", "ring_full", "issued_late", "other", "no_copy_left"), 0.0)
    prev = None
    for c in sorted(copies, key=lambda c: c[4]):
        start, end = max(c[4], lo), min(c[5], hi)
        if end <= start:
            continue
        if prev is None:
            gaps["step_start"] += max(start - lo, 0.0)
        elif start - prev > EPS:
            freed, issued = c[6].get("freed"), c[6].get("issued")
            t = prev
            for when, why in ((freed, "ring_full"), (issued, "issued_late")):
                if when is not None and when > t:
                    gaps[why] += min(when, start) - t
                    t = min(when, start)
            gaps["other"] += start - t
        prev = end if prev is None else max(prev, end)
    gaps["no_copy_left"] += (hi - prev) if prev is not None else (hi - lo)
    return gaps


def critical_path(kernels: Sequence[Sequence], copies: dict, gpu: int, lo: float, hi: float,
                  handoffs: Sequence[Sequence] = ()) -> dict[str, float]:
    """The window cut by what the step's chain was doing (:func:`path_of`)
    from records: ``copies``: (step, copy) -> when it ended; a gap's
    hand-off into a device is that device's ``wait`` and ``recv`` records
    and the other device's ``send``."""
    runs = []
    for k in kernels:
        done = max((copies[(k[3], i)] for i in k[6].get("waits", ()) if (k[3], i) in copies), default=None) \
            if k[0] == gpu else None
        runs.append((k[4], k[5], k[0], done))
    into = {d: union((r[4], r[5]) for r in handoffs
                     if (r[0] == d and r[1] in ("wait", "recv")) or (r[0] != d and r[1] == "send"))
            for d in {k[0] for k in kernels}}
    return path_of(sorted(runs), gpu, into, lo, hi)


def _covered(a: float, b: float, spans: Sequence[tuple[float, float]], at: list) -> float:
    """Seconds of ``[a, b]`` inside ``spans`` (sorted, disjoint); ``at[0]``:
    where to start looking, moved on (calls come in increasing ``a``)."""
    i = at[0]
    while i < len(spans) and spans[i][1] <= a:
        i += 1
    at[0] = i
    got = 0.0
    while i < len(spans) and spans[i][0] < b:
        got += min(b, spans[i][1]) - max(a, spans[i][0])
        i += 1
    return got


def path_of(runs: Sequence[tuple], gpu: int, into: dict, lo: float, hi: float) -> dict[str, float]:
    """The window ``[lo, hi]`` cut by what the step's chain was doing:
    ``runs``: (start, end, device, when its copies ended or None) by start;
    a device's kernels (``cpu`` / ``gpu``; where both ran, ``cpu``); in a
    gap before a run, a hand-off into its device (``handoff``: ``into[d]``,
    sorted disjoint spans), then a GPU run waiting for its copies
    (``copy_wait``) and the rest (``other``: host work, step start and end)."""
    path = dict.fromkeys(("cpu", "gpu", "copy_wait", "handoff", "other"), 0.0)
    cpu_spans = clip(((s, e) for s, e, d, _ in runs if d != gpu), lo, hi)
    gpu_spans = clip(((s, e) for s, e, d, _ in runs if d == gpu), lo, hi)
    path["cpu"] = length(cpu_spans)
    path["gpu"] = length(gpu_spans) - length(intersect(cpu_spans, gpu_spans))
    at = {d: [0] for d in into}
    end = lo
    for s, e, d, done in runs:
        if e <= lo or s >= hi:
            continue
        start = max(s, lo)
        if start > end:
            h = _covered(end, start, into[d], at[d]) if d in into else 0.0
            w = 0.0
            if done is not None and done > end:
                top = min(done, start)
                w = top - end - (_covered(end, top, into[d], [at[d][0]]) if d in into else 0.0)
            path["handoff"] += h
            path["copy_wait"] += w
            path["other"] += start - end - h - w
        end = max(end, min(e, hi))
    path["other"] += max(hi - end, 0.0)
    return path


def summarize_step(records: Sequence[Sequence], gpu: int, lo: float, hi: float, step: int | None = None) -> dict:
    """One step's summary (module docstring) from its window's records;
    ``copies``, ``copy_bytes`` and the issue lags count the copies of
    ``step`` (None: those that started in the window), wherever they ran."""
    kernels = [r for r in records if r[1] == "kernels"]
    copies = [r for r in records if r[1] == "copy"]
    spans = {
        "gpu": clip(((r[4], r[5]) for r in kernels if r[0] == gpu), lo, hi),
        "cpu": clip(((r[4], r[5]) for r in kernels if r[0] != gpu), lo, hi),
        "copy": clip(((r[4], r[5]) for r in copies), lo, hi),
        "handoff": clip(((r[4], r[5]) for r in records if r[1] in HANDOFF), lo, hi)}
    both = union(spans["gpu"] + spans["cpu"])
    mine = [c for c in copies if (c[3] == step if step is not None else lo <= c[4] < hi)]
    moved = sum(c[6].get("bytes", 0) for c in mine)
    copy_s = sum(c[5] - c[4] for c in mine)
    late = [c[6]["issued"] - c[6]["freed"] for c in mine
            if c[6].get("freed") is not None and c[6].get("issued") is not None]
    ends = {(c[3], c[6]["copy"]): c[5] for c in copies if "copy" in c[6]}
    recv = [r[5] - r[4] for r in records if r[1] == "recv"]
    return {"step_s": hi - lo,
            "busy_s": {k: length(v) for k, v in spans.items()},
            "copy_overlap_s": {"cpu": length(intersect(spans["copy"], spans["cpu"])),
                               "gpu": length(intersect(spans["copy"], spans["gpu"])),
                               "kernels": length(intersect(spans["copy"], both))},
            "copy_idle_s": copy_gaps(copies, lo, hi),
            "path_s": critical_path(kernels, ends, gpu, lo, hi, [r for r in records if r[1] in HANDOFF]),
            "copies": len(mine), "copy_bytes": moved, "copy_bps": moved / copy_s if copy_s > 0 else None,
            "issued_after_freed": sum(1 for x in late if x > EPS),
            "issue_lag_s": sum(x for x in late if x > EPS),
            "handoffs": sum(1 for r in records if r[1] == "recv" and lo <= r[4] < hi),
            "recv_s_max": max(recv, default=0.0)}


def summarize(records: Sequence[Sequence], gpu: int) -> list[dict]:
    """Per step (in order) its summary; records are cut into steps by time
    (the copies queued a step ahead count where they ran)."""
    out = []
    for n, (lo, hi) in windows(records).items():
        inside = [r for r in records if r[5] > lo and r[4] < hi]
        out.append({"step": n, **summarize_step(inside + [r for r in records if r[3] == n and r[1] == "copy"
                                                          and not (r[5] > lo and r[4] < hi)], gpu, lo, hi, n)})
    return out


def median_summary(steps: Sequence[dict]) -> dict:
    """The median of each number over ``steps`` (nested dicts kept)."""
    def med(values: list):
        values = sorted(v for v in values if v is not None)
        return values[len(values) // 2] if values else None

    def merge(items: list[dict]) -> dict:
        out = {}
        for k, v in items[0].items():
            if k == "step":
                continue
            out[k] = merge([i[k] for i in items]) if isinstance(v, dict) else med([i.get(k) for i in items])
        return out
    return merge(list(steps)) if steps else {}


def compare(predicted: dict, measured: dict) -> dict:
    """``{term: [predicted, measured, measured / predicted - 1]}`` for every
    number of both summaries (nested names joined by ``.``)."""
    out = {}

    def walk(p: dict, m: dict, prefix: str) -> None:
        for k, v in p.items():
            if k not in m:
                continue
            if isinstance(v, dict):
                walk(v, m[k], f"{prefix}{k}.")
            elif isinstance(v, (int, float)) and isinstance(m[k], (int, float)):
                out[prefix + k] = [v, m[k], (m[k] / v - 1) if v else None]
    walk(predicted, measured, "")
    return out


__all__ = ["compare", "copy_gaps", "critical_path", "path_of", "intersect", "length", "median_summary", "summarize",
           "summarize_step", "union", "windows"]
