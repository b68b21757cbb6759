"""Chat templates rendered with limits: a GGUF's template is a program from the file, and a
hostile one can loop 10^10 times, expand to gigabytes or recurse without end.

`render_chat_template` hands the template to llama-cpp-python's Jinja2ChatFormatter (Jinja's
sandbox) in a child process (worker.py) that has an address-space limit, caps the text a
render may produce, and is killed when a render outlives its time limit. Where the kernel does not
enforce an address-space limit (macOS), this process watches the child's address space while it
renders and kills it past the same bound. Each way of failing is a
one-line DgError. The child is started once (`start_renderer`: while a model loads) and kept for
the next renders, so a render costs what Jinja does; a render seen before is not sent again.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from dgcli.errors import DgError

# wall-clock seconds a render may take (a Gemma template renders in milliseconds), and the child's
# start-up (Python, Jinja and the formatter's import; slow only on a loaded machine)
TEMPLATE_TIMEOUT_S = 10.0
WORKER_START_TIMEOUT_S = 120.0
# address space a render may use beyond what the child's imports mapped
TEMPLATE_MEMORY_BYTES = 1 << 30
# where RLIMIT_AS is not enforced: how often the child's address space is looked at during a render
MEMORY_WATCH_INTERVAL_S = 0.02
# the rendered prompt: the template's own text plus the messages, a few times over at most
TEMPLATE_OUTPUT_MIN_CHARS = 1 << 20
TEMPLATE_OUTPUT_PER_INPUT_CHAR = 4
_CACHED_RENDERS = 64
_CACHED_PAYLOAD_MAX_CHARS = 1 << 20

_WORKER_SOURCE = Path(__file__).with_name("worker.py")


class ChatTemplateError(DgError):
    pass


class ChatTemplateParseError(ChatTemplateError):
    """The template does not parse: every render fails, whatever the messages."""


def output_limit(template: str, messages: Any) -> int:
    """How much text a render of `template` over `messages` may produce."""
    size = len(template) + len(json.dumps(messages))
    return max(TEMPLATE_OUTPUT_MIN_CHARS, TEMPLATE_OUTPUT_PER_INPUT_CHAR * size)


class _Timeout(Exception):
    """No answer in time."""


def _worker_import_dirs() -> list[str]:
    """Where this process finds what the child imports (llama_cpp, jinja2, markupsafe). `-I` leaves out
    PYTHONPATH and the user's site folder, where they may be installed (`pip install --target` and
    PYTHONPATH, a GPU machine's bundle): the child appends these after its standard library."""
    dirs = []
    for name in ("llama_cpp", "jinja2", "markupsafe"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            parent = str(Path(location).resolve().parent)
            if parent not in dirs:
                dirs.append(parent)
    return dirs


class _WorkerGone(Exception):
    """The child ended before it answered (a crash inside the renderer, or it was killed)."""


class _OverMemory(Exception):
    """The child's address space grew past the bound during a render (watched from here)."""


def kernel_limits_address_space() -> bool:
    """Whether RLIMIT_AS bounds a process here: Linux enforces it; macOS accepts it and ignores it."""
    return sys.platform.startswith("linux")


class _Worker:
    """One child process rendering requests one at a time."""

    def __init__(self) -> None:
        self.limited = kernel_limits_address_space()
        # a session of its own: a Ctrl-C at the terminal is dg's to handle, not the child's
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _WORKER_SOURCE.read_text(encoding="utf-8"), str(TEMPLATE_MEMORY_BYTES),
             "address-space" if self.limited else "parent", *_worker_import_dirs()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        self.buffer = b""
        self.ready = False
        self.watched: Any = None  # psutil.Process of the child where this process bounds its memory
        self.base_vms = 0

    def request(self, payload: bytes, timeout_s: float) -> dict[str, Any]:
        if not self.ready:  # its first line says that the formatter is imported
            self._answer(time.monotonic() + WORKER_START_TIMEOUT_S)
            self.ready = True
            if not self.limited:
                self._start_watching()
        try:
            self.proc.stdin.write(payload + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise _WorkerGone from None
        return self._answer(time.monotonic() + timeout_s, watch=self.watched is not None)

    def _start_watching(self) -> None:
        """The child's address space once its imports are mapped: a render may add TEMPLATE_MEMORY_BYTES."""
        import psutil

        try:
            self.watched = psutil.Process(self.proc.pid)
            self.base_vms = self.watched.memory_info().vms
        except psutil.Error:
            raise _WorkerGone from None

    def _over_memory(self) -> bool:
        import psutil

        try:
            return self.watched.memory_info().vms - self.base_vms > TEMPLATE_MEMORY_BYTES
        except psutil.Error:  # ended: the next read says so
            return False

    def _answer(self, deadline: float, watch: bool = False) -> dict[str, Any]:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Timeout
            ready, _, _ = select.select([fd], [], [], min(left, MEMORY_WATCH_INTERVAL_S) if watch else left)
            if watch and not ready and self._over_memory():
                raise _OverMemory
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise _WorkerGone
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.kill()
        status = self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        return status


_lock = threading.Lock()
_worker: _Worker | None = None
_renders: OrderedDict[str, str] = OrderedDict()


def _close_worker() -> int | None:
    global _worker
    status = None
    if _worker is not None:
        status = _worker.close()
        _worker = None
    return status


atexit.register(_close_worker)


def start_renderer() -> None:
    """Start the child now (it imports while the caller does something else, e.g. loads a model),
    so that the first render does not wait for it."""
    global _worker
    with _lock:
        if _worker is None:
            try:
                _worker = _Worker()
            except OSError:
                pass  # the first render says why


def render_chat_template(template: str, *, messages: list[dict], add_generation_prompt: bool = True,
                         bos_token: str = "", eos_token: str = "", source: str = "the model",
                         timeout_s: float = TEMPLATE_TIMEOUT_S, tools: list[dict] | None = None) -> str:
    """`template` over `messages` (and `tools`, OpenAI's function tools) as Jinja2ChatFormatter
    renders it, in the limited child process; ChatTemplateError naming `source` when it does not
    parse, fails or runs away."""
    global _worker
    max_chars = output_limit(template, [messages, tools])
    request = {"template": template, "messages": messages, "add_generation_prompt": add_generation_prompt,
               "bos_token": bos_token, "eos_token": eos_token, "max_chars": max_chars}
    if tools:
        request["tools"] = tools
    payload = json.dumps(request)
    what = f"the chat template of {source}"
    with _lock:
        if payload in _renders:
            _renders.move_to_end(payload)
            return _renders[payload]
        try:
            if _worker is None:
                _worker = _Worker()
            answer = _worker.request(payload.encode(), timeout_s)
        except _Timeout:
            _close_worker()
            raise ChatTemplateError(f"{what} did not finish within {timeout_s:g} s (stopped)") from None
        except _OverMemory:
            _close_worker()
            raise ChatTemplateError(f"{what} needed more than {TEMPLATE_MEMORY_BYTES >> 20} MB of memory (stopped)") \
                from None
        except _WorkerGone:
            status = _close_worker()
            raise ChatTemplateError(f"{what} could not be rendered: its renderer ended ({_describe_exit(status)})") \
                from None
        except OSError as err:
            _close_worker()
            raise ChatTemplateError(f"cannot render {what}: {err.strerror or err}") from None
        except BaseException:  # Ctrl-C mid-render: the child may stay busy for long; start afresh next time
            _close_worker()
            raise
        if "text" in answer:
            if len(payload) <= _CACHED_PAYLOAD_MAX_CHARS:
                _renders[payload] = answer["text"]
                if len(_renders) > _CACHED_RENDERS:
                    _renders.popitem(last=False)
            return answer["text"]
    kind, detail = answer.get("error"), answer.get("detail", "")
    if kind == "parse":
        raise ChatTemplateParseError(f"{what} does not parse: {detail}")
    if kind == "output":
        raise ChatTemplateError(f"{what} produced more than {max_chars:,} characters (stopped)")
    if kind == "memory":
        raise ChatTemplateError(f"{what} needed more than {TEMPLATE_MEMORY_BYTES >> 20} MB of memory (stopped)")
    raise ChatTemplateError(f"{what} failed: {detail}")


def _describe_exit(status: int | None) -> str:
    if status is None:
        return "unknown status"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"
