"""The step probe's recorder on one device: the intervals of a probed step
(``RunStep.probe``) as the records of
:mod:`tessera_actors.planning.offload.timeline`, answered in
``StepDone.timeline``.

Who records what (each on the device's worker thread, or its event loop
for ``wait`` on the loop): the segment runner each run of kernels between
two stamps of the compute stream (:mod:`.segments`), the streaming program
each weight copy between two stamps of the copy stream and the stamp behind
the read that freed its bytes (:mod:`.streaming`), the step path the
hand-off waits, sends and received writes (:mod:`.step`, :mod:`.driver`).
A stamp is the backend's (``stamp`` / ``stamp_s``: host time on a CPU,
CUDA events on a GPU); a record leaves once all its stamps resolved, so
copies queued for the next step go with a later probed answer.

Off (no probed step): nothing is made and the hooks are one ``is None``
test each.  Not thread-safe beyond that: the worker and the loop append
(list appends), only the loop takes.
"""
from __future__ import annotations

import time
from typing import Any

LIMIT = 200_000   # records kept unresolved at most (a stamp that never resolves must not grow memory)


class Probe:
    def __init__(self, backend: Any, device: int) -> None:
        self.backend, self.device = backend, device
        self.step = -1
        self.pending: list[list] = []

    def mark(self, stream: Any) -> Any:
        """A stamp behind what is queued on ``stream`` now."""
        return self.backend.stamp(stream)

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def add(self, resource: str, name: str, start: Any, end: Any, step: int | None = None, **args) -> None:
        """A record of ``resource``; ``start``/``end`` and any tuple in
        ``args`` are stamps (floats: host times already)."""
        if len(self.pending) < LIMIT:
            self.pending.append([self.device, resource, name, self.step if step is None else step, start, end, args])

    def _s(self, v: Any) -> Any:
        return self.backend.stamp_s(v) if isinstance(v, tuple) else v

    def take(self) -> list[list]:
        """The records whose stamps all ran, with host times; the others are
        kept for a later call."""
        done, left = [], []
        for r in self.pending:
            start, end = self._s(r[4]), self._s(r[5])
            args = {k: self._s(v) for k, v in r[6].items()}
            if start is None or end is None or any(v is None and isinstance(r[6][k], tuple) for k, v in args.items()):
                left.append(r)
                continue
            done.append([*r[:4], start, end, args])
        self.pending = left
        return done


__all__ = ["Probe"]
