"""The reference models' attention and experts are the kernels a user runs:
SDPA over a [B, KV, S, hd] cache (GQA folded or enable_gqa, sinks, sliding
window) and a grouped-GEMM top-k dispatch - equal to the textbook math."""
import pytest
import torch

from tessera_actors import models
from tessera_actors.capture import capture_module
from tessera_actors.models.attention import CachedAttention
from tessera_actors.models.common import rope_inv_freq, rope_tables


def textbook(att: CachedAttention, x, cos, sin, positions):
    """Attention written out: scores of every query head against its KV head's
    cache, masked, softmax with the sink logit in the denominator."""
    from tessera_actors.models.common import apply_rope
    B, T, _ = x.shape
    H, KV, hd = att.n_heads, att.n_kv_heads, att.head_dim
    q = apply_rope(att.wq(x).view(B, T, H, hd), cos, sin).transpose(1, 2)          # [B, H, T, hd]
    S = att.max_seq
    keys = att.k_cache[:B, :, :S].repeat_interleave(H // KV, dim=1)                # [B, H, S, hd]
    vals = att.v_cache[:B, :, :S].repeat_interleave(H // KV, dim=1)
    scores = (q @ keys.transpose(-1, -2)) * hd ** -0.5                             # [B, H, T, S]
    slots, pos = torch.arange(S), positions[:, None, :, None]
    mask = slots <= pos
    if att.sliding_window:
        mask &= slots > pos - att.sliding_window
    scores = scores.masked_fill(~mask, float("-inf"))
    if att.sinks is not None:
        sink = att.sinks.view(1, H, 1, 1).expand(B, H, T, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :S]
    else:
        probs = torch.softmax(scores, -1)
    return att.wo((probs @ vals).transpose(1, 2).reshape(B, T, H * hd))


@pytest.mark.parametrize("gqa", ["fold", "enable_gqa"])
@pytest.mark.parametrize("sinks,window", [(False, None), (True, 3)])
def test_sdpa_attention_equals_the_textbook_math(gqa, sinks, window):
    torch.manual_seed(0)
    att = CachedAttention(32, 4, 2, 8, max_batch=2, max_seq=10, sliding_window=window, sinks=sinks, gqa=gqa)
    if sinks:
        torch.nn.init.normal_(att.sinks)
    cos_t, sin_t = rope_tables(10, rope_inv_freq(8, 10000.0))
    with torch.no_grad():
        for positions in (torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]), torch.tensor([[4, 5, 6, 7], [2, 3, 4, 5]]),
                          torch.tensor([[8], [6]])):                 # prefill, a later chunk, decode
            x = torch.randn(2, positions.shape[1], 32)
            got = att(x, cos_t[positions], sin_t[positions], positions)
            want = textbook(att, x, cos_t[positions], sin_t[positions], positions)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if sinks:
        assert torch.count_nonzero(att.k_cache[:, :, 10:]) == 0    # the sink slots are never written


@pytest.mark.parametrize("name", ["llama", "moe"])
def test_reference_models_record_library_attention_and_grouped_experts(name):
    m = models.get(name, "tiny")
    res = capture_module(m, m.example_inputs("decode", batch=2, pos=3))
    names = [k.name for k in res.graph.kernels]
    assert sum("scaled_dot_product" in n for n in names) == m.cfg.n_layers
    if name == "moe":
        assert sum(n == "_grouped_mm" for n in names) == 2 * m.cfg.n_layers
    sdpa = next(k for k in res.graph.kernels if "scaled_dot_product" in k.name)
    cache_reads = {res.graph.buffers[a.buffer].role for a in sdpa.accesses if a.mode == "r"}
    assert "state" in cache_reads                                   # reads the KV cache in place


def test_grouped_dispatch_equals_every_expert_densely():
    torch.manual_seed(0)
    grouped, dense = models.get("moe", dispatch="grouped"), models.get("moe", dispatch="dense")
    x = grouped.example_inputs("prefill", batch=2, seq=6)
    torch.testing.assert_close(grouped(**x), dense(**x), rtol=1e-5, atol=1e-5)
