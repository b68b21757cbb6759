"""Rich rendering for dg: the live canvas, the AR stream, result/compare/bench tables.

Everything here takes engine events/results and returns renderables or strings, so it is unit-
testable with hand-made StepEvents and never drives a model itself.
"""

from __future__ import annotations

import statistics
from typing import Callable, Iterable, Sequence

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dgcli.engine.types import CanvasEvent, GenerationResult, StepEvent, TokenEvent

# Gemma 4's thinking channel (Transformers' gemma4 response template): the model opens it with
# `<|channel>thought\n` and closes it with `<channel|>`; the answer follows.
THINK_OPEN = "<|channel>thought"
THINK_CLOSE = "<channel|>"

ACCEPTED_STYLE = "bold bright_white"
NOISY_STYLE = "dim"
END_STYLE = "dim italic"
THINKING_STYLE = "dim italic"
MAX_PIECE_CHARS = 16


def split_thinking(text: str) -> tuple[str | None, str]:
    """(thinking, answer). An unclosed thinking channel is all thinking and no answer yet."""
    start = text.find(THINK_OPEN)
    if start < 0:
        return None, text
    before = text[:start]
    rest = text[start + len(THINK_OPEN):].lstrip("\n")
    end = rest.find(THINK_CLOSE)
    if end < 0:
        return rest, before
    return rest[:end].rstrip("\n"), before + rest[end + len(THINK_CLOSE):].lstrip("\n")


def answer_renderable(text: str, thinking: str = "show") -> RenderableType:
    thought, answer = split_thinking(text)
    parts: list[RenderableType] = []
    if thought is not None and thinking == "show":
        parts.append(Text("thinking: " + thought.strip(), style=THINKING_STYLE))
    parts.append(Text(answer.strip()))
    return Group(*parts)


def answer_plain(text: str, thinking: str = "show") -> str:
    thought, answer = split_thinking(text)
    if thought is not None and thinking == "show":
        return f"[thinking] {thought.strip()}\n[answer] {answer.strip()}"
    return answer.strip()


def _visible_piece(piece: str) -> str:
    """Canvas cells show whitespace visibly so the canvas keeps its shape."""
    piece = piece.replace("\n", "⏎").replace("\t", "→")
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


def canvas_text(ev: StepEvent, piece_of: Callable[[int], str], end_token_ids: Iterable[int] = ()) -> Text:
    """The canvas as tokens: accepted this step bright, still-noisy dim, from the first end token on marked."""
    ends = set(int(t) for t in end_token_ids)
    text = Text()
    ended = False
    for i, token in enumerate(ev.argmax_canvas):
        token = int(token)
        if token in ends:
            ended = True
        if ended:
            text.append("▪" if token not in ends else "⟨end⟩", style=END_STYLE)
        else:
            style = ACCEPTED_STYLE if bool(ev.accepted_mask[i]) else NOISY_STYLE
            text.append(_visible_piece(piece_of(token)), style=style)
        text.append(" ")
    return text


class DiffusionLiveView:
    """State for the live diffusion panel: committed text so far + the canvas being denoised."""

    def __init__(self, piece_of: Callable[[int], str], detokenize: Callable[[list[int]], str],
                 end_token_ids: Iterable[int] = (), title: str = "diffusion", thinking: str = "show"):
        self.piece_of, self.detokenize = piece_of, detokenize
        self.end_token_ids = list(end_token_ids)
        self.title, self.thinking = title, thinking
        self.committed_ids: list[int] = []
        self.last_step: StepEvent | None = None
        self.steps_per_canvas: list[int] = []
        self.forwards = 0

    def on_event(self, ev) -> None:
        if isinstance(ev, StepEvent):
            self.last_step = ev
            self.forwards += 1
        elif isinstance(ev, CanvasEvent):
            self.committed_ids.extend(ev.token_ids)
            self.steps_per_canvas.append(ev.steps)
            self.last_step = None

    @property
    def committed_text(self) -> str:
        return self.detokenize(self.committed_ids) if self.committed_ids else ""

    def status(self) -> str:
        if self.last_step is None:
            done = f"{len(self.steps_per_canvas)} canvas(es) committed, {len(self.committed_ids)} tokens"
            return done if self.steps_per_canvas else "prefilling prompt…"
        return step_status(self.last_step)

    def __rich__(self) -> RenderableType:
        parts: list[RenderableType] = []
        if self.committed_ids:
            parts.append(answer_renderable(self.committed_text, self.thinking))
        if self.last_step is not None:
            parts.append(canvas_text(self.last_step, self.piece_of, self.end_token_ids))
        parts.append(Text(self.status(), style="cyan"))
        return Panel(Group(*parts), title=self.title, border_style="magenta")


class AutoregressiveLiveView:
    def __init__(self, title: str = "autoregressive", thinking: str = "show"):
        self.title, self.thinking = title, thinking
        self.pieces: list[str] = []
        self.forward_s = 0.0

    def on_event(self, ev) -> None:
        if isinstance(ev, TokenEvent):
            self.pieces.append(ev.piece)
            self.forward_s += ev.forward_s

    def status(self) -> str:
        rate = len(self.pieces) / self.forward_s if self.forward_s > 0 else 0.0
        return f"tokens {len(self.pieces)}  (one forward each)  {rate:.1f} tok/s forward-only"

    def __rich__(self) -> RenderableType:
        return Panel(Group(answer_renderable("".join(self.pieces), self.thinking),
                           Text(self.status(), style="cyan")), title=self.title, border_style="green")


class SideBySide:
    """Two live panels next to each other (compare)."""

    def __init__(self, left, right):
        self.left, self.right = left, right

    def __rich__(self) -> RenderableType:
        grid = Table.grid(expand=True, padding=(0, 1))
        grid.add_column(ratio=1)
        grid.add_column(ratio=1)
        grid.add_row(self.left, self.right)
        return grid


def result_summary(res: GenerationResult) -> str:
    spc = res.steps_per_canvas
    steps = f"  steps/canvas {','.join(map(str, spc))}" if spc else ""
    flag = "  (interrupted)" if res.interrupted else ""
    return (
        f"{res.n_new_tokens} new tokens in {res.total_s:.2f}s  {res.tokens_per_second:.1f} tok/s  "
        f"{res.decoder_forwards} forwards  {res.tokens_per_forward:.2f} tokens/forward{steps}  "
        f"stop={res.stop_reason}{flag}"
    )


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


COMPARE_COLUMNS = ("metric", "diffusion", "autoregressive")


def compare_rows(diff: GenerationResult, ar: GenerationResult,
                 diff_rss: int | None, ar_rss: int | None) -> list[tuple[str, str, str]]:
    from dgcli.hub import format_bytes

    def spc(r: GenerationResult) -> str:
        return ",".join(map(str, r.steps_per_canvas)) if r.steps_per_canvas else "-"

    return [
        ("new tokens", str(diff.n_new_tokens), str(ar.n_new_tokens)),
        ("wall time (s)", _fmt(diff.total_s), _fmt(ar.total_s)),
        ("tok/s", _fmt(diff.tokens_per_second), _fmt(ar.tokens_per_second)),
        ("forwards", str(diff.decoder_forwards), str(ar.decoder_forwards)),
        ("tokens/forward", _fmt(diff.tokens_per_forward), _fmt(ar.tokens_per_forward)),
        ("steps/canvas", spc(diff), spc(ar)),
        ("peak RSS", format_bytes(diff_rss), format_bytes(ar_rss)),
        ("stop", diff.stop_reason, ar.stop_reason),
    ]


def speedup(diff: GenerationResult, ar: GenerationResult) -> float | None:
    if diff.tokens_per_second > 0 and ar.tokens_per_second > 0:
        return diff.tokens_per_second / ar.tokens_per_second
    return None


def compare_table(diff: GenerationResult, ar: GenerationResult, diff_rss: int | None, ar_rss: int | None,
                  diff_name: str = "diffusion", ar_name: str = "autoregressive") -> Table:
    table = Table(title="diffusion vs autoregressive")
    table.add_column("metric")
    table.add_column(f"diffusion ({diff_name})", justify="right")
    table.add_column(f"autoregressive ({ar_name})", justify="right")
    for row in compare_rows(diff, ar, diff_rss, ar_rss):
        table.add_row(*row)
    s = speedup(diff, ar)
    table.caption = f"speedup (diffusion tok/s ÷ AR tok/s): {_fmt(s)}x" if s is not None else "speedup: n/a"
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


def _mib(mib: float) -> str:
    return f"{mib / 1024:.2f} GiB" if mib >= 1024 else f"{mib:.1f} MiB"


def placement_lines(what: str, report) -> list[str]:
    """An engine.offload.LoadReport as a few lines: layers offloaded, buffers per device, and the
    tensors an override kept in system memory (layer runs merged: blk.{0-9}.ffn_down_exps.weight)."""
    from dgcli.engine.offload import layer_ranges

    if report.offloaded_layers is None:
        lines = [f"{what}: this llama.cpp build has no GPU offload: every weight is in system memory"]
    else:
        lines = [f"{what}: {report.offloaded_layers}/{report.total_layers} layers offloaded to the GPU"]
    if report.buffers:
        lines.append("  buffers: " + ", ".join(f"{name} {kind} {_mib(mib)}" for name, kind, mib in report.buffers))
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
