"""Every live path on a real (pseudo-)terminal, at 80 and 40 columns, read back as a person sees it.

Each test runs `dg` in a pty (pexpect) and replays its output on a virtual screen (pyte): the final
screen must hold the answer and no error. These drive Rich's terminal path, which a pipe or
CliRunner never takes (the compare crash of issue 8 only happened there).
"""

from __future__ import annotations

import os
import re
import time

import pytest

pytest.importorskip("pexpect", reason="the terminal tests need pexpect and pyte (pip install -e '.[test]')")
pytest.importorskip("pyte", reason="the terminal tests need pexpect and pyte (pip install -e '.[test]')")

import pty_screen  # noqa: E402
from pyte import modes as pyte_modes  # noqa: E402


pytestmark = [pytest.mark.pty, pytest.mark.native]
WIDTHS = [80, 40]


def assert_clean(term: pty_screen.Terminal) -> None:
    text = term.all_text()
    assert "error" not in text.lower() and "Traceback" not in text, text


def type_line(term: pty_screen.Terminal, text: str) -> None:
    """Type as a person does: one key at a time, then Enter."""
    for ch in text:
        term.send(ch)
        time.sleep(0.005)
    term.send("\r")


@pytest.mark.parametrize("columns", WIDTHS)
def test_generate_live(columns):
    rc, term = pty_screen.run("generate", "reverse: HELLO", "--seed", "1", columns=columns)
    assert rc == 0
    assert_clean(term)
    lines = [line.strip() for line in term.screen_lines()]
    assert "OLLEH" in lines
    assert "stop=end_token" in term.screen_text().replace("\n", "")
    assert "╭" not in term.screen_text()  # the live panel is gone, the answer stays


@pytest.mark.parametrize("value", ["²", "0", "1000000000"])
def test_columns_that_is_no_terminal_size_leaves_the_terminal_s_own(value):
    # COLUMNS=² was a traceback from Rich's int(); COLUMNS=1000000000 had Rich pad every line of the
    # live view to a billion cells (gigabytes, growing): now Rich asks the terminal
    import resource

    import pexpect

    def bounded():
        pty_screen._default_signals()
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    term = pty_screen.Terminal(40, 24)
    exe, argv = pty_screen.dg_command("generate", "reverse: HELLO", "--seed", "1", "--pace", "0.05")
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=value, LINES=value,
               PYTHONPATH=pty_screen.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    term.child = pexpect.spawn(exe, argv, env=env, dimensions=(24, 40), timeout=120, cwd=pty_screen.REPO,
                               preexec_fn=bounded)
    assert term.wait() == 0
    assert_clean(term)
    assert "OLLEH" in term.screen_text() and "╭" not in term.screen_text()


def test_a_dumb_terminal_shows_the_progress_as_status_lines():
    # TERM=dumb: Rich's Live draws nothing until it stops, so the whole run showed nothing but the answer
    rc, term = pty_screen.run("generate", "nato: QWERTY", "--seed", "1", env={"TERM": "dumb"})
    assert rc == 0
    assert_clean(term)
    text = term.all_text()
    assert "canvas 1  step 1/48" in text and "[stop]" in text
    assert "YANKEE" in text and "stop=end_token" in text.replace("\n", "")


@pytest.mark.parametrize("args", [["compare", "reverse: HELLO", "--seed", "1"], ["list"],
                                  ["generate", "nato: QWERTY", "--seed", "1", "-n", "4"]])
def test_a_dumb_terminal_of_40_columns_gets_lines_of_40_columns(args):
    # TERM=dumb: Rich took the terminal for 80x25 whatever its size, so on 40 columns every table and
    # notice was laid out for 80 and broken up by the terminal's own wrapping (no COLUMNS: as in a
    # terminal, where the shell does not export it)
    from rich.cells import cell_len

    rc, term = pty_screen.run(*args, columns=40, env={"TERM": "dumb", "COLUMNS": None, "LINES": None})
    assert rc == 0
    assert_clean(term)
    written = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", term.raw.decode("utf-8")).split("\r\n")
    assert max(cell_len(line) for line in written) <= 40, "\n".join(written)


@pytest.mark.parametrize("piped", [False, True])
def test_no_live_status_lines_start_lines_of_their_own(piped):
    # stdout and stderr on one terminal (or stdout through `| cat` to it): a canvas's text, streamed
    # without a newline, had the next status line glued to it and running past the edge
    # ("...ROMEO TANGO canvas 2  step 1/48  T=0.8")
    import shlex

    import pexpect

    exe, argv = pty_screen.dg_command("generate", "nato: QWERTY", "--seed", "1", "--no-live")
    term = pty_screen.Terminal(80, 24)
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="80", LINES="24",
               PYTHONPATH=pty_screen.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    term.child = pexpect.spawn("sh", ["-c", shlex.join([exe, *argv]) + (" | cat" if piped else "")], env=env,
                               dimensions=(24, 80), timeout=120, cwd=pty_screen.REPO)
    assert term.wait() == 0
    lines = [line.strip() for line in term.screen_lines()]
    assert "QUEBEC WHISKEY ECHO ROMEO TANGO" in lines, term.screen_text()
    # through `| cat` the answer's last piece reaches the terminal when cat writes it, which may be after
    # the summary dg writes to stderr: only the piece's line start is dg's to keep
    assert ("YANKEE" in lines) if not piped else any(line.startswith("YANKEE") for line in lines), term.screen_text()
    assert any(line.startswith("canvas 2  step 1/48") for line in lines), term.screen_text()


@pytest.mark.parametrize("columns", WIDTHS)
def test_compare_live(columns):
    # issue 8: this ended with `error: model demo-diffusion.gguf is closed` on every terminal
    rc, term = pty_screen.run("compare", "sort: QWERTY", "--seed", "0", columns=columns)
    assert rc == 0
    assert_clean(term)
    screen = term.screen_text()
    # both panels, printed whole after the run (at 40 columns one above the other, the first may have
    # scrolled off), and each once: no frame of the live view was left behind
    assert term.all_text().count("EQRTWY") == 2
    assert "speedup" in screen and "tok/s" in screen
    # the panels' titles whole: at 40 columns, side by side, they read "diffusion: dem" and "autoregressive:"
    assert "diffusion: demo" in term.all_text() and "autoregressive: demo-ar" in term.all_text()


@pytest.mark.parametrize("columns", WIDTHS)
def test_bench_live(columns, tmp_path):
    prompts = tmp_path / "prompts.tsv"
    prompts.write_text("sort-2\tsort: BA\tAB\nreverse-2\treverse: HI\tIH\n")
    rc, term = pty_screen.run("bench", "--prompts", str(prompts), "--repeat", "1", "--batch-sizes", "1,2",
                              columns=columns, rows=40)
    assert rc == 0
    assert_clean(term)
    text = term.all_text()
    for fragment in ("sort-2", "reverse-2", "accuracy", "speed model", "batch sweep"):
        assert fragment in text
    assert "batch sweep" in term.screen_text()
    if columns == 80:
        assert "…" not in text  # every column fits (it was `diffu…` everywhere)


@pytest.mark.parametrize("columns", WIDTHS)
def test_chat_keeps_the_session_across_turns_commands_and_ctrl_c(columns):
    term = pty_screen.Terminal(columns, 24).spawn("chat", "--seed", "1")
    term.read_until(">>> ")
    type_line(term, "reverse: HELLO")
    term.read_until(">>> ")
    type_line(term, "/system Answer briefly.")
    term.read_until("system prompt set")
    term.read_until(">>> ")
    type_line(term, "reverse: ABC")
    term.read_until(">>> ")
    term.sendintr()  # at the prompt: a hint, not the end
    term.read_until(">>> ")
    type_line(term, "/exit")
    assert term.wait() == 0
    assert_clean(term)
    text = term.all_text()
    assert "OLLEH" in text and "(Ctrl-D or /exit leaves)" in text and "bye" in term.screen_text()
    flat = text.replace("\n", "")  # the summary lines wrap on a narrow terminal
    prompts = [int(n) for n in re.findall(r"prompt\s*(\d+)\s*tokens", flat)]
    cached = [int(n) for n in re.findall(r"(\d+)\s*from\s*the\s*cache", flat)]
    # the first turn prefilled all of its prompt; after /system changed the conversation's start, only
    # the shared beginning (bos and the turn marker) came from the cache
    assert cached[0] == 0 and 0 < cached[1] < prompts[0]


def test_chat_banner_names_a_model_path_with_brackets(tmp_path):
    # the banner went through Rich markup: a model in a folder "d[/x]" ended dg chat in MarkupError
    import shutil

    from dgcli.registry import Registry

    model = tmp_path / "d[" / "x]" / "m[bold]q.gguf"
    model.parent.mkdir(parents=True)
    shutil.copy(Registry.load().resolve("demo").path, model)
    term = pty_screen.Terminal(120, 24).spawn("chat", "-m", str(model))
    term.read_until(">>> ")
    type_line(term, "/exit")
    assert term.wait() == 0
    assert_clean(term)
    assert f"Chat with {model}." in term.all_text()


def test_chat_takes_a_utf8_message_under_the_c_locale():
    # LC_ALL=C without Python's UTF-8 mode: stdin is ASCII, and "héllo" typed in UTF-8 came back from
    # input() as lone surrogates: "the message is not UTF-8 text"
    term = pty_screen.Terminal(80, 24).spawn("chat", "--seed", "1", env={"LC_ALL": "C", "PYTHONUTF8": "0"})
    term.read_until(">>> ")
    type_line(term, "reverse: héllo")
    term.read_until(">>> ")
    type_line(term, "/exit")
    assert term.wait() == 0
    assert_clean(term)
    assert "reverse: héllo" in term.all_text() and "stop=end_token" in term.all_text().replace("\n", "")


@pytest.mark.parametrize("columns", WIDTHS)
def test_chat_ctrl_c_stops_an_answer_not_the_session(columns):
    term = pty_screen.Terminal(columns, 24).spawn("chat", "--seed", "1", "--pace", "0.5")
    term.read_until(">>> ")
    type_line(term, "reverse: ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    term.read_until("step 2/48")
    term.sendintr()
    term.read_until(">>> ")
    type_line(term, "reverse: HELLO")
    term.read_until(">>> ")
    term.send("\x04")  # Ctrl-D
    assert term.wait() == 0
    assert_clean(term)
    text = term.all_text()
    # the first answer was stopped; the second ran to an end of the model's own (which end depends
    # on the model's answer, not on this test)
    stops = re.findall(r"stop=([a-z_]+)", text.replace("\n", ""))
    assert stops[0] == "interrupted" and stops[1] in {"end_token", "pad_canvas"}, stops
    assert "from the cache" in text


@pytest.mark.parametrize("columns", WIDTHS)
def test_ctrl_c_in_generate_leaves_no_stray_panel_line(columns):
    term = pty_screen.Terminal(columns, 24).spawn("generate", "reverse: ABCDEFGHIJKLMNOPQRSTUVWXYZ", "-n", "200",
                                                  "--seed", "0", "--pace", "0.3")
    term.read_until("step 3/48")
    term.sendintr()
    assert term.wait() == 130
    screen = term.screen_text()
    assert "╭" not in screen and "╰" not in screen and "│" not in screen, screen
    words = " ".join(screen.split())  # dg's notices wrap at word boundaries
    assert "stop=interrupted" in words and "interrupted: the output above" in words


@pytest.mark.parametrize("columns", WIDTHS)
def test_ctrl_c_in_compare_shows_the_diffusion_side_and_exits_130(columns):
    term = pty_screen.Terminal(columns, 24).spawn("compare", "reverse: ABCDEFGHIJKLMNOPQRSTUVWXYZ", "--seed", "0",
                                                  "--pace", "0.3")
    term.read_until("3/48")  # a narrow panel wraps "step 3/48"
    term.sendintr()
    assert term.wait() == 130
    screen = term.screen_text()
    assert "(interrupt" in screen and "(not" in screen  # the panels' notes (wrapped in narrow panels)
    assert "the AR side did not run" in " ".join(screen.split())  # wrapped at word boundaries


@pytest.mark.parametrize("columns", WIDTHS)
def test_a_long_answer_keeps_the_canvas_and_status_in_sight(columns, tiny_gguf):
    # --ignore-eos: 16-token canvases until -n, however the untrained model's canvases come out on this
    # CPU. On a 10-row terminal the committed text overflows after a few canvases; the status line must
    # stay on screen.
    term = pty_screen.Terminal(columns, 10).spawn("generate", "hi", "-m", str(tiny_gguf), "-n", "800", "--steps", "2",
                                                    "--ignore-eos",
                                                    "--seed", "0", "--pace", "0.02", "--threads", "1")
    term.read_until("canvas 45  step 2/2")
    term.read_until("╰")  # that frame, drawn to its bottom border
    lines = term.screen_lines()
    status = [i for i, line in enumerate(lines) if "canvas 45" in line]
    assert status, "\n".join(lines)
    assert any("╰" in line for line in lines[status[-1]:]), "\n".join(lines)  # the panel's bottom border
    assert any("…" in line for line in lines[:status[-1]])  # older text scrolled out of the panel
    term.wait()


@pytest.mark.parametrize("columns", WIDTHS)
def test_replay_of_a_saved_trace(columns, tmp_path):
    trace = tmp_path / "run.jsonl"
    rc, _ = pty_screen.run("generate", "sort: QWERTY", "--seed", "0", "--trace", str(trace), columns=columns)
    assert rc == 0
    rc, term = pty_screen.run("replay", str(trace), "--pace", "0.01", columns=columns)
    assert rc == 0
    assert_clean(term)
    screen = term.screen_text()
    assert "EQRTWY" in screen and "recorded:" in screen


def test_ctrl_c_in_replay_shows_the_text_it_had_reached(tmp_path):
    # the transient live view vanished and only "interrupted" was left on the screen
    trace = tmp_path / "run.jsonl"
    rc, _ = pty_screen.run("generate", "nato: QWERTY", "--seed", "1", "--trace", str(trace))
    assert rc == 0
    term = pty_screen.Terminal(80, 24).spawn("replay", str(trace), "--pace", "0.3")
    term.read_until("canvas 2  step 1/48")
    term.sendintr()
    assert term.wait() == 130
    screen = term.screen_text()
    assert "╭" not in screen, screen
    assert "QUEBEC WHISKEY ECHO ROMEO TANGO" in screen and "interrupted: the replay stopped here" in screen


# 96 denoising steps (stability and confidence out of reach), each on screen a while
SLOW_STEPS = ("--seed", "0", "--stability-threshold", "20", "--confidence-threshold", "1e-30")


@pytest.mark.parametrize("command", ["generate", "compare", "replay"])
def test_a_terminal_made_narrower_mid_run_keeps_no_old_frame(command, tmp_path):
    """The window made narrower under a live view: a terminal that reflows (tmux, VTE, kitty, ...)
    rewraps each line of the frame on screen onto two rows, and Rich's next frame, moving up as many
    lines as it had drawn, left the top half of every frame above it for good. No COLUMNS/LINES: dg
    follows the terminal's size. (The screen is full of a session's lines, as a terminal's usually
    is: the rows a reflow adds push them into the history. A frame at the top of an empty screen
    would lose its top rows to the history instead, where no one can erase them.)"""
    args = [command, "Tell me a story", *SLOW_STEPS, "--pace", "0.2"]
    if command == "replay":
        trace = tmp_path / "run.jsonl"
        rc, _ = pty_screen.run("generate", "Tell me a story", *SLOW_STEPS, "--trace", str(trace))
        assert rc == 0
        args = ["replay", str(trace), "--pace", "0.2"]
    term = pty_screen.Terminal(80, 24)
    term._feed(b"".join(b"$ earlier command %d\r\n" % i for i in range(30)))
    term.spawn(*args, env={"COLUMNS": None, "LINES": None})
    term.read_until("2/48")
    term.resize(40)
    term.read_until("8/48")
    # a frame or two drawn for the old width arrive after the resize (dg learns of it a moment later)
    term.resize(30, 20, tell=False)
    term.read_until("10/48")
    term.tell_size()
    assert term.wait() in (0, 1), term.all_text()  # compare: 1 when the AR side is missing
    text = term.all_text()
    assert_clean(term)
    assert "$ earlier command 29" in text
    whole = 2 if command == "compare" else 0  # compare prints both panels whole once the run is over
    assert text.count("╭") == text.count("╰") == whole, text


def test_sigterm_under_a_live_view_gives_the_terminal_back():
    import pexpect
    import signal

    term = pty_screen.Terminal(80, 24).spawn("generate", "reverse: ABCDEFGHIJKLMNOPQRSTUVWXYZ", "-n", "200",
                                             "--seed", "0", "--pace", "0.5")
    term.read_until("step 2/48")
    assert term.child.getecho() is False  # keys are not echoed under the live view
    term.child.kill(signal.SIGTERM)
    term.child.expect(pexpect.EOF)
    assert term.child.getecho() is True  # echo back on
    term._feed(term.child.before)
    assert b"\x1b[?25h" in term.raw[-200:]  # the cursor shown again
    assert pyte_modes.DECAWM in term.screen.mode  # long lines wrap again (the live view cuts them)
    term.child.close()
    assert term.child.signalstatus is None and term.child.exitstatus == 143


def _live_view_in_a_shell() -> pty_screen.Terminal:
    """An interactive bash (job control) on a terminal, running `dg generate` with its live view up."""
    import os
    import shlex

    import pexpect

    term = pty_screen.Terminal(80, 24)
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="80", LINES="24", PS1="$ ",
               PYTHONPATH=pty_screen.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    term.child = pexpect.spawn("bash", ["--norc", "--noprofile", "-i"], env=env, dimensions=(24, 80), timeout=120,
                               cwd=pty_screen.REPO, preexec_fn=pty_screen._default_signals)
    term.read_until(r"\$ ")
    # 96 steps (stability and confidence out of reach), 0.1 s each
    exe, argv = pty_screen.dg_command("generate", "Tell me a story", "--seed", "0", "--stability-threshold", "20",
                                      "--confidence-threshold", "1e-30", "--pace", "0.1")
    term.send(shlex.join([exe, *argv]) + "\r")
    term.read_until("step 2/48")
    assert term.screen.cursor.hidden  # the live view is up
    term.send("\x1a")  # Ctrl-Z
    term.read_until(r"Stopped.*\n.*\$ ")
    return term


def test_ctrl_z_gives_the_shell_a_cursor_and_fg_draws_the_live_view_again():
    """Ctrl-Z under a live view, in an interactive shell: the shell's prompt used to come back with no
    cursor (the live view hides it), and after `fg` the view's first frame erased the shell's last
    lines (the "fg" line). Now the cursor shows while dg is stopped and `fg` draws a new frame below."""
    term = _live_view_in_a_shell()
    assert not term.screen.cursor.hidden, term.raw[-300:]  # the shell's prompt has its cursor
    assert pyte_modes.DECAWM in term.screen.mode  # and its long lines wrap
    term.send("fg\r")
    term.read_until(r"step \d+/48")
    assert term.screen.cursor.hidden and pyte_modes.DECAWM not in term.screen.mode
    term.send("exit\r")  # typed ahead: bash reads it once dg is done
    assert term.wait() == 0
    screen = term.all_text()
    assert not term.screen.cursor.hidden and pyte_modes.DECAWM in term.screen.mode
    assert "$ fg" in screen, screen  # not erased by the first frame after `fg`
    tail = screen[screen.index("$ fg"):]
    assert "I can reverse" in tail and "new tokens" in tail and "Traceback" not in screen, tail


def test_kill_ends_a_live_view_stopped_with_ctrl_z():
    """`kill %1` on a dg stopped under its live view: bash sends SIGTERM and continues it in the
    background, where giving the terminal its settings back stopped dg again (SIGTTOU) before it
    could exit: the job stayed stopped for good."""
    term = _live_view_in_a_shell()
    term.send("kill %1\r")
    term.read_until(r"\$ ")
    term.send("sleep 2; jobs -l; echo LISTED-$((1+1))\r")
    term.read_until("LISTED-2")  # the output, not the command line
    screen = term.all_text()
    term.send("kill -9 %1 2>/dev/null; exit\r")  # a dg still stopped is not left behind
    term.send("exit\r")  # bash refuses the first exit while it has a stopped job
    term.wait()
    assert "Exit 143" in screen or "Terminated" in screen, screen
    assert "Stopped" not in screen[screen.rindex("jobs -l"):], screen


@pytest.mark.parametrize("columns", WIDTHS)
def test_serve_start_up_lines_wrap_between_words_and_ctrl_c_stops_it(columns):
    """On a terminal the banner (stdout) and the notices (stderr) wrap between words: at 80 columns the
    banner used to be one raw line cut mid-word ("toke" / "ns"). Scripts read it from a pipe, one line
    (tests/test_serve.py)."""
    term = pty_screen.Terminal(columns, 24).spawn("serve", "--port", "0", "--host", "0.0.0.0")
    term.read_until("Ctrl-C stops")
    lines = [line for line in term.screen_lines() if line]
    words = " ".join(" ".join(lines).split())
    assert re.search(r"dg serve: http://0\.0\.0\.0:\d+/v1 model demo \(canvas \d+\) 4 slots of \d+ tokens queue 64 "
                     r"warning: listening on 0\.0\.0\.0 without --api-key: anyone who reaches this port can use "
                     r"the model dg serve: http://0\.0\.0\.0:\d+/ shows the canvas denoise in a browser "
                     r"dg serve: Ctrl-C stops", words), lines
    # every line break falls between words: rejoining with spaces reads the same as the text had
    for line in lines:
        assert len(line) <= columns
    assert all(re.fullmatch(r"\S+( +\S+)*", line) for line in lines), lines
    assert max(len(line) for line in lines) > columns - 20  # filled, not one word per line
    term.sendintr()
    assert term.wait() == 130


@pytest.mark.parametrize("columns", [40, 30])
def test_info_tables_wrap_on_a_narrow_terminal_and_never_cut_a_value(columns, tiny_gguf):
    """At 40 columns the sampler and tensor-type tables used to cut names and parameter counts to "…"
    ("max_denoisi…", "6,258,6…"): a figure the reader cannot see whole. A table that fits folds at
    spaces; one that cannot without cutting a word prints a line per row ("t_min: 0.4, gguf")."""
    rc, term = pty_screen.run("info", str(tiny_gguf), "--gpu-layers", "-1", "--gpu-memory", "8GB", columns=columns,
                              rows=200)
    assert rc == 0
    text = term.all_text()
    assert "…" not in text, text
    # every figure is there whole once the folds are undone: each column's pieces, top to bottom
    columns_text: dict[int, str] = {}
    for line in text.splitlines():
        if line.startswith("│"):
            for i, cell in enumerate(line.strip("│").split("│")):
                columns_text[i] = columns_text.get(i, "") + cell.strip()
    rows = [line for line in text.splitlines() if not line.startswith(("│", "┃", "┏", "┡", "└"))]
    for name in ("max_denoising_steps", "confidence_threshold"):
        assert name in columns_text.get(0, "") or any(line.startswith(name + ": ") for line in rows), text
    from dgcli.modelfile import info

    for t in info.read_info(tiny_gguf).tensor_types:
        assert f"{t.parameters:,}" in columns_text.get(2, "") or f"{t.parameters:,}" in {
            word.strip(",") for word in text.split()}, t


@pytest.mark.parametrize("columns", WIDTHS)
def test_list_shows_every_model_whole_at_any_width(columns):
    """At 40 columns the table once squeezed role, pair, size and "on disk" to nothing (the names do not
    wrap), and at 80 it cut a pair name to "diffusiong…". Narrower than the table can fold to, dg list
    prints one wrapped line per model."""
    import json
    import subprocess
    import sys

    listed = subprocess.run([sys.executable, "-m", "dgcli.cli", "list", "--json"], capture_output=True, text=True,
                            check=True, cwd=pty_screen.REPO)
    rc, term = pty_screen.run("list", columns=columns, rows=100)
    assert rc == 0
    text = term.all_text()
    assert "…" not in text, text
    words = " ".join(text.split())
    from dgcli import hub

    for row in json.loads(listed.stdout)["models"]:
        size = hub.format_bytes(row["size"])
        assert size in words, (row, text)
        if columns == 40:  # the one-line-per-model form, whole
            name = row["name"] + (f":{row['quant']}" if row["quant"] else "") + (" *" if row["default"] and row["quant"]
                                                                                 else "")
            size = size if row["on_disk"] else "~" + size
            line = f"{name} {row['role']}, pair {row['pair'] or '-'} {size} {'on disk' if row['on_disk'] else 'not on disk'}"
            assert line in words, (line, text)


def test_model_text_printed_on_a_terminal_cannot_drive_it(tmp_path):
    """Answer text printed plainly (--no-live, and replay's plain stream) on a terminal shows its control
    characters as U+FFFD, as the live view does: a trace (a file anyone may hand over) or a model's
    answer with escape sequences must not retitle the window, clear the screen or move the cursor.
    Piped, the text stays byte for byte."""
    import json
    import subprocess
    import sys

    trace = tmp_path / "run.jsonl"
    rc, _ = pty_screen.run("generate", "nato: QWERTY", "--seed", "1", "--trace", str(trace))
    assert rc == 0
    injected = "\x1b]0;pwned\x07\x1b[2J\x1b[H"
    lines = []
    for line in trace.read_text().splitlines():
        doc = json.loads(line)
        if doc.get("kind") == "canvas":
            doc["text"] = injected + doc["text"]
        lines.append(json.dumps(doc))
    trace.write_text("\n".join(lines) + "\n")
    for args in (("--no-live",), ()):
        term = pty_screen.Terminal(80, 24).spawn("replay", str(trace), *args)
        assert term.wait() == 0
        assert b"\x1b]0;pwned" not in term.raw and b"\x1b[2J" not in term.raw, args
        screen = term.screen_text()
        assert "QUEBEC" in screen and "\ufffd]0;pwned" in screen, (args, screen)
    exe, argv = pty_screen.dg_command("replay", str(trace))
    piped = subprocess.run([exe, *argv], capture_output=True, cwd=pty_screen.REPO)
    assert piped.returncode == 0 and injected.encode() in piped.stdout


def test_dg_worker_wraps_its_notices_between_words_on_a_narrow_terminal():
    # at 40 columns the warning and the hint were cut mid-word ("authentication an" / "d no encryption")
    term = pty_screen.Terminal(40, 30).spawn("worker", "--host", "0.0.0.0", "--port", "0", "--threads", "1")
    term.read_until("Ctrl-C stops")
    term.sendintr()
    assert term.wait() == 130
    screen = term.screen_text()
    warning = ("llama.cpp's RPC protocol has no authentication and no encryption; whoever reaches this port can "
               "use this machine's memory and compute. Trusted networks only.")
    for word in warning.split() + ["Ctrl-C", "stops"]:
        assert re.search(rf"(^|\s){re.escape(word)}(\s|$)", screen, re.M), (word, screen)


def _slow_registry_model(fake_hub, tmp_path, monkeypatch, model: str, name: str) -> None:
    """A registry model `model` whose one file, 48 MiB (a few 10 MiB writes), the fake Hub sends in ~15 s:
    a Ctrl-C or a resize lands mid-transfer."""
    repo = "org/big-GGUF"
    fake_hub.files[(repo, name)] = bytes(range(256)) * (48 << 12)
    fake_hub.seconds_per_chunk = 0.02
    reg = tmp_path / "models.toml"
    reg.write_text(f'[models.{model}]\nrole = "diffusion"\nrepo = "{repo}"\n[models.{model}.files]\n'
                   f'Q4_K_M = {{ file = "{name}" }}\n')
    monkeypatch.setenv("DG_REGISTRY", str(reg))


@pytest.mark.parametrize("columns", WIDTHS)
def test_ctrl_c_during_pull_leaves_one_progress_line(columns, fake_hub, tmp_path, monkeypatch):
    # the kernel's `^C` echo pushed the cursor off a full-width bar, and stopping the bar then left
    # a second copy of it on the screen above the "interrupted" line
    _slow_registry_model(fake_hub, tmp_path, monkeypatch, "big", "diffusiongemma-26B-A4B-it-Q4_K_M.gguf")
    term = pty_screen.Terminal(columns, 24).spawn("pull", "big", timeout=60)
    term.read_until(r"MB", timeout=60)  # the bar is drawn
    time.sleep(1.0)
    term.sendintr()
    assert term.wait(60) == 130
    lines = [line for line in term.all_text().splitlines() if line.strip()]
    bars = [line for line in lines if " MB" in line]
    assert len(bars) == 1, term.all_text()
    assert any(line.startswith("interrupted: run `dg pull big") for line in lines), term.all_text()


def test_a_terminal_made_narrower_during_pull_keeps_one_progress_line(fake_hub, tmp_path, monkeypatch):
    # the full-width bar, rewrapped onto two rows by the terminal, kept its first half on the screen
    # at every resize (as the live views' frames did)
    _slow_registry_model(fake_hub, tmp_path, monkeypatch, "big", "diffusiongemma-26B-A4B-it-Q4_K_M.gguf")
    term = pty_screen.Terminal(100, 24)
    term._feed(b"".join(b"$ earlier command %d\r\n" % i for i in range(30)))
    term.spawn("pull", "big", env={"COLUMNS": None, "LINES": None}, timeout=60)
    term.read_until(r"MB", timeout=60)
    term.resize(70)
    time.sleep(1.0)
    term.resize(45, tell=False)  # a bar drawn for 70 columns arrives after the resize
    time.sleep(0.5)
    term.tell_size()
    time.sleep(1.0)
    term.sendintr()
    assert term.wait(60) == 130
    lines = [line for line in term.all_text().splitlines() if line.strip()]
    bars = [line for line in lines if "diffusion" in line or "MB/s" in line]
    assert len(bars) == 1, term.all_text()
    assert "$ earlier command 29" in lines
    # laid out for 45 columns: the figures whole (they were cut to "0.0/50.… -…", the columns chosen
    # for the width at the start)
    assert re.search(r"[\d.]+/[\d.]+ MB ", bars[0]), term.all_text()


@pytest.mark.parametrize("columns", WIDTHS)
def test_pull_interrupted_line_wraps_at_words(columns, fake_hub, tmp_path, monkeypatch):
    # typer.echo left the wrapping to the terminal, which cut words: "... download (t" / "he partial"
    _slow_registry_model(fake_hub, tmp_path, monkeypatch, "bigger", "big.gguf")
    term = pty_screen.Terminal(columns, 24).spawn("pull", "bigger", timeout=60)
    term.read_until(r"MB", timeout=60)
    time.sleep(1.0)
    term.sendintr()
    assert term.wait(60) == 130
    lines = [line for line in term.all_text().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.startswith("interrupted:"))
    words = " ".join(lines[start:]).split()
    assert words == ("interrupted: run `dg pull bigger:Q4_K_M` to continue the download "
                     "(the partial file is never loaded)").split(), term.all_text()
