"""SmolLM2's GGUF weights kept quantized (``weights="quantized"``): the layers
compute the file's matrices, the graph records torch's CPU int4/int8
kernels, a split serves the tokens of one device, the weights take a sixth
of float32's memory and no page of the file stays mapped, and a GPU is
refused by name."""
import asyncio

import numpy as np
import pytest
import torch

from tessera_actors import AsyncEngine, SamplingParams
from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.models.quantized import Int4Linear, q4_1_values, q8_0_per_row, q8_0_values
from tessera_actors.plan import PlanError, build_plan
from tessera_actors.serving.config import EngineConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
TINY = dict(model="smollm2", size="tiny", max_model_len=256, max_seqs=2, decode_buckets=(1, 2),
            prefill_buckets=(32,), embeddings=False)


def _blocks(w: np.ndarray, kind: str) -> np.ndarray:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize
    return quantize(w, getattr(GGMLQuantizationType, kind))


def _dequantized(blocks: np.ndarray, kind: str) -> torch.Tensor:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize
    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks, getattr(GGMLQuantizationType, kind))))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_an_int4_layer_multiplies_by_the_q4_1_matrix_of_the_file(dtype, tol):
    """float32 scales hold Q4_1's float16 ``d`` and ``m`` exactly: the result is
    the dense matmul by the dequantised matrix up to summation order."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen).numpy()
    blocks = _blocks(w, "Q4_1")
    layer = Int4Linear(128, 96, dtype)
    layer.load_q4_1(*q4_1_values(blocks))
    x = torch.randn(3, 5, 128, generator=gen)
    want = x @ _dequantized(blocks, "Q4_1").t()
    got = layer(x.to(dtype)).float()
    assert got.shape == (3, 5, 96)
    assert (got - want).abs().max() <= tol * want.abs().max()


def test_q8_0_requantized_per_row_moves_each_value_by_at_most_half_a_step():
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 96, generator=gen) * torch.rand(64, 1, generator=gen)).numpy()
    blocks = _blocks(w, "Q8_0")
    q, d = q8_0_values(blocks)
    exact = _dequantized(blocks, "Q8_0")
    assert torch.equal(torch.from_numpy(q.astype(np.float32)).view(64, 3, 32) * torch.from_numpy(d)[..., None],
                       exact.view(64, 3, 32))
    q8, scale = q8_0_per_row(q, d)
    moved = (torch.from_numpy(q8.astype(np.float32)) * torch.from_numpy(scale)[:, None] - exact).abs()
    assert (moved <= torch.from_numpy(scale)[:, None] / 2 * (1 + 1e-6)).all()


def test_quantized_weights_on_cpus_by_default_of_the_cli_and_refused_on_a_gpu():
    auto = EngineConfig(model="smollm2", devices="cpu", weights="auto")
    assert (auto.weights, auto.dtype) == ("quantized", "bfloat16")
    assert (EngineConfig(model="smollm2", devices="cpu").weights, EngineConfig().dtype) == ("dense", "float32")
    assert EngineConfig(model="smollm2", devices="cpu", weights="auto", dtype="float32").weights == "dense"
    assert EngineConfig(model="llama", devices="cpu", weights="auto").weights == "dense"
    assert EngineConfig(model="smollm2", devices="cuda:0,cpu", weights="auto").weights == "dense"
    with pytest.raises(ValueError, match=r"_weight_int4pack_mm_for_cpu.*cuda:0"):
        EngineConfig(model="smollm2", devices="cuda:0,cpu", weights="quantized")
    with pytest.raises(ValueError, match="smollm2"):
        EngineConfig(model="llama", devices="cpu", weights="quantized")


def test_a_plan_refuses_a_cpu_only_kernel_on_a_gpu_by_name():
    bufs = {0: Buffer(0, 64, "input"), 1: Buffer(1, 64, "temp"), 2: Buffer(2, 64, "output")}
    ks = [Kernel(0, "_weight_int4pack_mm_for_cpu", "library", (Access(0, 0, 64, "r"), Access(1, 0, 64, "w"))),
          Kernel(1, "add", "library", (Access(1, 0, 64, "r"), Access(2, 0, 64, "w")))]
    g = KernelGraph(ks, bufs, inputs={"x": 0}, outputs=[2])
    assert build_plan(g, ["cpu", "cuda:0"], [0, 1]).kernels_per_device() == [1, 1]
    with pytest.raises(PlanError, match=r"_weight_int4pack_mm_for_cpu .*cuda:0"):
        build_plan(g, ["cpu", "cuda:0"], [1, 1])


async def test_a_split_serves_the_tokens_of_one_device_with_quantized_weights():
    """Bitwise: the same kernels in the same precision on each side of the cut."""
    async def tokens(devices):
        async with AsyncEngine(devices=devices, weights="quantized", **TINY) as eng:
            got = await asyncio.gather(*(_tokens(eng, p) for p in ("Once upon a time", "The capital of")))
            graph = next(iter(eng.served.graphs.values()))
            return got, eng.stats()["placement"]["kernels_per_device"], {k.name for k in graph.kernels}
    one, _, names = await tokens("cpu")
    split, per_device, _ = await tokens("cpu,cpu")
    assert split == one and min(per_device) > 0
    assert {"_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm"} <= names


def test_the_real_model_s_quantized_weights_take_a_sixth_and_leave_the_file_unmapped():
    from tessera_actors import models
    from tessera_actors.models.smollm2 import gguf_path, release_file
    path = gguf_path()
    model = models.get("smollm2", "real", dtype=torch.bfloat16, weights="quantized", max_seq=64, max_batch=1)
    state = set(model.state_names())
    held = {t.data_ptr(): t.numel() * t.element_size() for n, t in [*model.named_parameters(),
                                                                   *model.named_buffers()] if n not in state}
    release_file()
    with open("/proc/self/maps") as f:
        assert path not in f.read()
    assert sum(held.values()) < 100 * 2**20   # float32: 513 MiB
    assert all(p.dim() == 1 for p in model.parameters())   # no float matrix left: only the norms' scales


async def _tokens(eng, prompt):
    toks = []
    async for out in eng.generate(prompt, GREEDY):
        toks += out.token_ids
    return toks
