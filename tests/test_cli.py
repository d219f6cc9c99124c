"""The ``tessera`` command line: every --help answers without importing torch
or an optional extra (so it is fast and works on the base install), and
shows each flag's default."""
import subprocess
import sys

from tessera_actors.cli import BENCH, COMMANDS

PROBE = """
import contextlib, io, sys
from tessera_actors.cli import main
out = io.StringIO()
for argv in {argvs!r}:
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
heavy = sorted(m for m in ("torch", "aiohttp", "prometheus_client", "matplotlib", "gguf", "tokenizers", "jinja2")
               if m in sys.modules)
print(repr((heavy, out.getvalue())))
"""


def _help_of(argvs: list[list[str]]) -> tuple[list[str], str]:
    r = subprocess.run([sys.executable, "-c", PROBE.format(argvs=argvs)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return eval(r.stdout.strip().splitlines()[-1])


def test_every_help_answers_without_torch_or_an_extra():
    argvs = [["--help"], ["bench", "--help"], ["node", "--help"]]
    argvs += [[name, "--help"] for name in COMMANDS] + [["bench", name, "--help"] for name in BENCH]
    heavy, text = _help_of(argvs)
    assert heavy == []
    assert "DESIGN.md" not in text          # users of the package do not have it
    for name in list(COMMANDS) + list(BENCH) + ["bench", "node"]:
        assert name in text
    assert "usage: python -m tessera_actors.node" in text   # the node daemon's own flags


def test_help_shows_defaults_and_plain_metavars():
    _, text = _help_of([["serve", "--help"]])
    assert "default 8000" in text
    assert "ENGINE_SEED" not in text and "--seed N" in text
    assert "(default: 16)" in text          # --max-seqs: EngineConfig's default, not "engine default"
    _, text = _help_of([["demo", "--help"]])
    assert "--size SIZE" in text and "(default: tiny)" in text
