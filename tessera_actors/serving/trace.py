"""Traces of served steps in the Chrome / Perfetto trace-event format.

``StepTrace`` collects, for every step the engine runs while tracing: an
engine span (the step's round trip, with its bucket and rows: the batching
decision) on the engine's track, and each device's spans (runs of kernels
with the bytes they send, transfer waits, sampling; wall clock, as the
device reported them in ``StepDone.spans``) on one track per device.
``write(path)`` saves ``{"traceEvents": [...]}`` JSON; open it at
ui.perfetto.dev (or chrome://tracing).  Times are host wall clock: on a GPU
a span ends when the host has seen its bytes ready.
"""
from __future__ import annotations

import json
import os
from typing import Sequence


class StepTrace:
    def __init__(self, limit: int = 100_000) -> None:
        self.events: list[dict] = []
        self.limit = limit
        self._tracks: dict[str, int] = {}

    def _tid(self, track: str) -> int:
        if track not in self._tracks:
            tid = self._tracks[track] = len(self._tracks) + 1
            self.events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}})
        return self._tracks[track]

    def span(self, track: str, name: str, start_s: float, end_s: float, **args) -> None:
        if len(self.events) >= self.limit:
            return
        self.events.append({"name": name, "ph": "X", "pid": 1, "tid": self._tid(track), "ts": start_s * 1e6,
                            "dur": max(end_s - start_s, 0.0) * 1e6, "args": args})

    def step(self, bucket: str, rows: Sequence[str], start_s: float, end_s: float, devices: Sequence[str],
             device_spans: Sequence[Sequence]) -> None:
        self.span("engine", bucket, start_s, end_s, rows=list(rows))
        for name, spans in zip(devices, device_spans):
            for what, s, e in spans:
                self.span(f"device {name}", what, s, e, bucket=bucket)

    def write(self, path: str) -> str:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)
        return path
