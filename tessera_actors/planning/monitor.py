"""Online switching between the latency and the throughput plan.

:class:`Monitor` is pure logic with an injectable clock: the engine reports
every finished request with :meth:`Monitor.record` (its latency, arrival to
completion, and its pure execution time, the time its steps spent running);
:meth:`Monitor.mode` compares the mean latency with the mean execution time
of the requests finished within the last ``window_s`` seconds.  Ratio >=
``beta`` means requests queue (the system is loaded): the throughput plan;
below it the latency plan.  The initial mode is ``latency``; with no request
in the window the mode stays what it was.

The engine applies the mode at step boundaries only (``serving/engine.py``:
once the monitor asks for the other plan no decode step starts until those
in flight have landed).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

MODES = ("latency", "throughput")


class MonitorError(ValueError):
    """Invalid monitor parameters or samples."""


class Monitor:
    """Sliding-window latency/execution ratio -> plan mode (module docstring)."""

    def __init__(self, window_s: float = 0.3, beta: float = 1.5,
                 clock: Callable[[], float] = time.monotonic, initial: str = "latency") -> None:
        if window_s <= 0:
            raise MonitorError(f"window_s must be positive, got {window_s}")
        if beta <= 0:
            raise MonitorError(f"beta must be positive, got {beta}")
        if initial not in MODES:
            raise MonitorError(f"initial mode must be one of {MODES}, got {initial!r}")
        self.window_s, self.beta, self.clock = window_s, beta, clock
        self._mode = initial
        self._samples: deque[tuple[float, float, float]] = deque()   # (time, latency, exec)
        self._lat_sum = 0.0
        self._exec_sum = 0.0

    def record(self, latency_s: float, exec_s: float, at: float | None = None) -> None:
        """One finished request; ``at`` defaults to ``clock()``. Samples must
        arrive in time order."""
        if latency_s < 0 or exec_s < 0:
            raise MonitorError(f"negative latency or execution time ({latency_s}, {exec_s})")
        t = self.clock() if at is None else at
        if self._samples and t < self._samples[-1][0]:
            raise MonitorError(f"sample at {t} is older than the last one at {self._samples[-1][0]}")
        self._samples.append((t, latency_s, exec_s))
        self._lat_sum += latency_s
        self._exec_sum += exec_s

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] <= now - self.window_s:
            _, lat, ex = self._samples.popleft()
            self._lat_sum -= lat
            self._exec_sum -= ex
        if not self._samples:
            self._lat_sum = self._exec_sum = 0.0   # no drift from float sums

    def ratio(self) -> float | None:
        """Mean latency / mean execution time over the window; None without
        samples (or with zero execution time)."""
        self._expire(self.clock())
        if not self._samples or self._exec_sum <= 0:
            return None
        return self._lat_sum / self._exec_sum

    def mode(self) -> str:
        """The plan mode now (updates the remembered mode)."""
        r = self.ratio()
        if r is not None:
            self._mode = "throughput" if r >= self.beta else "latency"
        return self._mode
