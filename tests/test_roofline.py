"""The pure parts of ``tessera bench roofline`` (the benchmark itself needs a GPU)."""
import torch

from tessera_actors import models
from tessera_actors.capture import capture_module
from tessera_actors.bench.roofline import RooflineConfig, build, format_table, step_bytes, step_flops


def test_step_bytes_are_the_weights_and_state_the_step_touches():
    m = models.get("llama", "tiny")
    inputs = m.example_inputs("decode", batch=2, pos=3)
    g = capture_module(m, inputs).graph
    weights = sum(b.nbytes for b in g.buffers.values() if b.role == "weight")
    state = sum(b.nbytes for b in g.buffers.values() if b.role == "state")
    out = sum(b.nbytes for b in g.buffers.values() if b.role == "output")
    n = step_bytes(g)
    # every layer's weights, no temporaries; a decode writes one position per row into the KV cache:
    # it moves the cache read once plus those values (and their indices), not the whole cache written back
    cfg = m.cfg
    kv_written = 2 * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 4    # k and v, 2 rows, fp32
    assert weights + state < n <= weights + state + out + 2 * kv_written
    assert step_flops(m, inputs) >= 2 * 2 * sum(p.numel() for n_, p in m.named_parameters() if "layers" in n_)


def test_cases_are_named_by_what_runs():
    cfg = RooflineConfig(layers=1, batch=4, cache=64, prompt=16)
    assert build("llama", "decode", cfg, torch.device("meta"))[1] == "decode b4 c64"
    assert build("llama", "prefill", cfg, torch.device("meta"))[1] == "prefill 1x16"
    assert build("dit", "prefill", cfg, torch.device("meta"))[1] == "denoise b1"
    row = {"model": "llama", "case": "decode b4 c64", "tessera_us": 110.0, "compile_us": 100.0, "floor_us": 90.0,
           "bytes": 1e9, "flops": 1e12, "tessera_over_compile": 1.1, "floor_fraction": 90 / 110}
    table = format_table([row, {"model": "moe", "case": "decode", "error": "boom"}])
    assert "1.100" in table and "0.818" in table and "error: boom" in table


def test_flops_count_grouped_experts_and_attention_like_the_textbook():
    grouped, gather = models.get("moe", dispatch="grouped"), models.get("moe", dispatch="gather")
    x = grouped.example_inputs("prefill", batch=1, seq=16)
    assert step_flops(grouped, x) == step_flops(gather, x)     # grouped GEMMs counted as the bmm they replace
    cfg = grouped.cfg
    attn = cfg.n_layers * 4 * 16 * cfg.n_heads * cfg.max_seq * cfg.head_dim   # q@k and p@v over every slot
    from tessera_actors.bench.roofline import _sdpa_flops
    assert _sdpa_flops((1, cfg.n_heads, 16, cfg.head_dim), (1, 2, cfg.max_seq, cfg.head_dim),
                       (1, 2, cfg.max_seq, cfg.head_dim)) * cfg.n_layers == attn
