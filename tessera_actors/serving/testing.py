"""Public test helpers for ``tessera serve``: the server as a child process.

``ServerProcess`` runs ``python -m tessera_actors.cli serve --port 0 ...``,
waits for its ``ready`` line (it prints the port it bound), and stops it with
SIGTERM.  Used by the tests and usable by benchmark scripts that want a real
server on this machine.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading

_READY = re.compile(r"tessera serve: ready (http://\S+)")


class ServerProcess:
    """``tessera serve ARGS`` in a child process (``--port 0``: a free port).

    ``start()`` returns once the server accepts requests, or raises
    ``RuntimeError`` with the child's output when it exits first or is not
    ready within ``timeout`` seconds.  ``stop()`` sends SIGTERM and returns the
    exit status (the child is killed after ``timeout`` seconds).  The child's
    output is drained by a thread into ``lines`` so it can never block on a
    full pipe."""

    def __init__(self, *args: str, timeout: float = 300.0, env: dict | None = None) -> None:
        self.args, self.timeout = list(args), timeout
        self.env = {**os.environ, **(env or {})}
        self.lines: list[str] = []
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None
        self._ready: queue.Queue = queue.Queue()

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = _READY.search(line)
            if m:
                self._ready.put(m.group(1))
        self._ready.put(None)                    # the child closed its output: it exited

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "tessera_actors.cli", "serve", "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, stdin=subprocess.DEVNULL)
        threading.Thread(target=self._drain, name="serve-output", daemon=True).start()
        try:
            url = self._ready.get(timeout=self.timeout)
        except queue.Empty:
            url = None
        if url is None:
            self.kill()
            raise RuntimeError(f"tessera serve was not ready within {self.timeout:.0f} s:\n" + self.output())
        self.url = url
        return self

    def output(self) -> str:
        return "\n".join(self.lines[-80:])

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; the exit status (killed after ``timeout``: -9)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
