"""What ``AsyncEngine`` reports about itself: ``stats()`` (queue, slots,
placement, devices' busy time, buckets, memory, counters), ``health()``
(``/health``), the plan in use, the trace, and the waits on the placement.
A part of :class:`~tessera_actors.serving.engine.AsyncEngine` (its state is
the engine's); no logic of the serving loop lives here."""
from __future__ import annotations

import threading
import time

from tessera_actors.serving.deployment_steps import RUN_COUNTS
from tessera_actors.serving.memory import memory_report


class Reporting:
    """The engine's introspection (mixed into ``AsyncEngine``)."""

    def plan_in_use(self) -> str:
        return "throughput" if self.groups > 1 else "latency"

    def stats(self) -> dict:
        rt = self.deployment
        ref = rt.placed.get(rt.reference_bucket()) if rt else None
        placement, devices = {}, []
        if ref is not None:
            placement = {"plan": ref.plan.name, "devices": list(ref.plan.devices),
                         "kernels_per_device": ref.plan.kernels_per_device(),
                         "bytes_per_step": ref.plan.bytes_per_step()}
            elapsed = max(time.monotonic() - rt.since, 1e-9)
            recent = rt.busy_fractions()   # over the last 10 s: what the chat page and /metrics show
            devices = [{"name": spec, "kernels": n, "busy_s": rt.busy_s.get(d, 0.0),
                        "busy_fraction": min(1.0, rt.busy_s.get(d, 0.0) / elapsed), "busy_recent": recent.get(d, 0.0)}
                       for d, (spec, n) in enumerate(zip(ref.plan.devices, ref.plan.kernels_per_device()))]
        return {"queue_depth": len(self._waiting), "slots_in_use": len(self.slots.used),
                "slots_total": self.slots.total, "plan": self.plan_in_use(), "groups": self.groups,
                "generation": rt.generation if rt else 0, "placement": placement, "devices": devices,
                "devices_chosen": self.cfg.devices_chosen,
                "lost": sorted(rt.lost) if rt else [],
                "buckets_placed": len(rt.placed) if rt else 0, "buckets": len(rt.served.buckets) if rt else 0,
                "step_s": {b: t / n for b, (n, t) in self.step_time.items() if n},
                "memory": memory_report(self.served if rt else None, self.cfg, rt.device_memory if rt else None),
                "bucket_stats": self._bucket_stats(), "host_s": self.host_times(), **self._pcie(), **self.counters}

    def host_times(self) -> dict[str, float]:
        """Host seconds since start (differences over a window, divided by its
        decode steps, are the host work per step): ``loop`` - CPU seconds of
        the serving loop's own work between its waits (batching, step
        messages, accepting and streaming tokens); ``loop_thread`` - CPU
        seconds of the event loop's thread, everything on it (the loop, the
        step messages through the actors, the streams' consumers; only when
        called on that thread); ``worker`` - CPU seconds of the devices'
        workers on steps outside runs of kernels (the step path's own work:
        inputs, sampling, copies), all devices; ``kernels`` - wall seconds
        of the workers inside runs of kernels (a CPU computes there, a GPU
        queues or replays them).  CPU seconds, so what a loaded machine, or
        the other thread holding the interpreter lock, adds does not count."""
        w = self.deployment.worker_s if self.deployment is not None else {}
        out = {"loop": self.loop_s, "worker": w.get("host", 0.0), "kernels": w.get("kernels", 0.0)}
        ident, cpu0 = self._thread
        if ident == threading.get_ident():
            out["loop_thread"] = time.thread_time() - cpu0
        return out

    def _pcie(self) -> dict:
        """Weight bytes streamed host -> device (PCIe) over every bucket's
        steps since placement, and per step (an offload plan's streamed weights)."""
        counts = self.deployment.bucket_counts.values() if self.deployment else ()
        moved = sum(c.get("streamed_bytes", 0) for c in counts)
        return {"pcie_bytes": moved, "pcie_bytes_per_step": moved / max(self.counters["steps"], 1)}

    def _bucket_stats(self) -> dict[str, dict]:
        """Per bucket: how it was captured (``inductor`` | ``aten``, or why
        inductor was not used), and over the steps served so far its runs of
        kernels replayed as CUDA graphs, run eagerly, and captures that failed
        (zeros for a bucket no step ran yet)."""
        rt = self.deployment
        if rt is None:
            return {}
        return {name: {"capture": rt.served.captures.get(name, ""), **dict.fromkeys(RUN_COUNTS, 0),
                       **rt.bucket_counts.get(name, {})}
                for name in rt.served.graphs}

    async def wait_placed(self) -> None:
        """Return once every bucket is placed: the engine serves as soon as
        its decode buckets and its shortest and longest prompt chunks are,
        and places the chunk sizes between them in the background (a prompt
        meanwhile runs in a longer chunk)."""
        if self.deployment is not None:
            await self.deployment.wait_placed()

    async def release_weights(self) -> bool:
        """Give back this process's copy of the weights once every bucket is
        placed, where nothing reads it again (in-process devices hold their
        own and are never re-placed; node deployments keep it to re-place
        after a lost node).  ``tessera serve`` calls it; True when done."""
        return self.deployment is not None and await self.deployment.release_weights()

    def health(self) -> dict:
        """``ok``: serving; ``status``: "ok", "starting" (being started:
        ``phase`` loading the model or placing the core buckets) or
        "unhealthy" (a node lost and not yet re-placed, stopped, or dead);
        ``buckets_placed`` of ``buckets``: the placement's progress (it goes
        on in the background after start)."""
        serving = self._loop_task is not None and not self._loop_task.done()
        ok = self._dead is None and not self._lost and serving and bool(self.deployment.placed)
        starting = not serving and self._dead is None and self._progress["phase"] in ("loading", "placing", "placed")
        return {"ok": ok, "status": "ok" if ok else ("starting" if starting else "unhealthy"),
                "lost": sorted(self.deployment.lost) if self.deployment else [], "error": self._dead,
                **self._progress}


    def write_trace(self) -> str | None:
        """Write the trace of the steps so far to ``trace_dir/trace.json``
        (also done at stop); returns the path, None when not tracing."""
        if self.trace is None:
            return None
        import os
        return self.trace.write(os.path.join(self.cfg.trace_dir, "trace.json"))
