"""`dg worker`: llama.cpp's RPC server in this process, lending this machine's devices to a dg process
that runs with `--rpc HOST:PORT` (dgcli/runtime/rpc.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from dgcli.cli import _errors, _options, _output
from dgcli.errors import InvalidParameter


def worker(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. The RPC protocol is unauthenticated: "
                                                         "anything but 127.0.0.1 must be a trusted network."),
    port: int = typer.Option(50052, "--port", "-p", help="TCP port (0: any free port, printed at start)."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="CPU threads for the computations "
                                                                        "(default: every core; a Mac's performance cores)."),
    cache: bool = typer.Option(False, "--cache", help="Keep received weights in a local file cache (by hash) so "
                                                      "the next load of the same model sends less over the network."),
) -> None:
    """Serve this machine's devices (its GPUs, else its CPU) to `dg ... --rpc HOST:PORT` over llama.cpp's RPC."""
    from dgcli.runtime import rpc
    from dgcli.runtime.cpu import MAX_THREADS, check_threads, compute_threads

    with _errors.user_errors():
        if not 0 <= port <= 65535:
            raise InvalidParameter("port", port, "an integer in [0, 65535]")
        check_threads(threads)  # ggml's thread pool takes at most 512: more fails natively at a client's first graph
        if not host.strip() or ":" in host:  # else parse_endpoint's words: "invalid RPC worker address '::1:50052'"
            raise InvalidParameter("host", host, "an IPv4 address or a host name (llama.cpp's RPC server takes no IPv6)")
        rpc.parse_endpoint(f"{host}:{port or 1}")
        if port == 0:
            port = rpc.free_port(host)
        cache_dir = None
        if cache:
            cache_dir = Path(os.environ.get("DG_CACHE_DIR") or Path.home() / ".cache" / "dg") / "rpc"
            try:
                cache_dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise _errors.fail(f"cannot use {cache_dir} for --cache (DG_CACHE_DIR): {err.strerror or err}") from None
        rpc.native_stdout_to_stderr()
        server = rpc.Worker(host, port, n_threads=threads or min(MAX_THREADS, compute_threads()),
                            cache_dir=cache_dir)
        if not _options.is_loopback(host):
            _output.notice(f"warning: listening on {host}: llama.cpp's RPC protocol has no authentication and no "
                          "encryption; whoever reaches this port can use this machine's memory and compute. "
                          "Trusted networks only.")
        server.start()
        typer.echo(f"dg worker: listening on {server.endpoint}; devices: {'; '.join(server.labels)}", err=False)
        _output.notice(f"dg worker: use it with `dg generate ... --rpc {_reachable_endpoint(server)}`; Ctrl-C stops")
        try:
            server.wait()
        except KeyboardInterrupt:
            typer.echo("dg worker: stopped", err=True)
            sys.stdout.flush()
            # the server thread sits in llama.cpp's accept(): leave without tearing the runtime down under it
            os._exit(_errors.EXIT_INTERRUPTED)
        raise _errors.fail("the RPC server stopped (see llama.cpp's message above)")


def _reachable_endpoint(server) -> str:
    """What a client names this worker by: a wildcard address (0.0.0.0, every interface) is no address
    to connect to from another machine, so this machine's name stands in for it."""
    import socket

    if server.host != "0.0.0.0":
        return server.endpoint
    return f"{socket.gethostname()}:{server.port}"
