"""Instrumentation: rewritten PTX assembles, sites are numbered, ranges recover."""
from __future__ import annotations

import glob
import os
import re
import shutil
import struct
import subprocess

import pytest

from ptx import PtxInstrumentError, decode_slots, initial_slots, instrument, param_ranges, parse

DATA = os.path.join(os.path.dirname(__file__), "data", "ptx")
CORPUS = sorted(glob.glob(os.path.join(DATA, "*", "*.ptx")))
PTXAS = shutil.which("ptxas") or ("/usr/local/cuda/bin/ptxas" if os.path.exists("/usr/local/cuda/bin/ptxas") else None)


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


@pytest.mark.skipif(PTXAS is None, reason="ptxas not installed")
@pytest.mark.parametrize("path", CORPUS, ids=lambda p: "/".join(p.split(os.sep)[-2:]))
def test_instrumented_ptx_assembles_with_ptxas(path, tmp_path):
    text = _read(path)
    res = instrument(text)
    src = tmp_path / "k.ptx"
    src.write_text(res.text)
    target = parse(text).target.split(",")[0].strip()
    arch = target if target.endswith("a") else "sm_90"  # Triton emits sm_90a for Hopper
    proc = subprocess.run([PTXAS, f"-arch={arch}", str(src), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_site_table_and_probe_param():
    res = instrument(_read(os.path.join(DATA, "cuda", "elementwise.ptx")))
    sites = [res.sites[i] for i in res.kernels["scale"]]
    assert [(s.kind, s.width, s.params) for s in sites] == [
        ("read", 4, ("scale_param_0",)), ("write", 4, ("scale_param_1",))]
    kernel = parse(res.text).functions["scale"]
    assert kernel.params[-1].name == "scale_tessera_probe" and kernel.params[-1].type == ".u64"
    assert len(kernel.params) == 5
    # probes precede their site: min then max into the site's own 16-byte slot
    lines = res.text.split("\n")
    first = next(i for i, line in enumerate(lines) if "atom.global.min.u64" in line)
    assert "[%tsa0+0]" in lines[first] and "[%tsa0+8]" in lines[first + 1]
    assert "ld.global" in lines[first + 2]


def test_probes_keep_the_sites_predicate_guard():
    res = instrument(_read(os.path.join(DATA, "handwritten", "triton_style_add.ptx")))
    probes = [line.strip() for line in res.text.split("\n") if "atom.global.m" in line]
    assert len(probes) == 6 and all(p.startswith("@%p1 ") for p in probes)
    assert [s.width for s in res.sites] == [16, 4, 16]


def test_device_function_sites_use_module_variable():
    res = instrument(_read(os.path.join(DATA, "cuda", "devfunc.ptx")))
    assert ".global .align 8 .u64 __tessera_probe;" in res.text
    assert len(res.kernels["call_kernel"]) == 2
    assert {s.function for s in res.sites} == {"_Z12store_scaledPfff", "_Z7load_atPKfi"}


def test_tma_sites_are_listed_but_not_instrumented():
    res = instrument(_read(os.path.join(DATA, "cuda", "tma_global.ptx")))
    tma = [s for s in res.sites if "tensor" in s.opcode]
    assert tma and not tma[0].instrumented


def test_no_entry_is_an_error():
    with pytest.raises(PtxInstrumentError):
        instrument(".version 8.0\n.target sm_90\n.address_size 64\n")


def test_param_ranges_from_slots():
    res = instrument(_read(os.path.join(DATA, "cuda", "elementwise.ptx")))
    idx = res.kernels["scale"]
    raw = bytearray(initial_slots(len(res.sites)))
    x, y = 0x7F0000000000, 0x7F0000100000
    struct.pack_into("<QQ", raw, 16 * idx[0], x, x + 3996)        # read x[0..999]
    struct.pack_into("<QQ", raw, 16 * idx[1], y + 400, y + 796)   # wrote y[100..199]
    slots = decode_slots(bytes(raw), len(res.sites))
    assert slots[idx[0]] == (x, x + 3996) and slots[2] is None
    ranges, stray = param_ranges([res.sites[i] for i in idx], [slots[i] for i in idx],
                                 {"x": (x, 4096), "y": (y, 4096), "a": (0x10, 4)})
    assert ranges["x"].read == (0, 4000) and ranges["x"].write is None and ranges["x"].exact
    assert ranges["y"].write == (400, 800) and ranges["y"].access == "write"
    assert "a" not in ranges and stray == []


def test_decode_slots_rejects_short_buffer():
    with pytest.raises(ValueError):
        decode_slots(b"\0" * 8, 1)


def test_instrumented_text_still_analyzes_the_same():
    text = _read(os.path.join(DATA, "cuda", "select.ptx"))
    from ptx import analyze
    before = analyze(text)["select_store"]
    after = analyze(instrument(text).text)["select_store"]
    assert [p.access for p in after.params[:-1]] == [p.access for p in before.params]
    assert not re.search(r"tessera", text)


ONE_LINE_ASM = """.version 8.0
.target sm_90
.address_size 64
.visible .entry k(.param .u64 k_p0, .param .u32 k_p1)
{
.reg .b64 %rd<3>;
.reg .b32 %r<2>;
.reg .pred %p<2>;
ld.param.u64 %rd1, [k_p0];
ld.param.u32 %r1, [k_p1];
setp.ne.s32 %p1, %r1, 0;
cvta.to.global.u64 %rd2, %rd1;
{ .reg .b64 t; add.s64 t, %rd2, 8; st.global.u32 [t], 1; @%p1 st.global.u32 [t+4], 3; }
$L1: st.global.u32 [%rd2], 2;
ret;
}
"""


def test_sites_packed_on_one_line_get_probes_in_place(tmp_path):
    res = instrument(ONE_LINE_ASM)
    assert [s.params for s in res.sites] == [("k_p0",)] * 3
    text = res.text
    # the probe for [t] comes after t is computed, and the guarded one keeps its guard
    assert text.index("add.s64 %tsa1, t, 0;") > text.index("add.s64 t, %rd2, 8;")
    assert "@%p1 add.s64 %tsa1, t, 4;" in text
    assert text.index("$L1:") < text.index("add.s64 %tsa1, %rd2, 0;")
    if PTXAS:
        src = tmp_path / "k.ptx"
        src.write_text(text)
        proc = subprocess.run([PTXAS, "-arch=sm_90", str(src), "-o", str(tmp_path / "k.cubin")],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
