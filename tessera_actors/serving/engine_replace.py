"""How ``AsyncEngine`` changes its placement while it serves: a node lost
(the steps in flight dropped, every bucket re-placed on the survivors, every
running request prefilled again from its prompt plus the tokens it already
produced), a restarted node re-admitted (the same path), and a switch
between the latency and the throughput plan at a step boundary.  A part of
:class:`~tessera_actors.serving.engine.AsyncEngine` (its state is the
engine's)."""
from __future__ import annotations

import asyncio
import logging
import time

from tessera_actors.serving.params import EngineDead

log = logging.getLogger("tessera_actors.serving")


class Replacing:
    """Re-placement and plan switching (mixed into ``AsyncEngine``)."""

    def _on_lost(self, endpoints: list[str]) -> None:
        self._lost.extend(e for e in endpoints if e not in self._lost)
        self._wake.set()

    def _on_back(self, endpoint: str) -> None:
        """A restarted node took its old place: re-place on every live node
        (the same path as a loss, so no stream loses or repeats a token)."""
        self._back.add(endpoint)
        self._readmit = True
        self._wake.set()

    async def _recover(self, inflight: dict) -> None:
        lost, self._lost, self._readmit = list(self._lost), [], False
        for t in inflight:
            t.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)
        for info in inflight.values():
            self._landed(info)   # the old plans are uninstalled below: their steps write nothing more
        inflight.clear()
        self.slots.forget()   # the cache is placed afresh: no row keeps a prefix
        self.counters["recoveries" if lost else "readmissions"] += 1
        if lost:
            log.warning("lost %s: re-placing on the survivors", lost)
        else:
            log.warning("a node is back (%s): re-placing on every live node", sorted(self._back))
        t0 = time.monotonic()
        for req in list(self._requests.values()):
            seq = req.seq
            if seq.phase in ("prefill", "decode"):
                seq.context = list(seq.prompt) + list(seq.generated)
                seq.prefilled = 0
                seq.tail = None
                if seq.phase == "decode":
                    seq.phase = "prefill"
                    self._prefill.append(req)
                    self._rows_changed += 1
        self._prefill.sort(key=lambda r: r.seq.arrival)
        # every stream stalls until its context is back: re-prefill them all first (the longest
        # gap is then the loss plus the re-prefills, not plus the decode steps between them)
        self._catchup = {r.seq.rid for r in self._prefill}
        try:   # the re-prefills' first buckets at once; decode steps stand in on the reference bucket
            await self.deployment.replace(lost, [self._prefill_bucket(r) for r in self._prefill])
        except Exception as e:
            if not self._lost:
                raise EngineDead(f"could not re-place after losing {lost}: {e}") from e
            # another node was lost meanwhile (its placement abandoned): the loop recovers again at once
            log.warning("re-placement after losing %s gave way to the loss of %s: %s", lost, self._lost, e)
            return
        self._back -= set(self.deployment.node_endpoints())   # back and placed on already: no second re-placement
        self._readmit = self._readmit and bool(self._back)
        log.warning("re-placed in %.2f s; %d requests continue", time.monotonic() - t0, len(self._prefill))
        async with self.placement_changed:
            self.placement_changed.notify_all()

    def _maybe_switch(self, inflight: dict) -> None:
        self._switching = False
        if self.cfg.mode != "auto":
            return
        want = self.cfg.groups if self.monitor.mode() == "throughput" else 1
        if want == self.groups:
            return
        if any(s.key.startswith("decode") for s in inflight.values()):
            self._switching = True   # no decode step starts meanwhile, so the ones in flight drain
            return   # switch at a step boundary: wait for the decode steps to land
        self.groups = want
        self.slots.set_groups(self.cfg.group_bounds(want))
        self.counters["plan_switches"] += 1
