"""The prompt: from the argument, -p, -f or stdin, as UTF-8 text whatever the locale, bounded, and
its token ids through the model's chat template.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from dgcli import textfile
from dgcli.errors import DgError, check_utf8

# A prompt file or piped prompt larger than this is a mistake (a 262k-token context is ~1 MB of text).
MAX_PROMPT_BYTES = 16 << 20


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
    lone surrogates, one per byte, which spell UTF-8 text again once turned back into those bytes.
    Bytes that are not UTF-8 are refused, naming the first."""
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
