"""`dg replay`: show a saved `--trace` again, at a pace a person can follow."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from dgcli.cli import _display, _errors, _options, _output, _terminal, render
from dgcli.engine.types import CanvasEvent, GenerationResult


def replay(
    trace_file: Path = typer.Argument(..., metavar="TRACE", help="A trace written by `dg generate --trace FILE` (dg-trace/1); '-' reads stdin."),
    pace: float = typer.Option(0.3, "--pace", help="Seconds each denoising step stays on screen."),
    thinking: str = _options.ThinkingOpt,
    no_live: bool = _options.NoLiveOpt,
) -> None:
    """Re-render a saved trace: the canvas denoising step by step, as it ran (no model needed)."""
    from dgcli.trace import read_trace

    with _errors.user_errors():
        _options.check_thinking(thinking)
        _options.check_generation_args(1, None, 0, None, pace)
        trace = read_trace(trace_file)
        header = trace.header
        texts: list[str] = []
        model = header.get("model") or {}
        view = render.DiffusionLiveView(
            lambda token: trace.pieces.get(token, f"<{token}>"), lambda ids: "".join(texts),
            end_token_ids=header.get("end_token_ids") or (), pad_token_id=header.get("pad_token_id"),
            title=f"replay: {model.get('name', 'stdin' if str(trace_file) == '-' else trace_file.name)}",
            thinking=thinking)
        live = _terminal.use_live(no_live, False)
        canvases = iter(trace.canvas_texts)
        interrupted, display = False, None
        try:
            with _display.DiffusionDisplay(None, live=live, thinking=thinking, stream_plain=not live, view=view,
                                         pace=pace) as display:
                for event in trace.events:
                    if isinstance(event, CanvasEvent):
                        texts.append(next(canvases))
                    display.on_event(event)
        except KeyboardInterrupt:  # the live view is gone: show the text it had reached, as generate does
            interrupted = True
        answer = "".join(texts)
        if live:
            _output.stdout.print(render.answer_renderable(answer, thinking))
        else:
            streamed = display.streamed_chars if display is not None else 0
            _output.echo_text(answer[streamed:] if thinking == "show" else render.answer_plain(answer, "hide"))
        if interrupted:
            _output.notice("interrupted: the replay stopped here")
            raise typer.Exit(_errors.EXIT_INTERRUPTED)
        result = _recorded_result(trace.result)
        if result is not None:
            _output.notice("recorded: " + render.result_summary(result), style="cyan")
        elif trace.cut_short:
            _output.notice("the trace ends in a cut-off line (its run stopped while writing it); replayed up to there",
                          style="yellow")
        else:
            _output.stderr.print("the trace has no result line (its run stopped early)", style="yellow")


def _recorded_result(doc: dict | None) -> GenerationResult | None:
    if doc is None:
        return None
    names = {f.name for f in dataclasses.fields(GenerationResult)}
    try:
        return GenerationResult(**{k: v for k, v in doc.items() if k in names})
    except TypeError:  # a result line missing fields
        return None
