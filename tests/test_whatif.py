"""The what-if cost model: exact roofline numbers on literal kernels and
specs, SM-count corrections, recovery of known parameters by the fit, and
cost tables the planner runs on."""
import math

import pytest

from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.planning import whatif as W
from tessera_actors.planning.simulate import simulate
from tessera_actors.planning.specs import SPECS, GpuSpec, get_spec, link_between
from tessera_actors.plan import build_plan

SPEC = GpuSpec("TOY", sms=100, boost_ghz=2.0, tensor={"bf16": 100e12}, fp32=10e12, mem_bw=1e12,
               l2_bytes=0, mem_bytes=10**9, nvlink=0.0, pcie=10e9, price_per_h=1.0, launch_s=2e-6)
# efficiencies 1, no floors, no power or wave terms, per-SM bandwidth unbounded
IDEAL = W.Params({c: 1.0 for c in W.CLASSES}, {c: 1.0 for c in W.CLASSES}, {c: 0.0 for c in W.CLASSES},
                 {c: 1.0 for c in W.CLASSES}, bw_sm=1e30, p=3.0, power=0.0, l2_gain=1.0, wave_s=0.0)


def t(buf, shape, dtype="bfloat16"):
    return {"t": [buf, 0, list(shape), [], dtype]}


def toy_graph():
    """mm (256x4096 @ 4096x8192, bf16) then a fp32 elementwise add of 1M elements."""
    m, k, n = 256, 4096, 8192
    bufs = {0: Buffer(0, m * k * 2, "input"), 1: Buffer(1, k * n * 2, "weight"), 2: Buffer(2, m * n * 2, "temp"),
            3: Buffer(3, 4 << 20, "temp"), 4: Buffer(4, 4 << 20, "output")}
    mm = Kernel(0, "mm", "library", (Access(0, 0, m * k * 2), Access(1, 0, k * n * 2), Access(2, 0, m * n * 2, "w")),
                flops=2.0 * m * n * k, signature="mm-sig",
                payload={"op": "aten.mm.default", "args": [t(0, (m, k)), t(1, (k, n))], "outs": [{"ref": t(2, (m, n))}]})
    add = Kernel(1, "add", "library", (Access(2, 0, 4 << 20), Access(3, 0, 4 << 20), Access(4, 0, 4 << 20, "w")),
                 flops=float(1 << 20), signature="add-sig",
                 payload={"op": "aten.add.Tensor", "args": [t(2, (1 << 20,), "float32"), t(3, (1 << 20,), "float32")],
                          "outs": [{"ref": t(4, (1 << 20,), "float32")}]})
    return KernelGraph([mm, add], bufs, meta={"model": "toy"})


def test_features_of_library_kernels():
    g = toy_graph()
    mm, add = W.graph_features(g)
    assert (mm.cls, mm.tensor, mm.dtype) == ("gemm", True, "bf16")
    assert mm.bytes == (256 * 4096 + 4096 * 8192 + 256 * 8192) * 2
    assert mm.ctas == 2 * 64 * 3          # 2 x 64 output tiles of 128x128, split-K in 3 to fill a GPU
    assert mm.act_bytes == (256 * 4096 + 256 * 8192) * 2    # the weight is not an activation
    assert (add.cls, add.tensor, add.ctas) == ("pointwise", False, 2048)
    assert add.bytes == 3 * (4 << 20)


def test_roofline_exact_numbers():
    g = toy_graph()
    mm, add = W.graph_features(g)
    flops = 2.0 * 256 * 8192 * 4096
    # whole GPU: compute bound, 384 CTAs on 100 SMs = 4 waves at 96% use
    assert W.roofline_time(mm, SPEC, 100, IDEAL) == pytest.approx(2e-6 + flops / (100e12 * 384 / 400), rel=1e-9)
    # 30 SMs: 30% of the peak, 384 CTAs in 13 waves of 30
    assert W.roofline_time(mm, SPEC, 30, IDEAL) == pytest.approx(2e-6 + flops / (30e12 * 384 / 390), rel=1e-9)
    # memory bound elementwise: bytes / HBM bandwidth
    assert W.roofline_time(add, SPEC, 100, IDEAL) == pytest.approx(2e-6 + 3 * (4 << 20) / 1e12, rel=1e-6)
    # bandwidth saturates in the SMs that have work: 10 SMs of 10 GB/s/GHz at 2 GHz = 200 GB/s
    few = W.Params(**{**IDEAL.__dict__, "bw_sm": 10e9, "p": 50.0})
    assert W.roofline_time(add, SPEC, 10, few) == pytest.approx(2e-6 + 3 * (4 << 20) / 200e9, rel=1e-2)
    # a floor and extra waves add on top
    fl = W.Params(**{**IDEAL.__dict__, "floor": {c: 1e-6 for c in W.CLASSES}, "wave_s": 0.5e-6})
    # (in cycles: at 2.0 GHz they take 1.98/2.0 of their seconds at the 1.98 GHz reference)
    assert W.roofline_time(mm, SPEC, 30, fl) == pytest.approx(
        W.roofline_time(mm, SPEC, 30, IDEAL) + (1e-6 + 12 * 0.5e-6) * 1.98 / 2.0, rel=1e-9)


def test_corrections_interpolate_in_log_sms():
    p = W.Params(corrections={"k": [(8, math.log(2.0)), (32, math.log(8.0))]})
    assert W.correction(p, "k", 8) == pytest.approx(2.0)
    assert W.correction(p, "k", 16) == pytest.approx(4.0)     # halfway in log(SMs)
    assert W.correction(p, "k", 132) == pytest.approx(8.0)    # flat outside the fitted range
    assert W.correction(p, "k", 4) == pytest.approx(2.0)
    assert W.correction(p, "other", 16) == 1.0


def test_fit_recovers_known_parameters():
    from tessera_actors.planning.advise import load_graph
    g = load_graph("dit", "denoise-b16")
    truth = W.Params(eff_c={**W.Params().eff_c, "gemm": 0.6}, eff_m={**W.Params().eff_m, "pointwise": 0.7},
                     bw_sm=30e9, p=2.0, power=0.1, l2_gain=1.5, wave_s=0.3e-6)
    spec = get_spec("H200")
    feats = W.graph_features(g)
    profiles = [W.Profile(g, "H200", s, [W.roofline_time(f, spec, s, truth) for f in feats]) for s in (8, 32, 132)]
    fitted = W.fit(profiles, corrections=False)
    assert fitted.eff_c["gemm"] == pytest.approx(0.6, rel=0.05)
    assert fitted.eff_m["pointwise"] == pytest.approx(0.7, rel=0.05)
    assert fitted.bw_sm == pytest.approx(30e9, rel=0.05)
    for pr in profiles:
        pred = [W.kernel_time(f, spec, pr.sms, fitted) for f in feats]
        assert sum(pred) == pytest.approx(sum(pr.times), rel=0.02)


def test_predict_is_a_cost_table_the_planner_runs_on():
    g = toy_graph()
    c = W.predict(g, ["A100", "L40S"], IDEAL)
    assert c.devices == ["A100", "L40S"] and c.source == "whatif"
    assert c.mem == [SPECS["A100"].mem_bytes, SPECS["L40S"].mem_bytes]
    assert (c.latency[0][1], c.bandwidth[0][1]) == link_between(SPECS["A100"], SPECS["L40S"]) == (10e-6, 32e9)
    assert W.predict(g, ["H100", "H100"], IDEAL).bandwidth[0][1] == SPECS["H100"].nvlink
    assert c.times[1][0] == pytest.approx(SPECS["A100"].launch_s + 3 * (4 << 20) / SPECS["A100"].mem_bw, rel=1e-6)
    plan = build_plan(g, c.devices, [0, 1])
    pred = simulate(plan, c)
    assert pred.step_s == pytest.approx(c.times[0][0] + c.comm_s(0, 1, 256 * 8192 * 2) + c.times[1][1], rel=1e-6)
    with pytest.raises(ValueError, match="unknown GPU"):
        W.predict(g, ["A100", "V100"], IDEAL)


def test_triton_launch_geometry_bounds_bytes():
    """An inductor kernel that writes one token into a KV cache: its access set
    is the whole cache, its launch touches xnumel elements."""
    from pathlib import Path
    g = KernelGraph.load(Path(__file__).parents[1] / "benchmarks/results/arena_h200x2_inductor/llama-decode-b64.tgraph")
    f = W.kernel_features(g, 7)
    assert g.kernels[7].bytes > 2e8 and f.bytes < 1e6
    assert f.cls == "t_pointwise" and f.ctas == 256       # 65536 elements / XBLOCK 256


def test_fused_attention_classes_decode_and_prefill():
    """cuDNN SDPA in captured graphs: 4 * Lq * Lk * D FLOPs per head (not the
    capture's elementwise count); a decode (GQA: 4 query rows per KV head)
    fills a sliver of a tensor-core tile and is its own CUDA-core class, a
    prefill's query tiles run on tensor cores."""
    from pathlib import Path
    res = Path(__file__).parents[1] / "benchmarks/results/whatif_h200"
    g = KernelGraph.load(res / "llama-decode-b64.tgraph")
    k = next(k for k in g.kernels if k.name == "_scaled_dot_product_cudnn_attention")
    f = W.kernel_features(g, k.id)
    assert f.cls == "attn_decode" and not f.tensor and f.dtype == "bf16"
    assert f.flops == 4.0 * (64 * 8 * 4 * 128) * 2048
    assert f.ctas >= 64 * 8 and f.resident == 1
    g = KernelGraph.load(res / "llama-prefill-b1-t1024.tgraph")
    k = next(k for k in g.kernels if k.name == "_scaled_dot_product_cudnn_attention")
    f = W.kernel_features(g, k.id)
    assert f.cls == "attention" and f.tensor and f.flops == 4.0 * (8 * 4096 * 128) * 2048
