"""Decode attention forms on one GPU, timed side by side (a diagnostic for
the reference models' attention and ``tessera bench roofline``): batch
``B`` of one-token queries, ``H`` query heads over ``KV`` KV heads, a cache
of ``S`` slots, each row attending to its slots ``<= position``.  Prints
each form's time, its fraction of the KV bytes' floor at ``--gbps``, and its
max abs difference to the first form.

    python scripts/decode_attention.py [--batch 64 --heads 32 --kv 8 --slots 2048]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, steps: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(steps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / steps


def kernels(fn) -> str:
    """The CUDA kernels one call of ``fn`` runs, longest first."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(((e.device_time_total, e.key) for e in prof.key_averages()
                   if e.device_time_total > 0 and e.device_type.name == "CUDA"), reverse=True)
    return "; ".join(f"{k[:60]} {t:.0f}us" for t, k in rows[:2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--gbps", type=float, default=4200.0)
    ap.add_argument("--full", action="store_true", help="every row at the last slot (else positions spread)")
    a = ap.parse_args()
    B, H, KV, S, hd = a.batch, a.heads, a.kv, a.slots, a.dim
    G = H // KV
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(B, H, 1, hd, device=dev, dtype=dt)
    k = torch.randn(B, KV, S, hd, device=dev, dtype=dt)
    v = torch.randn(B, KV, S, hd, device=dev, dtype=dt)
    pos = torch.full((B,), S - 1, device=dev) if a.full else torch.randint(S // 2, S, (B,), device=dev)
    slots = torch.arange(S, device=dev)
    keep = slots[None, :] <= pos[:, None]                                     # [B, S]
    add = torch.zeros(B, 1, 1, S, device=dev, dtype=dt).masked_fill_(~keep[:, None, None], float("-inf"))
    qf = q.view(B, KV, G, hd)
    add_f = add.expand(B, 1, G, S)
    bool_f = keep[:, None, None].expand(B, 1, G, S)
    k_bskd = k.transpose(1, 2).contiguous()                                   # [B, S, KV, hd]
    v_bskd = v.transpose(1, 2).contiguous()
    forms = {}
    forms["fold + additive mask (default)"] = lambda: F.scaled_dot_product_attention(qf, k, v, attn_mask=add_f)
    forms["fold + bool mask"] = lambda: F.scaled_dot_product_attention(qf, k, v, attn_mask=bool_f)
    forms["enable_gqa + additive mask"] = lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=add, enable_gqa=True).view(B, KV, G, hd)

    def backend(b, fn):
        def run():
            with sdpa_kernel([b]):
                return fn()
        return run
    forms["fold + mask, cuDNN"] = backend(SDPBackend.CUDNN_ATTENTION, forms["fold + additive mask (default)"])
    forms["fold + mask, efficient"] = backend(SDPBackend.EFFICIENT_ATTENTION, forms["fold + additive mask (default)"])
    forms["fold, no mask (flash; ignores positions)"] = lambda: F.scaled_dot_product_attention(qf, k, v)
    cu_q = torch.arange(B + 1, device=dev, dtype=torch.int32)
    cu_k = torch.arange(B + 1, device=dev, dtype=torch.int32) * S
    used = (pos + 1).to(torch.int32)

    def varlen():
        out = torch.ops.aten._flash_attention_forward(
            q.view(B, H, hd), k_bskd.view(B * S, KV, hd), v_bskd.view(B * S, KV, hd), cu_q, cu_k, 1, S, 0.0,
            False, False, seqused_k=used)[0]
        return out.view(B, KV, G, hd)
    forms["flash varlen, seqused_k ([B,S,KV,hd] cache)"] = varlen
    floor_us = 2 * B * KV * S * hd * 2 / (a.gbps * 1e3)
    ref = None
    print(f"B={B} H={H} KV={KV} S={S} hd={hd} bf16; KV bytes floor {floor_us:.1f} us at {a.gbps:.0f} GB/s")
    for name, fn in forms.items():
        try:
            out = fn()
            t = timed(fn)
        except Exception as e:   # noqa: BLE001 - a form this build lacks is reported, not fatal
            print(f"  {name:48} unavailable: {type(e).__name__}: {str(e)[:120]}")
            continue
        diff = float((out.float() - ref.float()).abs().max()) if ref is not None else 0.0
        ref = out if ref is None else ref
        print(f"  {name:48} {t:8.1f} us  floor/t {floor_us / t:5.2f}  max abs {diff:.2e}  [{kernels(fn)}]")


if __name__ == "__main__":
    main()
