"""What a ``Deployment`` measures of itself: each plan device's busy time
over a recent window (the chat page and ``/metrics``), and the reference
bucket's per-kernel profile for the planner.  A part of
:class:`~tessera_actors.serving.deployment.Deployment` (its state is the
deployment's)."""
from __future__ import annotations

import time

from tessera_actors.devices import parse_devices

BUSY_WINDOW_S = 10.0   # the busy fraction the chat page and /metrics show: over the last 10 s


class Measuring:
    """Busy fractions and the reference profile (mixed into ``Deployment``)."""

    def profile_reference(self) -> dict:
        """Measured per-kernel times of the reference bucket on every
        in-process device (and measured links between them), keyed for the
        planner (``planners.graph_key``).  Blocking."""
        from tessera_actors.execution.backends import backend_for
        from tessera_actors.planning.registry import graph_key
        from tessera_actors.planning.costs import CostTable
        from tessera_actors.execution.profile import measured_links, profile_kernels
        from tessera_actors.serving.buckets import bucket_inputs
        name = self.reference_bucket()
        graph, values = self.served.graphs[name], self.served.values[name]
        specs = [s.name for s in parse_devices(self.cfg.devices)]
        backends = [backend_for(s) for s in specs]
        try:
            profiles = [profile_kernels(graph, values, bucket_inputs(self.served.buckets[name], be.device), be)
                        for be in backends]
            links = measured_links(backends) if len(backends) > 1 else None
        finally:
            for be in backends:
                be.release()   # a budgeted GPU's cap on the allocator: the devices set their own
        self.profiles = profiles
        return {graph_key(graph): CostTable.from_profiles(graph, specs, profiles, links)}

    def _note_busy(self) -> None:
        now = time.monotonic()
        self._busy_log.append((now, dict(self.busy_s)))
        while len(self._busy_log) > 1 and self._busy_log[1][0] <= now - BUSY_WINDOW_S:
            self._busy_log.popleft()   # keep the last entry at or before the window's start

    def busy_fractions(self, window_s: float = BUSY_WINDOW_S) -> dict[int, float]:
        """Each plan device's fraction of the last ``window_s`` seconds (of
        the placement, when it is younger) spent on steps."""
        now = time.monotonic()
        start = max(now - window_s, self.since)
        before = {}
        for t, busy in self._busy_log:
            if t > start:
                break
            before = busy
        span = max(now - start, 1e-9)
        return {d: min(1.0, max(0.0, (b - before.get(d, 0.0)) / span)) for d, b in self.busy_s.items()}
