"""The errors dg raises for what a user can act on: the bottom layer every dgcli module may import.

The CLI prints a DgError as one line on stderr and exits non-zero; the server answers it as a 400.
"""

from __future__ import annotations

from typing import Any


class DgError(Exception):
    """An error a user can act on. The CLI prints `str(err)` on one line and exits with `exit_code`."""

    exit_code = 1


class InvalidParameter(DgError, ValueError):
    """A sampler or generation parameter outside its allowed range."""

    def __init__(self, name: str, value: Any, allowed: str):
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"invalid {name}={value!r}: must be {allowed}")


class WorkerLost(DgError):
    """A machine that held part of the model (an RPC worker) stopped answering, closed the connection or
    sent a malformed reply, after the model began loading there: the layers it held are gone. An
    engine's generation ends with what it produced before (stop_reason WORKER_LOST)."""

    exit_code = 3


# the stop_reason of a generation that a lost worker ended (its result also counts as interrupted)
WORKER_LOST = "worker_lost"


class ModelLoadError(DgError):
    """A file that is missing, not a GGUF, truncated, malformed, or of the wrong architecture."""


class ContextFull(DgError):
    """The KV cache has no room for what a forward would add (the engines stop with "context_full")."""


def check_utf8(text: str, what: str) -> None:
    """Text no tokenizer takes: bytes that are not UTF-8 (command-line arguments, lines typed or piped)
    arrive as lone surrogates, and JSON's \\uXXXX escapes can spell one. The error names the byte
    where the UTF-8 text stops."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        offset = len(text[:err.start].encode("utf-8"))
        raise DgError(f"{what} is not UTF-8 text (byte {offset})") from None
