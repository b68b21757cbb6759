"""Rendering: the live canvas view, thinking channel, compare table — from hand-made events."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from rich.console import Console

from dgcli import cli
from dgcli.cli import _display, _models, _output, _terminal, render
from dgcli.engine.diffusion import DiffusionEngine
from dgcli.engine.thinking import split_thinking
from dgcli.engine.types import CanvasEvent, GenerationResult, StepEvent, TokenEvent

WORDS = {0: "<pad>", 1: "<eos>", 5: "The", 6: " cat", 7: " sat", 8: "\n", 9: "zz"}


def piece(t: int) -> str:
    return WORDS.get(t, f"t{t}")


def detok(ids) -> str:
    return "".join(piece(t) for t in ids if t > 1)


def step(canvas, accepted, *, index=0, step=3, max_steps=48, temperature=0.75, entropy=0.1234, stopped=False):
    accepted = np.array(accepted, bool)
    return StepEvent(canvas_index=index, step=step, max_steps=max_steps, temperature=temperature,
                     argmax_canvas=np.array(canvas, np.int32), accepted_mask=accepted, n_accepted=int(accepted.sum()),
                     mean_entropy=entropy, forward_s=0.01, sampling_s=0.001, stopped=stopped)


def to_text(renderable, width=100) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_status_line_has_canvas_step_temperature_accepted_entropy():
    ev = step([5, 6, 7, 9], [True, True, False, False], index=1, step=3, temperature=0.75, entropy=0.1234)
    assert render.step_status(ev) == "canvas 2  step 3/48  T=0.750  accepted 2/4  mean H=0.1234"
    assert render.step_status(step([5], [True], stopped=True)).endswith("[stop]")


def test_canvas_accepted_bright_noisy_dim_end_marked():
    ev = step([5, 6, 9, 1, 7], [True, False, True, True, False])
    text = render.canvas_text(ev, piece, end_token_ids=[1])
    assert text.plain == "The  cat zz ⟨end⟩ ▪ "
    styles = {text.plain[s.start:s.end]: str(s.style) for s in text.spans}
    assert styles["The"] == render.ACCEPTED_STYLE and styles["zz"] == render.ACCEPTED_STYLE
    assert styles[" cat"] == render.NOISY_STYLE
    assert styles["⟨end⟩"] == render.END_STYLE and styles["▪"] == render.END_STYLE


def test_canvas_shows_whitespace_tokens_visibly():
    text = render.canvas_text(step([8, 5], [True, True]), piece)
    assert text.plain.startswith("⏎ The")


def test_live_view_shows_committed_text_canvas_and_status():
    view = render.DiffusionLiveView(piece, detok, end_token_ids=[1], title="diffusion: demo")
    assert "prefilling prompt" in to_text(view)
    view.on_event(step([5, 6, 9, 9], [True, False, False, False], step=1, temperature=0.8, entropy=2.5))
    out = to_text(view)
    assert "diffusion: demo" in out and "canvas 1  step 1/48  T=0.800  accepted 1/4  mean H=2.5000" in out
    assert "The  cat zz zz" in out
    view.on_event(CanvasEvent(canvas_index=0, token_ids=[5, 6, 7], steps=5, commit_s=0.01))
    out = to_text(view)
    assert "The cat sat" in out and "3 tokens, 1 canvas" in out
    assert view.steps_per_canvas == [5] and view.forwards == 1


def test_a_live_view_title_with_brackets_is_shown_as_it_is():
    # the title names a model: a GGUF named "m[/x].gguf", or a trace whose header says so, ended the
    # live view of generate, chat or replay in rich.errors.MarkupError
    for title in ("replay: evil[/x]", "diffusion: m[bold]"):
        view = render.DiffusionLiveView(piece, detok, end_token_ids=[1], title=title)
        view.on_event(step([5, 6, 9, 9], [True, False, False, False], step=1))
        assert title in to_text(view)
    ar = render.AutoregressiveLiveView(title="autoregressive: [/]")
    assert "autoregressive: [/]" in to_text(ar)


@pytest.mark.parametrize("width", [80, 61, 60, 40, 30])
def test_compare_panels_stack_on_a_narrow_terminal(width):
    # at 40 columns the side-by-side panels held 14 characters each and cut "diffusion: demo" to
    # "diffusion: dem": under 61 columns they stack, each fitted to half the height
    left = render.DiffusionLiveView(piece, detok, end_token_ids=[1], title="diffusion: demo")
    left.on_event(step([5, 6, 9, 9], [True, False, False, False], step=1))
    right = render.AutoregressiveLiveView(title="autoregressive: demo-ar")
    console = Console(width=width, height=24, record=True, file=io.StringIO())
    console.print(render.SideBySide(left, right))
    lines = console.export_text().splitlines()
    left_top = [i for i, line in enumerate(lines) if "diffusion: demo" in line]
    right_top = [i for i, line in enumerate(lines) if "autoregressive: demo-ar" in line]
    assert len(left_top) == len(right_top) == 1, lines
    assert (left_top == right_top) == (width >= 61), lines
    assert all(len(line) <= width for line in lines)


def test_compare_table_title_with_brackets_is_shown_as_it_is():
    # `dg compare -m "m[/x].gguf"`: the table's title names both models and ended in MarkupError
    diff = GenerationResult(mode="diffusion", text="x", token_ids=[5], n_prompt_tokens=3)
    ar = GenerationResult(mode="autoregressive", text="x", token_ids=[5], n_prompt_tokens=3)
    table = render.compare_table(diff, ar, None, None, diff_name="m[/x]", ar_name="[bold]a")
    assert "m[/x] (diffusion) vs [bold]a (AR)" in to_text(table)


def test_live_view_counts_the_seconds_of_a_slow_forward():
    """A step of the real model takes tens of seconds on a CPU: past render.SLOW_FORWARD_S the status
    says how long the engine has been working, so the screen does not look hung; a fast forward adds
    nothing."""
    view = render.DiffusionLiveView(piece, detok, end_token_ids=[1])
    view.busy_since = 100.0
    assert view.busy_note(now=101.0) == ""
    assert view.busy_note(now=112.4) == "  working 12 s"
    view.stopping = True  # a Ctrl-C the main thread acts on when the forward returns
    assert view.busy_note(now=112.4) == "  working 12 s, stopping after this forward (Ctrl-C again: now)"
    view.stopping = False
    view.on_event(step([5, 6, 9, 9], [True, False, False, False], step=1))
    view.busy_since = None
    assert view.busy_note(now=1000.0) == "" and "working" not in view.status()


class _RecordingLive:
    """A stand-in for Rich's Live: which threads asked for a redraw, and what the status said then."""

    def __init__(self, view):
        import threading

        self.view, self.lock, self.redraws = view, threading.Lock(), []

    def refresh(self):
        import threading

        with self.lock:
            self.redraws.append((threading.current_thread().name, self.view.status()))


def test_display_redraws_a_slow_forward_every_second_and_a_fast_one_never():
    import time

    view = render.DiffusionLiveView(piece, detok, end_token_ids=[1])
    live = _RecordingLive(view)
    # slow: the engine computes 3.3 s before its first event
    with _display.DiffusionDisplay(None, live=True, thinking="show", live_obj=live, view=view) as display:
        time.sleep(3.3)
        ticks = [status for thread, status in live.redraws if thread == "dg-busy-ticker"]
        display.on_event(step([5, 6, 9, 9], [True, False, False, False], step=1))
    assert ticks and ticks[-1].startswith("prefilling prompt, then step 1…  working 3 s"), ticks
    assert "stopping" not in ticks[-1]
    assert not display.ticker._thread.is_alive()  # stopped with the display
    # fast: events every 0.1 s for 1.5 s, the ticker never redraws
    view, live.redraws = render.DiffusionLiveView(piece, detok, end_token_ids=[1]), []
    live.view = view
    with _display.DiffusionDisplay(None, live=True, thinking="show", live_obj=live, view=view) as display:
        for i in range(15):
            time.sleep(0.1)
            display.on_event(step([5, 6, 9, 9], [True, False, False, False], step=i + 1))
    assert live.redraws and all(thread != "dg-busy-ticker" for thread, _ in live.redraws)
    assert "working" not in view.status()


def test_display_says_a_ctrl_c_waits_for_the_forward(monkeypatch):
    """The signal watcher counts a Ctrl-C at once; the main thread acts on it only when the native
    forward returns (tens of seconds on a CPU), so the ticker says the work stops after it."""
    import time

    from dgcli.cli import _signals

    view = render.DiffusionLiveView(piece, detok, end_token_ids=[1])
    live = _RecordingLive(view)
    monkeypatch.setattr(_signals, "interrupt_pending", lambda: True)
    with _display.DiffusionDisplay(None, live=True, thinking="show", live_obj=live, view=view):
        time.sleep(2.3)
    ticks = [status for thread, status in live.redraws if thread == "dg-busy-ticker"]
    assert ticks and ticks[-1].endswith("working 2 s, stopping after this forward (Ctrl-C again: now)"), ticks


def test_split_thinking():
    t = "<|channel>thought\nadd 3 and 5<channel|>The answer is 8."
    assert split_thinking(t) == ("add 3 and 5", "The answer is 8.")
    assert split_thinking("plain answer") == (None, "plain answer")
    assert split_thinking("<|channel>thought\nstill thinking") == ("still thinking", "")
    assert render.answer_plain(t, "hide") == "The answer is 8."
    assert render.answer_plain(t, "show") == "[thinking] add 3 and 5\n[answer] The answer is 8."
    shown = to_text(render.answer_renderable(t, "show"))
    assert "thinking: add 3 and 5" in shown and "The answer is 8." in shown
    assert "add 3" not in to_text(render.answer_renderable(t, "hide"))


def test_ar_view_accumulates_pieces():
    view = render.AutoregressiveLiveView(title="autoregressive: demo-ar")
    for i, p in enumerate(["The", " cat"]):
        view.on_event(TokenEvent(index=i, token_id=i, piece=p, forward_s=0.5, sampling_s=0.0))
    out = to_text(view)
    assert "The cat" in out and "2 tokens" in out and "2.0 tok/s" in out


def test_ar_view_rate_counts_the_tokens_its_forwards_made():
    # the engine's first token comes from the prefill (forward_s 0): 3 tokens over two 0.5 s decodes
    # are 2.0 tok/s of forwards, which the status showed as 3.0
    view = render.AutoregressiveLiveView()
    for i, s in enumerate([0.0, 0.5, 0.5]):
        view.on_event(TokenEvent(index=i, token_id=i, piece="x", forward_s=s, sampling_s=0.0))
    assert "3 tokens, one forward each  2.0 tok/s (forwards only)" in view.status()


def test_ar_view_has_no_rate_before_a_decode_ran():
    # at -n 1 (and until the second token) the only token came from the prefill: the status read "0.0 tok/s"
    view = render.AutoregressiveLiveView()
    view.on_event(TokenEvent(index=0, token_id=0, piece="x", forward_s=0.0, sampling_s=0.0))
    assert "1 token, one forward each  - tok/s (forwards only)" in view.status()


def _result(mode, n, total, forwards, spc=()):
    return GenerationResult(mode=mode, text="x", token_ids=list(range(n)), n_prompt_tokens=3,
                            steps_per_canvas=list(spc), decoder_forwards=forwards, tokens_per_forward=n / forwards,
                            prefill_s=0.0, total_s=total, stop_reason="end_token")


def test_compare_table_numbers_and_speedup():
    d = _result("diffusion", 40, 2.0, 10, [6, 4])
    a = _result("autoregressive", 40, 8.0, 40)
    rows = {r[0]: r[1:] for r in render.compare_rows(d, a, 2 * 10**9, 10**9)}
    assert rows["new tokens"] == ("40", "40")
    assert rows["tok/s"] == ("20.00", "5.00")
    assert rows["forwards"] == ("10", "40")
    assert rows["tokens/forward"] == ("4.00", "1.00")
    assert rows["steps/canvas"] == ("6,4", "-")
    assert rows["peak RSS"] == ("2.0 GB", "1.0 GB")
    assert render.speedup(d, a) == pytest.approx(4.0)
    caption = " ".join(to_text(render.compare_table(d, a, 1, 1), width=120).split())  # the caption wraps
    assert "speedup (diffusion tok/s ÷ AR tok/s): 4.00x" in caption


def test_slow_rates_keep_two_significant_digits_and_never_read_zero():
    # the real model on a CPU: 3 answer tokens in 75 s of denoising is 0.04 tok/s; the summary said
    # "0.0 tok/s", and against an AR side at 3.8 tok/s the speedup read "0.00x"
    d = _result("diffusion", 3, 75.0, 16, [16])
    a = _result("autoregressive", 40, 10.526, 40)
    assert "0.040 tok/s" in render.result_summary(d)
    rows = {r[0]: r[1:] for r in render.compare_rows(d, a, 1, 1)}
    assert rows["tok/s"] == ("0.040", "3.80")
    caption = " ".join(to_text(render.compare_table(d, a, 1, 1), width=120).split())
    assert "speedup (diffusion tok/s ÷ AR tok/s): 0.011x" in caption
    assert render.result_summary(_result("diffusion", 0, 1.0, 2, [2])).count(" 0.0 tok/s") == 1  # none is none


def test_an_ar_side_whose_only_token_came_from_the_prefill_has_no_rate():
    # dg compare -n 1: the AR token's logits come from the prefill, so tok/s divided it by its sampling
    # time alone and the table read "5413.75" (and a speedup of "0.0049x")
    d = _result("diffusion", 1, 0.04, 4, [4])
    a = GenerationResult(mode="autoregressive", text="x", token_ids=[5], n_prompt_tokens=3, decoder_forwards=1,
                         tokens_per_forward=1.0, prefill_s=0.005, total_s=0.0052, stop_reason="length",
                         timed_forwards=0, prefill_answer_tokens=1)
    rows = {r[0]: r[1:] for r in render.compare_rows(d, a, 1, 1)}
    assert rows["tok/s"] == ("25.00", "-")
    assert render.speedup(d, a) is None
    assert " - tok/s" in render.result_summary(a)
    caption = " ".join(to_text(render.compare_table(d, a, 1, 1), width=120).split())
    assert "speedup: n/a (a side made no answer token after the prefill)" in caption


def test_an_empty_answer_reads_0_tok_s_and_the_caption_says_why_there_is_no_speedup():
    # an AR answer that was the end token at once: its tok/s is 0.00 (no token in the time after the prefill),
    # and the caption said "speedup: n/a (a side has no tok/s)" under that 0.00
    d = _result("diffusion", 2, 0.04, 2, [2])
    a = GenerationResult(mode="autoregressive", text="", token_ids=[], n_prompt_tokens=3, prefill_s=0.01,
                         total_s=0.0101, stop_reason="end_token", timed_forwards=0)
    rows = {r[0]: r[1:] for r in render.compare_rows(d, a, 1, 1)}
    assert rows["tok/s"] == ("50.00", "0.00") and a.to_json()["tokens_per_second"] == 0.0
    caption = " ".join(to_text(render.compare_table(d, a, 1, 1), width=120).split())
    assert "speedup: n/a (a side made no answer token after the prefill)" in caption
    assert "no tok/s" not in caption


def test_a_run_faster_than_the_printed_precision_does_not_read_zero_seconds():
    # the demo's AR side answers in a few ms: "5 new tokens in 0.00s  1250.0 tok/s"
    summary = render.result_summary(_result("autoregressive", 5, 0.004, 5))
    assert summary.startswith("5 new tokens in 0.004s  1250.0 tok/s")
    assert render.result_summary(_result("autoregressive", 5, 0.08, 5)).startswith("5 new tokens in 0.08s")
    rows = {r[0]: r[1:] for r in render.compare_rows(_result("diffusion", 5, 0.02, 2), _result("autoregressive", 5, 0.004, 5), 1, 1)}
    assert rows["wall time (s)"] == ("0.02", "0.004")


def test_generate_live_view_on_a_terminal(tiny_gguf, monkeypatch):
    """The Rich Live path (what a user at a terminal sees), captured from a forced-terminal console."""
    from test_cli import ScriptedModel

    buf = io.StringIO()
    monkeypatch.setattr(_output, "stdout", Console(file=buf, force_terminal=True, width=100, color_system=None))
    monkeypatch.setattr(_output, "stderr", Console(file=io.StringIO(), force_terminal=True, width=100))
    monkeypatch.setattr(_models, "open_diffusion_engine", lambda p, threads=None, gpu_layers=0, **_: DiffusionEngine(ScriptedModel()))
    monkeypatch.setattr(_terminal.Throttle, "ready", lambda self, force=False: True)  # render every step
    from typer.testing import CliRunner

    r = CliRunner().invoke(cli.app, ["generate", "what is 3+5", "-m", str(tiny_gguf), "--seed", "0"])
    assert r.exit_code == 0, r.stderr
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    assert "canvas 1  step 1/48  T=0.800" in screen  # the status line, live
    assert "accepted " in screen and "mean H=" in screen
    # After the transient live panel: the final answer, on its own line.
    assert [line for line in screen.splitlines() if line.strip()][-1].strip() == "the answer is 8"


@pytest.mark.parametrize("width,height", [(80, 24), (40, 24), (40, 10)])
def test_a_live_panel_never_grows_taller_than_the_terminal(width, height):
    view = render.DiffusionLiveView(piece, detok, end_token_ids=[1], title="diffusion: demo")
    view.on_event(CanvasEvent(canvas_index=0, token_ids=[5, 6, 7, 8] * 200, steps=3, commit_s=0.0))
    view.on_event(step([5, 6, 7, 9] * 64, [True] * 256, index=1, step=2))
    console = Console(record=True, width=width, height=height, file=io.StringIO())
    console.print(view)
    lines = console.export_text().splitlines()
    assert len(lines) <= height - render.LIVE_SPARE_ROWS
    text = " ".join(" ".join(lines).replace("│", " ").split())
    assert "canvas 2 step 2/48" in text and "mean H=" in text  # the status line, whole
    assert ("more line" in text) == (width * height < 80 * 24)  # the canvas cut only where it cannot fit
    assert "The cat sat" in text  # the newest committed line still shows above the canvas
    view.fit = False
    console = Console(record=True, width=width, height=height, file=io.StringIO())
    console.print(view)
    assert len(console.export_text().splitlines()) > height  # printed whole, the terminal scrolls
