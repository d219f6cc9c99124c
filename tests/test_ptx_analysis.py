"""Static analysis rules on small PTX programs written for each rule."""
from __future__ import annotations

import pytest

from ptx import analyze

HEAD = ".version 8.0\n.target sm_90\n.address_size 64\n"


def kernel(body: str, params: str = ".param .u64 k_p0, .param .u64 k_p1") -> str:
    return HEAD + f".visible .entry k({params})\n{{\n.reg .b64 %rd<20>;\n.reg .b32 %r<20>;\n.reg .pred %p<4>;\n{body}\nret;\n}}\n"


def access(text: str) -> list[str]:
    return [p.access for p in analyze(text)["k"].params]


def test_pointer_loaded_from_memory_is_indirect():
    text = kernel("ld.param.u64 %rd1, [k_p0];\nld.global.u64 %rd2, [%rd1];\nst.global.u32 [%rd2], 1;")
    res = analyze(text)["k"]
    assert res.indirect and "loaded from memory" in res.reasons[0] and "line 11" in res.reasons[0]
    assert access(text) == ["readwrite", "readwrite"]


def test_loop_carried_pointer_reaches_store():
    body = ("ld.param.u64 %rd1, [k_p1];\nmov.u64 %rd2, 0;\n$L1:\nadd.s64 %rd3, %rd2, 4;\n"
            "mov.u64 %rd2, %rd1;\nst.global.f32 [%rd3], 0f00000000;\nsetp.lt.u32 %p1, %r1, 4;\n@%p1 bra $L1;")
    assert access(kernel(body)) == ["none", "write"]


def test_index_scaled_from_a_64_bit_param_is_not_a_base():
    body = ("ld.param.u64 %rd1, [k_p0];\nld.param.u64 %rd2, [k_p1];\nshl.b64 %rd3, %rd2, 2;\n"
            "add.s64 %rd4, %rd1, %rd3;\nst.global.f32 [%rd4], 0f00000000;")
    assert access(kernel(body)) == ["write", "none"]


def test_pointer_spilled_to_local_memory_keeps_provenance():
    body = (".local .align 8 .b8 depot[16];\nld.param.u64 %rd1, [k_p1];\nmov.u64 %rd5, depot;\n"
            "st.local.u64 [%rd5], %rd1;\nld.local.u64 %rd6, [%rd5];\nst.global.u32 [%rd6+8], 1;")
    res = analyze(kernel(body))["k"]
    assert not res.indirect and [p.access for p in res.params] == ["none", "write"]


def test_red_and_atom_are_read_write():
    body = "ld.param.u64 %rd1, [k_p0];\nred.global.add.u32 [%rd1], 1;\nld.param.u64 %rd2, [k_p1];\natom.global.cas.b32 %r1, [%rd2], 0, 1;"
    assert access(kernel(body)) == ["readwrite", "readwrite"]


def test_prefetch_is_no_access_and_cp_async_reads():
    body = ("ld.param.u64 %rd1, [k_p0];\nprefetch.global.L2 [%rd1];\nld.param.u64 %rd2, [k_p1];\n"
            ".shared .align 16 .b8 s[64];\nmov.u32 %r1, s;\ncp.async.ca.shared.global [%r1], [%rd2], 16;")
    assert access(kernel(body)) == ["none", "read"]


def test_opaque_call_is_indirect():
    text = HEAD + ".extern .func ext(.param .b64 a);\n" + kernel(
        "ld.param.u64 %rd1, [k_p0];\n{\n.param .b64 param0;\nst.param.b64 [param0+0], %rd1;\ncall.uni ext, (param0);\n}").split(HEAD)[1]
    res = analyze(text)["k"]
    assert res.indirect and res.params[0].access == "readwrite"


def test_indirect_call_through_register_is_indirect():
    body = "ld.param.u64 %rd1, [k_p0];\nproto : .callprototype ()_ (.param .b64 _);\ncall %rd1, (), proto;"
    assert analyze(kernel(body))["k"].indirect


def test_read_only_module_table_is_harmless_but_written_variable_is_not():
    table = ".global .align 4 .b8 tab[16] = {1, 2, 3, 4};\n"
    read = kernel("mov.u64 %rd1, tab;\nld.global.u32 %r1, [%rd1];\nld.param.u64 %rd2, [k_p0];\nst.global.u32 [%rd2], %r1;")
    res = analyze(read.replace(HEAD, HEAD + table))["k"]
    assert not res.indirect and res.params[0].access == "write"
    written = kernel("mov.u64 %rd1, tab;\nst.global.u32 [%rd1], 7;")
    assert analyze(written.replace(HEAD, HEAD + table))["k"].indirect


def test_unknown_address_is_indirect():
    body = "mov.u32 %r1, %tid.x;\ncvt.u64.u32 %rd1, %r1;\nst.global.u32 [%rd1], 1;"
    res = analyze(kernel(body))["k"]
    assert res.indirect and "not derived" in res.reasons[0]


def test_recursive_device_function_is_conservative():
    text = HEAD + (".func f(.param .b64 f_a)\n{\n.reg .b64 %rd<4>;\nld.param.u64 %rd1, [f_a];\n"
                   "st.global.u32 [%rd1], 1;\n{\n.param .b64 param0;\nst.param.b64 [param0+0], %rd1;\n"
                   "call.uni f, (param0);\n}\nret;\n}\n") + kernel(
        "ld.param.u64 %rd1, [k_p0];\n{\n.param .b64 param0;\nst.param.b64 [param0+0], %rd1;\ncall.uni f, (param0);\n}").split(HEAD)[1]
    res = analyze(text)["k"]
    assert res.params[0].access in ("write", "readwrite")


@pytest.mark.parametrize("space", ["shared", "local", "const"])
def test_non_global_spaces_are_not_parameter_accesses(space):
    body = f"ld.param.u64 %rd1, [k_p0];\nst.{space}.u32 [%rd1], 1;" if space != "const" else \
        "ld.param.u64 %rd1, [k_p0];\nld.const.u32 %r1, [%rd1];"
    assert access(kernel(body)) == ["none", "none"]


def test_stack_spill_slots_stay_distinct_but_overlaps_merge():
    body = (".local .align 8 .b8 __local_depot0[16];\n.reg .b64 %SP;\n.reg .b64 %SPL;\n"
            "mov.u64 %SPL, __local_depot0;\ncvta.local.u64 %SP, %SPL;\n"
            "ld.param.u64 %rd1, [k_p0];\nld.param.u64 %rd2, [k_p1];\n"
            "st.u64 [%SP+0], %rd1;\nst.u64 [%SP+8], %rd2;\n"
            "ld.u64 %rd3, [%SP+8];\nst.global.u32 [%rd3], 1;")
    assert access(kernel(body)) == ["none", "write"]
    # a 64-bit reload that overlaps a 32-bit spill of p0's low half sees p0 too
    body2 = body.replace("ld.u64 %rd3, [%SP+8];", "cvt.u32.u64 %r5, %rd1;\nst.u32 [%SP+12], %r5;\nld.u64 %rd3, [%SP+8];")
    assert access(kernel(body2)) == ["write", "write"]
