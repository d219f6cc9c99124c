"""The load generator's pure parts: fixed traces from a seed, exact-length
prompts, and the report's percentiles and goodput on literal records."""
from __future__ import annotations

import asyncio
import random

from tessera_actors.serving.loadgen import conversation_trace, exact_text, poisson_trace
from tessera_actors.serving.loadgen_report import Record, percentile, summarize, table


def test_poisson_trace_is_fixed_by_its_seed():
    a, b = poisson_trace(64, 2.0, seed=7), poisson_trace(64, 2.0, seed=7)
    assert a == b and a != poisson_trace(64, 2.0, seed=8)
    assert all(50 <= r.prompt_tokens <= 400 and 32 <= r.output_tokens <= 128 for r in a)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a) and a[0].arrival == 0.0
    long = poisson_trace(4000, 5.0, seed=1)
    mean_gap = long[-1].arrival / (len(long) - 1)
    assert abs(mean_gap - 0.2) < 0.02                  # exponential gaps of mean 1/rate


def test_conversation_trace_groups_turns():
    t = conversation_trace(10, 1.0, seed=3, turns=4)
    assert [r.conversation for r in t] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert [r.turn for r in t] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    starts = [r.arrival for r in t if r.turn == 0]
    assert starts == sorted(starts)


def test_exact_text_hits_the_target_count():
    def count_words_plus_one(text: str) -> int:   # any tokenizer-like count, e.g. a BOS token per prompt
        return len(text.split()) + 1

    async def count(text):
        return count_words_plus_one(text)
    for target in (5, 50, 400):
        text = asyncio.run(exact_text(count, target, random.Random(0)))
        assert count_words_plus_one(text) == target


def test_percentiles_and_goodput():
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    recs = [Record(0, 10, 5, sent=0.0, first=0.1, end=0.5, prompt_tokens=10, completion_tokens=5),  # TPOT 0.1
            Record(1, 10, 5, sent=0.0, first=0.2, end=0.28, prompt_tokens=10, completion_tokens=5),  # TPOT 0.02
            Record(2, 10, 5, error="HTTP 429")]
    s = summarize(recs, slo_tpot=0.05, slo_ttft=1.0)
    assert s["finished"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 429"]
    assert s["output_tokens"] == 10 and abs(s["output_tok_s"] - 10 / 0.5) < 1e-9
    assert abs(s["goodput_fraction"] - 1 / 3) < 1e-9          # only request 1 meets TPOT <= 50 ms
    assert abs(s["tpot_s"]["p50"] - 0.06) < 1e-9
    text = table({"a": s, "b": s})
    assert "b/a" in text and "1.00" in text and "2/3" in text
