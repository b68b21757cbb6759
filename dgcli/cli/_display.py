"""The diffusion run as it shows: a live panel, plain status lines with each committed canvas's
text, or nothing; a ticker while a slow forward computes; the trace recorder fed on the way.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from rich.live import Live

from dgcli.cli import _signals, render
from dgcli.cli._output import echo_text, notice
from dgcli.cli._terminal import Pacer, Throttle, live_view, refresh
from dgcli.engine.types import CanvasEvent, GenerationResult, StepEvent
from dgcli.params import DiffusionParams


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
    callback; it also feeds a TraceRecorder and holds each step `pace` seconds."""

    def __init__(self, model, *, live: bool, thinking: str, title: str = "diffusion", stream_plain: bool = False,
                 recorder=None, live_obj: Optional[Live] = None, view: Optional[render.DiffusionLiveView] = None,
                 pace: float = 0.0, text_to_stderr: bool = False):
        self.view = view or diffusion_view(model, title=title, thinking=thinking)
        self.live, self.live_obj, self._own = live, live_obj, None
        self.thinking, self.stream_plain, self.recorder = thinking, stream_plain, recorder
        self.text_to_stderr = text_to_stderr  # stdout holds something else (generate --trace -)
        self.throttle, self.pacer, self.pace = Throttle(), Pacer(pace), pace
        self.streamed_chars = 0
        self.ticker: Optional[BusyTicker] = None

    def __enter__(self) -> "DiffusionDisplay":
        if self.live and self.live_obj is None:
            self._own = live_view(self.view)
            self.live_obj = self._own.__enter__()
        if self.live_obj is not None:
            self.view.busy_since = time.monotonic()
            self.ticker = BusyTicker(self.live_obj, self.view)
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
        elif self.stream_plain:
            if isinstance(ev, StepEvent):
                notice(render.step_status(ev))
            elif isinstance(ev, CanvasEvent) and self.thinking == "show":
                # Plain mode streams each committed canvas's text as soon as it is final.
                text = self.view.committed_text
                echo_text(text[self.streamed_chars:], nl=False, err=self.text_to_stderr)
                self.streamed_chars = len(text)
        if isinstance(ev, StepEvent):
            self.pacer.wait()
        if self.ticker is not None:
            self.view.busy_since = time.monotonic()  # back to the engine: the next forward starts


class BusyTicker:
    """Redraws a live view about once a second while its engine computes a forward slower than
    render.SLOW_FORWARD_S, so that the view's "working N s" counts up instead of a frozen screen (a
    step of the real model takes tens of seconds on a CPU), and says when a Ctrl-C has arrived that
    the main thread can only act on once the forward returns. A fast model never triggers it. Rich's
    Live serializes redraws from several threads."""

    def __init__(self, live: Live, view: render.DiffusionLiveView, interval: float = 1.0):
        import threading

        self.live, self.view, self.interval = live, view, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dg-busy-ticker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.view.stopping = _signals.interrupt_pending()
            if self.view.busy_note():
                self.live.refresh()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_diffusion(engine, prompt, *, params: DiffusionParams, max_new_tokens: int, seed: Optional[int],
                  live: bool, thinking: str, recorder=None, stream_plain: bool = False, title: str = "diffusion",
                  live_obj: Optional[Live] = None, view: Optional[render.DiffusionLiveView] = None,
                  self_cond_top_k: Optional[int] = None, pace: float = 0.0,
                  text_to_stderr: bool = False, ignore_eos: bool = False) -> GenerationResult:
    """One diffusion generation shown by a DiffusionDisplay; returns the engine's result."""
    # Only an explicit choice reaches the engine; otherwise it picks (dense for small vocabularies).
    options = {} if self_cond_top_k is None else {"self_cond_top_k": self_cond_top_k}
    if ignore_eos:
        options["ignore_eos"] = True
        view = view or diffusion_view(engine.model, title=title, thinking=thinking, ignore_eos=True)
    with DiffusionDisplay(engine.model, live=live, thinking=thinking, title=title, stream_plain=stream_plain,
                          recorder=recorder, live_obj=live_obj, view=view, pace=pace,
                          text_to_stderr=text_to_stderr) as display:
        result = engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, seed=seed,
                                 on_event=display.on_event, **options)
    result._streamed_chars = display.streamed_chars  # type: ignore[attr-defined]
    return result
