"""What a terminal shows while dg works on a model as slow as the real one on a CPU (issue 28 item 2):
from the first second, a line saying what runs (loading, the prefill, a step) and for how long, in
every command; gone from the final screen; nothing of it in a pipe or in --json's stdout.

`tests/slow_dg.py SECONDS` runs dg with every load, prefill and forward of the demo models SECONDS
slower. The screens are read from a pseudo-terminal (pty_screen) as a person sees them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pexpect", reason="the terminal tests need pexpect and pyte (pip install -e '.[test]')")
pytest.importorskip("pyte", reason="the terminal tests need pexpect and pyte (pip install -e '.[test]')")

import pexpect  # noqa: E402

import pty_screen  # noqa: E402

pytestmark = [pytest.mark.pty, pytest.mark.native, pytest.mark.slow]
SLOW_DG = str(Path(__file__).resolve().parent / "slow_dg.py")


def slow_terminal(seconds: float, *args: str, columns: int = 80, rows: int = 24) -> pty_screen.Terminal:
    term = pty_screen.Terminal(columns, rows)
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(columns), LINES=str(rows),
               PYTHONPATH=pty_screen.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    term.child = pexpect.spawn(sys.executable, [SLOW_DG, str(seconds), *args], env=env, dimensions=(rows, columns),
                               timeout=120, cwd=pty_screen.REPO, preexec_fn=pty_screen._default_signals)
    return term


def feed_for(term: pty_screen.Terminal, seconds: float) -> None:
    """Feed what the command writes for `seconds` (Terminal.drain waits for a quiet moment, which a
    progress bar redrawn ten times a second never leaves)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        index = term.child.expect([b"(?s).+", pexpect.TIMEOUT, pexpect.EOF], timeout=left)
        term._feed(term.child.before + (term.child.after if index == 0 else b""))
        if index == 2:
            return


def flat(screen: str) -> str:
    """The screen's words in order, one space between them, panel borders left out: a status line
    wrapped in a narrow panel reads as one line again."""
    return " ".join(re.sub("[│╭╮╰╯─┃┏┓┗┛━]", " ", screen).split())


def screens_until(term: pty_screen.Terminal, pattern: str, timeout: float = 60) -> str:
    """Feed what the command writes until the screen shows `pattern` (a regular expression over
    `flat(screen)`: single spaces); returns the screen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        feed_for(term, 0.2)
        if re.search(pattern, flat(term.screen_text())) or re.search(pattern, "".join(term.screen_lines())):
            return term.screen_text()
    raise AssertionError(f"never showed {pattern!r}:\n{term.screen_text()}")


@pytest.mark.parametrize("columns", [80, 40])
def test_generate_says_what_it_does_from_the_first_second(columns):
    term = slow_terminal(2, "generate", "reverse: HELLO", "--seed", "1", columns=columns)
    assert "loading demo…" in screens_until(term, r"loading demo… [1-9] s")
    screen = screens_until(term, r"prefill of 2\d tokens, then step 1… working [1-9] s")
    assert "╭" in screen  # in the live panel
    screen = screens_until(term, r"canvas 1 +step 1/48")
    assert term.wait() == 0
    final = term.screen_text()
    assert "OLLEH" in final and "loading" not in final and "working" not in final and "╭" not in final


def test_generate_to_a_pipe_says_it_on_the_terminal_and_the_pipe_is_as_before(tmp_path):
    """stdout piped (| cat > file): the status line goes to the terminal (stderr) between the step
    lines; the file holds the answer alone."""
    out = tmp_path / "out.txt"
    term = pty_screen.Terminal(80, 24)
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="80", LINES="24",
               PYTHONPATH=pty_screen.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    term.child = pexpect.spawn("/bin/sh", ["-c", f'"{sys.executable}" "{SLOW_DG}" 2 generate "reverse: HELLO" '
                                                 f'--seed 1 > "{out}"'],
                               env=env, dimensions=(24, 80), timeout=120, cwd=pty_screen.REPO,
                               preexec_fn=pty_screen._default_signals)
    screens_until(term, r"loading demo… [1-9] s")
    screens_until(term, r"prefill of 2\d tokens, then step 1… [1-9] s")
    screens_until(term, r"canvas 1, step 2…")
    assert term.wait() == 0
    assert out.read_text() == "OLLEH\n"
    final = term.screen_text()
    assert "canvas 1  step 1/48" in final and "…" not in final  # the step lines stay, the status line went


def test_json_on_a_terminal_shows_the_status_and_prints_only_the_document_after_it():
    term = slow_terminal(1, "generate", "reverse: HELLO", "--seed", "1", "--json")
    screens_until(term, r"canvas 1, step \d…")
    assert term.wait() == 0
    text = term.all_text()
    assert "…" not in term.screen_text()
    doc = json.loads(text[text.index("{"):])
    assert doc["answer"] == "OLLEH"


@pytest.mark.subprocess
def test_piped_and_json_output_have_no_status_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=pty_screen.REPO)
    for extra in ([], ["--json"]):
        r = subprocess.run([sys.executable, SLOW_DG, "1", "generate", "reverse: HELLO", "--seed", "1", *extra],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "…" not in r.stdout + r.stderr and "loading" not in r.stderr


def test_compare_says_which_side_loads_and_both_sides_count_seconds():
    term = slow_terminal(2, "compare", "reverse: HELLO", "--seed", "1")
    # side by side, a panel's wrapped status reads with the other panel's words between its lines
    assert "prefill" not in screens_until(term, r"loading demo…")
    screens_until(term, r"prefill of 2\d tokens, then step 1….*working [1-9] s")
    screens_until(term, r"loading demo-ar….*working [1-9] s")
    screens_until(term, r"prefill of 2\d tokens, then token 1….*working [1-9] s")
    assert term.wait() == 0
    assert "speedup" in term.screen_text() and "working" not in term.screen_text()


def test_compare_at_40x12_shows_the_canvas_being_denoised():
    """Stacked at 40 columns, the AR panel waiting needs one line: the diffusion panel has room for its
    canvas under its status (it showed only '… 2 more lines')."""
    term = slow_terminal(1, "compare", "nato: QWERTY", "--seed", "1", columns=40, rows=12)
    screen = screens_until(term, r"canvas 1 +step [1-4]/48")
    top = screen.split("autoregressive")[0]
    assert "QUEBEC" in top.replace(" ", "") or "Q U E B E C" in top, screen
    assert "more line" not in top, screen
    assert term.wait() == 0


def test_chat_says_it_loads_then_what_each_turn_prefills():
    term = slow_terminal(2, "chat", "--seed", "1")
    screens_until(term, r"loading demo… [1-9] s")
    screens_until(term, r">>>")
    term.send("reverse: HELLO\r")
    screens_until(term, r"prefill of 27 new tokens, then step 1… working [1-9] s")
    screens_until(term, r"OLLEH")
    term.send("reverse: AB\r")
    # the second turn prefills only what the cache does not hold
    screen = screens_until(term, r"prefill of \d+ new tokens, then step 1…")
    assert "prefill of 27 new tokens" not in screen.split("reverse: AB")[-1]
    screens_until(term, r"(?s)reverse: AB.*new tokens in")
    term.send("\x04")
    assert term.wait() == 0


def test_bench_names_the_load_and_the_step_it_is_on(tmp_path):
    prompts = tmp_path / "p.tsv"
    prompts.write_text("rev\treverse: AB\n")
    term = slow_terminal(1, "bench", "--prompts", str(prompts), "--repeat", "1", "--no-speed-model")
    screens_until(term, r"loading demo\b(?!-)")
    screens_until(term, r"diffusion rev #1: canvas 1, step 2")
    screens_until(term, r"loading demo-ar")
    assert term.wait() == 0
    assert "all prompts" not in term.screen_text()  # one prompt: no row of them all


def test_ctrl_c_while_loading_says_it_waits_then_exits_130():
    term = slow_terminal(4, "generate", "reverse: HELLO", "--seed", "1")
    screens_until(term, r"loading demo…")
    term.sendintr()
    screens_until(term, r"stopping after this")
    assert term.wait() == 130
    assert "interrupted" in term.screen_text() and "…" not in term.screen_text()


def test_generate_dash_at_a_terminal_says_it_waits_for_the_prompt():
    term = pty_screen.Terminal(80, 24).spawn("generate", "-", "--seed", "1")
    screens_until(term, r"reading the prompt from the terminal: type it, then Ctrl-D on a line of its own")
    term.send("reverse: HELLO\r")
    term.send("\x04")
    assert term.wait() == 0
    assert "OLLEH" in term.screen_text()


def test_rm_asks_before_it_removes(fake_hub, tmp_path, monkeypatch):
    from dgcli import hub

    fake_hub.files[("org/tiny-GGUF", "tiny-Q8_0.gguf")] = b"GGUF" + bytes(3000)
    reg = tmp_path / "models.toml"
    reg.write_text('[models.tiny]\nrole = "diffusion"\nrepo = "org/tiny-GGUF"\n[models.tiny.files]\n'
                   'Q8_0 = { file = "tiny-Q8_0.gguf", size_gb = 0.001 }\n')
    env = {"DG_REGISTRY": str(reg), "HF_ENDPOINT": os.environ["HF_ENDPOINT"], "HF_HUB_CACHE": os.environ["HF_HUB_CACHE"]}
    monkeypatch.setenv("DG_REGISTRY", str(reg))
    assert pty_screen.run("pull", "tiny", env=env)[0] == 0
    term = pty_screen.Terminal(80, 24).spawn("rm", "tiny", env=env)
    screens_until(term, r"Remove tiny:Q8_0 \(tiny-Q8_0.gguf, 3.0 kB\) from .*\? \[y/N\]")
    term.send("n\r")
    assert term.wait() == 1 and "tiny:Q8_0 not removed" in term.screen_text()
    assert hub.cached_path("org/tiny-GGUF", "tiny-Q8_0.gguf") is not None
    term = pty_screen.Terminal(80, 24).spawn("rm", "tiny", env=env)
    screens_until(term, r"\[y/N\]")
    term.send("y\r")
    assert term.wait() == 0 and "removed tiny:Q8_0" in term.screen_text()
    assert hub.cached_path("org/tiny-GGUF", "tiny-Q8_0.gguf") is None
