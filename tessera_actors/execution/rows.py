"""A decode plan's rows on one device, kept from step to step.

The engine names a decode step's rows (``RunStep.rows``, a ``StepRows``):
the row of each sampled entry, and only what changed since the plan's
previous step - the rows that start there (their position, input token and
sampling), the rows that left.  :class:`PlanRows` keeps the rest on the
device between steps:

* the ``positions`` input (where this device reads it, in its own input
  buffer - or beside it, copied in, when the graph's kernels write that): a row of the previous step is one further (``+1`` on the
  device), a row that starts is where the engine says, a row that left and
  every padding row write the last cache slot (``pad``);
* the ``input_ids`` input (where read): a row of the previous step takes
  the token this device sampled for it there (no host round trip), a row
  that starts takes the engine's; a device that reads ``input_ids`` but
  does not sample takes the tokens from the device that does when that
  one is a co-located peer (handed over thread to thread, :mod:`.step`),
  else every entry's token from the engine (``tokens``);
* the sampled entries (where the logits end): a :class:`.sampling.SampleBatch`
  made when the rows change, moved on one token otherwise.

A step whose rows are those of the previous one is a few small device
operations and no copy from the host.  A step whose ``base`` is not this
device's last step of the plan fails (the engine then sends every row
again).  Blocking: torch work on the calling thread (the worker).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tessera_actors.execution.hostbuf import Uploads
from tessera_actors.execution.program import AtenProgram, BackendError
from tessera_actors.execution.sampling import SampleBatch
from tessera_actors.graph import KernelGraph
from tessera_actors.runtime.messages import SampleRow, StepRows


def _input(graph: KernelGraph, prog: AtenProgram, name: str, feed: Sequence[int], dims: int
           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(where the rows keep input ``name`` as [B] - ``input_ids[:, 0]`` -,
    and the input's view to copy that into before the kernels, or None when
    it is the view itself), or (None, None) when this device does not read
    it.  A graph whose kernels write the input buffer (a conservative access
    set may say so) reads a copy: the buffer cannot hold the rows."""
    ref = graph.meta.get("input_views", {}).get(name)
    if ref is None or ref[0] not in feed:
        return None, None
    t = prog.view(ref)
    if t.dim() != dims or (dims == 2 and t.shape[1] != 1):
        raise BackendError(f"decode rows need input {name!r} as [B{', 1' if dims == 2 else ''}], "
                           f"the graph's is {list(t.shape)}")
    view = t[:, 0] if dims == 2 else t
    if any(a.buffer == ref[0] and a.writes for k in graph.kernels for a in k.accesses):
        return torch.zeros_like(view), view
    return view, None


class PlanRows:
    def __init__(self, graph: KernelGraph, prog: AtenProgram, feed: Sequence[int], samples: bool,
                 uploads: Uploads) -> None:
        """``feed``: the input buffers this device reads; ``samples``: the
        logits end here."""
        self.ids, ids_to = _input(graph, prog, "input_ids", feed, 2)
        self.pos, pos_to = _input(graph, prog, "positions", feed, 1)
        self.copies = [(dst, src) for dst, src in ((ids_to, self.ids), (pos_to, self.pos)) if dst is not None]
        self.samples, self.uploads, self.device = samples, uploads, prog.device
        ref = graph.meta.get("input_views", {}).get("positions")
        self.size = int(ref[2][0]) if ref is not None and ref[2] else None   # the bucket's rows
        self.last: int | None = None          # the step whose rows these are
        self.order: list[int] = []
        self.params: dict[int, SampleRow] = {}   # row -> how it is sampled
        self.batch: SampleBatch | None = None
        self.order_t: torch.Tensor | None = None
        self.active: torch.Tensor | None = None   # 1 at the rows of ``order``, 0 at padding

    def apply(self, step: int, rows: StepRows, sampled: tuple[int, torch.Tensor] | None) -> None:
        """Write step ``step``'s inputs from ``rows`` and the rows kept;
        ``sampled``: (step, token ids) this device sampled last, or that
        the device sampling them handed it (another device samples)."""
        if rows.base >= 0 and rows.base != self.last:
            raise BackendError(f"step {step}: its rows continue step {rows.base} of the plan, but the last step "
                               f"of it on this device is {self.last}")
        if rows.base < 0 or rows.order is not None or rows.new:
            self._change(rows, sampled)
        else:
            fed = self._tokens(rows, sampled) if self.ids is not None and not rows.tokens else None
            if self.pos is not None:
                self.pos.add_(self.active)
            if fed is not None:
                self.ids.index_copy_(0, self.order_t, fed)
            if self.batch is not None:
                self.batch.advance()
        if self.ids is not None and rows.tokens:
            if len(rows.tokens) != len(self.order):
                raise BackendError(f"step {step}: {len(rows.tokens)} tokens for {len(self.order)} rows")
            self.ids.index_copy_(0, self.order_t, self.uploads.put(rows.tokens, self.ids.dtype))
        for dst, src in self.copies:
            dst.copy_(src)
        self.last = step

    def _tokens(self, rows: StepRows, sampled: tuple[int, torch.Tensor] | None) -> torch.Tensor:
        if sampled is None or sampled[0] != rows.base:
            raise BackendError(f"the rows continue step {rows.base}, whose tokens this device did not sample")
        ids = sampled[1]
        return ids if ids.dtype == self.ids.dtype and ids.device == self.ids.device else \
            ids.to(device=self.ids.device, dtype=self.ids.dtype)

    def _change(self, rows: StepRows, sampled: tuple[int, torch.Tensor] | None) -> None:
        """Rows start, leave or are all given (``base`` -1): rebuild what is kept."""
        order = list(rows.order) if rows.order is not None else self.order
        new = {int(e.row): e for e in rows.new}
        old = {r: i for i, r in enumerate(self.order)} if rows.base >= 0 else {}
        if len(set(order)) != len(order) or any(r not in new and r not in old for r in order):
            raise BackendError(f"rows {order}: each must be new or a row of step {rows.base}, once")
        if any(not 0 <= r < (self.size or r + 1) for r in [*order, *new]):
            raise BackendError(f"rows {order}: the bucket has {self.size} rows")
        kept = [(r, old[r]) for r in order if r not in new]
        fed = self._tokens(rows, sampled) if kept and self.ids is not None and not rows.tokens else None
        starts = list(new.values())
        gone = [r for r in old if r not in set(order)]
        a, b = len(order), len(kept)
        ints = self.uploads.put(order + [r for r, _ in kept] + [i for _, i in kept]
                                + [int(e.row) for e in starts] + [int(e.position) for e in starts]
                                + [int(e.token) for e in starts] + gone, torch.int64)
        self.order, self.order_t = order, ints[:a]
        kept_rows, kept_from = ints[a:a + b], ints[a + b:a + 2 * b]
        n = len(starts)
        start_rows, start_pos, start_tok = (ints[a + 2 * b + k * n:a + 2 * b + (k + 1) * n] for k in range(3))
        gone_t = ints[a + 2 * b + 3 * n:]
        if self.pos is not None:
            if rows.base < 0:
                self.pos.fill_(rows.pad)
            else:
                self.pos.index_add_(0, kept_rows, torch.ones_like(kept_rows, dtype=self.pos.dtype))
                self.pos.index_fill_(0, gone_t, rows.pad)
            self.pos.index_copy_(0, start_rows, start_pos.to(self.pos.dtype))
            self.active = torch.zeros_like(self.pos).index_fill_(0, self.order_t, 1)
        if self.ids is not None and not rows.tokens:
            if fed is not None:
                self.ids.index_copy_(0, kept_rows, fed.index_select(0, kept_from))
            self.ids.index_copy_(0, start_rows, start_tok.to(self.ids.dtype))
        if self.samples:
            self._sampling(order, new, old)

    def _sampling(self, order: list[int], new: dict[int, SampleRow], old: dict[int, int]) -> None:
        before = self.batch.index if self.batch is not None else None
        index = [int(new[r].index) if r in new else int(before[old[r]]) + 1 for r in order]
        self.params = {r: new.get(r) or self.params[r] for r in order}
        self.batch = SampleBatch([self.params[r] for r in order], self.device, self.uploads.put,
                                 np.array(index, dtype=np.uint64))

    def sample(self, logits: torch.Tensor, records: Sequence[Any] = (), greedy: Any = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.batch is None:
            raise BackendError("the plan's rows were never given to the device that samples them")
        return self.batch.sample(logits, records, greedy)
