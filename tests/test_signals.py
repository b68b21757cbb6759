"""Signals sent to a real `dg` process mid-run: Ctrl-C stops generate, compare and bench with what
they produced and exit 130 (on a terminal, piped, and with --json); a second Ctrl-C, SIGTERM and
SIGHUP exit at once, removing unfinished outputs and giving the terminal its cursor back.

Runs use the tiny random GGUFs (an untrained model never stops early, so a run lasts long enough
to be interrupted). The signal is sent once llama.cpp has logged a few decoder forwards (DG_VERBOSE=1
echoes its log to stderr), so it lands mid-generation whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pty_screen
from native_helpers import requires_native

pytestmark = pytest.mark.subprocess  # each test signals a dg process of its own

FORWARD_MARK = b"set_causal_attn"  # llama.cpp logs it around every decoder forward
HIDE_CURSOR, SHOW_CURSOR = b"\x1b[?25l", b"\x1b[?25h"
TIMEOUT_S = 120


class Run:
    """A dg process whose output (stdout and stderr, or the terminal) is read as it comes. On a
    terminal (tests/pty_screen.py) Ctrl-C is typed, as a person does; piped, SIGINT is sent."""

    def __init__(self, args, *, terminal: bool):
        self.output = bytearray()
        self.stdout = bytearray()
        self.term = None
        if terminal:
            self.term = pty_screen.Terminal(80, 24).spawn(*map(str, args), env={"DG_VERBOSE": "1"}, timeout=TIMEOUT_S)
            return
        env = dict(os.environ, DG_VERBOSE="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "dgcli.cli", *map(str, args)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.fds = {self.proc.stdout.fileno(): self.stdout, self.proc.stderr.fileno(): self.output}

    def _pump(self, timeout: float) -> bool:
        """Read what is there; False once every stream has ended."""
        if not self.fds:
            return False
        ready, _, _ = select.select(list(self.fds), [], [], timeout)
        for fd in ready:
            data = os.read(fd, 65536)
            if data:
                self.fds[fd].extend(data)
            else:
                del self.fds[fd]
        return bool(self.fds)

    def wait_for_forwards(self, count: int) -> None:
        if self.term is not None:
            for _ in range(count):
                self.term.read_until(FORWARD_MARK.decode())
            return
        deadline = time.monotonic() + TIMEOUT_S
        while self.output.count(FORWARD_MARK) < count:
            assert self.proc.poll() is None, f"dg ended before {count} forwards: {bytes(self.output)[-2000:]!r}"
            assert time.monotonic() < deadline, f"not {count} forwards after {TIMEOUT_S}s"
            self._pump(0.05)

    def signal(self, sig: int) -> None:
        if self.term is None:
            self.proc.send_signal(sig)
        elif sig == signal.SIGINT:
            self.term.sendintr()  # Ctrl-C typed on the terminal
        else:
            self.term.child.kill(sig)

    def finish(self) -> int:
        if self.term is not None:
            code = self.term.wait(TIMEOUT_S)
            self.output = bytearray(self.term.raw)
            return code
        deadline = time.monotonic() + TIMEOUT_S
        while self._pump(0.05):
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail("dg did not end after the signal")
        return self.proc.wait(TIMEOUT_S)

    def text(self) -> str:
        return self.output.decode("utf-8", "replace")


def assert_clean(run: Run) -> None:
    text = run.text() + run.stdout.decode("utf-8", "replace")
    assert "Traceback" not in text and "Exception ignored" not in text, text[-3000:]


def interrupted_exit(code: int) -> bool:
    # 130, or killed by SIGINT (what a shell also shows as 130) when Python was already exiting
    return code in (130, -signal.SIGINT, 128 + signal.SIGINT)


SAMPLER = ["--steps", "48", "--seed", "0", "--threads", "1"]


def command(kind: str, tiny_gguf: Path, tiny_ar_gguf: Path, mode: str) -> list:
    json_flag = ["--json"] if mode == "json" else []
    if kind == "generate":
        return ["generate", "tell me a story", "-m", tiny_gguf, "-n", "4000", *SAMPLER, *json_flag]
    if kind == "compare":
        return ["compare", "tell me a story", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "-n", "4000", *SAMPLER,
                *json_flag]
    return ["bench", "-m", tiny_gguf, "--ar-model", tiny_ar_gguf, "-n", "16", "--steps", "4", "--repeat", "50",
            "--threads", "1", "--no-speed-model", *json_flag]


@requires_native
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["terminal", "piped", "json"])
@pytest.mark.parametrize("kind", ["generate", "compare", "bench"])
@pytest.mark.pty
def test_ctrl_c_mid_run_exits_130_with_what_was_produced(kind, mode, tiny_gguf, tiny_ar_gguf):
    run = Run(command(kind, tiny_gguf, tiny_ar_gguf, mode), terminal=mode == "terminal")
    # bench: enough forwards for a few finished runs
    run.wait_for_forwards(60 if kind == "bench" else 12)
    run.signal(signal.SIGINT)
    code = run.finish()
    assert interrupted_exit(code), (code, run.text()[-2000:])
    assert_clean(run)
    text = run.text()
    if mode == "json":
        doc = json.loads(run.stdout)
        if kind == "generate":
            assert doc["result"]["stop_reason"] == "interrupted" and doc["result"]["decoder_forwards"] > 0
        elif kind == "compare":
            assert doc["diffusion"]["result"]["interrupted"] and doc["autoregressive"] is None
        else:
            assert doc["interrupted"] and doc["runs"]  # the finished runs are in the report
        return
    words = " ".join(text.split())  # on a terminal dg's notices wrap at word boundaries
    if kind == "generate":
        assert "stop=interrupted" in text and "interrupted: the output above is what was produced" in words
    elif kind == "compare":
        assert "the AR side did not run" in words
        assert ("(interrupted)" if mode == "terminal" else "stop=interrupted") in text  # the panel's note, the summary
    else:
        shown = text + run.stdout.decode()
        assert "tok/s" in shown and "interrupted (Ctrl-C)" in shown  # the tables of the finished runs
    if mode == "terminal":
        assert run.output.rfind(SHOW_CURSOR) >= run.output.rfind(HIDE_CURSOR)


@requires_native
@pytest.mark.slow
@pytest.mark.pty
def test_sigterm_on_a_terminal_restores_the_cursor_and_removes_the_unfinished_trace(tiny_gguf, tmp_path):
    trace = tmp_path / "t.jsonl"
    run = Run(["generate", "tell me a story", "-m", tiny_gguf, "-n", "4000", *SAMPLER, "--trace", trace],
              terminal=True)
    run.wait_for_forwards(12)
    assert HIDE_CURSOR in run.term.raw  # the live view is up
    run.signal(signal.SIGTERM)
    assert run.finish() == 143
    assert run.output.rfind(SHOW_CURSOR) > run.output.rfind(HIDE_CURSOR)
    assert list(tmp_path.iterdir()) == []  # neither the trace nor its temporary
    assert_clean(run)


# A main thread that does not react to the first Ctrl-C, as one inside a long forward of a big model.
STUCK = """
import signal, sys, tempfile, time
from pathlib import Path
from dgcli import outputs
from dgcli.cli import _signals
_signals.install()
signal.signal(signal.SIGINT, lambda *a: None)
out = outputs.OutputFile(Path(sys.argv[1]) / "report.json").open()
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("signals,code", [([signal.SIGINT, signal.SIGINT], 130), ([signal.SIGTERM], 143),
                                          ([signal.SIGHUP], 129)])
def test_second_ctrl_c_and_sigterm_exit_at_once_and_remove_temporaries(signals, code, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", STUCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    for i, s in enumerate(signals):
        if i:
            time.sleep(0.3)
            assert proc.poll() is None  # the first Ctrl-C alone does not end it
        proc.send_signal(s)
    assert proc.wait(10) == code
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_the_cli_is_still_importing_exits_130_without_a_traceback(tmp_path):
    """The CLI's imports take a few tenths of a second; a Ctrl-C then is not a Python traceback."""
    # A stand-in for a slow import (typer is among the first modules the CLI imports): it says when it
    # has started, then waits for the Ctrl-C.
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "typer.py").write_text("import sys, time\nsys.stderr.write('importing\\n'); sys.stderr.flush()\n"
                                   "time.sleep(30)\n")
    script = Path(sys.executable).with_name("dg")  # the installed console script, as a user runs it
    cmd = [str(script)] if script.exists() else [sys.executable, "-c", "from dgcli.cli import main; main()"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(slow), str(Path(__file__).resolve().parents[1])]))
    proc = subprocess.Popen([*cmd, "--version"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stderr.readline() == "importing\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (130, ""), err  # _signals.quiet_startup: the exit status says it all


@requires_native
@pytest.mark.slow
@pytest.mark.pty
def test_a_terminal_that_hangs_up_ends_the_live_run_at_once(tiny_gguf, tmp_path):
    """Closing the terminal window under a live view: SIGHUP on a terminal that has gone, where giving
    it its settings back fails (termios.error, not an OSError). dg still exits at once (129) and
    removes the unfinished trace, instead of computing on to the end for nobody."""
    import pty

    out = tmp_path / "out"
    out.mkdir()
    args = ["generate", "tell me a story", "-m", tiny_gguf, "-n", "4000", *SAMPLER, "--trace", out / "t.jsonl"]
    env = dict(os.environ, DG_VERBOSE="1", TERM="xterm-256color", COLUMNS="80", LINES="24",
               PYTHONPATH=pty_screen.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pid, fd = pty.fork()
    if pid == 0:  # the child: dg on the terminal, as a person runs it
        try:
            pty_screen._default_signals()
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            os.chdir(pty_screen.REPO)
            os.execve(sys.executable, [sys.executable, "-m", "dgcli.cli", *map(str, args)], env)
        finally:
            os._exit(99)
    seen, deadline = bytearray(), time.monotonic() + TIMEOUT_S
    while seen.count(FORWARD_MARK) < 12:
        assert time.monotonic() < deadline, bytes(seen[-2000:])
        if select.select([fd], [], [], 0.1)[0]:
            seen += os.read(fd, 65536)
    assert HIDE_CURSOR in seen  # the live view is up
    os.close(fd)  # the terminal goes away: the kernel hangs it up and sends SIGHUP
    deadline = time.monotonic() + 30
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("dg went on running after its terminal hung up")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status[1]) == 129
    assert list(out.iterdir()) == []  # neither the trace nor its temporary


# Enters and leaves `deferred_interrupts` as fast as it can for a while, counting the Ctrl-Cs it caught
# as KeyboardInterrupt (a Ctrl-C outside a block may land anywhere, so the loop itself is retried).
DEFERRED_LOOP = """
import sys, time
from dgcli.runtime import native
counts = {"blocks": 0, "interrupts": 0}
end = time.monotonic() + float(sys.argv[1])
def loop():
    while time.monotonic() < end:
        try:
            with native.deferred_interrupts(check=False):
                sum(range(2000))
            counts["blocks"] += 1
        except KeyboardInterrupt:
            counts["interrupts"] += 1
print("ready", flush=True)
while True:
    try:
        loop()
        break
    except KeyboardInterrupt:
        pass
print(counts["blocks"], counts["interrupts"], flush=True)
"""


def test_ctrl_c_at_any_moment_of_a_deferred_block_never_leaves_the_next_one_stuck():
    """A Ctrl-C that lands as a block hands SIGINT back to Python's default handler raises
    KeyboardInterrupt wherever the block's exit is; none of those places may hold a lock (it stayed
    held, and the engine's close hung: `dg compare` did not end after Ctrl-C)."""
    sending_s, running_s = 2.0, 3.0
    proc = subprocess.Popen([sys.executable, "-c", DEFERRED_LOOP, str(running_s)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        assert proc.stdout.readline() == "ready\n"
        end = time.monotonic() + sending_s
        while time.monotonic() < end and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.0005)
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the loop hung: a Ctrl-C left a deferred block's state locked")
    assert proc.returncode == 0, out
    blocks, interrupts = map(int, out.split())
    assert interrupts >= 10 and blocks > interrupts  # the Ctrl-Cs landed in blocks, which went on after them
