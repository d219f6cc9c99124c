"""Which waiting requests ``AsyncEngine`` admits to a KV row (a row that
still holds a prompt's prefix first: prefix caching) and which prompt
chunks its next prefill step carries (several prompts in one step when an
``R x C`` bucket for them is placed: batched prefill).  A part of
:class:`~tessera_actors.serving.engine.AsyncEngine` (its state is the
engine's)."""
from __future__ import annotations

from tessera_actors.serving.batch import prefill_batch, prefill_chunk
from tessera_actors.serving.buckets import bucket_name, window_for
from tessera_actors.serving.inflight import Request as _Request


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

    def _prefill_batch(self) -> tuple[list[_Request], list[int], str]:
        """(requests, their chunks' tokens, the bucket) of the next prompt-chunk
        step (:func:`~tessera_actors.serving.batch.prefill_batch`): several
        prompts when an ``R x C`` bucket for them is placed, else the first
        alone (the batched buckets are placed in the background)."""
        cfg = self.cfg
        seqs, chunks, size, rows = prefill_batch([r.seq for r in self._prefill], cfg.prefill_buckets,
                                                 cfg.prefill_rows, cfg.max_batched_tokens)
        if rows > 1:
            window = window_for(cfg, max(s.prefilled + m - 1 for s, m in zip(seqs, chunks)), size)
            for w in dict.fromkeys((window, 0)):
                name = bucket_name("prefill", size, 0, w, rows)
                if name in self.deployment.placed:
                    by_id = {r.seq.rid: r for r in self._prefill}
                    return [by_id[s.rid] for s in seqs], chunks, name
        first = self._prefill[0]
        return [first], chunks[:1], self.deployment.runnable(self._prefill_bucket(first))

