"""Reading a text file the user names (a prompt set, ...): regular files only, up to a size.

`/dev/zero` would be read for ever, a FIFO would block the open until some writer came, and a
terminal would wait for input; none of them is a file of prompts. The check is made on the open
descriptor (opened without blocking), so the path cannot be swapped between check and read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dgcli.errors import DgError

DEFAULT_MAX_BYTES = 16 << 20


def read_text_file(path: Path | str, *, what: str = "file", max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """The UTF-8 text of `path`; DgError naming `what` for anything that is not a readable
    regular UTF-8 file of at most `max_bytes` bytes."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise DgError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise DgError(f"{what} is not a regular file (a directory): {path}") from None
    except OSError as err:
        raise DgError(f"cannot read {what} {path}: {err.strerror or err}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = " (a directory)" if stat.S_ISDIR(st.st_mode) else ""
        raise DgError(f"{what} is not a regular file{kind}: {path}")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > max_bytes:
            raise DgError(f"{what} is {st.st_size:,} bytes; at most {max_bytes:,} are read: {path}")
        try:
            data = f.read(max_bytes + 1)  # /proc files say 0 bytes and may hold more
        except OSError as err:
            raise DgError(f"cannot read {what} {path}: {err.strerror or err}") from None
    if len(data) > max_bytes:
        raise DgError(f"{what} is more than {max_bytes:,} bytes: {path}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DgError(f"{what} is not UTF-8 text (byte {err.start}): {path}") from None
