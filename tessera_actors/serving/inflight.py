"""What the engine and its deployment hold while they serve: a request (its
sequence, its detokenizer, the queue its outputs stream through), a step in
flight, a placed bucket and a step's result (or ``StepFailed``)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tessera_actors.plan import Plan
from tessera_actors.runtime.actor import ActorRef
from tessera_actors.serving.batch import Sequence
from tessera_actors.serving.params import RequestOutput
from tessera_actors.serving.text import Detokenizer


class Outputs:
    """A request's stream: the engine loop puts pieces (``RequestOutput``) or
    an error, its ``generate`` takes them (``await`` what :meth:`wait`
    gives, if anything, then :meth:`take`: no coroutine per piece).  Pieces
    that queued meanwhile are taken as one (their text, ids and log
    probabilities joined, the last one's finish reason and usage), so a
    consumer slower than the steps wakes once for all of them; an error is
    taken after the pieces before it.  Made and used on the event loop."""

    def __init__(self) -> None:
        self._items: list = []
        self._waiter: asyncio.Future | None = None
        self._loop = asyncio.get_running_loop()

    def put_nowait(self, item) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def wait(self) -> asyncio.Future | None:
        """None when a piece is there, else a future done once one is."""
        if self._items:
            return None
        self._waiter = w = self._loop.create_future()
        return w

    def take(self):
        """The next piece (or error), after :meth:`wait`."""
        items = self._items
        first = items[0]
        if len(items) == 1 or isinstance(first, BaseException):
            del items[0]
            return first
        n = next((i for i, it in enumerate(items) if isinstance(it, BaseException)), len(items))
        pieces, self._items = items[:n], items[n:]
        return _joined(pieces)


def _joined(pieces: list[RequestOutput]) -> RequestOutput:
    last = pieces[-1]
    return RequestOutput(last.request_id, "".join(p.text for p in pieces), [t for p in pieces for t in p.token_ids],
                         last.finish_reason, last.usage, [x for p in pieces for x in p.logprobs],
                         [x for p in pieces for x in p.top_logprobs])


class Request:
    def __init__(self, seq: Sequence, detok: Detokenizer | None) -> None:
        self.seq, self.detok = seq, detok
        self.out = Outputs()
        self.finished: str | None = None
        self.in_step = 0   # steps in flight that carry its row: its KV slot is freed only when they landed


@dataclass
class Step:
    """A step in flight: ``key`` "prefill" or "decode<group>", its rows (in
    sampling-entry order), the prompt tokens it feeds per row (prefill), its bucket,
    the placement generation, the launch order, its step number when its
    tokens can feed the next step on the device (``Deployment.decode_rows``),
    and (a decode step) how its rows were formed, for the group's next step
    to take them as they are while no row joins or ends
    (``AsyncEngine._continued``)."""
    key: str
    reqs: list
    chunk: list
    bucket: str
    generation: int
    order: int
    number: int | None = None
    formed: "Formed | None" = None


@dataclass
class Formed:
    """A decode step's rows as formed: the engine's count of rows changes
    then (a row joined decode or a request ended), the group bounds, the
    rows and their sequences and request ids, the largest next position + 1
    and slot, how many more steps every row can take (``max_tokens``, the
    context), and whether a row's sampling record needs the tokens so far
    (penalties, JSON masks: such rows are formed afresh every step)."""
    changes: int
    bounds: list
    reqs: list
    seqs: list
    rids: list
    end: int
    top: int
    horizon: int
    needs_tokens: bool = False
    continues: bool = False   # the rows of the step before, as they were (AsyncEngine._continued)


class StepFailed(RuntimeError):
    """A step could not be completed; the message names the device and why."""


@dataclass
class PlacedBucket:
    """A bucket's deployed plan: its id, the plan, a ref per plan device."""
    plan_id: str
    plan: Plan
    refs: list[ActorRef]
    routes: list
    steps: int = 0
    feeds: int | None = None   # the plan device that reads input_ids and samples: it can take tokens on the device
    rows_at: int | None = None   # the latest step sent with decode rows (StepRows), and its rows
    order: list | None = None


@dataclass
class StepResult:
    tokens: list[int]
    seconds: float
    logprobs: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    spans: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)   # per sampled entry, when asked: [[id, logprob], ...]
    outputs: list = field(default_factory=list)        # step(outputs=True): [buffer, start, end, bytes] of each

    def top(self, i: int) -> list | None:
        """Sampled entry ``i``'s top log probabilities (None: not asked)."""
        return self.top_logprobs[i] if i < len(self.top_logprobs) else None
