"""llama.cpp's RPC backend (ggml-rpc): a model's layers spread over other machines.

A worker (`dg worker`, `serve_worker` here) runs ggml's RPC server in this process and lends its
devices (its GPUs, else its CPU) to one dg process at a time. The client (`--rpc HOST:PORT,...`)
registers each worker's devices (`rpc_devices`) and hands them to llama.cpp as the model's devices
(llama_model_params.devices, what llama.cpp's own `--rpc` does); offloaded layers, their KV cache
and their compute then live on the workers, split in proportion to the memory each reports.

The protocol is llama.cpp's and it is unauthenticated and unencrypted: whoever reaches a worker's
port can make it allocate memory and run computations, and can read what it holds. Bind workers to
127.0.0.1 or a trusted network only.

ggml's client aborts the process when a worker stops answering mid-run (GGML_ABORT in its
dispatcher thread). `rpc_devices` installs ggml's abort callback so that this becomes one line on
stderr naming the workers that are gone, and exit status WORKER_LOST_EXIT, instead of a native
abort with a backtrace.
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

from dgcli.errors import DgError
from dgcli.units import format_bytes
from dgcli.runtime import native
from dgcli.runtime.cpu import MAX_THREADS

DEFAULT_PORT = 50052
# ggml-rpc.h of the vendored llama.cpp: a worker must speak the same major version
RPC_PROTO_MAJOR = 7
MAX_SERVERS = 16  # GGML_RPC_MAX_SERVERS
PROBE_TIMEOUT_S = 5.0
WORKER_LOST_EXIT = 3

_CMD_HELLO = 14
_CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: transport capabilities; all zero = plain TCP
_HELLO_REPLY = 4 + _CONN_CAPS  # major, minor, patch, padding, caps

GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_ACCEL = 0, 3


class RpcError(DgError):
    """A worker address that is malformed, unreachable, busy or speaks another protocol version."""


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
        self.add_server = ctypes.CFUNCTYPE(vp, ctypes.c_char_p)(add)
        self.start_server = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, sz, sz,
                                             ctypes.POINTER(vp))(start)

    def device_label(self, dev: int) -> str:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        name = (self.ggml_backend_dev_name(dev) or b"?").decode()
        desc = (self.ggml_backend_dev_description(dev) or b"").decode()
        return f"{name} ({desc}, {format_bytes(total.value)}, {format_bytes(free.value)} free)"


_ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
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
    missing, busy or incompatible one is an RpcError rather than a native abort or a hang."""
    endpoints = parse_endpoints(endpoints)
    check_distinct(endpoints)
    lib = ggml()
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
            reg = lib.add_server(endpoint.encode())
            count = lib.ggml_backend_reg_dev_count(reg) if reg else 0
            if not count:
                raise RpcError(f"RPC worker {endpoint} offers no devices")
            devs = [lib.ggml_backend_reg_dev_get(reg, i) for i in range(count)]
            _registered[endpoint] = (devs, [f"{endpoint}: {lib.device_label(d)}" for d in devs])
        devs, names = _registered[endpoint]
        handles += devs
        labels += names
    return RpcDevices(endpoints, handles, labels)


_watched: list[str] = []
_abort_callback: Any = None  # keeps the ctypes callback alive
# how the process ends once a worker is lost: the CLI sets its own exit (it removes the temporaries of
# unfinished output files and gives the terminal its cursor back, as on SIGTERM)
exit_process: Callable[[int], None] = os._exit


def watch_workers(endpoints: Sequence[str]) -> None:
    """From now on a ggml abort (what ggml's RPC client does when a worker stops answering) prints
    one line naming the workers that no longer accept connections and exits WORKER_LOST_EXIT."""
    global _abort_callback
    _watched[:] = list(endpoints)
    if _abort_callback is None:
        _abort_callback = _ABORT_CALLBACK(_on_ggml_abort)
        ggml().ggml_set_abort_callback(_abort_callback)


def _on_ggml_abort(message: bytes | None) -> None:
    # runs on ggml's thread (usually its RPC dispatcher's), right before abort(): say what happened
    # and end the process here, since ggml would abort right after this returns
    reason = (message or b"").decode("utf-8", "replace").strip()
    reason = reason.split(": ", 1)[1] if ": " in reason else reason  # drop "file.cpp:123: "
    gone = _refusing_workers(_watched)
    if gone:
        line = (f"error: lost RPC worker {', '.join(gone)} mid-run (llama.cpp: {reason}); "
                "the model's layers there are gone: restart the worker and run again")
    else:
        line = f"error: llama.cpp stopped: {reason}"
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
