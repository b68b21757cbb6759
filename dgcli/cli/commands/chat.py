"""`dg chat`: an interactive conversation with DiffusionGemma, the canvas denoising live per answer."""

from __future__ import annotations

import locale
import sys
from typing import Optional

import typer

from dgcli.cli import _display, _errors, _models, _options, _output, _prompt, _signals, _terminal, render
from dgcli.errors import DgError
from dgcli.units import plural

BANNER = "Chat with {name}. /help lists the commands; /exit or Ctrl-D leaves; Ctrl-C stops an answer."


def chat(
    model: Optional[str] = _options.ModelOpt,
    system: Optional[str] = _options.SystemOpt,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="At most this many answer tokens per turn."),
    seed: Optional[int] = _options.SeedOpt,
    temp: Optional[float] = _options.TempOpt,
    steps: Optional[int] = _options.StepsOpt, t_min: Optional[float] = _options.TMinOpt, t_max: Optional[float] = _options.TMaxOpt,
    entropy_bound: Optional[float] = _options.EBOpt, stability_threshold: Optional[int] = _options.StabOpt,
    confidence_threshold: Optional[float] = _options.ConfOpt,
    ctx_size: Optional[int] = _options.CtxOpt,
    threads: Optional[int] = _options.ThreadsOpt, gpu_layers: int = _options.GpuOpt,
    n_cpu_moe: Optional[int] = _options.NCpuMoeOpt, cpu_moe: bool = _options.CpuMoeOpt, verbose: bool = _options.VerboseOpt,
    thinking: str = _options.ThinkingOpt,
    pace: float = _options.PaceOpt,
    no_live: bool = _options.NoLiveOpt,
    parse_special: bool = _options.ParseSpecialOpt,
    yes: bool = _options.YesOpt,
) -> None:
    """Talk with DiffusionGemma, turn after turn, the earlier turns kept in the KV cache.

    Only each new message is prefilled. Messages come from the terminal, or one per line from a pipe."""
    from dgcli.engine.chat import ChatSession, is_command, message_text

    with _errors.user_errors():
        _options.check_thinking(thinking)
        _options.check_generation_args(max_new_tokens, threads, gpu_layers, ctx_size, pace)
        gpu_layers, n_cpu_moe = _options.resolve_offload(gpu_layers, n_cpu_moe, cpu_moe)
        system = _prompt.check_prompt_options(system, False)
        resolved, path = _models.resolve_model(model, yes=yes, want="diffusion")
        _models.preflight(path, diffusion=True, command="chat", gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                         ctx_size=ctx_size)
        params = _options.diffusion_params(path, temp, **_options.sampler_flags(
            steps, t_min, t_max, entropy_bound, stability_threshold, confidence_threshold))
        interactive = sys.stdin.isatty()
        live = _terminal.use_live(no_live, False)
        engine = _models.open_diffusion_engine(path, threads=threads, gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe,
                                              ctx_size=ctx_size, verbose=verbose)
        try:
            # a template that cannot render fails every message: say so once, before the session
            template = engine.model.chat_template
            if template is None:
                raise DgError(f"{path.name} has no chat template (tokenizer.chat_template), which dg chat needs: "
                              "dg generate --raw sends a prompt as it is")
            template.check()
            session = ChatSession(engine, system=system, params=params, max_new_tokens=max_new_tokens,
                                  seed=None if seed == -1 else seed, parse_special=parse_special)
            if interactive:
                # text, not markup: the name of a model file is its path, which may hold "[/x]"
                _output.stderr.print(BANNER.format(name=resolved.display_name), style="dim", markup=False)
            turns = failed = 0
            for line in _messages(interactive):
                if is_command(line):
                    outcome = session.command(line)
                    # piped, an unknown /command is a message lost (a "/usr/lib ..."): an error, as the count says
                    lost = outcome.unknown and not interactive
                    # not markup: it may quote the user's text
                    _output.notice(("error: " if lost else "") + outcome.message, style="dim")
                    if outcome.exit:
                        break
                    if lost:
                        turns, failed = turns + 1, failed + 1
                    continue
                turns += 1
                failed += not _turn(session, message_text(line), live=live, thinking=thinking, pace=pace,
                                    title=resolved.display_name)
        finally:
            engine.close()
        # piped messages are a script: one that got no answer makes the run a failure (at a terminal
        # the person saw the error and went on)
        if failed and not interactive:
            raise DgError(f"{plural(failed, 'message')} of {turns} got no answer (see the errors above)")


def _messages(interactive: bool):
    """The user's messages: typed at a `>>> ` prompt (Ctrl-C clears the line, Ctrl-D leaves) or read
    one per line from a pipe."""
    if not interactive:
        # bytes, so that a line that is not UTF-8 is that turn's error whatever the locale's error handler
        for raw in getattr(sys.stdin, "buffer", sys.stdin):
            line = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
            if line.strip():
                yield line.rstrip("\r\n")
        return
    import readline  # line editing and history for input()

    if "libedit" not in (readline.__doc__ or "") and "utf" not in locale.nl_langinfo(locale.CODESET).lower():
        # a locale that is not UTF-8 (LC_ALL=C): readline takes each byte of a typed "é" for Meta and a
        # key unless told otherwise, and drops it from the message. Bytes pass as they are typed (stdin
        # decodes them as UTF-8: see cli._utf8_standard_streams)
        for setting in ("input-meta on", "output-meta on", "convert-meta off"):
            readline.parse_and_bind("set " + setting)

    while True:
        _signals.interrupt_handled()  # a Ctrl-C before this one has been acted on
        try:
            line = input(">>> ")
        except KeyboardInterrupt:
            _output.stderr.print("\n(Ctrl-D or /exit leaves)", style="dim")
            continue
        except EOFError:
            _output.stderr.print()
            return
        except UnicodeDecodeError:  # typed or pasted bytes that are not UTF-8, in a strict locale
            _output.stderr.print("error: the message is not UTF-8 text", style="red")
            continue
        if line.strip():
            yield line


def _turn(session, text: str, *, live: bool, thinking: str, pace: float, title: str) -> bool:
    """One answer, shown live; errors and Ctrl-C end the answer, not the session. False: an error
    left the message without an answer."""
    _signals.interrupt_handled()
    model = session.engine.model
    try:
        with _display.DiffusionDisplay(model, live=live, thinking=thinking, title=title, pace=pace) as display:
            result = session.ask(text, on_event=display.on_event)
    except DgError as err:
        _output.notice(f"error: {' '.join(str(err).split())}", style="red")
        return False
    except KeyboardInterrupt:
        _output.stderr.print("(stopped)", style="dim")
        return True
    if _output.stdout.is_terminal:
        _output.stdout.print(render.answer_renderable(result.text, thinking))
    else:  # piped: the answer as it is (Rich would wrap it at its width), as generate and compare print it
        _output.echo_text(render.answer_plain(result.text, thinking))
    cached = f"  prompt {result.n_prompt_tokens} tokens, {result.n_cached_prompt_tokens} from the cache"
    _output.notice(render.result_summary(result) + cached, style="dim cyan")
    return True
