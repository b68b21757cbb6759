"""The diffusion run as it shows: a live panel, plain status lines with each committed canvas's
text, or nothing; a ticker while a slow forward computes; the trace recorder fed on the way.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from rich.live import Live

from dgcli.cli import _output, _signals, render
from dgcli.cli._output import echo_text, notice
from dgcli.cli._status import StatusLine
from dgcli.cli._terminal import Pacer, Throttle, live_view, refresh
from dgcli.engine.stops import held_back
from dgcli.engine.types import CanvasEvent, GenerationResult, StepEvent
from dgcli.params import DiffusionParams
from dgcli.units import plural


def piece_of(model):
    cache: dict[int, str] = {}

    def piece(token: int) -> str:
        if token not in cache:
            cache[token] = model.detokenize([token])
        return cache[token]

    return piece


def diffusion_view(model, *, title: str, thinking: str, ignore_eos: bool = False) -> render.DiffusionLiveView:
    end_token_ids = () if ignore_eos else getattr(model, "end_token_ids", ())
    return render.DiffusionLiveView(piece_of(model), model.detokenize, end_token_ids,
                                    title=title, thinking=thinking, pad_token_id=getattr(model, "pad_token_id", None))


def trace_recorder(model, sinks: list[Callable[[dict], Any]]):
    from dgcli.trace import TraceRecorder

    return TraceRecorder(piece_of(model), model.detokenize, sinks) if sinks else None


class DiffusionDisplay:
    """What a diffusion generation shows while it runs: a Rich Live panel (its own, transient, or
    `live_obj` shared with compare), or plain status lines on stderr with each committed canvas's
    text on stdout (`stream_plain`: logs and pipes), or nothing. `on_event` is the engine's
    callback; it also feeds a TraceRecorder and holds each step `pace` seconds. Without a panel,
    `status` (a StatusLine) says what the engine computes now; a panel takes its place on screen.
    `activity`: the work before the first step ("prefill of 27 tokens, then step 1")."""

    def __init__(self, model, *, live: bool, thinking: str, title: str = "diffusion", stream_plain: bool = False,
                 recorder=None, live_obj: Optional[Live] = None, view: Optional[render.DiffusionLiveView] = None,
                 pace: float = 0.0, text_to_stderr: bool = False, status: Optional[StatusLine] = None,
                 activity: str = "prefill, then step 1", status_prefix: str = "", stop: Sequence[str] = (),
                 tick: bool = True):
        self.view = view or diffusion_view(model, title=title, thinking=thinking)
        self.live, self.live_obj, self._own = live, live_obj, None
        self.thinking, self.stream_plain, self.recorder = thinking, stream_plain, recorder
        self.text_to_stderr = text_to_stderr  # stdout holds something else (generate --trace -)
        self.throttle, self.pacer, self.pace = Throttle(), Pacer(pace), pace
        self.streamed_chars = 0
        self.ticker: Optional[BusyTicker] = None
        self.status, self.activity, self.status_prefix = status, activity, status_prefix
        self.stop = list(stop)  # stop strings: streamed text holds back what could begin one
        self.tick = tick  # False: the caller runs a BusyTicker over this view (compare's, over both panels)

    def __enter__(self) -> "DiffusionDisplay":
        if self.live and self.live_obj is None:
            if self.status is not None:
                self.status.stop()  # the panel says it from here
            self._own = live_view(self.view)
            self.live_obj = self._own.__enter__()
        if self.live_obj is not None:
            if self.tick:
                self.ticker = BusyTicker(self.live_obj, [self.view])
            self.view.start_activity(self.activity)
            refresh(self.live_obj)
        elif self.status is not None:
            self.status.show(self.status_prefix + self.activity)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.view.busy_since = None
        if self.ticker is not None:
            self.ticker.stop()
        if self._own is not None:
            self._own.__exit__(*exc)
        elif self.live_obj is not None:
            refresh(self.live_obj)

    def on_event(self, ev) -> None:
        self.view.busy_since = None  # the engine is in this callback, not computing
        self.view.on_event(ev)
        if self.recorder is not None:
            self.recorder.on_event(ev)
        if self.live_obj is not None:
            if self.throttle.ready(force=isinstance(ev, CanvasEvent) or self.pace > 0):
                refresh(self.live_obj)
        else:
            if self.stream_plain:
                if isinstance(ev, StepEvent):
                    notice(render.step_status(ev))
                elif isinstance(ev, CanvasEvent) and self.thinking == "show":
                    self._stream_committed_text()
            if self.status is not None:
                self.status.show(self.status_prefix + next_work(ev))
        if isinstance(ev, StepEvent):
            self.pacer.wait()
        if self.live_obj is not None:
            self.view.busy_since = time.monotonic()  # back to the engine: the next forward starts

    def set_activity(self, activity: str) -> None:
        """The work before the first step, once it is known (chat: the new tokens to prefill)."""
        self.activity = activity
        if self.live_obj is not None:
            self.view.start_activity(activity)
            refresh(self.live_obj)
        elif self.status is not None:
            self.status.show(self.status_prefix + activity)

    def _stream_committed_text(self) -> None:
        """Plain mode streams each committed canvas's text as soon as it is final. Text that may reach
        the terminal (stdout a terminal, or a pipe: `| cat`) ends the status line for the rest of the
        run: a redrawn line would erase text written at its place, by dg or by the other end of a pipe
        (a file or /dev/null keeps it)."""
        text = self.view.committed_text
        text = text[:len(text) - held_back(text, self.stop)]
        if len(text) <= self.streamed_chars:
            return
        if self.status is not None and not (not self.text_to_stderr and _output.stdout_is_a_file()):
            self.status.stop()
            self.status = None
        echo_text(text[self.streamed_chars:], nl=False, err=self.text_to_stderr)
        self.streamed_chars = len(text)


def next_work(ev) -> str:
    """What the engine computes after this event: the next step, or the commit of a finished canvas."""
    if isinstance(ev, CanvasEvent):
        return f"canvas {ev.canvas_index + 2}, step 1"
    if ev.stopped or ev.step == ev.max_steps:
        return f"canvas {ev.canvas_index + 1} done after {ev.step} steps; committing it"
    return f"canvas {ev.canvas_index + 1}, step {ev.step + 1}"


class BusyTicker:
    """Redraws a live view twice a second while one of its panels' engines computes something
    slower than render.SLOW_FORWARD_S (a load, a prefill, a forward), so that the panel's "working
    N s" counts up instead of a frozen screen (a step of the real model takes tens of seconds on a
    CPU), and says when a Ctrl-C has arrived that the main thread can only act on once the forward
    returns. A fast model never triggers it. Rich's Live serializes redraws from several threads."""

    def __init__(self, live: Live, views: "list | Callable[[], list]", interval: float = 0.5):
        import threading

        self.live, self.views, self.interval = live, views, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dg-busy-ticker", daemon=True)
        self._thread.start()

    def __enter__(self) -> "BusyTicker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            busy = False
            for view in self.views() if callable(self.views) else self.views:
                view.stopping = _signals.interrupt_pending()
                busy = bool(view.busy_note()) or busy
            if busy:
                self.live.refresh()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_diffusion(engine, prompt, *, params: DiffusionParams, max_new_tokens: int, seed: Optional[int],
                  live: bool, thinking: str, recorder=None, stream_plain: bool = False, title: str = "diffusion",
                  live_obj: Optional[Live] = None, view: Optional[render.DiffusionLiveView] = None,
                  self_cond_top_k: Optional[int] = None, pace: float = 0.0,
                  text_to_stderr: bool = False, ignore_eos: bool = False, status: Optional[StatusLine] = None,
                  status_prefix: str = "", stop: Sequence[str] = (), tick: bool = True) -> GenerationResult:
    """One diffusion generation shown by a DiffusionDisplay; returns the engine's result. A prompt of
    token ids is named by its length in the status ("prefill of 27 tokens")."""
    # Only an explicit choice reaches the engine; otherwise it picks (dense for small vocabularies).
    options: dict[str, Any] = {} if self_cond_top_k is None else {"self_cond_top_k": self_cond_top_k}
    if stop:
        options["stop"] = list(stop)
    if ignore_eos:
        options["ignore_eos"] = True
        view = view or diffusion_view(engine.model, title=title, thinking=thinking, ignore_eos=True)
    activity = f"prefill of {plural(len(prompt), 'token')}, then step 1" if isinstance(prompt, list) \
        else "prefill, then step 1"
    with DiffusionDisplay(engine.model, live=live, thinking=thinking, title=title, stream_plain=stream_plain,
                          recorder=recorder, live_obj=live_obj, view=view, pace=pace,
                          text_to_stderr=text_to_stderr, status=status, activity=activity,
                          status_prefix=status_prefix, stop=stop, tick=tick) as display:
        result = engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, seed=seed,
                                 on_event=display.on_event, **options)
    result._streamed_chars = display.streamed_chars  # type: ignore[attr-defined]
    return result
