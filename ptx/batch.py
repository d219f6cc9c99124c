"""Analyse many PTX modules at once, spread over processes.

A model's forward pass brings hundreds of small modules (one per Triton
kernel); they are independent, so :func:`report_many` fans them out over a
process pool and returns the JSON-ready reports of :mod:`ptx.report` in input
order. Blocking; meant for offline graph building, not for an event loop
(run it in a thread there).
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from typing import Sequence

from ptx.errors import PtxParseError
from ptx.parser import no_gc, parse
from ptx.report import report_module


def _one(args: tuple[int, str, bool]) -> tuple[int, dict | None, str | None, int]:
    index, text, features = args
    try:
        with no_gc():
            return index, report_module(parse(text), features), None, 0
    except PtxParseError as exc:
        return index, None, exc.message, exc.line


def report_many(texts: Sequence[str], workers: int | None = None, features: bool = True) -> list[dict]:
    """Reports for ``texts`` (same order), using ``workers`` processes.

    ``workers=None`` uses every CPU; 1 (or a single text) runs in-process.
    The first text that is not valid PTX raises :class:`PtxParseError`, whose
    message names the text's index.
    """
    n = workers or os.cpu_count() or 1
    jobs = [(i, t, features) for i, t in enumerate(texts)]
    if n <= 1 or len(texts) <= 1:
        results = [_one(j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(_one, jobs, chunksize=max(1, len(jobs) // (8 * n))))
    out: list[dict] = []
    for index, rep, err, line in results:
        if rep is None:
            raise PtxParseError(f"module #{index}: {err}", line)
        out.append(rep)
    return out
