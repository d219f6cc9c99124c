"""The examples do what their docstrings promise."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_embed_async_reports_its_start_and_interleaves_two_replies_tagged_by_request_id():
    pytest.importorskip("tokenizers")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "embed_async.py"), "--max-tokens", "16", "Hi!"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[engine] loading the model" in r.stderr and "placing buckets" in r.stderr
    tags = [line.split("]")[0] + "]" for line in r.stdout.splitlines()
            if line.startswith(("[r2] ", "[r3] ")) and " done: " not in line]
    assert {"[r2]", "[r3]"} <= set(tags)
    switches = sum(a != b for a, b in zip(tags, tags[1:]))
    assert switches >= 2, tags          # one reply after the other would switch once
    assert "r2: " in r.stdout and "r3: " in r.stdout
