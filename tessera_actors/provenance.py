"""Where a result came from: the one reader of the git commit, and the stamp
every benchmark result carries (``git_commit``, ``command``, machine, date).

``TESSERA_GIT_COMMIT`` names the commit when the tree was copied to a machine
whose ``.git`` is stale or absent (the GPU machines get a copy of the work
tree).  Imports nothing of the project; no torch import (the GPU name is read
only when the caller already imported torch).
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(root: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit(checkout: str | Path | None = None) -> str | None:
    """The commit of ``checkout`` (default: this package's tree), None when git
    cannot say.  For this package's own tree ``TESSERA_GIT_COMMIT`` comes first."""
    if checkout is None and os.environ.get("TESSERA_GIT_COMMIT"):
        return os.environ["TESSERA_GIT_COMMIT"]
    return _git(Path(checkout) if checkout is not None else ROOT, "rev-parse", "HEAD") or None


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user types it (``tessera ...`` for the CLI)."""
    argv = list(sys.argv if argv is None else argv)
    head = "tessera" if argv and argv[0].endswith("cli.py") else (argv[0] if argv else "")
    return " ".join([head] + argv[1:])


def provenance(argv: list[str] | None = None) -> dict:
    """The stamp of a result: git commit (+ dirty flag), command line, machine, date."""
    gpu = ""
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        gpu = sys.modules["torch"].cuda.get_device_name(0)
    return {"git_commit": git_commit(), "git_dirty": bool(_git(ROOT, "status", "--porcelain")),
            "command": command_line(argv),
            "machine": {"node": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "gpu": gpu,
                        "load_avg_1m": os.getloadavg()[0]},      # a busy shared box skews every number
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


__all__ = ["command_line", "git_commit", "provenance"]
