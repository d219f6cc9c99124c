"""The analyzer agrees 100% with ground truth on the whole PTX corpus.

CUDA C kernels are compiled with nvcc during the run when nvcc is present
(and the checked-in PTX is checked as well, so both stay honest); Triton
fixtures come from torch inductor via scripts/gen_triton_fixtures.py.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from ptx import analyze

DATA = os.path.join(os.path.dirname(__file__), "data", "ptx")
CUDA = os.path.join(DATA, "cuda")
TRITON = os.path.join(DATA, "triton")
HAND = os.path.join(DATA, "handwritten")


def _nvcc() -> str | None:
    return shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc") or None


def _load_truth(path: str) -> dict:
    with open(path) as fh:
        return {k: v for k, v in json.load(fh).items() if not k.startswith("_")}


def _analyze_dir(paths: list[str]) -> dict:
    out = {}
    for path in paths:
        with open(path) as fh:
            out.update(analyze(fh.read()))
    return out


@pytest.fixture(scope="module")
def checked_in() -> dict:
    return _analyze_dir(sorted(glob.glob(os.path.join(CUDA, "*.ptx"))))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not installed: only the checked-in PTX is checked")
    out = tmp_path_factory.mktemp("nvcc")
    sources = sorted(glob.glob(os.path.join(CUDA, "*.cu")))

    def build(src: str) -> str:
        dst = os.path.join(out, os.path.basename(src)[:-3] + ".ptx")
        subprocess.run([nvcc, "-ptx", "-arch=sm_90", "-o", dst, src], check=True, capture_output=True, timeout=300)
        return dst

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return _analyze_dir(list(pool.map(build, sources)))


def _check(result, truth: dict) -> None:
    got = [p.access for p in result.params]
    assert got[: len(truth["access"])] == truth["access"], result.reasons
    assert result.indirect == truth["indirect"], result.reasons
    for index, fields in truth.get("fields", {}).items():
        assert {str(k): v for k, v in result.params[int(index)].fields.items()} == fields


CUDA_TRUTH = _load_truth(os.path.join(CUDA, "truth.json"))


@pytest.mark.parametrize("kernel", sorted(CUDA_TRUTH))
def test_checked_in_cuda_ptx_matches_truth(checked_in, kernel):
    _check(checked_in[kernel], CUDA_TRUTH[kernel])


@pytest.mark.parametrize("kernel", sorted(CUDA_TRUTH))
def test_freshly_compiled_cuda_ptx_matches_truth(compiled, kernel):
    _check(compiled[kernel], CUDA_TRUTH[kernel])


def test_every_corpus_kernel_has_truth(checked_in):
    assert sorted(checked_in) == sorted(CUDA_TRUTH)


def test_handwritten_triton_style_fixture():
    truth = _load_truth(os.path.join(HAND, "truth.json"))
    results = _analyze_dir(sorted(glob.glob(os.path.join(HAND, "*.ptx"))))
    for kernel, t in truth.items():
        _check(results[kernel], t)


def _triton_truth() -> dict:
    path = os.path.join(TRITON, "truth.json")
    return _load_truth(path) if os.path.exists(path) else {}


TRITON_TRUTH = _triton_truth()


@pytest.mark.skipif(not TRITON_TRUTH, reason="no Triton fixtures yet (run scripts/gen_triton_fixtures.py on a GPU)")
@pytest.mark.parametrize("fixture", sorted(TRITON_TRUTH) or ["none"])
def test_triton_fixture_matches_inductor_truth(fixture):
    t = TRITON_TRUTH[fixture]
    with open(os.path.join(TRITON, fixture)) as fh:
        result = analyze(fh.read())[t["kernel"]]
    got = [p.access for p in result.params]
    assert got[: len(t["access"])] == t["access"], (t["names"], result.reasons)
    assert not result.indirect, result.reasons
    # parameters Triton appends (global/profile scratch) are not touched
    assert all(a == "none" for a in got[len(t["access"]):])


def test_no_write_is_ever_missed_across_corpus(checked_in):
    """The cardinal rule, stated separately: truth write => static write."""
    for kernel, t in CUDA_TRUTH.items():
        for p, want in zip(checked_in[kernel].params, t["access"]):
            if want in ("write", "readwrite"):
                assert p.access in ("write", "readwrite"), (kernel, p.name)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["-G", "-arch=sm_90"], ["-lineinfo", "-arch=sm_100"], ["-O3", "-arch=sm_80"]],
                         ids=["debug-sm90", "lineinfo-sm100", "O3-sm80"])
def test_other_compile_modes_match_truth(flags, tmp_path):
    """Debug builds (everything spilled to the local stack), other ISAs."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not installed")

    def build(src: str) -> str:
        dst = os.path.join(tmp_path, os.path.basename(src)[:-3] + ".ptx")
        subprocess.run([nvcc, "-ptx", *flags, "-o", dst, src], check=True, capture_output=True, timeout=300)
        return dst

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = _analyze_dir(list(pool.map(build, sorted(glob.glob(os.path.join(CUDA, "*.cu"))))))
    for kernel, truth in CUDA_TRUTH.items():
        _check(results[kernel], truth)
