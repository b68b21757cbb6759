"""Files dg writes (a --trace, a bench report, a converted GGUF): never over an input, never over an
existing file unless asked, never half-written.

`OutputFile(path, force=..., inputs=...)` decides what a path means before any work starts:
- `-`, a character device (/dev/null, a terminal) or a FIFO: a stream, written to directly
  (a FIFO nobody reads yet is waited for, as the shell's `>` does, with a line saying so);
- a regular file: written to a temporary file beside it (`.NAME.XXXX.partial`) that replaces it
  only once complete; removed on failure, Ctrl-C and SIGTERM (`remove_temporaries`). A path that
  already exists (or a symlink to a file) is replaced only with `force`; the symlink stays a
  symlink and its target gets the new content;
- refused, in one line: one of the command's inputs (even with `force`), a folder, a block
  device or socket, a missing or unwritable folder.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Optional, Sequence

from dgcli.errors import DgError

STREAM = "-"
PARTIAL_SUFFIX = ".partial"

# temporary files being written right now, removed by a signal handler that exits at once
_temporaries: set[Path] = set()


def remove_temporaries() -> None:
    for tmp in list(_temporaries):
        try:
            tmp.unlink()
        except OSError:
            pass
    _temporaries.clear()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _os_reason(err: OSError) -> str:
    return err.strerror or str(err)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return a.resolve() == b.resolve()


class OutputFile:
    """One output path, checked when constructed (see the module's docstring)."""

    def __init__(self, path: Path | str, *, force: bool = False, inputs: Iterable[Path | str] = (),
                 what: str = "output", binary: bool = False, streams: bool = True):
        self.path = Path(path)
        self.what = what
        self.binary = binary
        self.force = force
        self.stream = False
        self.target = self.path  # where a regular file lands (a symlink's target)
        self.tmp: Optional[Path] = None
        self.handle: Optional[IO[Any]] = None
        self._check(inputs, streams)

    # -- deciding what the path is

    def _fail(self, why: str) -> DgError:
        return DgError(f"cannot write {self.what} {self.path}: {why}")

    def _check(self, inputs: Iterable[Path | str], streams: bool) -> None:
        if str(self.path) == STREAM:
            if not streams:
                raise self._fail("this output is a regular file, not a stream")
            self.stream = True
            return
        for given in inputs:
            if _same_file(self.path, Path(given)):
                raise self._fail("it is one of this command's inputs")
        try:
            st = os.stat(self.path)  # follows symlinks: what the path would write to
        except FileNotFoundError:
            st = None
        except OSError as err:
            raise self._fail(_os_reason(err)) from None
        if st is not None and not stat.S_ISREG(st.st_mode):
            if stat.S_ISDIR(st.st_mode):
                raise self._fail("it is a folder")
            if not (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
                raise self._fail("not a regular file, a character device or a FIFO")
            if not streams:
                raise self._fail("this output must be a regular file (it is a device or a FIFO)")
            self.stream = True
            return
        link = self.path.is_symlink()
        if st is not None or link:
            if not self.force:
                kind = "a symlink to an existing file" if link and st is not None else (
                    "a symlink to a missing file" if link else "it exists")
                raise self._fail(f"{kind}; pass --force to replace it")
            self.target = Path(os.path.realpath(self.path))
        folder = self.target.parent
        if not folder.is_dir():
            raise self._fail(f"folder {folder} does not exist")

    @property
    def is_stdout(self) -> bool:
        """This output is dg's stdout (`-`, or a stream that is the file stdout writes to, /dev/null aside):
        nothing else may be printed there."""
        if str(self.path) == STREAM:
            return True
        if not self.stream:
            return False
        try:
            mine, out = os.stat(self.path), os.fstat(sys.stdout.fileno())
            null = os.stat(os.devnull)
        except (OSError, ValueError, AttributeError):  # no real stdout (a test runner's buffer)
            return False
        same = (mine.st_dev, mine.st_ino) == (out.st_dev, out.st_ino)
        return same and (mine.st_dev, mine.st_ino) != (null.st_dev, null.st_ino)

    # -- writing

    @property
    def write_path(self) -> Path:
        """The path the bytes go to while writing (the temporary file; for writers that open paths)."""
        if self.tmp is None:
            raise DgError(f"internal: {self.path} is not open as a file")
        return self.tmp

    def open(self) -> "OutputFile":
        if self.stream:
            self.handle = self._open_stream()
            return self
        try:
            fd, name = tempfile.mkstemp(prefix=f".{self.target.name}.", suffix=PARTIAL_SUFFIX,
                                        dir=self.target.parent)
        except OSError as err:
            raise self._fail(_os_reason(err)) from None
        self.tmp = Path(name)
        _temporaries.add(self.tmp)
        # what a plain open() would have made (not mkstemp's 0600); a file replaced keeps its own mode, as
        # the shell's `>` keeps it (a private 0600 report must not come back world-readable)
        try:
            mode = stat.S_IMODE(os.stat(self.target).st_mode)
        except OSError:
            mode = 0o666 & ~_umask()
        os.fchmod(fd, mode)
        self.handle = os.fdopen(fd, "wb") if self.binary else os.fdopen(fd, "w", encoding="utf-8")
        return self

    def _open_stream(self) -> IO[Any]:
        if str(self.path) == STREAM:
            return sys.stdout.buffer if self.binary else sys.stdout
        try:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as err:
                if err.errno != errno.ENXIO:
                    raise
                # a FIFO nobody reads yet: wait for its reader as the shell's `>` does, but say so
                print(f"waiting for a process to read {self.path} (Ctrl-C to stop)", file=sys.stderr, flush=True)
                fd = os.open(self.path, os.O_WRONLY)
        except OSError as err:
            raise self._fail(_os_reason(err)) from None
        os.set_blocking(fd, True)
        return os.fdopen(fd, "wb") if self.binary else os.fdopen(fd, "w", encoding="utf-8")

    def write(self, data: Any) -> None:
        if self.handle is None:
            return
        try:
            self.handle.write(data)
        except OSError as err:
            raise self._fail(_os_reason(err)) from None

    def write_line(self, obj: dict) -> None:
        self.write(json.dumps(obj) + "\n")

    def write_all(self, obj: dict) -> None:
        self.write(json.dumps(obj, indent=2) + "\n")

    def commit(self) -> None:
        """Finish: flush a stream; put a complete temporary file in place of the target."""
        handle, self.handle = self.handle, None
        if handle is None:
            return
        try:
            if handle in (sys.stdout, sys.stdout.buffer):
                handle.flush()
            else:
                handle.close()
            if self.tmp is not None:
                self._put_in_place()
        except OSError as err:
            self.discard()
            raise self._fail(_os_reason(err)) from None
        finally:
            if self.tmp is not None:
                _temporaries.discard(self.tmp)

    def _put_in_place(self) -> None:
        assert self.tmp is not None
        if self.force:
            os.replace(self.tmp, self.target)
            return
        # a hard link fails if the target appeared meanwhile: never replace what we did not check
        try:
            os.link(self.tmp, self.target)
        except FileExistsError:
            self.discard()
            raise self._fail("it was created by something else while dg was writing; pass --force to "
                             "replace it") from None
        except OSError:  # a file system without hard links
            if self.target.exists():
                self.discard()
                raise self._fail("it was created by something else while dg was writing") from None
            os.replace(self.tmp, self.target)
            return
        self.tmp.unlink()

    def discard(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None and handle not in (sys.stdout, sys.stdout.buffer):
            try:
                handle.close()
            except OSError:
                pass
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            _temporaries.discard(self.tmp)


def check_distinct(outputs: Sequence[Optional[OutputFile]]) -> None:
    """Two outputs of one command must not be one file (`--ar-twin OUT`)."""
    files = [o for o in outputs if o is not None and not o.stream]
    for i, a in enumerate(files):
        for b in files[i + 1:]:
            if _same_file(a.path, b.path):
                raise DgError(f"{a.what} and {b.what} are the same file ({a.path}); give two paths")


@contextmanager
def writing(*outputs: Optional[OutputFile]) -> Iterator[list[Optional[OutputFile]]]:
    """Open the outputs; commit them all when the block ends normally, discard them all otherwise."""
    check_distinct(outputs)
    opened: list[OutputFile] = []
    try:
        for out in outputs:
            if out is not None:
                opened.append(out.open())
        yield list(outputs)
        for out in opened:
            out.commit()
    except BaseException:
        for out in opened:
            out.discard()
        raise
