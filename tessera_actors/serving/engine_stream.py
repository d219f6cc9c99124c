"""How ``AsyncEngine`` hands the sampled tokens to the requests' streams:
each token is accepted (it ends its request at the end of text, a stop
string, ``max_tokens`` or the context), its piece is queued, and the pieces
are delivered - detokenized - after the next steps were sent, so this host
work overlaps the devices' work.  A part of
:class:`~tessera_actors.serving.engine.AsyncEngine` (its state is the
engine's)."""
from __future__ import annotations

import time

from tessera_actors.serving.inflight import Request, StepResult
from tessera_actors.serving.params import RequestOutput, Usage


class Streaming:
    """Accepting tokens and delivering stream pieces (mixed into ``AsyncEngine``)."""

    def _accept_step(self, reqs: list[Request], result: StepResult) -> None:
        """A decode step's tokens, one per row (in entry order), as the step
        lands: each row is out of the step (``Request.in_step``, its token
        no longer pending; a row that ended while the step was in flight -
        end of text, a stop string, an abort - frees its KV slot once no
        step carries it, and its token is discarded) and each row that goes
        on accepts its token.  One pass over the rows, no call per row but
        :meth:`_accept`."""
        seconds, tokens, logprobs, tops = result.seconds, result.tokens, result.logprobs, result.top_logprobs
        accept, release = self._accept, self.slots.release
        eos = self.tokenizer.eos_id if self.tokenizer is not None else None
        ntop = len(tops)
        gone = 0
        for i, req in enumerate(reqs):
            seq = req.seq
            req.in_step -= 1
            seq.pending -= 1
            if req.finished is None:
                seq.exec_s += seconds
                accept(req, tokens[i], logprobs[i], tops[i] if i < ntop else None, eos)
                continue
            gone += 1
            if seq.slot >= 0 and not req.in_step:
                release(seq.slot, self._kept(req))
                seq.slot = -1
                self._slot_freed.set()
                self._wake.set()
        self.counters["discarded_tokens"] += gone
        self.counters["generated_tokens"] += len(reqs) - gone

    def _accept(self, req: Request, token: int, logprob: float, top: list | None = None, eos: int | None = -1
                ) -> None:
        """A new token of ``req`` (``eos``: the end-of-text id, -1: look it
        up; a decode step counts its generated tokens itself): queue its
        piece, and finish the request when done."""
        seq = req.seq
        p = seq.params
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        if eos == -1:
            eos = self.tokenizer.eos_id if self.tokenizer is not None else None
            self.counters["generated_tokens"] += 1
        generated = seq.generated
        generated.append(token)
        n = len(generated)
        is_eos = token == eos and not p.ignore_eos
        length = n >= p.max_tokens or len(seq.prompt) + n >= self.max_model_len   # its position, the last one
        detok = req.detok
        if detok is None or not detok.stop:   # (no stop string: the text is made when the piece is delivered)
            if not (is_eos or length):
                self._outbox.append((req, token, logprob, None, None, False, False, n, top))
                return
            reason, text = "stop" if is_eos else "length", None
        else:   # a stop string decides whether the row decodes on
            text = detok.push([] if is_eos else [token], final=is_eos or length)
            reason = "stop" if (is_eos or detok.stopped) else ("length" if length else None)
        self._outbox.append((req, token, logprob, reason, text, is_eos or length, is_eos, n, top))
        if reason is None:
            return
        req.finished = reason
        self._retire(req)
        self.monitor.record(time.monotonic() - seq.arrival, seq.exec_s)
        self._wake.set()

    def _deliver(self) -> None:
        """Detokenize the queued pieces (``text`` None: not yet) and hand them
        to their streams."""
        box = self._outbox
        if not box:
            return
        self._outbox = []
        for req, token, logprob, reason, text, final, eos, generated, top in box:
            seq = req.seq
            if text is None:
                detok = req.detok
                text = detok.push([] if eos else [token], final=final) if detok is not None else ""
            req.out.put_nowait(RequestOutput(seq.rid, text, [token], reason, Usage(len(seq.prompt), generated),
                                             [logprob], [top[:seq.params.top_logprobs]] if top else []))
