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
        """A decode step's tokens, one per row (in entry order)."""
        seconds, tops = result.seconds, result.top_logprobs
        accept = self._accept
        gone = 0
        for i, (req, tok, lp) in enumerate(zip(reqs, result.tokens, result.logprobs)):
            if req.finished is None:
                req.seq.exec_s += seconds
                accept(req, tok, lp, tops[i] if i < len(tops) else None)
            else:   # it ended (end of text, a stop string, an abort) while this step was in flight
                gone += 1
        self.counters["discarded_tokens"] += gone

    def _accept(self, req: Request, token: int, logprob: float, top: list | None = None) -> None:
        """A new token of ``req``: queue its piece, and finish the request when done."""
        seq = req.seq
        p = seq.params
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        token = int(token)
        seq.generated.append(token)
        n = len(seq.generated)
        self.counters["generated_tokens"] += 1
        eos = self.tokenizer.eos_id if self.tokenizer is not None else None
        is_eos = token == eos and not p.ignore_eos
        length = n >= p.max_tokens or len(seq.prompt) + n >= self.max_model_len   # its position, the last one
        final = is_eos or length
        text = None
        detok = req.detok
        if detok is not None and detok.stop:   # a stop string decides whether the row decodes on
            text = detok.push([] if is_eos else [token], final=final)
        stopped = detok is not None and detok.stopped
        reason = "stop" if (is_eos or stopped) else ("length" if length else None)
        self._outbox.append((req, token, logprob, reason, text, final, is_eos, n, top))
        if reason is None:
            return
        req.finished = reason
        self._retire(req)
        self.monitor.record(time.monotonic() - seq.arrival, seq.exec_s)
        self._wake.set()

    def _deliver(self) -> None:
        """Detokenize the queued pieces (``text`` None: not yet) and hand them
        to their streams."""
        box, self._outbox = self._outbox, []
        for req, token, logprob, reason, text, final, eos, generated, top in box:
            seq = req.seq
            if text is None:
                text = req.detok.push([] if eos else [token], final=final) if req.detok is not None else ""
            req.out.put_nowait(RequestOutput(seq.rid, text, [token], reason, Usage(len(seq.prompt), generated),
                                             [logprob], [top[:seq.params.top_logprobs]] if top else []))
