"""Which waiting requests ``AsyncEngine`` admits to a KV row (a row that
still holds a prompt's prefix first: prefix caching) and which prompt
chunks its next prefill step carries (several prompts in one step when an
``R x C`` bucket for them is placed: batched prefill), and how many
prompt-chunk steps are in flight at once.  A part of
:class:`~tessera_actors.serving.engine.AsyncEngine` (its state is the
engine's)."""
from __future__ import annotations

import asyncio

from tessera_actors.planning.inflight import prompt_inflight
from tessera_actors.serving.batch import chunk_rows, prefill_batch, prefill_chunk
from tessera_actors.serving.buckets import bucket_name, window_for
from tessera_actors.serving.inflight import Request as _Request, Step as _Step


class Admitting:
    """Admission and prefill batching (mixed into ``AsyncEngine``)."""

    def _kept(self, req: _Request) -> list[int]:
        """What ``req``'s KV row keeps for a later prompt that starts the same
        (prefix caching): its tokens in the cache, unless a step failed on it."""
        return [] if req.finished == "error" or self._lost else req.seq.kv_tokens(self.max_model_len)

    def _admit(self) -> None:
        while self._waiting and self.slots.free():
            req = self._waiting.pop(0)
            seq = req.seq
            seq.slot, reused = self.slots.take_for(seq.context) if self.cfg.prefix_caching else (self.slots.take(), 0)
            seq.prefilled = min(reused, len(seq.context) - 1)   # the last token is fed: its logits sample
            if seq.prefilled:
                self.counters["prefix_hits"] += 1
                self.counters["prefix_tokens"] += seq.prefilled
            req.seq.phase = "prefill"
            self._prefill.append(req)

    def _prefill_bucket(self, req: _Request) -> str:
        """The bucket of the next prompt chunk of ``req`` (its own, before any stand-in)."""
        size, n = prefill_chunk(req.seq, self.cfg.prefill_buckets)
        return bucket_name("prefill", size, 0, window_for(self.cfg, req.seq.prefilled + n - 1, size))

    def _prefill_batch(self, ready: list[_Request]) -> tuple[list[_Request], list[int], str]:
        """(requests, their chunks' tokens, the bucket) of the next prompt-chunk
        step of ``ready`` (:func:`~tessera_actors.serving.batch.prefill_batch`):
        several prompts when an ``R x C`` bucket for them is placed, else the
        first alone (the batched buckets are placed in the background)."""
        cfg = self.cfg
        seqs, chunks, size, rows = prefill_batch([r.seq for r in ready], cfg.prefill_buckets,
                                                 cfg.prefill_rows, cfg.max_batched_tokens)
        if rows > 1:
            window = window_for(cfg, max(s.prefilled + m - 1 for s, m in zip(seqs, chunks)), size)
            for w in dict.fromkeys((window, 0)):
                name = bucket_name("prefill", size, 0, w, rows)
                if name in self.deployment.placed:
                    by_id = {r.seq.rid: r for r in ready}
                    return [by_id[s.rid] for s in seqs], chunks, name
        first = ready[0]
        return [first], chunks[:1], self.deployment.runnable(self._prefill_bucket(first))

    def _launch_prefill(self, inflight: dict) -> None:
        """Prompt-chunk steps while fewer are in flight than the plan of the
        next one pipelines (:func:`~tessera_actors.planning.inflight.prompt_inflight`:
        its micro-batches; 1 for a plan not placed yet; at most
        ``prompt_steps``), each of requests
        that no prompt step in flight carries: a request's chunks go one
        after another (the next reads the KV rows the one before writes),
        different requests' chunks may overlap (their rows are apart), and
        the devices of the plan run its steps in the order they are sent."""
        loop = asyncio.get_running_loop()
        while True:
            ready = [r for r in self._prefill if not r.in_step]
            if not ready:
                return
            reqs, chunks, bucket = self._prefill_batch(ready)
            placed = self.deployment.placed.get(bucket)
            running = sum(1 for s in inflight.values() if s.key == "prefill")
            most = prompt_inflight(placed.plan) if placed is not None else 1
            if running >= min(most, self.cfg.prompt_steps or most):
                return
            b = self.deployment.served.buckets.get(bucket)
            size, rows = (b.size, b.rows) if b is not None else (prefill_chunk(reqs[0].seq, self.cfg.prefill_buckets)[0],
                                                                 1)
            chunk, sample = chunk_rows([r.seq for r in reqs], chunks, size, rows, self.max_model_len)
            task = loop.create_task(self.deployment.step(bucket, {}, sample, [r.seq.rid for r in reqs], chunk=chunk))
            task.add_done_callback(self._stepped)
            for r in reqs:
                r.in_step += 1
            if running:
                self.counters["pipelined_prompt_steps"] += 1
            inflight[task] = _Step("prefill", reqs, chunks, bucket, self.deployment.generation, next(self._order))

