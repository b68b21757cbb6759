"""What the dg commands share: consoles, one-line errors, model resolution, engine seams, options,
the diffusion run with its live view. Commands reach these through the module (`shared.X`), so tests
can replace a seam (`open_diffusion_engine`, `stdout`, ...) in one place."""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import typer
from rich.console import Console, ConsoleOptions, RenderResult
from rich.control import Control
from rich.live import Live
from rich.live_render import LiveRender
from rich.segment import ControlType, Segment

from dgcli import hub, info as ginfo, render, textfile
from dgcli.commands import _signals
from dgcli.engine.header import read_header
from dgcli.engine.hparams import sampler_defaults
from dgcli.engine.types import (CanvasEvent, DgError, DiffusionParams, GenerationResult, InvalidParameter, StepEvent,
                               check_utf8)
from dgcli.outputs import OutputFile
from dgcli.registry import DEFAULT_MODEL, Registry, ResolvedModel, missing_shipped_message

EXIT_INTERRUPTED = 130
LIVE_REFRESH_S = 1 / 15
# A prompt file or piped prompt larger than this is a mistake (a 262k-token context is ~1 MB of text).
MAX_PROMPT_BYTES = 16 << 20


def _pipe_width() -> Optional[int]:
    """Tables stay readable when piped (Rich would otherwise assume 80 columns): COLUMNS, or 120 when
    it is not a positive integer (as Rich, which ignores such a value)."""
    if sys.stdout.isatty():
        return None
    columns = os.environ.get("COLUMNS", "").strip()
    return int(columns) if columns.isascii() and columns.isdigit() and int(columns) > 0 else 120


def _dumb_terminal_size(stream: Any) -> tuple[Optional[int], Optional[int]]:
    """(columns, lines) of a dumb terminal (TERM=dumb or unknown, as Rich tells one) that `stream` is,
    else (None, None): Rich takes such a terminal for 80x25 whatever its size and COLUMNS say, so on a
    40-column one every table and line was laid out for 80, broken up by the terminal's wrapping."""
    if os.environ.get("TERM", "").lower() not in ("dumb", "unknown"):
        return None, None
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):  # not a terminal
        return None, None
    columns, lines = os.environ.get("COLUMNS", ""), os.environ.get("LINES", "")  # checked by cli
    return (int(columns) if columns.isdigit() else size.columns) or 80, (int(lines) if lines.isdigit() else size.lines) or 25


_PIPE_WIDTH = _pipe_width()
_STDOUT_DUMB, _STDERR_DUMB = _dumb_terminal_size(sys.stdout), _dumb_terminal_size(sys.stderr)
stdout = Console(highlight=False, width=_PIPE_WIDTH or _STDOUT_DUMB[0], height=_STDOUT_DUMB[1])
stderr = Console(stderr=True, highlight=False, width=_STDERR_DUMB[0], height=_STDERR_DUMB[1])


def fail(message: str, code: int = 1) -> "typer.Exit":
    # One line, whatever the message contained; no control characters (a key or tensor name quoted from
    # a file may hold an escape sequence, which click passes to a terminal and, for OSC, even to a pipe)
    typer.echo("error: " + render.printable(" ".join(str(message).split())), err=True)
    return typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """DgError (and a missing native layer) become one line on stderr and exit 1."""
    try:
        yield
    except InvalidParameter as err:
        raise fail(flag_message(err)) from None
    except DgError as err:
        raise fail(str(err), err.exit_code) from None
    except ImportError as err:
        raise fail(f"native layer unavailable ({err}); build it with `make setup` (python native/build.py)") from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


# engine parameters whose flag has another name
_FLAG_PARAMETERS = {"max_denoising_steps": "steps"}


def flag_message(err: InvalidParameter) -> str:
    """An engine parameter the user typed as a flag, named as that flag: "invalid --n-cpu-moe 1000"
    rather than the engine's "invalid n_cpu_moe=1000"."""
    parameter = _FLAG_PARAMETERS.get(err.name, err.name)
    if not typed_option(parameter):
        return str(err)
    value = err.value if isinstance(err.value, (int, float)) and not isinstance(err.value, bool) else repr(err.value)
    return f"invalid --{parameter.replace('_', '-')} {value}: must be {err.allowed}"


# ---------------------------------------------------------------- model resolution / pulling


ROLE_NAMES = {"diffusion": "a diffusion", "ar": "an autoregressive"}


def registry() -> Registry:
    return Registry.load()


def download_with_progress(resolved: ResolvedModel) -> Path:
    """hub.download with a progress bar for the transfer and one for the sha256 pass after it.
    Ctrl-C keeps the partial file for the next `dg pull` and exits 130."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
    from rich.markup import escape
    from rich.table import Column

    # One line per bar at any width (a fixed 40-cell bar beside the registry's file names pushed a
    # 16 GB file's unit onto a line of its own at 80 columns): the name is cut to what the figures
    # leave, the bar takes the rest, and under 60 columns only the name, the bytes and the speed stay.
    def fixed() -> Column:
        return Column(no_wrap=True)

    def columns_for(width: int) -> list:
        name_column = TextColumn("[bold]{task.description}",
                                 table_column=Column(no_wrap=True, overflow="ellipsis", max_width=max(10, width - 52)))
        figures = [DownloadColumn(table_column=fixed()), TransferSpeedColumn(table_column=fixed())]
        return ([name_column, BarColumn(bar_width=None), *figures, TimeRemainingColumn(table_column=fixed())]
                if width >= 60 else [name_column, *figures])

    class FittedProgress(Progress):
        """The columns for the terminal's width when drawn: chosen once, at the start, a terminal made
        narrower then cut the figures ("diffusiongemma-26B-A4B-it-Q4_K_M… 0.0/50.… -…")."""

        def get_renderables(self):
            self.columns = tuple(columns_for(stderr.width))
            yield from super().get_renderables()

    # Started on the first byte count, so a missing repo/file or a full disk prints only its error.
    progress = anchored(FittedProgress(*columns_for(stderr.width), console=stderr, transient=False, expand=True))
    tasks: dict[str, Any] = {}

    def bar(description: str):
        def update(done: int, total: int | None) -> None:
            if description not in tasks:
                progress.start()
                # text, not markup: the name column formats "[bold]{task.description}" (a "[/x]" was a MarkupError)
                tasks[description] = progress.add_task(escape(description), total=total)
            progress.update(tasks[description], completed=done, total=total)
        return update

    name = resolved.filename or "download"
    try:
        with echo_off():  # as under a live view: a `^C` echoed past a full-width bar left a copy of it
            return hub.download(resolved.repo, resolved.filename, approx_size=resolved.approx_size_bytes,
                                on_progress=bar(name), on_verify=bar("sha256 check"),
                                on_wait=lambda line: notice(line, style="yellow"))
    except KeyboardInterrupt:
        progress.stop()
        notice(f"interrupted: run `dg pull {resolved.display_name}` to continue the download "
               "(the partial file is never loaded)")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    finally:
        progress.stop()


def ensure_local(resolved: ResolvedModel, *, yes: bool) -> Path:
    """The model's file on disk, pulling it first (after asking) when it is a registry model."""
    if resolved.path is not None:
        return resolved.path
    if resolved.entry is not None and resolved.entry.shipped is not None:
        raise DgError(missing_shipped_message(resolved))
    size = hub.format_bytes(resolved.approx_size_bytes)
    if not yes:
        if not sys.stdin.isatty():
            raise DgError(
                f"{resolved.display_name} is not downloaded (~{size}); run `dg pull {resolved.display_name}` or pass --yes"
            )
        if not typer.confirm(f"{resolved.display_name} (~{size}) is not downloaded. Download it from {resolved.repo} now?"):
            raise DgError(f"{resolved.display_name} not downloaded")
    return download_with_progress(resolved)


def resolve_model(spec: Optional[str], *, yes: bool, want: str,
                  option: str = "--model") -> tuple[ResolvedModel, Path]:
    resolved = registry().resolve(DEFAULT_MODEL if spec is None else spec, what=f"{option} value")
    if resolved.role is not None and resolved.role != want:
        raise DgError(f"{resolved.display_name} is {ROLE_NAMES[resolved.role]} model; this needs "
                      f"{ROLE_NAMES[want]} model (see `dg list`)")
    return resolved, ensure_local(resolved, yes=yes)


def resolve_pair(diff: ResolvedModel, ar_spec: Optional[str], *, yes: bool) -> tuple[ResolvedModel, Path]:
    if ar_spec is not None:  # --ar-model "" is an error, not the registry pair
        return resolve_model(ar_spec, yes=yes, want="ar", option="--ar-model")
    pair = registry().pair_of(diff)
    if pair is None:
        raise DgError(f"{diff.display_name} has no registry pair; pass --ar-model NAME|PATH")
    return pair, ensure_local(pair, yes=yes)


def preflight(path: Path, *, diffusion: bool, command: str, gpu_layers: int, n_cpu_moe: int = 0,
              ctx_size: Optional[int] = None, n_seq: int = 1) -> None:
    """The file's architecture and header, then whether its weights and the KV cache of the context
    asked for (-c/--ctx-size: n_seq sequences of ctx_size cells; None: the default, small) fit."""
    ginfo.check_architecture(path, diffusion=diffusion, command=command)
    ginfo.check_fits_memory(path, n_gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe, n_ctx=ctx_size, n_seq=n_seq)


def resolve_offload(gpu_layers: int, n_cpu_moe: Optional[int], cpu_moe: bool) -> tuple[int, int]:
    """(gpu_layers, n_cpu_moe) for the engines from --gpu-layers / --n-cpu-moe / --cpu-moe.

    Keeping experts in RAM only means something when the rest is offloaded, so --n-cpu-moe and
    --cpu-moe offload every layer unless --gpu-layers says how many."""
    if cpu_moe and n_cpu_moe is not None:
        raise DgError("pass --cpu-moe or --n-cpu-moe N, not both")
    if n_cpu_moe is not None and n_cpu_moe < 0:
        raise DgError(f"invalid --n-cpu-moe {n_cpu_moe}: must be an integer >= 0 (--cpu-moe keeps every layer's experts)")
    experts = -1 if cpu_moe else (n_cpu_moe or 0)
    if experts and gpu_layers == 0 and not typed_option("gpu_layers"):
        gpu_layers = -1
    return gpu_layers, experts


def typed_option(name: str) -> bool:
    """Whether the user gave the running command's parameter `name` (e.g. `--gpu-layers 0`), rather than
    it holding its default; False outside a command."""
    try:  # typer >= 0.20 vendors click
        from typer._click.core import ParameterSource
        from typer._click.globals import get_current_context
    except ImportError:  # pragma: no cover - older typer on real click
        from click.core import ParameterSource
        from click.globals import get_current_context
    ctx = get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def rpc_placement(rpc: Optional[str], gpu_layers: int) -> tuple[Optional[list[str]], int]:
    """(RPC workers, layers to offload) from --rpc and --gpu-layers: with workers and no --gpu-layers,
    every layer goes to them."""
    if rpc is None:
        return None, gpu_layers
    from dgcli.engine import rpc as rpc_backend

    # a worker lost mid-run ends the process from ggml's thread: as a signal would, not leaving a
    # half-written --trace/--output behind or the terminal's cursor hidden
    rpc_backend.exit_process = _signals.exit_now
    return rpc_backend.parse_endpoints(rpc), gpu_layers or (0 if typed_option("gpu_layers") else -1)


def rpc_option(rpc_servers: Optional[list[str]]) -> dict:
    """The engine seams' keyword for RPC workers, passed only when there are some."""
    return {"rpc": rpc_servers} if rpc_servers else {}


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def report_placement(what: str, model) -> None:
    """--verbose: where llama.cpp put this model's weights, from its load log."""
    report = getattr(model, "load_report", None)
    if report is not None:
        target = "the RPC workers" if getattr(model, "rpc_devices", None) is not None else "the GPU"
        for line in render.placement_lines(what, report, target):  # one line each when piped, as notice()
            stderr.print(line, markup=False, highlight=False, soft_wrap=not stderr.is_terminal)


def notice(text: str, style: Optional[str] = None) -> None:
    """A line on stderr: word-wrapped at a terminal's width (a terminal cuts words), one line when piped
    (for logs and grep)."""
    _end_text_line()
    stderr.print(text, style=style, markup=False, highlight=False, soft_wrap=not stderr.is_terminal)


def print_table(table: Any, console: Optional[Console] = None) -> None:
    """A Rich table on stdout (or `console`): on a terminal as Rich lays it out; piped, its title and
    caption each one line of their own, for logs and grep (Rich centred both on the table's width,
    padding them with spaces, and wrapped a caption at that width)."""
    console = console or stdout
    if console.is_terminal:
        console.print(table)
        return
    title, caption = table.title, table.caption
    table.title = table.caption = None
    try:
        if title:
            console.print(title, soft_wrap=True)  # markup-escaped text, or a Text
        console.print(table)
        if caption:
            console.print(caption, soft_wrap=True)
    finally:
        table.title, table.caption = title, caption


def placement_of(model) -> Optional[dict]:
    """Where llama.cpp put a loaded model's weights (engine.offload.LoadReport.to_json()), for --json:
    the figures beside it are that device's."""
    report = getattr(model, "load_report", None)
    return report.to_json() if report is not None else None


def warn_if_not_offloaded(what: str, model, gpu_layers: int) -> None:
    """--gpu-layers asked for a GPU and llama.cpp put every weight in system memory: say so and why,
    since the speed shown is then the CPU's."""
    report = getattr(model, "load_report", None)
    missed = report.offload_missed(gpu_layers) if report is not None else None
    if missed:
        notice(f"warning: {_offload_asked_by(gpu_layers)}: {missed}; the {what} runs on the CPU")


def _offload_asked_by(gpu_layers: int) -> str:
    """The flag that asked for the offload, as the user typed it: --cpu-moe / --n-cpu-moe offload every
    layer when --gpu-layers is not given (resolve_offload), and a warning about --gpu-layers -1 named a
    flag nobody had typed."""
    if not typed_option("gpu_layers"):
        for name, flag in (("cpu_moe", "--cpu-moe"), ("n_cpu_moe", "--n-cpu-moe")):
            if typed_option(name):
                return f"{flag} (which offloads every layer but the experts it keeps)"
    return f"--gpu-layers {gpu_layers}"


# ---------------------------------------------------------------- engines (seams for tests)


def open_diffusion_engine(path: Path, *, threads: Optional[int], gpu_layers: int, n_cpu_moe: int = 0,
                          ctx_size: Optional[int] = None, verbose: bool = False, rpc: Optional[list[str]] = None):
    from dgcli.engine.diffusion import DiffusionEngine

    engine = DiffusionEngine(str(path), n_threads=threads, n_gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe, n_ctx=ctx_size,
                             rpc_servers=rpc)
    warn_if_not_offloaded("diffusion model", engine.model, gpu_layers)
    if verbose:
        report_placement(f"diffusion model {path.name}", engine.model)
    return engine


def open_speed_model(path: Path, n_seq_max: int, *, threads: Optional[int], gpu_layers: int, n_cpu_moe: int = 0,
                     rpc: Optional[list[str]] = None):
    """The diffusion weights loaded with room for `n_seq_max` canvases in one forward (bench's batch sweep)."""
    from dgcli.engine.model import DiffusionModel

    model = DiffusionModel(str(path), n_threads=threads, n_gpu_layers=gpu_layers, n_seq_max=n_seq_max,
                           n_cpu_moe=n_cpu_moe, rpc_servers=rpc)
    warn_if_not_offloaded("speed model", model, gpu_layers)
    return model


def open_ar_engine(path: Path, *, threads: Optional[int], gpu_layers: int, n_cpu_moe: int = 0,
                   ctx_size: Optional[int] = None, verbose: bool = False, rpc: Optional[list[str]] = None):
    from dgcli.engine.autoregressive import AutoregressiveEngine

    engine = AutoregressiveEngine(str(path), n_threads=threads, n_gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                                  n_ctx=ctx_size, rpc_servers=rpc)
    warn_if_not_offloaded("autoregressive model", engine.model, gpu_layers)
    if verbose:
        report_placement(f"autoregressive model {path.name}", engine.model)
    return engine


# ---------------------------------------------------------------- prompt / params / outputs


def read_prompt(argument: Optional[str], option: Optional[str] = None, file: Optional[Path] = None) -> str:
    """The prompt from the argument, -p/--prompt, -f/--file or stdin ('-', or nothing with piped input).
    Text read from a file or a pipe loses its trailing newline, as llama-cli's -f does: `echo` adds one."""
    given = [v for v in (argument, option) if v is not None] + ([file] if file is not None else [])
    if len(given) > 1:
        raise DgError("the prompt was given twice: pass it as an argument, with -p/--prompt, or with -f/--file")
    text = argument if argument is not None else option
    if text is not None and text != "-":
        text = argument_text(text, "the prompt from the command line")
    if file is not None and str(file) != "-":
        text = read_text_file(file, "prompt file").rstrip("\r\n")
    elif text is None or text == "-" or file is not None:
        if text is None and file is None and sys.stdin.isatty():
            raise DgError("no prompt: pass one as an argument, with -p/--prompt or -f/--file, or pipe it on stdin")
        text = decode_prompt(sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1), "stdin").rstrip("\r\n")
    if not text.strip():
        raise DgError("empty prompt")
    return text


def argument_text(text: str, what: str) -> str:
    """A command-line argument as the UTF-8 text its bytes spell, whatever the locale: Python decodes
    argv with the locale's encoding, so under LC_ALL=C (without its UTF-8 mode) "héllo" arrives as
    lone surrogates, one per byte, and was refused as not UTF-8. Bytes that are not UTF-8 are refused,
    naming the first."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        text = os.fsencode(text).decode("utf-8", "surrogateescape")  # the bytes as given, then as UTF-8
    check_utf8(text, what)
    return text


def decode_prompt(data: bytes, source: str) -> str:
    if len(data) > MAX_PROMPT_BYTES:
        raise DgError(f"the prompt from {source} is larger than {MAX_PROMPT_BYTES >> 20} MB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DgError(f"the prompt from {source} is not UTF-8 text (byte {err.start})") from None


def read_text_file(path: Path, what: str) -> str:
    """A regular file's UTF-8 text (never a device or a FIFO that would block or never end)."""
    return textfile.read_text_file(path, what=what, max_bytes=MAX_PROMPT_BYTES)


def prompt_messages(text: str, system: Optional[str]) -> list[dict]:
    """The chat messages of one turn: the system prompt (if any), then the user's text."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def echo_text(text: str, *, nl: bool = True, err: bool = False) -> None:
    """Model text (an answer, a replayed trace's) on stdout or stderr: as it is into a pipe or a file,
    which may want every byte (color=True: click would strip what looks like a color code from it); on
    a terminal with its control characters shown as U+FFFD, as the live view shows them, so that the
    text cannot move the cursor, clear the screen or retitle the window."""
    stream = sys.stderr if err else sys.stdout
    if stream is not None and stream.isatty():
        text = render.printable(text)
    typer.echo(text, nl=nl, err=err, color=True)
    if text or nl:
        _mid_line["stderr" if err else "stdout"] = not (nl or text.endswith("\n"))


# echo_text left that stream in the middle of a line (plain streaming writes each canvas's text as
# it is final, without a newline): a notice starts a line of its own (see _end_text_line)
_mid_line = {"stdout": False, "stderr": False}


def _end_text_line() -> None:
    """Before a notice on stderr: end the line that streamed text left open where the notice would
    follow it: on stderr, or on the terminal, where stdout's text shows too (directly, or through
    `| cat`, `| tee`), or in the one file or pipe both streams go to (`> run.log 2>&1`, `2>&1 | cat`);
    stdout keeps its bytes. A status line glued to the text ("...ROMEO TANGO canvas 2  step 1/48
    T=0.800 ...") ran past the terminal's edge."""
    if _mid_line["stderr"] or (_mid_line["stdout"] and (stderr.is_terminal or _one_stream())):
        typer.echo("", err=True)
    _mid_line.update(stdout=False, stderr=False)


def _one_stream() -> bool:
    """stdout and stderr are the same open file or pipe (`2>&1`)."""
    try:
        sys.stdout.flush()
        return os.path.sameopenfile(sys.stdout.fileno(), sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # no file descriptors (a test runner's buffers)
        return False


def check_prompt_options(system: Optional[str], raw: bool) -> Optional[str]:
    """--system checked against --raw; returns its text (argument_text)."""
    if raw and system:
        raise DgError("--system needs the chat template; with --raw, write the system text into the prompt")
    if system is not None and not system.strip():
        raise DgError("empty --system text")
    return argument_text(system, "the --system text") if system is not None else None


def prompt_ids(model, text: str, *, system: Optional[str], raw: bool, parse_special: bool) -> list[int]:
    """The prompt's tokens for `model`: through its chat template (with the system prompt), or as it
    is (--raw). User text never turns into control tokens unless parse_special."""
    from dgcli.engine.diffusion import prompt_token_ids

    prompt = text if raw else prompt_messages(text, system)
    if not raw and not system and not hasattr(model, "chat_tokens"):
        prompt = text  # a step-level stand-in with only the one-message form
    return prompt_token_ids(model, prompt, chat=not raw, parse_special=parse_special)


def diffusion_params(path: Path, temp: Optional[float] = None, **flags: Any) -> DiffusionParams:
    """The GGUF's sampler defaults with the user's flags on top, validated (against the file's canvas)
    before any loading. temp: a constant temperature (t_min = t_max), llama-cli's --temp."""
    if temp is not None:
        if flags.get("t_min") is not None or flags.get("t_max") is not None:
            raise DgError("--temp sets both ends of the temperature schedule; pass --temp or --t-min/--t-max, not both")
        flags.update(t_min=temp, t_max=temp)
    header = read_header(path)
    canvas = header.get("diffusion.canvas_length")
    return sampler_defaults(header).replace(**flags).validate(canvas_length=canvas if isinstance(canvas, int) else None)


def check_generation_args(max_new_tokens: int, threads: Optional[int], gpu_layers: int,
                          ctx_size: Optional[int] = None, pace: float = 0.0) -> None:
    from dgcli.engine.model import check_gpu_layers, check_threads

    if max_new_tokens < 1:
        raise InvalidParameter("max_new_tokens", max_new_tokens, "an integer >= 1")
    check_threads(threads)
    check_gpu_layers(gpu_layers)
    if ctx_size is not None and ctx_size < 0:
        raise InvalidParameter("ctx_size", ctx_size, "0 (the model's training context) or a token count")
    if not 0 <= pace <= 60:
        raise InvalidParameter("pace", pace, "seconds per step between 0 and 60")


def seed_of(seed: Optional[int]) -> int:
    """The run's seed: the user's, or a random one (-1 or none, as llama-cli's -s -1), shown afterwards."""
    from dgcli.engine.rng import resolve_seed

    return resolve_seed(None if seed == -1 else seed)


def check_prompt_fits(engine, n_prompt: int) -> None:
    """Refuse a prompt that leaves no room for one canvas in the context."""
    model = getattr(engine, "model", None)
    n_ctx = getattr(model, "n_ctx", None)
    if model is None or not isinstance(n_ctx, int):
        return
    room = getattr(model, "canvas_length", 1) or 1
    if n_prompt + room > n_ctx:
        what = f"one {room}-token canvas" if room > 1 else "one new token"
        raise DgError(f"prompt is {n_prompt} tokens; with {what} it exceeds the context of {n_ctx} tokens "
                      "(raise it with -c/--ctx-size)")


def output_file(path: Optional[Path], *, force: bool, inputs: Sequence[Optional[Path]], what: str) -> Optional[OutputFile]:
    """An output path checked before any work starts (None: not asked for); see dgcli.outputs."""
    if path is None:
        return None
    return OutputFile(path, force=force, inputs=[p for p in inputs if p is not None], what=what)


class Throttle:
    def __init__(self, interval: float = LIVE_REFRESH_S):
        self.interval, self.last = interval, 0.0

    def ready(self, force: bool = False) -> bool:
        now = time.monotonic()
        if force or now - self.last >= self.interval:
            self.last = now
            return True
        return False


class Pacer:
    """--pace: each denoising step stays on screen at least `seconds` (the demo is too fast to watch)."""

    def __init__(self, seconds: float = 0.0):
        self.seconds, self.last = seconds, None

    def wait(self) -> None:
        if self.seconds <= 0:
            return
        now = time.monotonic()
        if self.last is not None and now - self.last < self.seconds:
            time.sleep(self.seconds - (now - self.last))
        self.last = time.monotonic()


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Ctrl-C waits until the block is done: a live frame is drawn whole, so stopping the live view
    erases exactly what it drew (an interrupted frame left a stray panel line behind)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            raise KeyboardInterrupt


@contextmanager
def echo_off() -> Iterator[Optional[tuple[int, Any]]]:
    """No echo of typed keys while a live view is drawn: the terminal's `^C` (or any key) would move
    the cursor under the live view, and stopping it would then erase one line too few (a stray
    panel line was left behind). SIGTERM still restores the terminal (and the cursor, through the
    live view's own cleanup). Yields (fd, the settings without echo), or None: no terminal."""
    fd, saved = _terminal_settings()
    if saved is None:
        yield None
        return
    import termios

    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    previous_term = signal.getsignal(signal.SIGTERM)
    if previous_term is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    _signals.terminal_settings.append((fd, saved))  # a signal that exits at once restores them too
    try:
        yield fd, quiet
    finally:
        _signals.terminal_settings.remove((fd, saved))
        if _signals.in_foreground(fd):  # from the background (Ctrl-Z, `bg`) it would stop dg (SIGTTOU)
            termios.tcsetattr(fd, termios.TCSANOW, saved)
        if previous_term is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _terminal_settings() -> tuple[int, Any]:
    """The terminal's file descriptor (stdin's, else stdout's) and its termios settings, or (-1, None)."""
    try:
        import termios
    except ImportError:
        return -1, None
    for stream in (sys.stdin, sys.stdout):
        try:
            fd = stream.fileno()
            if os.isatty(fd):
                return fd, termios.tcgetattr(fd)
        except (AttributeError, OSError, ValueError):
            continue
    return -1, None


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


# DECAWM: a line longer than the terminal is cut at its right edge instead of wrapping onto the next
# row. Under a live view, a frame drawn for the width from before a resize (dg learns of the new one a
# moment later) then still takes as many rows as it has lines, and the next frame erases it whole.
NO_AUTOWRAP, AUTOWRAP = "\x1b[?7l", "\x1b[?7h"
# The cursor's line and every line below it erased: deleted (DL), as many as the screen has. Not CSI J:
# from the top-left corner tmux takes that for a clear screen and keeps the screen in its history.
ERASE_BELOW = "\r\x1b[9999M"


class _AnchoredRender(LiveRender):
    """Rich's live region with the cursor left at its top-left corner between frames.

    Rich leaves the cursor after a frame's last line and erases the frame by going up as many lines
    as it drew. A terminal made narrower rewraps those lines (tmux, VTE, kitty, xterm.js reflow each
    line longer than the new width onto more rows; xterm cuts them): the count no longer matches, and
    the top of the frame on screen stayed above every later one. The start of a line stays the start
    of a line however a terminal resizes, and the cursor moves with it: each frame is drawn from
    there over whatever is below (ERASE_BELOW), then the cursor goes back there.
    `anchor` False (the last frame, when the live view stops): the cursor stays after it, as Rich's."""

    anchor = True
    _at_top = False

    def position_cursor(self) -> Control:
        return _codes(ERASE_BELOW) if self._shape is not None and self._at_top else super().position_cursor()

    def restore_cursor(self) -> Control:
        return _codes(ERASE_BELOW) if self._shape is not None and self._at_top else super().restore_cursor()

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from super().__rich_console__(console, options)
        height = self._shape[1] if self._shape else 0  # last_render_height, which Rich 13.0 lacks
        self._at_top = self.anchor and height > 0
        down = f"\x1b[{height - 1}B" if self._at_top and height > 1 else ""
        _signals.live_view_exit[0] = (down + AUTOWRAP).encode()
        if self._at_top:
            yield Control(ControlType.CARRIAGE_RETURN, *([(ControlType.CURSOR_UP, height - 1)] if height > 1 else []))

    def leave(self) -> Control:
        """The cursor after the frame's last line (where Rich's own would be), autowrap on: the
        terminal as the shell wants it at a Ctrl-Z."""
        width, height = self._shape or (0, 0)
        moves = [(ControlType.CURSOR_DOWN, height - 1)] if self._at_top and height > 1 else []
        if self._at_top:
            moves.append((ControlType.CURSOR_MOVE_TO_COLUMN, width))
        self._at_top = False
        return Control(*moves) if moves else Control()


def _codes(text: str) -> Control:
    """Control codes Rich has no name for (delete lines, autowrap), written as they are, only to a
    terminal."""
    control = Control()
    control.segment = Segment(text, None, [(ControlType.CARRIAGE_RETURN,)])
    return control


class _AnchoredLive(Live):
    """Rich's Live, drawn by an _AnchoredRender with autowrap off: it survives the terminal's resizing."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._live_render = _AnchoredRender(self.get_renderable(), vertical_overflow=self.vertical_overflow)

    def start(self, refresh: bool = False) -> None:
        _signals.live_view_exit[0] = AUTOWRAP.encode()
        self.console.control(_codes(NO_AUTOWRAP))
        super().start(refresh)

    def stop(self) -> None:
        self._live_render.anchor = False  # the last frame ends where Rich's does: stop erases it from there
        try:
            super().stop()
        finally:
            self.console.control(_codes(AUTOWRAP))
            _signals.live_view_exit[0] = b""


def anchored(progress: Any) -> Any:
    """A Rich Progress whose bars are drawn as the live views are (_AnchoredLive): a terminal made
    narrower rewrapped a full-width bar onto two rows, and each redraw left a copy of its first half."""
    live = progress.live
    progress.live = _AnchoredLive(console=live.console, auto_refresh=live.auto_refresh,
                                  refresh_per_second=live.refresh_per_second, transient=live.transient,
                                  redirect_stdout=live._redirect_stdout, redirect_stderr=live._redirect_stderr,
                                  get_renderable=progress.get_renderable)
    return progress


@contextmanager
def live_view(renderable: Any) -> Iterator[Live]:
    """A transient Rich Live on stdout (auto-refresh off: the caller refreshes), keys not echoed, that
    a resized terminal does not leave old frames of (_AnchoredRender). Ctrl-Z stops it with the
    terminal given back to the shell; `fg` draws it again (_signals.suspend)."""
    with echo_off() as quiet:
        live = _AnchoredLive(renderable, console=stdout, auto_refresh=False, transient=True)
        live.start()
        try:
            with _signals.suspendable(_suspended_live(live, quiet)):
                yield live
        finally:
            live.stop()


def _suspended_live(live: Live, quiet: Optional[tuple[int, Any]]) -> Callable[[], Any]:
    """What a live view does around a Ctrl-Z stop: no frame drawn while the shell has the terminal;
    on `fg`, echo off and the cursor hidden again, and a new frame below the shell's lines (the one
    from before the stop stays where it was: erasing it would erase the shell's lines instead)."""
    @contextmanager
    def hold() -> Iterator[None]:
        with live._lock:
            anchored = isinstance(live._live_render, _AnchoredRender) and live.is_started
            if anchored:  # the shell's lines go below the frame, and wrap
                live.console.control(live._live_render.leave(), _codes(AUTOWRAP))
            yield
            if not live.is_started:  # it ended while the stop waited for it: the terminal is given back
                return
            live._live_render._shape = None
            if not _signals.in_foreground(quiet[0] if quiet is not None else 1):
                return  # continued in the background (`bg`, `kill %1`): the terminal stays the shell's
            if quiet is not None:
                import termios

                termios.tcsetattr(quiet[0], termios.TCSANOW, quiet[1])
            live.console.show_cursor(False)
            if anchored:
                live.console.control(_codes(NO_AUTOWRAP))
            live.refresh()
    return hold


def refresh(live: Live) -> None:
    with sigint_deferred():
        live.refresh()


def use_live(no_live: bool, json_out: bool) -> bool:
    """A live view when stdout is a terminal that can redraw: on TERM=dumb (or unknown) Rich's Live
    draws nothing until it stops, so the plain status lines show the progress instead."""
    return not (no_live or json_out) and stdout.is_terminal and not stdout.is_dumb_terminal


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


# ---------------------------------------------------------------- options shared by commands

ModelOpt = typer.Option(None, "--model", "-m", help="Registry name (`name` or `name:QUANT`, see `dg list`) or a .gguf path. Default: demo.")
YesOpt = typer.Option(False, "--yes", "-y", help="Download a missing registry model without asking.")
ThreadsOpt = typer.Option(None, "--threads", "-t", help="CPU threads (default: 1 for tiny models under 64 MB, else every core).")
GpuOpt = typer.Option(0, "--gpu-layers", "-ngl", help="Layers to offload to the GPU (-1 = all).")
RpcOpt = typer.Option(
    None, "--rpc", metavar="HOST:PORT[,HOST:PORT]",
    help="Spread the model's layers over llama.cpp RPC workers (`dg worker` on each; all layers unless "
         "--gpu-layers says how many). The protocol is unauthenticated: trusted networks only. "
         "DG_RPC_TIMEOUT: seconds a worker may stay silent before dg gives up on it (default 30).")
NCpuMoeOpt = typer.Option(None, "--n-cpu-moe", metavar="N",
                          help="Keep the expert weights of the first N layers in system memory, the rest on the GPU "
                               "(offloads every layer unless --gpu-layers is given).")
CpuMoeOpt = typer.Option(False, "--cpu-moe", help="Keep every layer's expert weights in system memory (--n-cpu-moe all).")
VerboseOpt = typer.Option(False, "--verbose", "-v", help="Print where llama.cpp put the weights (GPU/RAM buffers, tensors kept in RAM).")
CtxOpt = typer.Option(None, "--ctx-size", "-c", help="Context size in tokens (0 = the model's training context; default: min(training, 4096)).")

PromptArg = typer.Argument(None, help="The prompt; '-' (or nothing, with piped stdin) reads stdin.", show_default=False)
PromptOpt = typer.Option(None, "--prompt", "-p", help="The prompt (as llama-cli's -p), instead of the argument.", show_default=False)
FileOpt = typer.Option(None, "--file", "-f", help="Read the prompt from this file ('-': stdin).", show_default=False)
SystemOpt = typer.Option(None, "--system", help="A system prompt (through the chat template).", show_default=False)
RawOpt = typer.Option(False, "--raw", help="No chat template: the prompt as it is, after a bos (GGUFs without a template).")
ParseSpecialOpt = typer.Option(
    False, "--parse-special",
    help="Let control-token text in your prompt (<turn|>, <eos>, ...) act as control tokens. For experts: "
         "by default it stays text, so piped text cannot forge turns.")
SeedOpt = typer.Option(None, "--seed", "-s", help="Random seed (canvas init, sampling, renoise); -1 or none: a random one, shown afterwards.", show_default=False)
TempOpt = typer.Option(None, "--temp", help="A constant temperature: sets --t-min and --t-max to this value.", show_default=False)
PaceOpt = typer.Option(0.0, "--pace", help="Seconds each denoising step stays on screen at least (0 = as fast as it runs), to watch a fast model.")
NoLiveOpt = typer.Option(False, "--no-live", help="Plain streaming (automatic when stdout is not a terminal).")
ForceOpt = typer.Option(False, "--force", help="Replace output files that already exist (never an input).")


def sampler_flags(steps, t_min, t_max, entropy_bound, stability_threshold, confidence_threshold) -> dict:
    return dict(max_denoising_steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
                stability_threshold=stability_threshold, confidence_threshold=confidence_threshold)


StepsOpt = typer.Option(None, "--steps", help="Max denoising steps per canvas (GGUF default: diffusion.eb_max_steps).", show_default=False)
TMinOpt = typer.Option(None, "--t-min", help="Final temperature of the schedule.", show_default=False)
TMaxOpt = typer.Option(None, "--t-max", help="Initial temperature of the schedule.", show_default=False)
EBOpt = typer.Option(None, "--entropy-bound", help="Entropy budget of the accepted prefix per step (speed knob).", show_default=False)
StabOpt = typer.Option(None, "--stability-threshold", help="Steps the argmax canvas must stay unchanged to stop.", show_default=False)
ConfOpt = typer.Option(None, "--confidence-threshold", help="Mean entropy below which the canvas may stop.", show_default=False)
ThinkingOpt = typer.Option("show", "--thinking", help="Thinking channel: show (dimmed) or hide.")


def check_thinking(thinking: str) -> None:
    if thinking not in ("show", "hide"):
        raise DgError(f"invalid --thinking {thinking!r}: must be show or hide")
