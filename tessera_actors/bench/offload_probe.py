"""``tessera bench offload --probe N``: a few decode steps of each row's
engine run probed (``RunStep.probe``, :mod:`tessera_actors.execution.probe`)
after its timed window, so the timing is of unprobed steps.

The row JSON gets ``timeline``: per probed step the summary of
:mod:`tessera_actors.planning.offload.timeline` (busy seconds per resource,
the copy engine's overlap with the kernels and its idle gaps by cause, the
step cut along its critical path), their median (``measured``), the
planner's summary of its own step model in the same terms (``predicted``)
and ``compare``: ``{term: [predicted, measured, measured / predicted - 1]}``.
Every record also goes to a trace-event JSON in ``--out``
(``probe_<row>_<workload>.json``; open it at ui.perfetto.dev): one track per
device and resource, times from the first probed step's start."""
from __future__ import annotations

import asyncio
from pathlib import Path

from tessera_actors.planning.offload.timeline import compare, median_summary, summarize
from tessera_actors.serving import AsyncEngine, SamplingParams
from tessera_actors.serving.trace import StepTrace

WARM = 3   # tokens every row has before the probe starts: all rows decode together


async def probe_decode(eng: AsyncEngine, batch: int, steps: int) -> list:
    """``batch`` concurrent greedy requests; once each has :data:`WARM`
    tokens the next ``steps + 2`` decode steps are probed: the first one's
    first copies were queued by an unprobed step and the last one's copies
    queued for the step after it never land in an answer, so both are left
    out of the summaries (:func:`row_timeline`).  Returns the records."""
    got = [0] * batch
    records: list = []

    async def one(r: int) -> None:
        params = SamplingParams(max_tokens=WARM + steps + 4, ignore_eos=True)
        async for out in eng.generate([1 + r, 2 + r, 3 + r], params):
            got[r] += len(out.token_ids)
            if not records and min(got) >= WARM and not eng.deployment.probe_left:
                records.append(eng.deployment.probe_steps(steps + 2))
    await asyncio.gather(*(one(r) for r in range(batch)))
    eng.deployment.probe_left = 0
    return records[0] if records else []


def track(rec: list, devices: list[str]) -> str:
    d, what = rec[0], rec[1]
    name = devices[d] if d < len(devices) else str(d)
    return f"{d}: {name} {'copy stream' if what == 'copy' else what}"


def write_trace(path: Path, records: list, devices: list[str]) -> str:
    """The records as a trace-event JSON (times from the first record's start)."""
    trace = StepTrace()
    t0 = min((r[4] for r in records), default=0.0)
    for r in sorted(records, key=lambda r: (r[0], r[1], r[4])):
        args = {k: v - t0 if k in ("issued", "freed") and v is not None else v for k, v in r[6].items()}
        trace.span(track(r, devices), r[2], r[4] - t0, r[5] - t0, step=r[3], **args)
    return trace.write(str(path))


def row_timeline(records: list, plan, out: Path, label: str) -> dict:
    """The row JSON's ``timeline`` (module docstring) of one probed workload;
    the trace file is written to ``out``."""
    off = plan.meta.get("offload") or {}
    gpu = int(off.get("device", 0))
    steps = summarize(records, gpu)
    steps = steps[1:-1] or steps   # the first and the last probed step miss copies (probe_decode)
    measured = median_summary(steps)
    predicted = off.get("timeline") or {}
    path = write_trace(out / f"probe_{label}.json", records, list(plan.devices)) if records else None
    return {"steps": steps, "measured": measured, "predicted": predicted,
            "compare": compare(predicted, measured) if predicted and measured else {},
            "trace": Path(path).name if path else None, "records": len(records)}


__all__ = ["probe_decode", "row_timeline", "write_trace"]
