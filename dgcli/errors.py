"""The errors dg raises for what a user can act on: the bottom layer every dgcli module may import.

The CLI prints a DgError as one line on stderr and exits non-zero; the server answers it as a 400.
"""

from __future__ import annotations

from typing import Any


class DgError(Exception):
    """An error a user can act on. The CLI prints `str(err)` on one line and exits non-zero."""


class InvalidParameter(DgError, ValueError):
    """A sampler or generation parameter outside its allowed range."""

    def __init__(self, name: str, value: Any, allowed: str):
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"invalid {name}={value!r}: must be {allowed}")


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
