"""GPU spec table for the what-if cost model (:mod:`.whatif`) and ``tessera advise``.

Every number is the vendor's published peak (dense, i.e. without 2:4
structured sparsity) unless its comment says otherwise; each cites the
datasheet it comes from.  Where a datasheet gives only the sparse figure the
dense one is half of it (marked "sparse/2").  Prices are $/GPU-hour: the
Tessera paper's (arXiv 2604.10180, evaluation section) for A100, L40S, H100,
B200 and RTX Pro 6000; H200's is chosen here (cited at its entry).

Units: FLOP/s, bytes/s, bytes, GHz, seconds.  Link bandwidths are *per
direction* (datasheets quote NVLink and PCIe bidirectional: halved here).
Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

T = 1e12
GB = 1e9
MiB = 2 ** 20


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type.  ``tensor[dtype]`` is the dense tensor-core peak for
    ``bf16``, ``fp16``, ``tf32`` and (where the GPU has it) ``fp8``;
    ``fp32`` the non-tensor (CUDA core) FP32 peak.  ``nvlink`` is 0 for a
    GPU without NVLink.  ``launch_s`` is the per-kernel cost inside a
    CUDA-graph replay (measured on H200, DESIGN.md; assumed equal elsewhere)."""

    name: str
    sms: int
    boost_ghz: float
    tensor: dict[str, float]
    fp32: float
    mem_bw: float
    l2_bytes: int
    mem_bytes: int
    nvlink: float
    pcie: float
    price_per_h: float
    launch_s: float = 2.3e-6
    notes: dict[str, str] = field(default_factory=dict, compare=False)

    def tensor_peak(self, dtype: str) -> float:
        """Dense tensor-core FLOP/s for ``dtype``; a dtype the GPU has no
        tensor path for (fp8 on A100) runs at the next wider one it has."""
        for d in {"fp8": ("fp8", "fp16", "bf16"), "fp16": ("fp16", "bf16"), "bf16": ("bf16", "fp16"),
                  "tf32": ("tf32",), "fp32": ("tf32",)}.get(dtype, ("bf16",)):
            if d in self.tensor:
                return self.tensor[d]
        return self.fp32


_H100 = GpuSpec("H100", sms=132, boost_ghz=1.98,
                tensor={"bf16": 989.5 * T, "fp16": 989.5 * T, "fp8": 1979 * T, "tf32": 494.5 * T},
                fp32=67 * T, mem_bw=3350 * GB, l2_bytes=50 * MiB, mem_bytes=80 * 10**9,
                nvlink=450 * GB, pcie=64 * GB, price_per_h=2.9)

SPECS: dict[str, GpuSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021 revision with the 80 GB parts, A100 80GB
    # SXM column): FP32 19.5 TF, TF32 156 TF (312 sparse),
    # BF16/FP16 312 TF (624 sparse), no FP8, HBM2e 80 GB at 2,039 GB/s, NVLink 600 GB/s,
    # PCIe Gen4 64 GB/s (both bidirectional).  SMs (108), boost clock (1410 MHz) and L2
    # (40 MB): NVIDIA A100 Tensor Core GPU Architecture whitepaper (V1.0), table 3.
    "A100": GpuSpec("A100", sms=108, boost_ghz=1.41,
                    tensor={"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T},
                    fp32=19.5 * T, mem_bw=2039 * GB, l2_bytes=40 * MiB, mem_bytes=80 * 10**9,
                    nvlink=300 * GB, pcie=32 * GB, price_per_h=1.5),
    # NVIDIA L40S datasheet (Ada Lovelace, 2023): FP32 91.6 TF, TF32 183 TF
    # (366 sparse), BF16/FP16 362.05 TF (733 sparse), FP8 733 TF (1,466 sparse), 48 GB GDDR6
    # at 864 GB/s, PCIe Gen4 x16 64 GB/s bidirectional, no NVLink; 18,176 CUDA cores = 142 SMs.
    # Boost clock 2,520 MHz and L2 96 MB: NVIDIA Ada GPU Architecture whitepaper (V2.02,
    # AD102 full chip; L40S is AD102 with 142 SMs).
    "L40S": GpuSpec("L40S", sms=142, boost_ghz=2.52,
                    tensor={"bf16": 362.05 * T, "fp16": 362.05 * T, "fp8": 733 * T, "tf32": 183 * T},
                    fp32=91.6 * T, mem_bw=864 * GB, l2_bytes=96 * MiB, mem_bytes=48 * 10**9,
                    nvlink=0.0, pcie=32 * GB, price_per_h=1.0),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column, 2023):
    # FP32 67 TF, TF32 989 TF sparse (494.5 dense = sparse/2), BF16/FP16 1,979 TF sparse
    # (989.5 dense), FP8 3,958 TF sparse (1,979 dense), 80 GB HBM3 at 3.35 TB/s, NVLink
    # 900 GB/s, PCIe Gen5 128 GB/s (bidirectional).  132 SMs, 1,980 MHz boost (SXM5) and
    # 50 MB L2: NVIDIA H100 Tensor Core GPU Architecture whitepaper (V1.01), table 3.
    "H100": _H100,
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column, 2024): compute
    # as H100 SXM (FP32 67 TF; TF32 989, BF16/FP16 1,979, FP8 3,958 TF sparse), 141 GB HBM3e at
    # 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s (bidirectional).  Same GH100 die and
    # clocks as H100 SXM (132 SMs, 1,980 MHz, 50 MB L2; H100 whitepaper V1.01).
    # Price: $3.50/GPU-hour, the low end of the "specialty cloud" on-demand range for H200
    # SXM5 ($3.50-4.50) in Mercatus, "Cloud GPU pricing" (May 2026), between the paper's
    # H100 (2.9) and B200 (5.0).
    "H200": replace(_H100, name="H200", mem_bw=4800 * GB, mem_bytes=141 * 10**9, price_per_h=3.5),
    # NVIDIA HGX B200 datasheet (2024; the 8-GPU board's figures divided by 8):
    # FP32 75 TF (600/8), TF32 18 PF sparse -> 1.125 PF dense per GPU, FP16/BF16 36 PF sparse
    # -> 2.25 PF dense, FP8 72 PF sparse -> 4.5 PF dense, HBM3e 1,440 GB -> 180 GB per GPU at
    # 8 TB/s (64 TB/s / 8), NVLink 5 1.8 TB/s per GPU (bidirectional), PCIe Gen5 128 GB/s.
    # SMs (148), boost clock (~1,965 MHz) and L2 (126 MB) are NOT in NVIDIA's datasheet: they
    # are third-party device-query reports for B200 and only approximate (the model uses SMs
    # and clock for wave quantisation and per-SM bandwidth, L2 for activation reuse).
    "B200": GpuSpec("B200", sms=148, boost_ghz=1.965,
                    tensor={"bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T, "tf32": 1125 * T},
                    fp32=75 * T, mem_bw=8000 * GB, l2_bytes=126 * MiB, mem_bytes=180 * 10**9,
                    nvlink=900 * GB, pcie=64 * GB, price_per_h=5.0),
    # NVIDIA RTX PRO 6000 Blackwell Workstation/Server Edition datasheet (2025): 24,064 CUDA
    # cores = 188 SMs, FP32 125 TF, "4,000 AI TOPS" (FP4, sparse) -> FP4 2,000 dense, FP8
    # 1,000 TF dense, FP16/BF16 500 TF dense, TF32 250 TF dense (each precision step halves,
    # as the Blackwell architecture whitepaper's RTX tables give; sparse/2 throughout),
    # 96 GB GDDR7 (512-bit, 28 Gbps) at 1,792 GB/s, 128 MB L2, PCIe Gen5 x16 128 GB/s
    # bidirectional, no NVLink.  Boost clock 2.6 GHz = 125 TF / (2 x 24,064 cores).
    "RTX-PRO-6000": GpuSpec("RTX-PRO-6000", sms=188, boost_ghz=2.6,
                            tensor={"bf16": 500 * T, "fp16": 500 * T, "fp8": 1000 * T, "tf32": 250 * T},
                            fp32=125 * T, mem_bw=1792 * GB, l2_bytes=128 * MiB, mem_bytes=96 * 10**9,
                            nvlink=0.0, pcie=64 * GB, price_per_h=1.2),
}

# Links between two GPUs of a pair (per direction): NVLink between two GPUs of one type
# that both have it (one HGX board), else GPU-initiated copies over PCIe / an RDMA NIC on
# PCIe, limited by the slower PCIe end.  Latencies: DESIGN.md's measured NVLink copy
# (~24 us on H200) and ~10 us for a PCIe peer copy.
NVLINK_LATENCY_S = 24e-6
PCIE_LATENCY_S = 10e-6


def get_spec(name: str) -> GpuSpec:
    """The spec named exactly as on the command line (``A100``, ``L40S``,
    ``H100``, ``H200``, ``B200``, ``RTX-PRO-6000``); case-insensitive."""
    for k, v in SPECS.items():
        if k.lower() == name.strip().lower():
            return v
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(SPECS)}")


def link_between(a: GpuSpec, b: GpuSpec) -> tuple[float, float]:
    """(latency s, bytes/s per direction) of a simulated link from ``a`` to ``b``."""
    if a.name == b.name and a.nvlink > 0:
        return NVLINK_LATENCY_S, a.nvlink
    return PCIE_LATENCY_S, min(a.pcie, b.pcie)


__all__ = ["GpuSpec", "SPECS", "get_spec", "link_between"]
