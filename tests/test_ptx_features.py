"""Cost features: tensor-core ops, instruction mix, bytes by width, smem, barriers."""
from __future__ import annotations

import os

from ptx import parse
from ptx.features import kernel_features

DATA = os.path.join(os.path.dirname(__file__), "data", "ptx")


def feats(*parts: str) -> dict:
    with open(os.path.join(DATA, *parts)) as fh:
        module = parse(fh.read())
    return {fn.name: kernel_features(fn, module) for fn in module.entries}


def test_reduction_with_shared_memory_and_barriers():
    f = feats("cuda", "atomics.ptx")["sum_atomic"]
    assert f["shared_static_bytes"] == 1024 and f["barriers"] >= 2 and f["atomics"] == 1
    assert f["arith"]["fp32"] >= 1 and f["arith"]["int"] > 0


def test_vector_widths_are_counted():
    f = feats("cuda", "vector.ptx")["copy_float4"]
    assert f["global_load_bytes"] == {"16": 1} and f["global_store_bytes"] == {"16": 1}
    assert f["global_load_total"] == 16


def test_wmma_counts_as_mma():
    f = feats("cuda", "mma.ptx")["wmma_tile"]
    assert f["mma"] == 1 and f["wgmma"] == 0


def test_wgmma_and_mma_sync_counted():
    text = (".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k()\n{\n"
            ".reg .f32 %f<8>;\n.reg .b64 %rd<4>;\n.reg .b32 %r<8>;\n"
            "wgmma.fence.sync.aligned;\n"
            "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%f1,%f2,%f3,%f4}, %rd1, %rd2, 1, 1, 1, 0, 0;\n"
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1,%f2,%f3,%f4}, {%r1,%r2,%r3,%r4}, {%r5,%r6}, {%f1,%f2,%f3,%f4};\n"
            "add.rn.bf16x2 %r1, %r2, %r3;\nadd.f16 %r1, %r2, %r3;\nbar.sync 0;\nret;\n}\n")
    f = kernel_features(parse(text).functions["k"], parse(text))
    assert f["mma"] == 2 and f["wgmma"] == 1
    assert f["arith"]["bf16"] == 1 and f["arith"]["fp16"] == 1 and f["barriers"] == 1


def test_triton_dynamic_shared_and_launch_bounds():
    f = feats("handwritten", "triton_style_add.ptx")["triton_poi_fused_add_mul_0"]
    assert f["shared_dynamic"] is True
    assert f["launch_bounds"] == {"reqntid": [128, 1, 1]}
    assert f["global_load_total"] == 20 and f["global_store_total"] == 16
