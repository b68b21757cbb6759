"""llama.cpp's RPC backend (ggml-rpc): a model's layers spread over other machines.

A worker (`dg worker`, `serve_worker` here) runs ggml's RPC server in this process and lends its
devices (its GPUs, else its CPU) to one dg process at a time. The client (`--rpc HOST:PORT,...`)
registers each worker's devices (`rpc_devices`) and hands them to llama.cpp as the model's devices
(llama_model_params.devices, what llama.cpp's own `--rpc` does); offloaded layers, their KV cache
and their compute then live on the workers, split in proportion to the memory each reports.

The protocol is llama.cpp's and it is unauthenticated and unencrypted: whoever reaches a worker's
port can make it allocate memory and run computations, and can read what it holds. Bind workers to
127.0.0.1 or a trusted network only.

Every wait on a worker has a deadline (our patch of ggml's client, see native/patch): a connection
fails once no byte has moved for DG_RPC_TIMEOUT seconds (DEFAULT_TIMEOUT_S). A graph computation
sends nothing until it is done, which on a slow CPU can take minutes, so a dg worker sends keepalive
frames while it runs a command: a busy worker is not taken for a frozen one, however long its forward.
A connection also fails when the worker closes it or sends a reply that is malformed or out of range
(a device count, size, alignment or amount of memory no device has): every value is checked before it
sizes an allocation or a loop.

A failed connection is recorded natively and ggml's client then completes every command to that
worker at once with neutral values, so the native call returns and the caller's thread raises:
RpcError while `rpc_devices` sets the workers up, WorkerLost (exit WORKER_LOST_EXIT) afterwards, from
the seam of every native call (`native.deferred_interrupts`). The engines end a generation there with
what it produced before. Where nothing can use a partial result (a server),
`end_process_on_lost_worker()` makes the failure end the process at once with one line instead
(`_on_worker_failure`, which ggml calls on a thread of its own).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from dgcli.errors import DgError, WorkerLost
from dgcli.runtime import native
from dgcli.runtime.cpu import MAX_THREADS

DEFAULT_PORT = 50052
# ggml-rpc.h of the vendored llama.cpp: a worker must speak the same major version
RPC_PROTO_MAJOR = 7
MAX_SERVERS = 16  # GGML_RPC_MAX_SERVERS
PROBE_TIMEOUT_S = 5.0
WORKER_LOST_EXIT = WorkerLost.exit_code
# How long a worker may send nothing (and take nothing) before dg gives up on it. A dg worker sends a
# keepalive frame every TIMEOUT/6 (at most 5 s) while it computes, so a long forward never comes near it.
TIMEOUT_ENV = "DG_RPC_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 1e6
# ggml's scheduler takes at most 16 backends (GGML_SCHED_MAX_BACKENDS): the workers' devices and this
# machine's CPU; ggml's client refuses a worker that reports more than 16 devices of its own
MAX_DEVICES = 15

_CMD_HELLO = 14
_CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: transport capabilities; all zero = plain TCP
_HELLO_REPLY = 4 + _CONN_CAPS  # major, minor, patch, padding, caps

GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_ACCEL = 0, 3


class RpcError(DgError):
    """A worker address that is malformed, unreachable, busy or speaks another protocol version."""


def timeout_seconds() -> float:
    """DG_RPC_TIMEOUT (seconds; 0: wait forever, as llama.cpp does), else DEFAULT_TIMEOUT_S."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_TIMEOUT_S:  # NaN fails this too
        raise RpcError(f"invalid {TIMEOUT_ENV}={text!r}: must be seconds from 0 to {MAX_TIMEOUT_S:g} "
                       "(0: wait for RPC workers forever)")
    return value


# -- addresses --------------------------------------------------------------------------------------


def parse_endpoint(text: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port). ggml splits at the first ':' so IPv6 literals are not accepted."""
    host, sep, port = text.strip().partition(":")
    if not sep or not host or ":" in port:
        raise RpcError(f"invalid RPC worker address {text!r}: expected HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT})")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise RpcError(f"invalid port in RPC worker address {text!r}: expected 1-65535")
    if any(c.isspace() for c in host) or len(host) > 253:
        raise RpcError(f"invalid host in RPC worker address {text!r}")
    return host, int(port)


def parse_endpoints(spec: str | Sequence[str]) -> list[str]:
    """'HOST:PORT[,HOST:PORT...]' (or a list of them) -> normalised 'host:port' strings, in order."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    endpoints = []
    for part in parts:
        if not str(part).strip():
            raise RpcError(f"invalid --rpc {spec!r}: an empty worker address")
        host, port = parse_endpoint(str(part))
        endpoint = f"{host}:{port}"
        if endpoint in endpoints:
            raise RpcError(f"RPC worker {endpoint} is listed twice")
        endpoints.append(endpoint)
    if not endpoints:
        raise RpcError("no RPC workers given")
    if len(endpoints) > MAX_SERVERS:
        raise RpcError(f"{len(endpoints)} RPC workers given; llama.cpp takes at most {MAX_SERVERS}")
    return endpoints


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[int, int, int]:
    """The worker's RPC protocol version, from ggml's HELLO handshake with a timeout.

    ggml's own client aborts the process when a worker cannot be reached, and waits forever on one
    that is busy serving another client; asking first turns both into an RpcError."""
    sock, version = _handshake(endpoint, timeout)
    sock.close()
    return version


def _handshake(endpoint: str, timeout: float, held: Sequence[str] = ()) -> tuple[socket.socket, tuple[int, int, int]]:
    """probe(), leaving the connection open: the worker serves nobody else until it is closed.
    `held`: the workers this process holds such a connection to now (named when this one is mute)."""
    host, port = parse_endpoint(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        raise RpcError(f"cannot reach RPC worker {endpoint}: no answer within {timeout:g} s") from None
    except OSError as err:
        raise RpcError(f"cannot reach RPC worker {endpoint}: {err.strerror or err} "
                       f"(start one there with `dg worker --host HOST --port {port}`)") from None
    try:
        try:
            sock.settimeout(timeout)
            sock.sendall(struct.pack("<BQ", _CMD_HELLO, _CONN_CAPS) + bytes(_CONN_CAPS))
            reply = _recv_exact(sock, 8 + _HELLO_REPLY, timeout)
        except socket.timeout:
            also = (f", or is it {' or '.join(held)} again under another address?" if held else "?")
            raise RpcError(f"RPC worker {endpoint} accepted the connection but did not answer within {timeout:g} s "
                           f"(a worker serves one dg process at a time: is another one using it{also})") from None
        except OSError as err:
            raise RpcError(f"RPC worker {endpoint} closed the connection during the handshake "
                           f"({err.strerror or err}); is it a dg worker (llama.cpp rpc-server)?") from None
        size, major, minor, patch = struct.unpack_from("<QBBB", reply)
        if size != _HELLO_REPLY:
            # a size past any reply is not one: an HTTP server's "HTTP/1.1" read as a 3543824036068086856-byte message
            what = f"a {size}-byte message" if size <= 1 << 20 else f"something else ({reply[:8]!r}...)"
            raise RpcError(f"{endpoint} answered the RPC handshake with {what}; not a llama.cpp RPC "
                           "worker of a compatible version")
        if major != RPC_PROTO_MAJOR:
            raise RpcError(f"RPC worker {endpoint} speaks protocol {major}.{minor}.{patch}; this dg speaks "
                           f"{RPC_PROTO_MAJOR}.x: run the same dg version on every machine")
    except BaseException:
        sock.close()
        raise
    return sock, (major, minor, patch)


def _address(endpoint: str) -> tuple[str, int] | None:
    """The IPv4 address and port ggml's client connects to for `endpoint` (it resolves with
    gethostbyname), or None when the name does not resolve (the probe then says so)."""
    host, port = parse_endpoint(endpoint)
    try:
        return socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][:2]
    except (OSError, UnicodeError, IndexError):
        return None


def check_distinct(endpoints: Sequence[str]) -> None:
    """Two names of one worker (localhost:P and 127.0.0.1:P) would be two connections to a worker that
    serves one at a time: ggml's client would wait forever on the second while loading the model."""
    seen: dict[tuple[str, int], str] = {}
    for endpoint in endpoints:
        address = _address(endpoint)
        if address is None:
            continue
        if address[0] == "0.0.0.0":  # connecting to 0.0.0.0 reaches this machine
            address = ("127.0.0.1", address[1])
        if address in seen:
            raise RpcError(f"RPC workers {seen[address]} and {endpoint} are the same worker "
                           f"({address[0]}:{address[1]}): list it once")
        seen[address] = endpoint


def _recv_exact(sock: socket.socket, n: int, timeout: float) -> bytes:
    """n bytes within `timeout` seconds in all (socket.timeout past it): the socket's own timeout is
    per read, so a peer sending a byte at a time could hold the caller for n timeouts."""
    deadline = time.monotonic() + timeout
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("timed out")
        sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("connection closed")
        data += chunk
    return data


# -- ggml's backend registry (ctypes) ---------------------------------------------------------------


class _Ggml:
    """The ggml functions dg needs for RPC, declared on the libraries llama_cpp loaded."""

    def __init__(self) -> None:
        lib_mod = native.lib()
        if not lib_mod.llama_supports_rpc():
            raise RpcError(f"this llama.cpp build has no RPC backend (llama.cpp's ggml-rpc); {native.BUILD_HINT}")
        ggml = ctypes.CDLL(native.loaded_library("ggml", "ggml_backend_reg_by_name"))
        base = ctypes.CDLL(native.loaded_library("ggml-base", "ggml_set_abort_callback"))
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for lib, name, argtypes, restype in (
            (ggml, "ggml_backend_reg_by_name", [ctypes.c_char_p], vp),
            (ggml, "ggml_backend_dev_count", [], sz),
            (ggml, "ggml_backend_dev_get", [sz], vp),
            (ggml, "ggml_backend_dev_by_type", [ctypes.c_int], vp),
            (base, "ggml_backend_reg_get_proc_address", [vp, ctypes.c_char_p], vp),
            (base, "ggml_backend_reg_dev_count", [vp], sz),
            (base, "ggml_backend_reg_dev_get", [vp, sz], vp),
            (base, "ggml_backend_dev_name", [vp], ctypes.c_char_p),
            (base, "ggml_backend_dev_description", [vp], ctypes.c_char_p),
            (base, "ggml_backend_dev_type", [vp], ctypes.c_int),
            (base, "ggml_backend_dev_memory", [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
            (base, "ggml_set_abort_callback", [_ABORT_CALLBACK], _ABORT_CALLBACK),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
            setattr(self, name, fn)
        reg = self.ggml_backend_reg_by_name(b"RPC")
        if not reg:
            raise RpcError(f"llama.cpp's RPC backend is not registered in this build; {native.BUILD_HINT}")
        # looked up through the registry, as llama.cpp's own --rpc does (works for dynamic backends too)
        add = self.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
        start = self.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_start_server")
        if not add or not start:
            raise RpcError("llama.cpp's RPC backend lacks ggml_backend_rpc_add_server/start_server")
        dg_functions = {name: self.ggml_backend_reg_get_proc_address(reg, name.encode()) for name in (
            "dg_rpc_set_timeout", "dg_rpc_set_failure_hook", "dg_rpc_first_failure", "dg_rpc_clear_failures")}
        if not all(dg_functions.values()):
            raise RpcError(f"llama.cpp's RPC backend lacks dg's deadlines (not built with dg's patch); {native.BUILD_HINT}")
        self.add_server = ctypes.CFUNCTYPE(vp, ctypes.c_char_p)(add)
        self.start_server = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, sz, sz,
                                             ctypes.POINTER(vp))(start)
        self.set_timeout = ctypes.CFUNCTYPE(None, ctypes.c_double)(dg_functions["dg_rpc_set_timeout"])
        self.set_failure_hook = ctypes.CFUNCTYPE(None, _FAILURE_HOOK)(dg_functions["dg_rpc_set_failure_hook"])
        self.first_failure = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, sz, ctypes.c_char_p, sz)(
            dg_functions["dg_rpc_first_failure"])
        self.clear_failures = ctypes.CFUNCTYPE(None)(dg_functions["dg_rpc_clear_failures"])

    def device_label(self, dev: int) -> str:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        name = (self.ggml_backend_dev_name(dev) or b"?").decode()
        desc = (self.ggml_backend_dev_description(dev) or b"").decode()
        return f"{name} ({desc}, {total.value / 2**30:.1f} GiB, {free.value / 2**30:.1f} GiB free)"


_ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_FAILURE_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p)  # (endpoint, reason)
_ggml: _Ggml | None = None
_ggml_lock = threading.Lock()


def ggml() -> _Ggml:
    global _ggml
    with _ggml_lock:
        if _ggml is None:
            _ggml = _Ggml()
        return _ggml


def available() -> tuple[bool, str]:
    try:
        ggml()
    except DgError as err:
        return False, str(err)
    return True, ""


# -- client -----------------------------------------------------------------------------------------


class RpcDevices:
    """The devices of some RPC workers, as llama_model_params.devices wants them (NULL-terminated)."""

    def __init__(self, endpoints: Sequence[str], handles: Sequence[int], labels: Sequence[str]):
        self.endpoints, self.labels = list(endpoints), list(labels)
        self.array = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)

    @property
    def pointer(self) -> int:
        return ctypes.addressof(self.array)

    def __len__(self) -> int:
        return len(self.labels)


_registered: dict[str, tuple[list[int], list[str]]] = {}


def rpc_devices(endpoints: Sequence[str], timeout: float = PROBE_TIMEOUT_S) -> RpcDevices:
    """Every device of every worker, in the order given; each worker is asked first (probe), so a
    missing, busy or incompatible one is an RpcError rather than a native abort or a hang, as is one
    that fails or reports values out of range while its devices are registered. From here on a
    failing worker raises WorkerLost (see the module's docstring)."""
    endpoints = parse_endpoints(endpoints)
    check_distinct(endpoints)
    deadline = timeout_seconds()
    lib = ggml()
    lib.set_timeout(deadline)
    watch_workers(list(_registered))
    lib.clear_failures()
    with _state_lock:
        _state["setting_up"] = True
    try:
        return _register(endpoints, lib, timeout)
    finally:
        with _state_lock:
            _state["setting_up"] = False


def _register(endpoints: list[str], lib: "_Ggml", timeout: float) -> RpcDevices:
    # every new worker's handshake connection stays open until all have answered: one worker listed
    # under two addresses that check_distinct cannot tell apart (its LAN address and 127.0.0.1) then
    # fails its second handshake instead of hanging ggml's client at the model's load
    held: dict[str, socket.socket] = {}
    try:
        for endpoint in endpoints:
            if endpoint not in _registered:
                held[endpoint] = _handshake(endpoint, timeout, held=list(held))[0]
    finally:
        for sock in held.values():
            sock.close()
    handles: list[int] = []
    labels: list[str] = []
    for endpoint in endpoints:
        if endpoint not in _registered:
            watch_workers([*_registered, endpoint])
            with native.deferred_interrupts():
                reg = lib.add_server(endpoint.encode())
            _raise_setup_failure()
            count = lib.ggml_backend_reg_dev_count(reg) if reg else 0
            if not count:
                raise RpcError(f"RPC worker {endpoint} offers no devices")
            devs = [lib.ggml_backend_reg_dev_get(reg, i) for i in range(count)]
            with native.deferred_interrupts():
                names = [f"{endpoint}: {lib.device_label(d)}" for d in devs]
            _raise_setup_failure()
            _registered[endpoint] = (devs, names)
        devs, names = _registered[endpoint]
        handles += devs
        labels += names
    if len(handles) > MAX_DEVICES:
        raise RpcError(f"the RPC workers offer {len(handles)} devices in all; llama.cpp schedules at most "
                       f"{MAX_DEVICES} beside this machine's CPU: list fewer workers")
    return RpcDevices(endpoints, handles, labels)


# -- failures ---------------------------------------------------------------------------------------

_state_lock = threading.Lock()
_state = {"setting_up": False, "end_process": False}
_failure_hook: Any = None  # keeps the ctypes callback alive


def _on_worker_failure(endpoint: bytes | None, reason: bytes | None) -> None:
    # once per failed connection, on a thread ggml starts for it (the failure is recorded natively
    # already): where nothing can use a partial result, end the process here
    failure = ((endpoint or b"?").decode("utf-8", "replace"), (reason or b"failed").decode("utf-8", "replace"))
    with _state_lock:
        end_now = _state["end_process"] and not _state["setting_up"]
    if end_now:
        _end_process(f"error: {lost_worker(*failure)}")


def lost_worker(endpoint: str, reason: str) -> WorkerLost:
    """The error for a worker that failed after the model began loading there."""
    hint = ""
    if "sends no keepalive" in reason:
        hint = f": a forward longer than {TIMEOUT_ENV} looks the same"
    elif reason.startswith(("sent nothing for", "took no data for")):
        hint = f" (stopped, frozen, or its machine or network is gone? {TIMEOUT_ENV} sets how long dg waits)"
    return WorkerLost(f"lost RPC worker {endpoint} mid-run: it {reason}{hint}; the model's layers there are "
                      "gone: restart the worker and run again")


def _first_failure() -> tuple[str, str] | None:
    """(endpoint, reason) of the first worker that failed since `rpc_devices` began, if any."""
    if _ggml is None:
        return None
    endpoint, reason = ctypes.create_string_buffer(512), ctypes.create_string_buffer(1024)
    if not _ggml.first_failure(endpoint, len(endpoint), reason, len(reason)):
        return None
    return endpoint.value.decode("utf-8", "replace"), reason.value.decode("utf-8", "replace")


def _raise_setup_failure() -> None:
    failure = _first_failure()
    if failure is not None:
        raise RpcError(f"RPC worker {failure[0]} {failure[1]}")


def check_workers() -> None:
    """Raise WorkerLost when a worker failed since `rpc_devices` (runs after every native call); after
    `end_process_on_lost_worker()`, end the process instead."""
    failure = _first_failure()
    if failure is None or _state["setting_up"]:
        return
    if _state["end_process"]:  # the hook's thread may be at it too: one of them ends it
        _end_process(f"error: {lost_worker(*failure)}")
    raise lost_worker(*failure)


def end_process_on_lost_worker() -> None:
    """From now on a worker's failure ends the process at once: one line, exit WORKER_LOST_EXIT (for a
    server, whose requests cannot go on without the worker's layers); one that failed already ends it now."""
    with _state_lock:
        _state["end_process"] = True
    check_workers()


_watched: list[str] = []
_abort_callback: Any = None  # keeps the ctypes callback alive
# how the process ends once a worker is lost: the CLI sets its own exit (it removes the temporaries of
# unfinished output files and gives the terminal its cursor back, as on SIGTERM)
exit_process: Callable[[int], None] = os._exit


def watch_workers(endpoints: Sequence[str]) -> None:
    """From now on a worker's failure reaches `_on_worker_failure` (not ggml's abort), and any ggml abort
    prints one line, naming a failed worker or the workers that no longer accept connections, and exits
    WORKER_LOST_EXIT."""
    global _abort_callback, _failure_hook
    _watched[:] = list(endpoints)
    if _failure_hook is None:
        _failure_hook = _FAILURE_HOOK(_on_worker_failure)
        ggml().set_failure_hook(_failure_hook)
        native.call_checks.append(check_workers)
    if _abort_callback is None:
        _abort_callback = _ABORT_CALLBACK(_on_ggml_abort)
        ggml().ggml_set_abort_callback(_abort_callback)


def _on_ggml_abort(message: bytes | None) -> None:
    # runs on ggml's thread (usually its RPC dispatcher's), right before abort(): say what happened
    # and end the process here, since ggml would abort right after this returns
    reason = (message or b"").decode("utf-8", "replace").strip()
    reason = reason.split(": ", 1)[1] if ": " in reason else reason  # drop "file.cpp:123: "
    failure = _first_failure()  # llama.cpp stopped on the neutral values a failed worker left behind
    gone = [] if failure else _refusing_workers(_watched)
    if failure:
        line = f"error: {lost_worker(*failure)}"
    elif gone:
        line = (f"error: lost RPC worker {', '.join(gone)} mid-run (llama.cpp: {reason}); "
                "the model's layers there are gone: restart the worker and run again")
    else:
        line = f"error: llama.cpp stopped: {reason}"
    _end_process(line)


_ending = threading.Lock()


def _end_process(line: str) -> None:
    """`line` on stderr and exit WORKER_LOST_EXIT, once: a second thread that gets here waits for the end."""
    if not _ending.acquire(blocking=False):
        threading.Event().wait()
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    finally:
        try:
            exit_process(WORKER_LOST_EXIT)
        finally:
            os._exit(WORKER_LOST_EXIT)


def _refusing_workers(endpoints: Sequence[str], settle_s: float = 1.0) -> list[str]:
    # a killed worker's kernel closes its sockets in descriptor order, so the broken connection can
    # reach us a moment before its listening socket is gone: ask again for a short while
    deadline = time.monotonic() + settle_s
    while True:
        gone = [e for e in endpoints if not _accepts_connections(e)]
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.1)


def _accepts_connections(endpoint: str) -> bool:
    try:
        with socket.create_connection(parse_endpoint(endpoint), timeout=1.0):
            return True
    except OSError:
        return False


# -- worker -----------------------------------------------------------------------------------------


def worker_devices() -> list[int]:
    """What a worker lends: its GPUs (any non-CPU device), else its CPU, as llama.cpp's rpc-server."""
    lib = ggml()
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if lib.ggml_backend_dev_type(dev) not in (GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_ACCEL):
            devices.append(dev)
    if not devices:
        cpu = lib.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
        if cpu:
            devices.append(cpu)
    if not devices:
        raise RpcError("no device to serve (no CPU backend in this llama.cpp build)")
    return devices


def free_port(host: str) -> int:
    """A port the OS says is free on `host` now (for --port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_bindable(host: str, port: int) -> str:
    """Fail with a clear message when host:port cannot be listened on (ggml only prints to stderr);
    else the IPv4 address `host` names (ggml's server takes only a numeric one: inet_addr)."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise RpcError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # ggml sets SO_REUSEADDR too: a port in TIME_WAIT is usable, one in use is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(infos[0][4])
        except OSError as err:
            raise RpcError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return infos[0][4][0]


def native_stdout_to_stderr() -> None:
    """ggml's RPC server logs with printf (its banner, a line per client) from its own thread; sent
    to stderr, it cannot interleave with what this process prints on stdout. Python's sys.stdout
    keeps the original stdout.

    C's stdout is made fully buffered: on a terminal it is line-buffered, and glibc writes a printf'd
    line's text and its newline in two writes, so a line this process printed between them would join
    it. ggml flushes after each of its lines."""
    sys.stdout.flush()
    _c_stdout_fully_buffered()
    own_stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = open(own_stdout, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8", closefd=True)


_c_stdout_buffer: Any = None  # C's stdout buffer: lives as long as the process


def _c_stdout_fully_buffered() -> None:
    global _c_stdout_buffer
    libc = ctypes.CDLL(None)
    for name in ("stdout", "__stdoutp"):  # glibc/musl, BSD/macOS
        try:
            stream = ctypes.c_void_p.in_dll(libc, name)
        except ValueError:
            continue
        libc.fflush(stream)
        # a buffer of our own: given NULL, glibc's setvbuf(_IOFBF) leaves a stream already used unbuffered
        _c_stdout_buffer = ctypes.create_string_buffer(1 << 16)
        libc.setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t]
        libc.setvbuf(stream, _c_stdout_buffer, 0, len(_c_stdout_buffer))  # _IOFBF
        return


class Worker:
    """ggml's RPC server on host:port, on a background thread of this process (its accept loop never
    returns, so the main thread stays free to notice Ctrl-C)."""

    def __init__(self, host: str, port: int, n_threads: int, cache_dir: Path | None = None):
        if isinstance(n_threads, bool) or not isinstance(n_threads, int) or not 1 <= n_threads <= MAX_THREADS:
            raise RpcError(f"invalid threads={n_threads}: must be an integer from 1 to {MAX_THREADS}")
        self.host, self.port = check_bindable(host, port), port
        lib = ggml()
        self.devices = worker_devices()
        self.labels = [lib.device_label(d) for d in self.devices]
        self._args = (self.endpoint.encode(), str(cache_dir).encode() if cache_dir else None, n_threads,
                      len(self.devices), (ctypes.c_void_p * len(self.devices))(*self.devices))
        self.thread = threading.Thread(target=self._run, name="dg-rpc-worker", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def _run(self) -> None:
        endpoint, cache, n_threads, n_devices, devices = self._args
        ggml().start_server(endpoint, cache, n_threads, n_devices, devices)

    def start(self, ready_timeout: float = 30.0) -> None:
        """Start serving; return once the worker answers a handshake (or raise RpcError)."""
        self.thread.start()
        deadline = time.monotonic() + ready_timeout
        while True:
            if not self.thread.is_alive():
                raise RpcError(f"llama.cpp's RPC server on {self.endpoint} stopped at start (see its message above)")
            try:
                probe(self.endpoint, timeout=2.0)
                return
            except RpcError:
                if time.monotonic() > deadline:
                    raise
            self.thread.join(0.05)

    def wait(self, poll: Callable[[], None] | None = None) -> None:
        """Block until the server thread ends (it does not, normally); Ctrl-C raises KeyboardInterrupt."""
        while self.thread.is_alive():
            self.thread.join(0.5)
            if poll is not None:
                poll()
