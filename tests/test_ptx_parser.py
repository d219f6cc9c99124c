"""Parser: structure of real PTX, and clear errors (with lines) for non-PTX."""
from __future__ import annotations

import os

import pytest

from ptx import PtxParseError, analyze, parse
from ptx.model import Instruction, Label

DATA = os.path.join(os.path.dirname(__file__), "data", "ptx")


def _access(kernel, name: str) -> str:
    """The access the analysis gives parameter ``name`` of ``kernel``."""
    return {p.name: p.access for p in kernel.params}[name]


def _read(*parts: str) -> str:
    with open(os.path.join(DATA, *parts)) as fh:
        return fh.read()


def test_header_entries_and_params_of_nvcc_output():
    m = parse(_read("cuda", "structparam.ptx"))
    assert m.version == "9.0" and m.target == "sm_90" and m.address_size == 64
    fn = m.functions["struct_kernel"]
    assert fn.is_entry
    struct, alpha = fn.params
    assert struct.is_aggregate and struct.array_len == 32 and struct.align == 8 and struct.size == 32
    assert alpha.type == ".f32" and not alpha.is_aggregate


def test_triton_params_debug_sections_and_guards():
    m = parse(_read("handwritten", "triton_style_add.ptx"))
    fn = m.functions["triton_poi_fused_add_mul_0"]
    assert [p.is_ptr for p in fn.params] == [True, True, True, False, True, True]
    assert fn.params[0].ptr_space == "global"
    guarded = [s for s in fn.body if isinstance(s, Instruction) and s.guard]
    assert guarded and guarded[0].guard == "%p1"
    vec = next(s for s in guarded if s.opcode == "ld.global.v4.b32")
    assert vec.operands == ("{ %r2, %r3, %r4, %r5 }", "[ %rd1 + 0 ]")
    assert any(isinstance(s, Label) and s.name == "$L__tmp0" for s in fn.body)
    assert m.symbols["global_smem"].extern


def test_call_with_prototype_and_device_functions():
    m = parse(_read("cuda", "devfunc.ptx"))
    assert not m.functions["_Z12store_scaledPfff"].is_entry
    calls = [s for s in m.functions["call_kernel"].body if isinstance(s, Instruction) and s.base == "call"]
    assert calls[0].operands == ("(retval0)", "_Z7load_atPKfi", "( param0, param1 )")
    assert m.functions["_Z7load_atPKfi"].returns[0].name == "func_retval0"


def test_line_numbers_are_exact():
    text = _read("cuda", "elementwise.ptx")
    fn = parse(text).functions["scale"]
    lines = text.split("\n")
    for ins in fn.instructions:
        assert ins.opcode in lines[ins.line - 1], ins


def test_unknown_instructions_are_carried_along():
    text = _read("cuda", "elementwise.ptx").replace(
        "ret;", "frobnicate.sync.b32 %r1, %r1, 7;\n\tret;", 1)
    m = parse(text)
    ops = [s.opcode for s in m.functions["scale"].instructions]
    assert "frobnicate.sync.b32" in ops
    assert _access(analyze(text)["scale"], "scale_param_1") == "write"


def test_crlf_input():
    text = _read("cuda", "elementwise.ptx").replace("\n", "\r\n")
    assert _access(analyze(text)["scale"], "scale_param_1") == "write"


@pytest.mark.parametrize("text, line, words", [
    ("hello world\n", 1, "not PTX"),
    ("\n\nimport torch\nprint(1)\n", 3, "not PTX"),
    ("{\n  \"json\": 1\n}\n", 1, "not PTX"),
    ("// comment\nint main() { return 0; }\n", 2, "not PTX"),
    (".target sm_90\n.version 8.0\n", 1, "before the '.version'"),
])
def test_non_ptx_is_rejected_with_line(text, line, words):
    with pytest.raises(PtxParseError) as err:
        parse(text)
    assert err.value.line == line
    assert words in str(err.value) and f"line {line}" in str(err.value)


HEAD = ".version 8.0\n.target sm_90\n.address_size 64\n"


@pytest.mark.parametrize("body, line, words", [
    (".visible .entry k()\n{\n\tret;\n}\n}\n", 8, "unbalanced '}'"),
    (".visible .entry k()\n{\n\tret;\n", 7, "missing '}'"),
    ("\tmov.u32 %r1, 0;\n", 4, "outside a function"),
    (".visible .entry k(.param k_param_0)\n{\n\tret;\n}\n", 4, "has no type"),
    (".bogus 1;\n", 4, "unexpected directive"),
    ("{\n\tret;\n}\n", 4, "outside a function definition"),
])
def test_malformed_ptx_errors_carry_lines(body, line, words):
    with pytest.raises(PtxParseError) as err:
        parse(HEAD + body)
    assert words in str(err.value)
    assert err.value.line == line
    assert err.value.line == line


def test_declaration_without_body_and_module_variables():
    text = HEAD + (".extern .func (.param .b32 r) vprintf(.param .b64 a, .param .b64 b);\n"
                   ".global .align 4 .b8 table[16] = {1, 2, 3, 4};\n"
                   ".visible .entry k()\n{\n\tret;\n}\n")
    m = parse(text)
    assert m.functions["vprintf"].body_start is None
    assert m.symbols["table"].space == "global" and m.symbols["table"].size == 16
    assert [f.name for f in m.entries] == ["k"]
