"""The report of ``tessera bench serve``: one summary for every client (HTTP or
in-process), a printed table, JSON with provenance, a PNG of latency over time.

Definitions (per request, measured by the client): TTFT = send to the first
non-empty text; TPOT = (last token - first token) / (completion tokens - 1);
e2e = send to the last token.  Output tok/s = completion tokens of finished
requests / (first send to last finish).  Goodput = finished requests per
second that meet both SLOs (TPOT <= ``slo_tpot``, TTFT <= ``slo_ttft``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tessera_actors.provenance import provenance


@dataclass
class Record:
    """One replayed request as the client saw it (times in seconds since the run began;
    ``target_prompt_tokens`` -1: no target, a conversation turn)."""
    index: int
    target_prompt_tokens: int
    target_output_tokens: int
    sent: float = 0.0
    first: float | None = None
    end: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.end is None or self.completion_tokens < 2:
            return None
        return (self.end - self.first) / (self.completion_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(records: list[Record], slo_tpot: float, slo_ttft: float) -> dict:
    ok = [r for r in records if r.ok]
    start = min((r.sent for r in records), default=0.0)
    end = max((r.end for r in ok), default=start)
    duration = max(end - start, 1e-9)
    out_tokens = sum(r.completion_tokens for r in ok)
    good = [r for r in ok if r.ttft is not None and r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]

    def dist(name: str) -> dict:
        vals = [getattr(r, name) for r in ok if getattr(r, name) is not None]
        return {"p50": percentile(vals, 50), "p90": percentile(vals, 90), "p99": percentile(vals, 99),
                "mean": sum(vals) / len(vals) if vals else None}
    return {
        "requests": len(records), "finished": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration, "output_tokens": out_tokens, "output_tok_s": out_tokens / duration,
        "request_s": len(ok) / duration,
        "prompt_tokens_exact": sum(r.prompt_tokens == r.target_prompt_tokens for r in ok),
        "prompt_tokens_targeted": sum(r.target_prompt_tokens >= 0 for r in ok),
        "output_tokens_exact": sum(r.completion_tokens == r.target_output_tokens for r in ok),
        "ttft_s": dist("ttft"), "tpot_s": dist("tpot"), "e2e_s": dist("e2e"),
        "slo": {"tpot_s": slo_tpot, "ttft_s": slo_ttft},
        "goodput_request_s": len(good) / duration, "goodput_fraction": len(good) / max(len(records), 1),
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


# (label, numeric value of a summary or None, how to print it); numeric rows get a ratio column
_ROWS = [
    ("output tok/s", lambda s: s["output_tok_s"], lambda v: f"{v:.1f}"),
    ("requests/s", lambda s: s["request_s"], lambda v: f"{v:.2f}"),
    ("TTFT p50 ms", lambda s: s["ttft_s"]["p50"], _ms), ("TTFT p99 ms", lambda s: s["ttft_s"]["p99"], _ms),
    ("TPOT p50 ms", lambda s: s["tpot_s"]["p50"], _ms), ("TPOT p99 ms", lambda s: s["tpot_s"]["p99"], _ms),
    ("e2e p50 ms", lambda s: s["e2e_s"]["p50"], _ms), ("e2e p90 ms", lambda s: s["e2e_s"]["p90"], _ms),
    ("e2e p99 ms", lambda s: s["e2e_s"]["p99"], _ms),
    ("goodput req/s", lambda s: s["goodput_request_s"], lambda v: f"{v:.2f}"),
]
_COUNTS = [
    ("finished / requests", lambda s: f"{s['finished']}/{s['requests']}"),
    ("goodput fraction", lambda s: f"{100 * s['goodput_fraction']:.0f}%"),
    ("exact prompt lengths", lambda s: f"{s['prompt_tokens_exact']}/{s['prompt_tokens_targeted']}"),
    ("exact output lengths", lambda s: f"{s['output_tokens_exact']}/{s['finished']}"),
]


def table(summaries: dict[str, dict]) -> str:
    """Side-by-side table, one column per run; with two runs, a column of second/first."""
    names = list(summaries)
    two = len(names) == 2
    head = ["metric"] + names + ([f"{names[1]}/{names[0]}"] if two else [])
    body = []
    for label, value, fmt in _ROWS:
        vals = [value(summaries[n]) for n in names]
        cells = ["-" if v is None else fmt(v) for v in vals]
        if two:
            cells.append(f"{vals[1] / vals[0]:.2f}" if vals[0] and vals[1] is not None else "-")
        body.append([label] + cells)
    for label, text in _COUNTS:
        body.append([label] + [text(summaries[n]) for n in names] + ([""] if two else []))
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head] + body]
    lines.insert(1, "-" * len(lines[0]))
    slo = summaries[names[0]]["slo"]
    lines.append(f"(goodput SLO: TPOT <= {slo['tpot_s'] * 1000:.0f} ms and TTFT <= {slo['ttft_s'] * 1000:.0f} ms)")
    return "\n".join(lines)


def write_json(path: Path, config: dict, summaries: dict[str, dict], records: dict[str, list[Record]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"provenance": provenance(), "config": config, "summary": summaries,
           "records": {k: [asdict(r) for r in v] for k, v in records.items()}}
    path.write_text(json.dumps(doc, indent=1))


def write_png(path: Path, records: dict[str, list[Record]], slo_tpot: float) -> str | None:
    """TTFT, TPOT and e2e of every request against its send time; None, or why no PNG was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[serve]') - no PNG written"
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for name, recs in records.items():
        ok = [r for r in recs if r.ok]
        for ax, what in zip(axes, ("ttft", "tpot", "e2e")):
            pts = [(r.sent, getattr(r, what)) for r in ok if getattr(r, what) is not None]
            ax.scatter([p[0] for p in pts], [p[1] * 1000 for p in pts], s=10, label=name)
    axes[1].axhline(slo_tpot * 1000, color="red", linestyle="--", linewidth=1, label="TPOT SLO")
    for ax, label in zip(axes, ("TTFT (ms)", "TPOT (ms)", "end-to-end (ms)")):
        ax.set_ylabel(label)
        ax.set_yscale("log")                 # queueing makes latencies span decades
        ax.grid(alpha=.3, which="both")
    axes[0].legend(loc="upper left", fontsize=8)
    axes[1].legend(loc="upper left", fontsize=8)
    axes[-1].set_xlabel("request sent at (s since start)")
    fig.suptitle("tessera bench serve: latency over the run")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
