"""Greedy tokens of quantized SmolLM2 against the float32-dequantized model (issue #33).

Both served through ``AsyncEngine`` on one CPU device (``weights="dense"``:
the GGUF dequantized to float32; ``weights="quantized"``: its 4-bit blocks
and the int8 head through torch's CPU kernels), for fixed chat prompts,
``--tokens`` greedy tokens each.  Where the two first differ, the float32
model is run teacher-forced on the common prefix (eager, the same weights)
and the step is classified: a *near-tie* when the float32 model's logit
for the quantized token is within ``--tie`` of its top logit (the rank
says how many tokens lie between them).

    PYTHONPATH=. python benchmarks/quant_tokens.py --out benchmarks/results/cpu_step/quant_tokens.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch

from tessera_actors import AsyncEngine, SamplingParams
from tessera_actors.provenance import provenance

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis in one sentence.", "List three prime numbers.",
           "How do I reverse a list in Python?", "Give me a tip for a job interview.",
           "What is 12 times 7?", "Describe a cat to someone who has never seen one."]


async def greedy(weights: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    out = []
    async with AsyncEngine(model="smollm2", devices="cpu", weights=weights, max_seqs=4, max_model_len=512,
                           kv_cache_memory=None, embeddings=False) as eng:
        for ids in prompts:
            got = []
            async for o in eng.generate(ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)):
                got += o.token_ids
            out.append(got)
    return out


@torch.no_grad()
def at_difference(model, prompt_ids: list[int], common: list[int], theirs: int) -> dict:
    """The float32 model's logits at the first differing step: its choice, the quantized one's."""
    ids = torch.tensor([prompt_ids + common])
    model.reset_state()
    logits = model(input_ids=ids, positions=torch.arange(ids.shape[1])[None])[0, -1].float()
    top2 = torch.topk(logits, 2)
    probs = torch.softmax(logits, -1)
    return {"dense_token": int(top2.indices[0]), "quantized_token": theirs,
            "quantized_rank": int((logits > logits[theirs]).sum()),
            "logit_gap": float(logits[top2.indices[0]] - logits[theirs]),
            "dense_prob": float(probs[top2.indices[0]]), "quantized_prob_under_dense": float(probs[theirs])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--tie", type=float, default=1.0, help="near-tie: the quantized token within this many logits of the top")
    ap.add_argument("--out", default="benchmarks/results/cpu_step/quant_tokens.json")
    a = ap.parse_args()
    from tessera_actors.models.smollm2 import chat_prompt, load_smollm2, load_tokenizer
    tok = load_tokenizer()
    prompts = [tok.encode(chat_prompt(p)) for p in PROMPTS]
    dense, quant = asyncio.run(greedy("dense", prompts, a.tokens)), asyncio.run(greedy("quantized", prompts, a.tokens))
    model = load_smollm2("real", max_batch=1, max_seq=512)
    rows = []
    for p, ids, d, q in zip(PROMPTS, prompts, dense, quant):
        first = next((i for i, (x, y) in enumerate(zip(d, q)) if x != y), None)
        row = {"prompt": p, "same": d == q, "first_difference": first, "dense": tok.decode(d), "quantized": tok.decode(q)}
        if first is not None:
            row.update(at_difference(model, ids, d[:first], q[first]))
            row["near_tie"] = row["logit_gap"] <= a.tie
        rows.append(row)
        where = "same" if first is None else (f"first difference at token {first}: gap {row['logit_gap']:.2f} "
                                             f"logits, rank {row['quantized_rank']}, near-tie {row['near_tie']}")
        print(f"{p[:40]:42} {where}")
    same = sum(r["same"] for r in rows)
    ties = sum(bool(r.get("near_tie")) for r in rows if not r["same"])
    print(f"\n{same}/{len(rows)} prompts give the same {a.tokens} tokens; {ties}/{len(rows) - same} differences are "
          f"near-ties (within {a.tie} logits of the float32 model's top choice)")
    prov = provenance()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"git_commit": prov["git_commit"], "command": prov["command"], "provenance": prov,
                               "tokens": a.tokens, "tie_logits": a.tie, "same": same, "near_ties": ties,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
