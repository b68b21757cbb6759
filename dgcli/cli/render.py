"""Rich rendering for dg: the live canvas, the AR stream, result/compare/bench tables.

Everything here takes engine events/results and returns renderables or strings, so it is unit-
testable with hand-made StepEvents and never drives a model itself.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable, Sequence

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dgcli.engine.thinking import split_thinking
from dgcli.engine.types import CanvasEvent, GenerationResult, StepEvent, TokenEvent
from dgcli.units import format_bytes, format_figure, plural

ACCEPTED_STYLE = "bold bright_white"
NOISY_STYLE = "dim"
END_STYLE = "dim italic"
THINKING_STYLE = "dim italic"
MAX_PIECE_CHARS = 16
# a forward this long with nothing on screen moving looks hung: the live view then counts the seconds
SLOW_FORWARD_S = 2.0


# Control characters in model output (a random model emits them; any model can) would move the
# cursor or start escape sequences under the live view: on screen they show as U+FFFD.
_CONTROLS = {c: "\ufffd" for c in [*range(0x00, 0x09), *range(0x0b, 0x20), 0x7f, *range(0x80, 0xa0)]}


def printable(text: str) -> str:
    """Text safe to draw on a terminal: newlines and tabs kept, other control characters replaced."""
    return text.translate(_CONTROLS)


def answer_text(text: str, thinking: str = "show") -> Text:
    """The answer, after its thinking (dimmed) when shown."""
    thought, answer = split_thinking(printable(text))
    out = Text()
    if thought is not None and thinking == "show":
        out.append("thinking: " + thought.strip(), style=THINKING_STYLE)
        if answer.strip():
            out.append("\n")
    out.append(answer.strip())
    return out


def answer_renderable(text: str, thinking: str = "show") -> RenderableType:
    return answer_text(text, thinking)


def answer_plain(text: str, thinking: str = "show") -> str:
    thought, answer = split_thinking(text)
    if thought is not None and thinking == "show":
        return f"[thinking] {thought.strip()}\n[answer] {answer.strip()}"
    return answer.strip()


def _visible_piece(piece: str) -> str:
    """Canvas cells show whitespace visibly so the canvas keeps its shape."""
    piece = printable(piece.replace("\n", "⏎").replace("\t", "→"))
    if len(piece) > MAX_PIECE_CHARS:
        piece = piece[: MAX_PIECE_CHARS - 1] + "…"
    return piece or "∅"


def step_status(ev: StepEvent, canvas_length: int | None = None) -> str:
    n = canvas_length if canvas_length is not None else len(ev.accepted_mask)
    stop = "  [stop]" if ev.stopped else ""
    return (
        f"canvas {ev.canvas_index + 1}  step {ev.step}/{ev.max_steps}  T={ev.temperature:.3f}  "
        f"accepted {ev.n_accepted}/{n}  mean H={ev.mean_entropy:.4f}{stop}"
    )


def canvas_text(ev: StepEvent, piece_of: Callable[[int], str], end_token_ids: Iterable[int] = (),
                pad_token_id: int | None = None) -> Text:
    """The canvas as tokens: accepted this step bright, still-noisy dim; what is not answer (the end
    token, what follows it, padding) marked."""
    ends = set(int(t) for t in end_token_ids)
    text = Text()
    ended = False
    for i, token in enumerate(ev.argmax_canvas):
        token = int(token)
        if token in ends:
            ended = True
        if ended or token == pad_token_id:
            text.append("▪" if token not in ends else "⟨end⟩", style=END_STYLE)
        else:
            style = ACCEPTED_STYLE if bool(ev.accepted_mask[i]) else NOISY_STYLE
            text.append(_visible_piece(piece_of(token)), style=style)
        text.append(" ")
    return text


# Rows a live panel leaves free below itself, so the terminal never scrolls under the live view.
LIVE_SPARE_ROWS = 1
MORE_STYLE = "dim"


def _wrapped(console: Console, text: Text | None, width: int) -> list[Text]:
    return list(text.wrap(console, width)) if text is not None and text.plain else []


def fitted_panel(console: Console, options: ConsoleOptions, *, committed: Text | None, canvas: Text | None,
                 status: Text, title: str, border_style: str, fit: bool = True) -> Panel:
    """A panel no taller than the terminal (fit=True): the status line always, then as much of the
    canvas as fits (its first lines), then the end of the committed text in what is left, so that the
    moving canvas and its status stay in sight however long the answer grows. fit=False: all of it."""
    width = max(options.max_width - 4, 1)  # borders and padding
    room = max(options.max_height - 2 - LIVE_SPARE_ROWS, 1) if fit else 1 << 30
    status_lines = _wrapped(console, status, width)
    canvas_lines = _wrapped(console, canvas, width)
    committed_lines = _wrapped(console, committed, width)
    room -= len(status_lines)
    canvas_room = max(room - (1 if committed_lines else 0), 0)
    if len(canvas_lines) > canvas_room:
        shown = max(canvas_room - 1, 0)
        more = Text(f"… {plural(len(canvas_lines) - shown, 'more line')}", style=MORE_STYLE)
        canvas_lines = (canvas_lines[:shown] + [more])[:canvas_room]
    committed_room = max(room - len(canvas_lines), 0)
    if len(committed_lines) > committed_room:
        # the newest lines, under a "…" when there is room for it
        keep = committed_room - 1 if committed_room > 1 else committed_room
        tail = committed_lines[len(committed_lines) - keep:] if keep else []
        committed_lines = ([Text("…", style=MORE_STYLE)] if committed_room > 1 else []) + tail
    body = Text("\n").join(committed_lines + canvas_lines + status_lines)
    # the title names a model (a file name, a trace's header): text, not markup, as a name may hold "[/x]"
    return Panel(body, title=escape(title), border_style=border_style)


class DiffusionLiveView:
    """The live diffusion panel: committed text so far + the canvas being denoised + a status line.

    Everything it shows is computed when an event arrives, never while drawing: the view can be
    redrawn after its model is closed (compare redraws it while the AR side runs). The one exception,
    `busy_note`, reads only the clock."""

    def __init__(self, piece_of: Callable[[int], str], detokenize: Callable[[list[int]], str],
                 end_token_ids: Iterable[int] = (), title: str = "diffusion", thinking: str = "show",
                 pad_token_id: int | None = None):
        self.piece_of, self.detokenize = piece_of, detokenize
        self.end_token_ids = list(end_token_ids)
        self.pad_token_id = pad_token_id
        self.title, self.thinking = title, thinking
        self.committed_ids: list[int] = []
        self.committed_text = ""
        self.last_step: StepEvent | None = None
        self.canvas: Text | None = None
        self.steps_per_canvas: list[int] = []
        self.forwards = 0
        self.note = ""  # shown after the status (e.g. "interrupted")
        self.fit = True  # live: no taller than the terminal; False: the whole text (a final print)
        # since when the engine has been computing with no event (a step of the real model takes tens
        # of seconds on a CPU): a live view says so, or the screen looks hung. None: not computing.
        self.busy_since: float | None = None
        self.stopping = False  # a Ctrl-C came during that forward: the work stops when it returns

    def on_event(self, ev) -> None:
        if isinstance(ev, StepEvent):
            self.last_step = ev
            self.forwards += 1
            self.canvas = canvas_text(ev, self.piece_of, self.end_token_ids, self.pad_token_id)
        elif isinstance(ev, CanvasEvent):
            self.committed_ids.extend(ev.token_ids)
            self.committed_text = self.detokenize(self.committed_ids) if self.committed_ids else ""
            self.steps_per_canvas.append(ev.steps)
            self.last_step = None
            self.canvas = None

    def status(self) -> str:
        if self.last_step is None:
            done = (f"{plural(len(self.committed_ids), 'token')}, "
                    f"{plural(len(self.steps_per_canvas), 'canvas', 'canvases')}")
            # no event comes between the prompt's forward and the first step's
            status = done if self.steps_per_canvas else "prefilling prompt, then step 1…"
        else:
            status = step_status(self.last_step)
        return status + self.busy_note() + (f"  {self.note}" if self.note else "")

    def busy_note(self, now: float | None = None) -> str:
        """"  working 12 s": how long the engine has been on the next forward, once that is long enough
        to look like a hang (the first forward counts from the start: the prompt, then step 1)."""
        if self.busy_since is None:
            return ""
        waited = (time.monotonic() if now is None else now) - self.busy_since
        if waited < SLOW_FORWARD_S:
            return ""
        return f"  working {waited:.0f} s" + (", stopping after this forward (Ctrl-C again: now)"
                                              if self.stopping else "")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        committed = answer_text(self.committed_text, self.thinking) if self.committed_text else None
        yield fitted_panel(console, options, committed=committed, canvas=self.canvas,
                           status=Text(self.status(), style="cyan"), title=self.title, border_style="magenta",
                           fit=self.fit)


class AutoregressiveLiveView:
    def __init__(self, title: str = "autoregressive", thinking: str = "show"):
        self.title, self.thinking = title, thinking
        self.pieces: list[str] = []
        self.forward_s = 0.0
        self.timed = 0  # tokens whose forward forward_s holds (the first token's came from the prefill: 0 s)
        self.note = ""
        self.fit = True

    def on_event(self, ev) -> None:
        if isinstance(ev, TokenEvent):
            self.pieces.append(ev.piece)
            self.forward_s += ev.forward_s
            self.timed += ev.forward_s > 0

    def status(self) -> str:
        if not self.pieces and not self.note:
            return "waiting for the diffusion side…"
        if not self.fit:  # printed once the run is over: the table has the rates
            return plural(len(self.pieces), "token") + (f"  {self.note}" if self.note else "")
        rate = self.timed / self.forward_s if self.forward_s > 0 else None  # None: only the prefill's token yet
        status = f"{plural(len(self.pieces), 'token')}, one forward each  {_fmt(rate, 1)} tok/s (forwards only)"
        return status + (f"  {self.note}" if self.note else "")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        text = "".join(self.pieces)
        yield fitted_panel(console, options, committed=answer_text(text, self.thinking) if text else None,
                           canvas=None, status=Text(self.status(), style="cyan"), title=self.title,
                           border_style="green", fit=self.fit)


# the narrowest panel compare shows side by side; below it (a terminal under 61 columns) the panels
# stack: at 40 columns each half held 14 characters of text and "diffusion: demo" read "diffusion: dem"
SIDE_BY_SIDE_MIN_COLUMNS = 30


class SideBySide:
    """Two live panels next to each other (compare); one above the other on a narrow terminal."""

    def __init__(self, left, right):
        self.left, self.right = left, right

    def whole(self) -> "SideBySide":
        """Both panels with all their text, for printing once the live view is gone."""
        self.left.fit = self.right.fit = False
        return self

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if (options.max_width - 1) // 2 >= SIDE_BY_SIDE_MIN_COLUMNS:  # two columns and the space between
            grid = Table.grid(expand=True, padding=(0, 1))
            grid.add_column(ratio=1)
            grid.add_column(ratio=1)
            grid.add_row(self.left, self.right)
            yield grid
            return
        # stacked: a live panel fits half the height (fitted_panel reads max_height), so both stay in sight
        upper = max(options.max_height // 2, 1)
        for view, rows in ((self.left, upper), (self.right, max(options.max_height - upper, 1))):
            view_options = options.copy()
            view_options.max_height = rows
            yield from console.render(view, view_options)


def result_summary(res: GenerationResult) -> str:
    """One line: answer tokens (answer_token_ids), time, tok/s, forwards, tokens per forward, stop, seed."""
    spc = res.steps_per_canvas
    steps = f"  steps/canvas {','.join(map(str, spc))}" if spc else ""
    flag = "  (interrupted)" if res.interrupted else ""
    seed = f"  seed {res.seed}" if res.seed is not None else ""
    return (
        f"{plural(res.n_new_tokens, 'new token')} in {format_figure(res.total_s, 2, significant=1)}s  {_fmt(res.tokens_per_second, 1)} tok/s  "
        f"{plural(res.decoder_forwards, 'forward')}  {format_figure(res.tokens_per_forward)} tokens/forward{steps}  "
        f"stop={res.stop_reason}{seed}{flag}"
    )


def _fmt(value: float | None, digits: int = 2, significant: int = 2) -> str:
    return "-" if value is None else format_figure(value, digits, significant)


def compare_rows(diff: GenerationResult, ar: GenerationResult,
                 diff_rss: int | None, ar_rss: int | None) -> list[tuple[str, str, str]]:
    """The comparison, metric by metric; token counts and rates count answer tokens (answer_token_ids)."""

    def spc(r: GenerationResult) -> str:
        return ",".join(map(str, r.steps_per_canvas)) if r.steps_per_canvas else "-"

    return [
        ("new tokens", str(diff.n_new_tokens), str(ar.n_new_tokens)),
        ("wall time (s)", _fmt(diff.total_s, significant=1), _fmt(ar.total_s, significant=1)),
        ("tok/s", _fmt(diff.tokens_per_second), _fmt(ar.tokens_per_second)),
        ("forwards", str(diff.decoder_forwards), str(ar.decoder_forwards)),
        ("tokens/forward", _fmt(diff.tokens_per_forward), _fmt(ar.tokens_per_forward)),
        ("steps/canvas", spc(diff), spc(ar)),
        ("peak RSS", format_bytes(diff_rss), format_bytes(ar_rss)),
        ("stop", diff.stop_reason, ar.stop_reason),
    ]


def speedup(diff: GenerationResult, ar: GenerationResult) -> float | None:
    if diff.tokens_per_second and ar.tokens_per_second:  # None: no rate (AR: its only token came from the prefill)
        return diff.tokens_per_second / ar.tokens_per_second
    return None


def compare_table(diff: GenerationResult, ar: GenerationResult, diff_rss: int | None, ar_rss: int | None,
                  diff_name: str = "diffusion", ar_name: str = "autoregressive", quant=None) -> Table:
    """The comparison; `quant` (dgcli.modelfile.info.QuantPair) adds the files' quantization types as a
    row, and says in the caption when they differ."""
    # the names are the models' (file names): text, not markup, as a name may hold "[/x]"
    table = Table(title=escape(f"{diff_name} (diffusion) vs {ar_name} (AR)"))
    # narrow terminals fold long values rather than cut them to `end_tok…`
    table.add_column("metric", overflow="fold")
    table.add_column("diffusion", justify="right", overflow="fold")
    table.add_column("AR", justify="right", overflow="fold")
    for row in compare_rows(diff, ar, diff_rss, ar_rss):
        table.add_row(*row)
    if quant is not None:
        table.add_row("quantization", quant.diffusion or "?", quant.autoregressive or "?")
    s = speedup(diff, ar)
    table.caption = (f"speedup (diffusion tok/s ÷ AR tok/s): {_fmt(s)}x" if s is not None
                     else "speedup: n/a (a side made no answer token after the prefill)") + f"; seed {diff.seed}"
    if quant is not None and quant.mismatch_words():
        table.caption += f"; {quant.mismatch_words()}"
    return table


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    if not values:
        return (float("nan"),) * 3
    return statistics.median(values), min(values), max(values)


def fmt_spread(values: Sequence[float], digits: int = 2) -> str:
    if not values:
        return "-"
    med, lo, hi = spread(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def placement_lines(what: str, report, target: str = "the GPU") -> list[str]:
    """A runtime.offload.LoadReport as a few lines: layers offloaded (to `target`: the GPU, or the RPC
    workers), buffers per device, and the tensors an override kept in system memory (layer runs merged:
    blk.{0-9}.ffn_down_exps.weight)."""
    from dgcli.runtime.offload import layer_ranges

    if report.offloaded_layers is None:
        lines = [f"{what}: every weight is in system memory: {report.why_cpu_only()}"]
    else:
        lines = [f"{what}: {report.offloaded_layers}/{report.total_layers} layers offloaded to {target}"]
    if report.buffers:
        # as llama.cpp logs them, in MiB to 2 decimals: converted to kB or MB they would read as more
        # precise than they are, and a buffer under 0.005 MiB as none
        lines.append("  buffers: " + ", ".join(f"{name} {kind} {mib:.2f} MiB" for name, kind, mib in report.buffers))
    runs: dict[tuple[str, str], set[int]] = {}
    for tensor, buft in report.overridden:
        layer, _, rest = tensor.removeprefix("blk.").partition(".")
        key = (rest, buft) if layer.isdigit() else (tensor, buft)
        runs.setdefault(key, set()).update([int(layer)] if layer.isdigit() else [])
    for (rest, buft), layers in runs.items():
        ranges = layer_ranges(layers)
        name = rest if not layers else f"blk.{ranges}.{rest}" if len(layers) == 1 else f"blk.{{{ranges}}}.{rest}"
        lines.append(f"  kept in system memory ({buft}): {name}")
    return lines
