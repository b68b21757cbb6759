"""`dg serve` as a child process, for tests and benchmarks: started on a free port of 127.0.0.1
(or what the arguments say), its /v1 URL read from the line it prints, stopped with Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30


class ServeProcess:
    """`python -m dgcli.cli serve --port 0 ARGS...`; `.url` is the /v1 base URL it printed, `.root`
    the server root (/health). Every wait is bounded."""

    def __init__(self, *args: str, env: dict | None = None, start_timeout: float = START_TIMEOUT_S,
                 preexec_fn: Any = None):
        self.start_timeout = start_timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dgcli.cli", "serve", "--port", "0", *map(str, args)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                     **(env or {})), preexec_fn=preexec_fn)
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.url = self._read_url()
        self.root = self.url.rsplit("/v1", 1)[0]

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line.rstrip("\n"))

    def _read_url(self) -> str:
        found: list[str] = []

        def read() -> None:
            line = self.proc.stdout.readline()
            found.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(self.start_timeout)
        line = found[0] if found else ""
        if not line.startswith("dg serve: http://"):
            self.stop()
            raise AssertionError(f"dg serve did not start: {line!r}\n" + "\n".join(self.stderr_lines))
        self.banner = line.rstrip("\n")
        return line.split()[2]

    def stop(self, sig: int = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        return self.proc.returncode

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
