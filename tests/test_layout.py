"""The shape of the code holds (issue #30): ``scripts/check_layout.py`` finds no
import cycle, no import up a layer, no module over 500 lines or function over
80, no definition referenced nowhere and no result JSON without its
provenance.  CI runs it through this test."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_check_layout_finds_nothing():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_layout.py")], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_check_layout_fails_on_an_import_up_a_layer(tmp_path):
    """The check can fail: a runtime module importing the serving layer is found."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "scripts" / "check_layout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pkg = tmp_path / "tessera_actors"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "serving").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "serving" / "__init__.py").write_text("from tessera_actors.runtime import x\n")
    (pkg / "runtime" / "x.py").write_text("from tessera_actors.serving import engine\n")
    (pkg / "serving" / "engine.py").write_text("from tessera_actors.runtime import x\n")
    found = mod.check_imports(mod.modules(tmp_path, ("tessera_actors",)))
    assert any(f.startswith("import up a layer: tessera_actors.runtime.x") for f in found), found
    assert any(f.startswith("file cycle:") for f in found), found
