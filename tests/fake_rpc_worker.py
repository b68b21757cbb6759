"""A scripted llama.cpp RPC worker for tests: it speaks the handshake and the commands a client sends
while it sets a worker up (device count, memory, buffer type), with values a test chooses, and can
fall silent from any command on: a hostile or frozen worker without a real one's timing.

    with FakeWorker(device_count=20000) as worker:   # worker.endpoint: "127.0.0.1:PORT"
        ...
    with FakeWorker(silent_from=CMD_GET_ALIGNMENT) as worker:   # answers set-up, then nothing
        ...
"""

from __future__ import annotations

import socket
import struct
import threading

RPC_PROTO_MAJOR = 7
CONN_CAPS = 24
# ggml-rpc.cpp's enum rpc_cmd
CMD_ALLOC_BUFFER, CMD_GET_ALIGNMENT, CMD_GET_MAX_SIZE, CMD_BUFFER_GET_BASE = 0, 1, 2, 3
CMD_GET_DEVICE_MEMORY, CMD_HELLO, CMD_DEVICE_COUNT = 11, 14, 15
CMD_DG_KEEPALIVE = 0xD6  # dg's extension (native/patch): keepalive frames while a command runs
HELLO_DG_KEEPALIVE = 0x01

GIB = 1 << 30


class _LoopbackServer:
    """A listener on a free loopback port, its accept loop on a thread from `with` on; each accepted
    connection goes to `_accepted`. Leaving the `with` closes the listener and every connection kept in
    `_open`."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._open: list[socket.socket] = []

    def __enter__(self):
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._listener.close()
        for conn in self._open:
            conn.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._accepted(conn)

    def _accepted(self, conn: socket.socket) -> None:
        raise NotImplementedError


class FakeWorker(_LoopbackServer):
    """Serves one connection at a time, as a worker does. `silent_from`: the first command it reads
    and never answers (it keeps the connection open and reads on); None: it answers all it knows."""

    def __init__(self, *, device_count: int = 1, free: int = 8 * GIB, total: int = 16 * GIB,
                 alignment: int = 32, max_size: int = (1 << 64) - 1, silent_from: int | None = None,
                 keepalive: bool = False):
        self.device_count, self.free, self.total = device_count, free, total
        self.alignment, self.max_size = alignment, max_size
        self.silent_from, self.keepalive = silent_from, keepalive
        self.commands: list[int] = []  # every command received, in order, over all connections
        super().__init__()

    def _accepted(self, conn: socket.socket) -> None:
        # one connection at a time, as a worker serves them
        self._open.append(conn)
        try:
            self._client(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def _client(self, conn: socket.socket) -> None:
        silent = False
        while True:
            head = _recv(conn, 9)
            if head is None:
                return
            cmd, size = struct.unpack("<BQ", head)
            if _recv(conn, size) is None:
                return
            self.commands.append(cmd)
            silent = silent or cmd == self.silent_from
            reply = None if silent else self._reply(cmd)
            if reply is not None:
                conn.sendall(struct.pack("<Q", len(reply)) + reply)

    def _reply(self, cmd: int) -> bytes | None:
        if cmd == CMD_HELLO:
            flags = HELLO_DG_KEEPALIVE if self.keepalive else 0
            return struct.pack("<BBBB", RPC_PROTO_MAJOR, 0, 0, flags) + bytes(CONN_CAPS)
        if cmd == CMD_DG_KEEPALIVE:
            return b"\x00"  # declined: this worker sends no frames
        if cmd == CMD_DEVICE_COUNT:
            return struct.pack("<I", self.device_count)
        if cmd == CMD_GET_DEVICE_MEMORY:
            return struct.pack("<QQ", self.free, self.total)
        if cmd == CMD_GET_ALIGNMENT:
            return struct.pack("<Q", self.alignment)
        if cmd == CMD_GET_MAX_SIZE:
            return struct.pack("<Q", self.max_size)
        return None  # anything else: never answered


def _recv(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(min(n - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
    return data


class WithoutKeepalives(_LoopbackServer):
    """A TCP proxy to a real worker that hides its offer of keepalive frames in the handshake: the worker
    as a client sees llama.cpp's own rpc-server (or a dg from before keepalives)."""

    def __init__(self, endpoint: str):
        host, _, port = endpoint.rpartition(":")
        self._target = (host, int(port))
        super().__init__()

    def _accepted(self, client: socket.socket) -> None:
        worker = socket.create_connection(self._target)
        self._open += [client, worker]
        threading.Thread(target=_pump, args=(client, worker, None), daemon=True).start()
        threading.Thread(target=_pump, args=(worker, client, _hide_keepalive_offer), daemon=True).start()


def _hide_keepalive_offer(first: bytes) -> bytes:
    # the worker's first message is its HELLO reply: size (8 bytes), major, minor, patch, padding (flags)
    return first[:11] + bytes([first[11] & ~HELLO_DG_KEEPALIVE]) + first[12:] if len(first) > 11 else first


def _pump(src: socket.socket, dst: socket.socket, edit_first) -> None:
    head = b""
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            if edit_first is not None:
                head += data
                if len(head) < 12:
                    continue
                data, head, edit_first = edit_first(head), b"", None
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
