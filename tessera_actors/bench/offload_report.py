"""What ``tessera bench offload`` prints and draws (the table of tokens/s per
policy against the bound, the bar plot), and how it compares a policy's
tokens and logits with the reference run's."""
from __future__ import annotations

from pathlib import Path

import torch


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def real_flips(tokens: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor], rel: float = 1e-2) -> int:
    """Steps whose argmax differs from the reference's by more than a near
    tie: the token taken scores below the reference's best by more than
    ``rel`` of the reference's logit range (bf16 logits differ by an ulp
    between CPU and GPU kernels, and ties at one ulp are common)."""
    n = 0
    for t, r, lg in zip(tokens, ref_tokens, ref_logits):
        if t != r and float(lg[r] - lg[t]) > rel * float(lg.max() - lg.min()):
            n += 1
    return n


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def table(res: dict) -> str:
    lines = [f"{'workload':<11} {'gpu-only':>9} {'layer':>9} {'stream':>9} {'tessera':>9} {'ideal':>9} "
             f"{'x best':>7} {'% ideal':>7}  (tok/s)"]
    for name, row in res.items():
        if not isinstance(row, dict) or "ideal_tok_s" not in row:
            continue

        def f(v):
            return f"{v:9.1f}" if v else f"{'-':>9}"
        best = max(row.get("layer_offload_tok_s") or 0, row.get("streaming_tok_s") or 0)
        t = row.get("tessera_tok_s") or 0
        lines.append(f"{name:<11} {f(row.get('gpu_only_tok_s'))} {f(row.get('layer_offload_tok_s'))} "
                     f"{f(row.get('streaming_tok_s'))} {f(t)} {f(row['ideal_tok_s'])} "
                     f"{t / best if best else 0:7.2f} {100 * t / row['ideal_tok_s']:6.1f}%")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n, r in res.items() if isinstance(r, dict) and "ideal_tok_s" in r]
    pols = ["layer_offload", "streaming", "tessera", "ideal"]
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), squeeze=False)
    for ax, n in zip(axes[0], names):
        vals = [res[n].get(f"{p}_tok_s") or 0 for p in pols]
        ax.bar(pols, vals, color=["#999", "#69c", "#c33", "#ddd"])
        ax.set_title(n)
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
