"""The tables of ``benchmarks/bench_cpu_compare.py``: each server's medians, the per-round ratios of
the pairs that issue #33 compares, and its acceptance rows (per round, the median, met or not)."""
from __future__ import annotations

import statistics

from cpu_compare_servers import LABELS

# (label, path into a server block, scale, higher is better)
METRICS = (("start to ready, s", ("ready_s",), 1, False),
           ("RSS idle, GB (process tree)", ("memory_idle", "rss_bytes"), 1e-9, False),
           ("RSS after load, GB", ("memory_after_load", "rss_bytes"), 1e-9, False),
           ("PSS after load, GB", ("memory_after_load", "pss_bytes"), 1e-9, False),
           ("idle TTFT, fresh chat prompt, s", ("ttft_fresh_s",), 1, False),
           ("TTFT, same prompt repeated, s", ("ttft_repeated_s",), 1, False),
           ("batch-1 decode, tok/s", ("batch1_tok_s",), 1, True),
           ("guidellm output tok/s", ("guidellm", "output_tok_s"), 1, True),
           ("guidellm output tokens per request", ("guidellm", "output_tokens_per_request"), 1, True),
           ("guidellm TTFT p50, s", ("guidellm", "ttft_p50_s"), 1, False),
           ("guidellm TTFT p99, s", ("guidellm", "ttft_p99_s"), 1, False),
           ("guidellm ITL p50 (vLLM's TPOT), ms", ("guidellm", "itl_p50_s"), 1e3, False),
           ("guidellm TPOT p50 (latency/token), ms", ("guidellm", "tpot_p50_s"), 1e3, False))
METRIC = {m[0]: m for m in METRICS}

# the ratios a round keeps: numerator / denominator, same weights first
PAIRS = (("tessera", "vllm"), ("tessera-q", "llamacpp"), ("tessera-q", "vllm"))

# issue #33's acceptance: (row, metric, numerator, denominator or None for the value itself, bound, ">=" | "<=")
ACCEPTANCE = (("c16 output tok/s, tessera fp32 / vLLM fp32", "guidellm output tok/s", "tessera", "vllm", 1.0, ">="),
              ("idle TTFT fresh 290-token prompt, tessera fp32 / vLLM fp32", "idle TTFT, fresh chat prompt, s",
               "tessera", "vllm", 1.0, "<="),
              ("idle TTFT fresh 290-token prompt, tessera quantized / vLLM fp32", "idle TTFT, fresh chat prompt, s",
               "tessera-q", "vllm", 1.0, "<="),
              ("TTFT of a repeated prompt, tessera fp32, s", "TTFT, same prompt repeated, s", "tessera", None,
               0.2, "<="),
              ("TTFT of a repeated prompt, tessera quantized, s", "TTFT, same prompt repeated, s", "tessera-q",
               None, 0.2, "<="),
              ("batch-1 decode, tessera fp32 / vLLM fp32", "batch-1 decode, tok/s", "tessera", "vllm", 1.0, ">="),
              ("batch-1 decode, tessera quantized / llama.cpp Q4_1", "batch-1 decode, tok/s", "tessera-q",
               "llamacpp", 0.5, ">="),
              ("server RSS after load, tessera quantized, GB", "RSS after load, GB", "tessera-q", None, 1.5, "<="),
              ("server RSS idle, tessera quantized, GB", "RSS idle, GB (process tree)", "tessera-q", None, 1.5, "<="))


def get(block: dict, path: tuple):
    for key in path:
        block = (block or {}).get(key)
    return block


def _value(servers: dict, name: str, label: str):
    _, path, scale, _ = METRIC[label]
    v = get(servers.get(name), path)
    return None if v is None else v * scale


def round_ratios(servers: dict) -> dict:
    """``{"a/b": {metric: a / b}}`` for every pair of ``PAIRS`` that ran (None where either is missing)."""
    out = {}
    for a, b in PAIRS:
        if a not in servers or b not in servers:
            continue
        ratios = {}
        for label in METRIC:
            x, y = _value(servers, a, label), _value(servers, b, label)
            ratios[label] = x / y if x is not None and y else None
        out[f"{a}/{b}"] = ratios
    return out


def _near_tie(side: list, other_token: str, near: float) -> bool:
    """``other_token`` is this side's second choice, within ``near`` nats of its first."""
    top = sorted(side[2], key=lambda t: -t[1])
    return len(top) > 1 and top[1][0] == other_token and top[0][1] - top[1][1] <= near


def compare_greedy(a: list[dict], b: list[dict], near: float) -> list[dict]:
    """Per prompt: same text?  The largest |log-probability difference| over the tokens both chose, and
    where they part, the first differing token, each side's top-1 - top-2 margin and whether it is a
    near-tie (each side's token the other's second choice within ``near`` nats)."""
    rows = []
    for x, y in zip(a, b):
        row = {"prompt": x["prompt"], "same_text": x["text"] == y["text"], "a": x["text"], "b": y["text"]}
        tx, ty = x["tokens"], y["tokens"]
        i = next((k for k, (p, q) in enumerate(zip(tx, ty)) if p[0] != q[0]), None)
        same = list(zip(tx, ty))[:i]
        row["max_logprob_diff"] = max((abs(p[1] - q[1]) for p, q in same), default=None)
        if i is not None:
            def margin(t):
                top = sorted((lp for _, lp in t[2]), reverse=True)
                return top[0] - top[1] if len(top) > 1 else None
            row.update(first_diff_token=i, a_token=tx[i][0], b_token=ty[i][0], a_margin=margin(tx[i]),
                       b_margin=margin(ty[i]),
                       near_tie=_near_tie(ty[i], tx[i][0], near) or _near_tie(tx[i], ty[i][0], near))
        row["ok"] = row["same_text"] or bool(row.get("near_tie"))
        rows.append(row)
    return rows


def fmt(x) -> str:
    return "-" if x is None else (f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}")


def median(xs):
    known = [x for x in xs if x is not None]
    return statistics.median(known) if known else None


def server_table(rounds: list[dict], names: list[str]) -> str:
    """Each server's median of every metric over the rounds, and the median of each pair's ratio."""
    pairs = [f"{a}/{b}" for a, b in PAIRS if a in names and b in names]
    head = ["metric", *(f"{LABELS[n]} (median)" for n in names), *(f"median {p}" for p in pairs), "better"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for label, _, _, higher in METRICS:
        meds = [median([_value(r["servers"], n, label) for r in rounds]) for n in names]
        ratios = [median([(r["ratios"].get(p) or {}).get(label) for r in rounds]) for p in pairs]
        lines.append(" | ".join([label, *map(fmt, meds), *map(fmt, ratios), "higher" if higher else "lower"]))
    return "\n".join(lines)


def round_table(r: dict, number: int) -> str:
    """One round: every metric of every server that ran, in the round's order, and the load averages."""
    names = [n for n in r["order"] if n in r["servers"]]
    head = [f"round {number}", *(LABELS[n] for n in names)]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for label, _, _, _ in METRICS:
        lines.append(" | ".join([label, *(fmt(_value(r["servers"], n, label)) for n in names)]))
    loads = [r["servers"][n].get("load_before", [None])[0] for n in names]
    lines.append(" | ".join(["load average 1 min at start", *map(fmt, loads)]))
    lines.append(" | ".join(["started (UTC)", *(r["servers"][n].get("started_utc", "-") for n in names)]))
    return "\n".join(lines)


def acceptance(rounds: list[dict]) -> list[dict]:
    """Each acceptance row whose servers ran: its value per round, their median, met or not."""
    rows = []
    for label, metric, a, b, bound, op in ACCEPTANCE:
        per = []
        for r in rounds:
            x = _value(r["servers"], a, metric)
            y = _value(r["servers"], b, metric) if b else 1.0
            per.append(x / y if x is not None and y else None)
        if all(v is None for v in per):
            continue
        med = median(per)
        met = None if med is None else (med >= bound if op == ">=" else med <= bound)
        rows.append({"row": label, "per_round": per, "median": med, "bound": f"{op} {bound:g}", "met": met})
    greedy = [r.get("greedy") for r in rounds]
    if any(greedy):
        per = [None if g is None else sum(row["ok"] for row in g) for g in greedy]
        n = len(next(g for g in greedy if g))
        med = median(per)
        rows.append({"row": f"greedy text = vLLM fp32's or first difference a near-tie (prompts of {n})",
                     "per_round": per, "median": med, "bound": f"= {n}", "met": med == n})
    return rows


def acceptance_table(rows: list[dict], n_rounds: int) -> str:
    head = ["acceptance (#33)", *(f"r{i + 1}" for i in range(n_rounds)), "median", "bound", "met"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for row in rows:
        met = "-" if row["met"] is None else ("met" if row["met"] else "not met")
        lines.append(" | ".join([row["row"], *map(fmt, row["per_round"]), fmt(row["median"]), row["bound"], met]))
    return "\n".join(lines)


def write_plot(rounds: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter
    labels = [m[0] for m in METRICS]
    ran = {p for r in rounds for p in r.get("ratios", {})}
    pairs = [f"{a}/{b}" for a, b in PAIRS if f"{a}/{b}" in ran]
    fig, axes = plt.subplots(1, max(1, len(pairs)), figsize=(6 * max(1, len(pairs)), 5.5), sharey=True,
                             squeeze=False)
    for ax, pair in zip(axes[0], pairs):
        for i, r in enumerate(rounds):
            ratios = r.get("ratios", {}).get(pair) or {}
            ax.scatter([ratios.get(lbl) or float("nan") for lbl in labels], range(len(labels)),
                       label=f"round {i + 1}", s=20)
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator([0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        a, b = pair.split("/")
        ax.set_xlabel(f"{LABELS[a]} / {LABELS[b]} (2 threads)", fontsize=9)
        ax.legend(fontsize=7)
    axes[0][0].set_yticks(range(len(labels)), [f"{m[0]} ({'higher' if m[3] else 'lower'} is better)"
                                                for m in METRICS], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
