"""Continuous batching, as pure logic over request records (no I/O).

* :class:`Sequence` is one request's serving state: its KV slot (row), the
  context still to prefill, the tokens produced so far.
* :class:`SlotAllocator` hands out KV rows; with several micro-batch groups
  it fills the emptiest group first (lowest row within it), so groups stay
  balanced and a decode bucket stays small.
* :func:`decode_rows` forms one decode step of a group as the change of
  its plan's previous step (``StepRows``): the rows in entry order, and
  only the rows that start there with their position, input token and
  sampling; the devices keep the rest (padding rows write a throw-away KV
  entry at the last position, which a sequence always writes itself before
  it reads it; a row whose previous token is still being sampled by a step
  in flight, ``Sequence.pending``, takes it on the device);
  :func:`chunk_rows` forms one prompt-chunk step (ints: the device builds
  its tensors).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as Seq

from tessera_actors.runtime.messages import ChunkRows, SampleRow, StepRows


@dataclass
class Sequence:
    rid: str
    prompt: list[int]
    params: object                     # SamplingParams (validated)
    seed: int
    slot: int = -1
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0                 # tokens of ``context`` already in the KV cache
    context: list[int] = field(default_factory=list)   # what prefill must feed (prompt [+ tokens so far])
    tail: tuple[int, int] | None = None  # (tokens left, bucket): the second of two last chunks, once chosen
    phase: str = "waiting"             # waiting | prefill | decode | done
    arrival: float = 0.0
    first_token_at: float | None = None
    exec_s: float = 0.0
    steps: int = 0
    pending: int = 0                   # tokens of decode steps in flight, not yet produced
    record: object = None              # records.RowRecord: penalties, bias, JSON mask, top logprobs
    fed: tuple | None = None           # (plan id, step) of the decode step that fed it last

    def sample_row(self, row: int, col: int = 0, whole: bool = True) -> SampleRow:
        """How its next token is drawn (its index in the output counts the
        tokens still in flight), with its sampling record (``whole``: with
        the parts that change every step) and, for a decode step, its input
        (the next position and the latest token)."""
        p = self.params
        rec = {} if self.record is None else (self.record(self) if whole else self.record.fixed)
        return SampleRow(row, col, float(p.temperature), float(p.top_p), int(p.top_k), int(self.seed),
                         len(self.generated) + self.pending, rec, self.next_position,
                         self.generated[-1] if self.generated else 0)

    @property
    def position(self) -> int:
        """Position of the last produced token, the next decode input."""
        return len(self.prompt) + len(self.generated) - 1

    @property
    def next_position(self) -> int:
        """Position of the next decode input, counting tokens in flight."""
        return self.position + self.pending

    def kv_tokens(self, max_len: int) -> list[int]:
        """The tokens whose keys and values this sequence's KV row holds, from
        position 0: the context prefilled so far, then each generated token
        fed to a decode step (all but the latest); never the last slot
        (``max_len - 1``), which padding writes."""
        if self.prefilled < len(self.context):
            held = self.context[:self.prefilled]
        else:
            held = self.context + self.generated[len(self.context) - len(self.prompt):][:-1]
        return held[:max_len - 1]


class SlotAllocator:
    """KV rows.  A row given back keeps the tokens whose keys and values it
    holds (``release(slot, kept)``), so a new prompt that starts with them
    can take that row and skip prefilling them (:meth:`take_for`: automatic
    prefix caching on the static cache - no copy, no memory beyond the rows;
    a row with kept tokens is reused for another prompt only after the rows
    without, the longest unused first)."""

    def __init__(self, bounds: Seq[tuple[int, int]], min_reuse: int = 16) -> None:
        self.set_groups(bounds)
        self.used: set[int] = set()
        self.kept: dict[int, list[int]] = {}   # free row -> the tokens its cache holds from position 0
        self.min_reuse = min_reuse
        self._age = 0
        self._kept_at: dict[int, int] = {}

    def set_groups(self, bounds: Seq[tuple[int, int]]) -> None:
        self.bounds = list(bounds)
        self.total = self.bounds[-1][1]
        self.groups = [0] * self.total   # row -> its group
        for g, (lo, hi) in enumerate(self.bounds):
            self.groups[lo:hi] = [g] * (hi - lo)

    def free(self) -> int:
        return self.total - len(self.used)

    def take(self) -> int | None:
        """A free row in the emptiest group (its kept tokens, if any, dropped)."""
        best = None
        for lo, hi in self.bounds:
            free = [r for r in range(lo, hi) if r not in self.used]
            if free and (best is None or len(free) > best[0]):
                best = (len(free), min(free, key=lambda r: (r in self.kept, self._kept_at.get(r, 0), r)))
        if best is None:
            return None
        return self._use(best[1])

    def take_for(self, tokens: Seq[int]) -> tuple[int | None, int]:
        """(a free row, how many of ``tokens`` from the start its cache already
        holds): the row keeping the longest such prefix, when it is at least
        ``min_reuse`` tokens, else :meth:`take`'s row and 0."""
        best, most = None, 0
        for r, kept in self.kept.items():
            if r in self.used:
                continue
            n = common_prefix(kept, tokens)
            if n > most:
                best, most = r, n
        if best is None or most < self.min_reuse:
            return self.take(), 0
        self.used.add(best)
        self.kept.pop(best, None)
        return best, most

    def _use(self, row: int) -> int:
        self.used.add(row)
        self.kept.pop(row, None)
        return row

    def release(self, slot: int, kept: Seq[int] = ()) -> None:
        self.used.discard(slot)
        if len(kept) >= self.min_reuse:
            self._age += 1
            self.kept[slot], self._kept_at[slot] = list(kept), self._age

    def forget(self) -> None:
        """Drop every kept prefix (the KV cache was placed afresh)."""
        self.kept.clear()


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def smallest_bucket(sizes: Seq[int], need: int) -> int:
    for s in sorted(sizes):
        if s >= need:
            return s
    raise ValueError(f"no bucket holds {need} (buckets {list(sizes)})")


def decode_rows(seqs: Seq[Sequence], lo: int, plan: str | None, base: int, number: int | None,
                before: list[int] | None, pad: int, host_tokens: bool, same: bool = False) -> StepRows:
    """The rows of one decode step of ``seqs`` (all in the group whose first
    row is ``lo``) on the plan ``plan`` as a change of its step ``base``
    (-1: none; ``before``: that step's rows): a sequence that plan's step
    ``base`` fed (``Sequence.fed``) goes on there, any other starts (it is
    in ``new``); ``number``: this step's number (None: not known yet, every
    row starts next time).  ``pad``: the position padding rows write;
    ``host_tokens``: every entry's input token from here (the device that
    reads input_ids does not sample).  A sequence whose previous token is
    in flight must go on (the device feeds it).  ``same``: the caller knows
    ``seqs`` are ``base``'s rows in its order, none with a record that
    changes every step - nothing to look at but the tokens (``host_tokens``)."""
    key, now = (plan, base), (plan, number) if number is not None else None
    if same:
        for s in seqs:
            s.fed = now
        return StepRows(base, None, [], pad, [s.generated[-1] for s in seqs] if host_tokens else [], [])
    order = [s.slot - lo for s in seqs]
    new, records = [], []
    for i, s in enumerate(seqs):   # (one pass, every row every step: what a steady row costs is two tests)
        if base < 0 or s.fed != key:
            if s.pending:
                raise ValueError(f"request {s.rid}: its previous token is in flight but not in the fed step")
            new.append(s.sample_row(order[i], whole=False))
        if s.record is not None and s.record.needs_tokens:
            records.append([i, s.record.changing(s)])
        s.fed = now
    return StepRows(base, None if base >= 0 and order == before else order, new, pad,
                    [s.generated[-1] for s in seqs] if host_tokens else [], records)


STEP_TOKENS = 16   # what one more prefill step costs, in padded tokens (the choice of the last chunks)


def prefill_chunk(seq: Sequence, sizes: Seq[int]) -> tuple[int, int]:
    """(bucket size, real tokens) of the next chunk of ``seq``'s context:
    the largest bucket while at least that much remains; the rest in one
    chunk (the smallest bucket that holds it) or in two (a bucket it fills,
    then the smallest that holds what is left) when that pads fewer tokens
    by more than a step's cost - 290 tokens with buckets 32, 128, 256 are
    256 + 32 + 32, not 256 + 128.  The second of two last chunks is kept on
    the sequence (``tail``), so the rest is never split again: at most one
    step more than ``ceil(context / largest bucket)``.  Calling it again
    before the chunk is done gives the same answer."""
    left = len(seq.context) - seq.prefilled
    if seq.tail is not None and seq.tail[0] == left:
        return seq.tail[1], left
    biggest = max(sizes)
    if left >= biggest:
        return biggest, biggest
    best, split = smallest_bucket(sizes, left), None
    for first in (b for b in sizes if b < left):
        second = smallest_bucket(sizes, left - first)
        if first + second + STEP_TOKENS < best:
            best, split = first + second + STEP_TOKENS, (first, second)
    if split is None:
        return best, left
    seq.tail = (left - split[0], split[1])
    return split[0], split[0]


def prefill_batch(waiting: Seq[Sequence], sizes: Seq[int], row_counts: Seq[int], budget: int
                  ) -> tuple[list[Sequence], list[int], int, int]:
    """(sequences, their chunks' real tokens, chunk size, rows) of the next
    prompt-chunk step (batched prefill): the first waiting sequence's next
    chunk (:func:`prefill_chunk`) and, in order, the next chunks of those
    after it whose own chunk size is no larger, up to the most rows of
    ``row_counts`` whose padded tokens stay within ``budget`` (vLLM's
    ``max_num_batched_tokens``; the decode rows run in their own steps
    between these, so it bounds how long a prefill holds them up).  The
    sequences taken are the first ones of ``waiting`` that qualify, which
    need not be contiguous: callers use the returned sequences.  ``rows``:
    the smallest row count that holds them."""
    size, n = prefill_chunk(waiting[0], sizes)
    seqs, chunks = [waiting[0]], [n]
    most = max((r for r in row_counts if r * size <= budget), default=1)
    for seq in waiting[1:]:
        if len(seqs) >= most:
            break
        own, m = prefill_chunk(seq, sizes)
        if own <= size:
            seqs.append(seq)
            chunks.append(m)
    rows = min((r for r in row_counts if r >= len(seqs)), default=len(seqs))
    return seqs, chunks, size, rows


def chunk_rows(seqs: Seq[Sequence], chunks: Seq[int], size: int, rows: int, max_len: int
               ) -> tuple[ChunkRows, list]:
    """(rows, sample entries) of one prompt-chunk step of ``rows`` rows of
    ``size`` tokens: row ``i`` feeds ``chunks[i]`` tokens of ``seqs[i]``'s
    context into its KV row, from where its prefill stands; a sequence whose
    chunk ends its context samples (entry row ``i``).  Padding - tokens past
    a chunk, rows past the sequences - writes only the last cache slot
    (``max_len - 1``) of a row of the step, which no sequence reads before
    it writes it itself."""
    if not 0 < len(seqs) <= rows or len(chunks) != len(seqs):
        raise ValueError(f"{len(seqs)} sequences for a prefill step of {rows} rows")
    tokens, sample = [], []
    for i, (seq, n) in enumerate(zip(seqs, chunks)):
        if not 0 < n <= size:
            raise ValueError(f"a prefill chunk of {n} tokens does not fit a bucket of {size}")
        tokens.append(seq.context[seq.prefilled:seq.prefilled + n])
        if seq.prefilled + n == len(seq.context):
            sample.append(seq.sample_row(i))
    return ChunkRows(size, rows, [s.slot for s in seqs], [s.prefilled for s in seqs], tokens, max_len - 1), sample
