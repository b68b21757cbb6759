"""`dg serve`: the model behind an OpenAI-compatible HTTP API; concurrent requests' canvases are
denoised together (dgcli/server/)."""

from __future__ import annotations

import os
import signal
import socket
from typing import Optional

import typer

from dgcli.cli import _errors, _models, _options, _output, _signals, render
from dgcli.errors import DgError, InvalidParameter
from dgcli.units import plural

STOPPED = "dg serve: stopped"  # the log's last line, whichever signal stopped it

MAX_PARALLEL = 64
INT32_MAX = 2**31 - 1  # llama.cpp's n_ctx (every slot's cells together)


def serve(
    model: Optional[str] = _options.ModelOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface; "
                                                         "there is no authentication unless --api-key)."),
    port: int = typer.Option(8080, "--port", "-p", help="TCP port (0: any free port, printed at start)."),
    parallel: int = typer.Option(4, "--parallel", "-np", help="Requests denoised together: each gets a KV-cache "
                                                               "sequence, their canvases share one decoder forward."),
    queue_size: int = typer.Option(64, "--queue", help="Requests that may wait for a free slot; beyond that, 503."),
    ctx_size: Optional[int] = typer.Option(None, "--ctx-size", "-c", help="Context of each request: prompt + canvases "
                                                                          "(default: min(training context, 4096))."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="max_tokens of a request that sets none."),
    api_key: Optional[str] = typer.Option(None, "--api-key",
                                          help="Require `Authorization: Bearer KEY` (env DG_API_KEY)."),
    alias: Optional[str] = typer.Option(None, "--alias", help="The model's id in the API (default: its registry "
                                                              "name, or the path given to -m)."),
    cors: Optional[list[str]] = typer.Option(None, "--cors", help="Let web pages from ORIGIN call the API "
                                                                   "(CORS; repeatable; default: none)."),
    allowed_host: Optional[list[str]] = typer.Option(None, "--allowed-host", help="A host name clients may use "
                                                     "in the Host header besides the address (repeatable)."),
    max_connections: int = typer.Option(1024, "--max-connections", help="Open connections at most (idle ones "
                                                                        "are closed first to make room)."),
    self_cond_top_k: Optional[int] = typer.Option(
        None, "--self-cond-top-k", show_default=False,
        help="Tokens per position fed back to self-conditioning (default 0: all of them, the reference's dense "
             "form; K: the K most probable)."),
    threads: Optional[int] = _options.ThreadsOpt, gpu_layers: int = _options.GpuOpt,
    rpc: Optional[str] = _options.RpcOpt,
    yes: bool = _options.YesOpt,
) -> None:
    """Serve a diffusion model over HTTP: OpenAI-compatible /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health, and a page at / that shows the canvas denoise."""
    with _errors.user_errors():
        if max_tokens < 1:  # the flag's name, not generate's max_new_tokens
            raise InvalidParameter("max_tokens", max_tokens, "an integer >= 1")
        _options.check_generation_args(max_tokens, threads, gpu_layers)
        rpc_servers, gpu_layers = _options.rpc_placement(rpc, gpu_layers)
        if not 1 <= parallel <= MAX_PARALLEL:
            raise InvalidParameter("parallel", parallel, f"an integer in [1, {MAX_PARALLEL}]")
        if queue_size < 0:
            raise InvalidParameter("queue", queue_size, "an integer >= 0")
        if not 0 <= port <= 65535:
            raise InvalidParameter("port", port, "an integer in [0, 65535]")
        api_key = resolve_api_key(api_key)
        if alias is not None and not (0 < len(alias) <= 256 and alias.isprintable() and alias.strip() == alias):
            raise InvalidParameter("alias", alias, "a printable name of 1 to 256 characters, no surrounding spaces")
        if max_connections < 1:
            raise InvalidParameter("max_connections", max_connections, "an integer >= 1")
        if self_cond_top_k is not None and self_cond_top_k < 0:
            raise InvalidParameter("self_cond_top_k", self_cond_top_k, "an integer >= 0 (0 = all tokens)")
        if ctx_size is not None and not 1 <= ctx_size <= INT32_MAX // parallel:
            raise InvalidParameter("ctx_size", ctx_size, f"an integer from 1 to {INT32_MAX // parallel} "
                                                         f"({parallel} slots share llama.cpp's context of at most "
                                                         f"{INT32_MAX} tokens)")
        _serve_dependencies()
        resolved, path = _models.resolve_model(model, yes=yes, want="diffusion")
        ctx_size = ctx_size or default_ctx_size(path)
        _models.preflight(path, diffusion=True, command="serve", gpu_layers=gpu_layers, ctx_size=ctx_size,
                         n_seq=parallel)
        listener = _listen(host, port)
        try:
            _run(listener, alias or resolved.display_name, path, parallel=parallel, queue_size=queue_size,
                 ctx_size=ctx_size, max_tokens=max_tokens, api_key=api_key, self_cond_top_k=self_cond_top_k,
                 threads=threads, gpu_layers=gpu_layers, rpc_servers=rpc_servers, cors=cors or [],
                 allowed_hosts=allowed_host or [], max_connections=max_connections)
        finally:
            listener.close()


def _serve_dependencies() -> None:
    try:
        import starlette  # noqa: F401,PLC0415
        import uvicorn  # noqa: F401,PLC0415
    except ImportError as err:
        raise DgError(f"dg serve needs its optional dependencies ({err.name} is missing): "
                      "pip install -e '.[serve]' in dg's source folder, as the README says (Starlette and uvicorn)") from None


def resolve_api_key(flag: Optional[str]) -> Optional[str]:
    """--api-key, else DG_API_KEY; either one set but empty is refused (it would let in any client that
    sends 'Authorization: Bearer '), and so is a key HTTP clients cannot send in a header."""
    source, key = ("--api-key", flag) if flag is not None else ("DG_API_KEY", os.environ.get("DG_API_KEY"))
    if key is None:
        return None
    if not key.strip():  # `--api-key "$KEY"` with KEY unset, or `DG_API_KEY= dg serve`
        raise DgError(f"{source} is empty: an empty key lets in any client that sends 'Authorization: "
                      "Bearer '; give a key, or leave it unset to serve without one")
    if not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise DgError(f"{source} must be printable ASCII without spaces: HTTP clients send the key in a header, "
                      "where other characters do not arrive as typed")
    return key


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a taken port fails at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise DgError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise DgError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def _run(listener: socket.socket, name: str, path, *, parallel: int, queue_size: int, ctx_size: int,
         max_tokens: int, api_key: Optional[str], self_cond_top_k: Optional[int], threads: Optional[int],
         gpu_layers: int, rpc_servers: Optional[list[str]], cors: list[str], allowed_hosts: list[str],
         max_connections: int) -> None:
    from dgcli.engine.diffusion import DiffusionEngine
    from dgcli.runtime.model import DiffusionModel
    from dgcli.server.app import DgService, ServeConfig, create_app
    from dgcli.server.net import ConnectionLimits, run_server
    from dgcli.server.scheduler import BatchScheduler

    with _output.stderr.status(f"loading {name} ({plural(parallel, 'slot')} of {ctx_size} tokens)"):
        # a KV-cache stream per request: each is laid out as if alone, so answers equal `dg generate`'s
        model = DiffusionModel(str(path), n_threads=threads, n_gpu_layers=gpu_layers, n_ctx=ctx_size * parallel,
                               n_seq_max=parallel, kv_unified=False, rpc_servers=rpc_servers)
    if rpc_servers:  # no request can go on without the worker's layers: the server ends, with one line
        from dgcli.runtime import rpc

        rpc.end_process_on_lost_worker()
    _models.warn_if_not_offloaded("model", model, gpu_layers)
    scheduler = None
    try:
        if model.n_ctx_seq < model.canvas_length + 1:
            raise DgError(f"--ctx-size {ctx_size} cannot hold a prompt and one {model.canvas_length}-token canvas")
        if model.chat_template is not None:  # one that does not parse would fail every chat request
            model.chat_template.check()
        engine = DiffusionEngine(model, n_threads=threads, self_cond_top_k=self_cond_top_k)
        log = lambda line: typer.echo(line, err=True)  # noqa: E731
        scheduler = BatchScheduler(engine, slots=parallel, max_queue=queue_size, log=log)
        service = DgService(scheduler, ServeConfig(model_name=name, default_max_tokens=max_tokens, api_key=api_key,
                                                   allowed_hosts=allowed_hosts, cors_origins=cors), log=log)
        host, port = listener.getsockname()[:2]
        service.config.bound_host = host
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        banner = (f"dg serve: {url}/v1  model {name} (canvas {model.canvas_length})  "
                  f"{plural(parallel, 'slot')} of {model.n_ctx_seq} tokens  queue {queue_size}")
        if _output.stdout.is_terminal:  # wrapped between words; scripts reading stdout get one raw line
            _output.stdout.print(banner, markup=False, highlight=False)
        else:
            typer.echo(banner)
        if model.chat_template is None:  # completions still work: the prompt as it is
            _output.notice(f"dg serve: {path.name} has no chat template (tokenizer.chat_template): "
                          "/v1/chat/completions answers 400; send the prompt text to /v1/completions")
        if rpc_servers:
            _output.notice(f"dg serve: layers on RPC workers {', '.join(rpc_servers)}")
        if not _options.is_loopback(host) and api_key is None:
            _output.notice(f"warning: listening on {host} without --api-key: anyone who reaches this port can use "
                          "the model")
        if "*" in cors and api_key is None:
            _output.notice("warning: --cors '*' without --api-key: any web page you open can use the model")
        _output.notice(f"dg serve: {url}/ shows the canvas denoise in a browser")
        _output.notice("dg serve: Ctrl-C stops")
        _signals.hand_over()  # uvicorn's own handlers: SIGTERM shuts down gracefully, a second Ctrl-C forces it
        # After its graceful shutdown uvicorn raises the signal again with the handler it found: Ctrl-C
        # then unwinds to here (exit 130), SIGTERM and SIGHUP end the process as a service manager expects.
        signal.signal(signal.SIGTERM, _stopped_by_signal)
        signal.signal(signal.SIGHUP, _stopped_by_signal)
        try:
            # in-flight requests end at the first signal (their clients get 503) instead of holding shutdown
            run_server(create_app(service), listener, ConnectionLimits(max_connections=max_connections), log,
                       on_exit=lambda: scheduler.close(timeout=0))
        finally:
            _output.notice(STOPPED)
    finally:
        if scheduler is not None:
            scheduler.close()
        model.close()


def default_ctx_size(path) -> int:
    """Each request's context without --ctx-size: min(training context, 4096)."""
    from dgcli.modelfile.header import read_header
    from dgcli.runtime.model import DEFAULT_N_CTX

    n_ctx_train = read_header(path).arch("context_length")
    n_ctx_train = n_ctx_train if isinstance(n_ctx_train, int) and n_ctx_train > 0 else DEFAULT_N_CTX
    return min(n_ctx_train, DEFAULT_N_CTX)


def _stopped_by_signal(signum: int, _frame) -> None:
    """SIGTERM or SIGHUP after uvicorn's graceful shutdown: say so, then die of the signal (not exit 143
    or 129), which service managers count as a clean stop."""
    _output.notice(STOPPED)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
