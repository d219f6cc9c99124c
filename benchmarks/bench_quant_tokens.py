"""Greedy tokens of SmolLM2 with quantized weights against float32 (issue #33).

Through ``AsyncEngine`` on one ``cpu`` device, fixed chat prompts, ``--tokens``
greedy tokens each (``ignore_eos``), one request at a time, for every weight
form of ``--forms`` (``WEIGHTS/DTYPE``; the first is the reference, dense
float32 by default).  For each prompt and form: the first position where its
tokens leave the reference's, and there the reference's two most likely
tokens with their log probabilities (``top_logprobs``): the difference is a
near-tie when the form's token is the reference's second choice within
``--near-tie`` nats of its first.  After the first difference the texts
diverge and are not compared further.  Also: what requantizing the Q8_0 LM
head to a scale per row changes in its values.

    PYTHONPATH=. python benchmarks/bench_quant_tokens.py --out benchmarks/results/serve_cpu/quant_tokens.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from tessera_actors import AsyncEngine, SamplingParams
from tessera_actors.provenance import provenance

PROMPTS = ("What is the capital of France?", "Write a short story about a robot who learns to paint.",
           "Explain in three sentences why the sky is blue.", "Give me a recipe for pancakes.")


async def greedy(weights: str, dtype: str, prompts: list[str], tokens: int) -> list[dict]:
    """Per prompt: the greedy ids and, per position, the two most likely ``[id, logprob]``."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, top_logprobs=2)
    out = []
    async with AsyncEngine(model="smollm2", devices="cpu", weights=weights, dtype=dtype, max_seqs=1,
                           max_model_len=512, embeddings=False) as eng:
        for p in prompts:
            ids, tops = [], []
            async for o in eng.generate([{"role": "user", "content": p}], params):
                ids += o.token_ids
                tops += o.top_logprobs
            out.append({"ids": ids, "top2": tops})
    return out


def first_difference(ref: dict, got: dict, near: float) -> dict:
    """Where ``got`` leaves ``ref``, and whether the reference held a near-tie there."""
    i = next((i for i, (a, b) in enumerate(zip(ref["ids"], got["ids"])) if a != b), None)
    if i is None:
        return {"first_difference": None, "same_tokens": len(ref["ids"])}
    (a, la), (b, lb) = ref["top2"][i][:2]
    gap = la - lb
    return {"first_difference": i, "ref_top2": [[a, la], [b, lb]], "ref_gap_nats": gap, "token": got["ids"][i],
            "near_tie": got["ids"][i] == b and gap <= near}


def lm_head_requantized() -> dict:
    """What requantizing the Q8_0 embedding / LM head to a scale per row does to
    its values: RMS change over the values' RMS, beside Q8_0's own rounding
    (uniform over a block's step: ``d / sqrt(12)``), and the largest change in
    its row's steps."""
    import numpy as np

    from tessera_actors.models.quantized import GROUP, q8_0_per_row, q8_0_values
    from tessera_actors.models.smollm2 import _reader, release_file
    _, _, blocks = _reader().raw("token_embd.weight")
    release_file()
    q, d = q8_0_values(blocks)
    q8, scale = q8_0_per_row(q, d)
    w = (q.reshape(q.shape[0], -1, GROUP).astype(np.float32) * d[..., None]).reshape(q.shape)
    moved = q8.astype(np.float32) * scale[:, None] - w
    rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
    return {"rms_change_over_rms": float(np.sqrt(np.mean(moved.astype(np.float64) ** 2))) / rms,
            "q8_0_rounding_rms_over_rms": float(np.sqrt(np.mean(d.astype(np.float64) ** 2) / 12)) / rms,
            "max_change_in_row_steps": float(np.max(np.abs(moved) / scale[:, None]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forms", default="dense/float32;dense/bfloat16;quantized/bfloat16",
                    help="';' between WEIGHTS/DTYPE forms; the first is the reference (quantized/float32 runs "
                         "torch's scalar int4 kernel: a 448-token prompt chunk takes minutes)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--near-tie", type=float, default=0.5, help="nats between the reference's two first choices")
    ap.add_argument("--out", default="benchmarks/results/serve_cpu/quant_tokens.json")
    a = ap.parse_args()
    forms = [tuple(f.split("/")) for f in a.forms.split(";") if f]
    load = os.getloadavg()[0]
    runs = {f"{w}/{d}": asyncio.run(greedy(w, d, list(PROMPTS), a.tokens)) for w, d in forms}
    ref_name = "/".join(forms[0])
    ref = runs[ref_name]
    rows = []
    print(f"{'prompt':58} {'form':20} {'first diff':>10} {'ref gap':>8}  near-tie")
    for name, res in runs.items():
        for p, r, g in zip(PROMPTS, ref, res):
            row = {"prompt": p, "form": name, **first_difference(r, g, a.near_tie)}
            rows.append(row)
            diff = row["first_difference"]
            print(f"{p[:58]:58} {name:20} {'-' if diff is None else diff:>10} "
                  f"{row.get('ref_gap_nats', float('nan')):8.3f}  {row.get('near_tie', '')}")
    requant = lm_head_requantized()
    print(f"LM head requantized per row: RMS change {requant['rms_change_over_rms'] * 100:.2f}% of the values' RMS "
          f"(Q8_0's own rounding: {requant['q8_0_rounding_rms_over_rms'] * 100:.2f}%), at most "
          f"{requant['max_change_in_row_steps']:.3f} of its row's step")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": {**provenance(), "load_avg_1m_start": load}, "reference": ref_name,
                               "tokens": a.tokens, "near_tie_nats": a.near_tie, "rows": rows,
                               "lm_head_requantized": requant,
                               "ids": {n: [r["ids"] for r in res] for n, res in runs.items()}}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
