"""``python -m ptx``: table, JSON contract, errors with line numbers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

DATA = os.path.join(os.path.dirname(__file__), "data", "ptx")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ptx", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_json_output_contract():
    proc = run("analyze", os.path.join(DATA, "cuda", "structparam.ptx"), "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    k = rep["struct_kernel"]
    assert set(k) >= {"params", "indirect", "features"}
    assert k["indirect"] is False
    p0, p1 = k["params"]
    assert {key: p0[key] for key in ("index", "name", "pointer", "access")} == {
        "index": 0, "name": "struct_kernel_param_0", "pointer": True, "access": "readwrite"}
    assert p0["fields"] == {"0": "read", "8": "write"}
    assert p1["access"] == "none" and p1["pointer"] is False
    assert k["features"]["global_store_total"] == 4


def test_table_output_lists_every_kernel():
    proc = run("analyze", os.path.join(DATA, "cuda", "indirect.ptx"))
    assert proc.returncode == 0
    assert "scatter_ptrs  [INDIRECT]" in proc.stdout and "gather_rows" in proc.stdout
    assert "why indirect: line" in proc.stdout


def test_not_ptx_exits_2_with_line(tmp_path):
    bad = tmp_path / "bad.ptx"
    bad.write_text("\n# just a comment\n")
    proc = run("analyze", str(bad))
    assert proc.returncode == 2 and "line 2" in proc.stderr and "not PTX" in proc.stderr


def test_missing_file_exits_1(tmp_path):
    assert run("analyze", str(tmp_path / "nope.ptx")).returncode == 1


def test_instrument_command_writes_ptx_and_sites(tmp_path):
    out, sites = tmp_path / "i.ptx", tmp_path / "sites.json"
    proc = run("instrument", os.path.join(DATA, "cuda", "vector.ptx"), "-o", str(out), "--sites", str(sites))
    assert proc.returncode == 0, proc.stderr
    table = json.loads(sites.read_text())
    assert "atom.global.max.u64" in out.read_text()
    assert table["kernels"]["copy_float4"] and table["sites"][0]["width"] == 16


def test_ptx_package_imports_neither_torch_nor_cupy():
    code = "import sys, ptx, ptx.cli, ptx.batch; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'cupy')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_report_many_keeps_order_and_reports_bad_module_index():
    import pytest

    from ptx import PtxParseError
    from ptx.batch import report_many

    texts = [open(os.path.join(DATA, "cuda", f)).read() for f in ("vector.ptx", "select.ptx")]
    reps = report_many(texts, workers=2, features=False)
    assert list(reps[0]) == ["copy_float4", "pack_int2"] and "select_store" in reps[1]
    assert "features" not in reps[0]["copy_float4"]
    with pytest.raises(PtxParseError) as err:
        report_many(texts + ["not ptx"], workers=1)
    assert "module #2" in str(err.value)
