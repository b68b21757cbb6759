"""Beyond one machine with llama.cpp's own RPC backend, on loopback: `dg worker` processes lend their
CPU; `--rpc` spreads the model's layers over them. The same tokens and (exact mode) the same logits
within a measured tolerance as the local run; a worker killed mid-run is one clear error, not a
hang or a native abort; an unreachable, busy or malformed worker is a one-line error up front."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from native_helpers import requires_native

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "dgcli" / "models" / "demo-diffusion.gguf"
TIMEOUT_S = 300
# exact mode locally vs over RPC: the workers run the same CPU kernels on the same F32 weights; the
# measured difference was 0 on every forward (tiny random model and demo); this bound leaves room
# for a different split of the graph between the client's CPU and the workers
RPC_EXACT_TOL = 1e-5


def _rpc_reason() -> str | None:
    from dgcli.runtime import native, rpc

    ok, reason = native.available()
    if not ok:
        return f"native library unavailable: {reason}"
    ok, reason = rpc.available()
    return None if ok else reason


RPC_REASON = _rpc_reason()
pytestmark = [requires_native, pytest.mark.skipif(RPC_REASON is not None, reason=f"no RPC backend: {RPC_REASON}")]


def env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
                COLUMNS="120")


class Worker:
    """`dg worker --port 0` in a child process; `.endpoint` is what it printed."""

    def __init__(self, host: str = "127.0.0.1"):
        self.proc = subprocess.Popen([sys.executable, "-m", "dgcli.cli", "worker", "--host", host, "--port", "0",
                                      "--threads", "1"],
                                     cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True)
        self.endpoint = self._endpoint()

    def _endpoint(self) -> str:
        found: list[str] = []

        def scan() -> None:
            for line in self.proc.stdout:
                if line.startswith("dg worker: listening on "):
                    found.append(line.split()[4].rstrip(";"))
                    break

        reader = threading.Thread(target=scan, daemon=True)
        reader.start()
        reader.join(TIMEOUT_S)
        if not found:
            self.kill()
            raise AssertionError(f"dg worker did not start: {self.proc.stderr.read() if self.proc.poll() is not None else ''}")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # keep the pipe drained
        return found[0]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(TIMEOUT_S)


@pytest.fixture
def workers():
    started = [Worker(), Worker()]
    yield started
    for w in started:
        w.kill()


def first_line(stream, timeout: float = TIMEOUT_S) -> str:
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else ""


def dg(*args: str, timeout: float = TIMEOUT_S, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgcli.cli", *map(str, args)], cwd=REPO, env=dict(env(), **extra_env),
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)


def assert_one_line_error(p: subprocess.CompletedProcess, *fragments: str) -> str:
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    assert "Traceback" not in p.stderr and "Aborted" not in p.stderr
    return lines[0]


@pytest.mark.subprocess
def test_two_workers_give_the_local_tokens_and_logits(workers):
    endpoints = ",".join(w.endpoint for w in workers)
    p = subprocess.run([sys.executable, str(REPO / "tests" / "rpc_compare.py"), str(DEMO), endpoints], cwd=REPO,
                       env=dict(env(), DG_VERBOSE="1"), capture_output=True, text=True, timeout=TIMEOUT_S,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    print("max |logit diff| per forward, local vs 2 RPC workers (exact mode):", doc["max_abs_diff"])
    assert doc["rpc_tokens"] == doc["local_tokens"] and doc["local_tokens"]
    assert max(doc["max_abs_diff"]) <= RPC_EXACT_TOL
    # the layers really went to both workers
    for w in workers:
        assert any(w.endpoint in d for d in doc["devices"])
        assert any(f"[{w.endpoint}] model buffer size" in line for line in p.stderr.splitlines()), w.endpoint


@pytest.mark.subprocess
def test_generate_and_serve_over_rpc_answer_as_locally(workers):
    endpoints = ",".join(w.endpoint for w in workers)
    local = dg("generate", "reverse: HELLO", "--seed", "0", "--json")
    remote = dg("generate", "reverse: HELLO", "--seed", "0", "--json", "--rpc", endpoints)
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout)["result"]["token_ids"] == json.loads(local.stdout)["result"]["token_ids"]

    from serve_helpers import ServeProcess, fetch_json

    with ServeProcess("--rpc", endpoints, "--parallel", "2") as server:
        status, body = fetch_json("POST", server.url + "/chat/completions", {
            "messages": [{"role": "user", "content": "reverse: HELLO"}], "seed": 0})
    assert status == 200 and body["choices"][0]["message"]["content"] == json.loads(local.stdout)["answer"]


class LostWorkerRun:
    """What `dg generate --rpc` did after one of its workers was killed or stopped mid-run."""

    def __init__(self, rc: int, stdout: str, stderr: list[str], took: float):
        self.rc, self.stdout, self.stderr, self.took = rc, stdout, stderr, took

    @property
    def errors(self) -> list[str]:
        return [line for line in self.stderr if line.startswith("error:")]


def lose_a_worker_mid_run(workers, tiny_gguf, *args: str, signum: int = signal.SIGKILL, at: str = "canvas 1  step",
                          **extra_env: str) -> LostWorkerRun:
    """`dg generate ARGS --rpc` over both workers, `signum` sent to the second once a stderr line starts
    with `at`; the client must end within 60 s of it."""
    endpoints = ",".join(w.endpoint for w in workers)
    client = subprocess.Popen([sys.executable, "-m", "dgcli.cli", "generate", "hi", "-m", str(tiny_gguf), "--steps", "48",
                               "--max-new-tokens", str(16 * 60), "--seed", "0", "--no-live", "--ignore-eos",
                               "--rpc", endpoints, *args],
                              cwd=REPO, env=dict(env(), **extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True)
    stderr: list[str] = []
    stdout: list[str] = []
    reached = threading.Event()

    def read_stderr() -> None:
        for line in client.stderr:
            stderr.append(line.rstrip("\n"))
            if line.startswith(at):
                reached.set()

    readers = [threading.Thread(target=read_stderr, daemon=True),
               threading.Thread(target=lambda: stdout.extend(client.stdout), daemon=True)]
    for reader in readers:
        reader.start()
    assert reached.wait(TIMEOUT_S), "\n".join(stderr)
    workers[1].proc.send_signal(signum)
    lost_at = time.monotonic()
    try:
        rc = client.wait(60)
    except subprocess.TimeoutExpired:
        client.kill()
        raise AssertionError("the client hung after its worker was lost")
    took = time.monotonic() - lost_at
    for reader in readers:
        reader.join(10)
    return LostWorkerRun(rc, "".join(stdout), stderr, took)


@pytest.mark.subprocess
def test_a_worker_killed_mid_run_is_one_clear_error_not_a_hang(workers, tiny_gguf):
    run = lose_a_worker_mid_run(workers, tiny_gguf)
    from dgcli.runtime.rpc import WORKER_LOST_EXIT

    assert run.rc == WORKER_LOST_EXIT, "\n".join(run.stderr[-5:])
    assert run.errors == [run.errors[-1]]
    assert run.errors[-1].startswith(f"error: lost RPC worker {workers[1].endpoint} mid-run: it closed the connection")
    assert not any("Aborted" in line or "ggml_print_backtrace" in line or "#0 " in line for line in run.stderr)
    print(f"client exited {run.took:.2f} s after the worker was killed")


@pytest.mark.subprocess
def test_a_worker_frozen_mid_run_ends_the_run_with_its_answer_so_far(workers, tiny_gguf):
    # `kill -STOP`: the worker's kernel keeps its connections open and even accepts new ones, so only
    # a deadline can tell. dg hung with no output: two Ctrl-C did nothing, SIGTERM ended it (143) and
    # the answer so far was lost
    from dgcli.runtime.rpc import WORKER_LOST_EXIT

    run = lose_a_worker_mid_run(workers, tiny_gguf, signum=signal.SIGSTOP, at="canvas 3  step", DG_RPC_TIMEOUT="5")
    assert run.rc == WORKER_LOST_EXIT, "\n".join(run.stderr[-5:])
    assert run.errors == [f"error: lost RPC worker {workers[1].endpoint} mid-run: it sent nothing for 5 s (stopped, "
                          "frozen, or its machine or network is gone? DG_RPC_TIMEOUT sets how long dg waits); the "
                          "model's layers there are gone: restart the worker and run again"], run.stderr[-5:]
    # the two canvases finished before it: their answer on stdout, the summary says why it stopped
    summary = [line for line in run.stderr if "stop=" in line]
    assert summary and "stop=worker_lost" in summary[-1], run.stderr[-5:]
    streamed = re.search(r"(\d+) tokens", summary[-1])
    assert streamed and int(streamed.group(1)) >= 32 and run.stdout.strip(), (summary, run.stdout)
    print(f"client exited {run.took:.2f} s after the worker was stopped (DG_RPC_TIMEOUT=5)")


@pytest.mark.subprocess
def test_a_worker_lost_mid_run_keeps_the_trace_of_what_was_done(workers, tiny_gguf, tmp_path):
    # the run ends as a Ctrl-C ends it: the trace of the canvases done is written whole, no temporary
    # is left behind (the abort callback's os._exit used to leave the .partial file)
    trace = tmp_path / "run.jsonl"
    run = lose_a_worker_mid_run(workers, tiny_gguf, "--trace", str(trace), at="canvas 2  step")
    from dgcli.runtime.rpc import WORKER_LOST_EXIT

    assert run.rc == WORKER_LOST_EXIT, "\n".join(run.stderr[-5:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.jsonl"]
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(r["kind"] == "canvas" for r in records)  # canvas 1 was done
    assert records[-1]["kind"] == "result" and records[-1]["stop_reason"] == "worker_lost" and records[-1]["interrupted"]


@pytest.mark.subprocess
def test_unreachable_busy_and_malformed_workers_are_one_line_errors(tiny_gguf):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert_one_line_error(dg("generate", "hi", "-m", tiny_gguf, "--rpc", f"127.0.0.1:{free}"),
                          f"cannot reach RPC worker 127.0.0.1:{free}")
    assert_one_line_error(dg("generate", "hi", "-m", tiny_gguf, "--rpc", "localhost"), "expected HOST:PORT")
    assert_one_line_error(dg("generate", "hi", "-m", tiny_gguf, "--rpc", "127.0.0.1:99999"), "invalid port")
    assert_one_line_error(dg("generate", "hi", "-m", tiny_gguf, "--rpc", "127.0.0.1:1,127.0.0.1:1"), "listed twice")
    # something listening that is not a worker: it accepts and never answers the handshake
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        assert_one_line_error(dg("generate", "hi", "-m", tiny_gguf, "--rpc", f"127.0.0.1:{port}"),
                              f"RPC worker 127.0.0.1:{port} accepted the connection but did not answer")



def test_a_server_that_is_no_worker_is_named_by_what_it_sent():
    # an HTTP server's answer read as "a 3543824036068086856-byte message" (the bytes 'HTTP/1.1' as a size)
    from dgcli.runtime import rpc

    with socket.socket() as http:
        http.bind(("127.0.0.1", 0))
        http.listen(1)

        def answer() -> None:
            conn, _ = http.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        endpoint = f"127.0.0.1:{http.getsockname()[1]}"
        with pytest.raises(rpc.RpcError) as err:
            rpc.probe(endpoint, timeout=10)
    assert str(err.value) == (f"{endpoint} answered the RPC handshake with something else (b'HTTP/1.1'...); "
                              "not a llama.cpp RPC worker of a compatible version")


@pytest.mark.subprocess
def test_one_worker_under_two_addresses_is_one_line_error_not_a_hang(tiny_gguf):
    # ggml's client opens one connection per address: the second one to the same worker (which
    # serves one at a time) waited forever during the model's load, and Ctrl-C did not end it
    worker = Worker(host="0.0.0.0")
    port = worker.endpoint.rpartition(":")[2]
    try:
        assert_one_line_error(dg("generate", "hi", "-m", tiny_gguf, "--rpc", f"localhost:{port},127.0.0.1:{port}",
                                 timeout=60), f"RPC workers localhost:{port} and 127.0.0.1:{port} are the same worker")
        # two addresses that only the worker can tell are its own (on Linux, 127.0.0.2 reaches 0.0.0.0)
        assert_one_line_error(dg("generate", "hi", "-m", tiny_gguf, "--rpc", f"127.0.0.1:{port},127.0.0.2:{port}",
                                 timeout=60), f"RPC worker 127.0.0.2:{port} accepted the connection but did not answer",
                              f"is it 127.0.0.1:{port} again under another address?")
        # the worker is free again afterwards
        assert dg("generate", "hi", "-m", tiny_gguf, "--max-new-tokens", "16", "--rpc", f"127.0.0.1:{port}").returncode == 0
    finally:
        worker.kill()


@pytest.mark.subprocess
def test_a_worker_serves_one_client_at_a_time_and_says_so(tiny_gguf):
    worker = Worker()
    try:
        # a server holds its connection to the worker for as long as it runs (a generation may end
        # before the second client has even started)
        first = subprocess.Popen([sys.executable, "-m", "dgcli.cli", "serve", "-m", str(tiny_gguf), "--port", "0",
                                  "--rpc", worker.endpoint], cwd=REPO,
                                 env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                 text=True)
        assert first_line(first.stderr).startswith("dg serve: layers on RPC workers")  # loaded over the worker
        assert_one_line_error(dg("generate", "hi", "-m", tiny_gguf, "--rpc", worker.endpoint),
                              "did not answer within", "another one using it")
        first.send_signal(signal.SIGINT)
        first.wait(TIMEOUT_S)
    finally:
        worker.kill()


@pytest.mark.subprocess
def test_worker_usage_errors_and_ctrl_c():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert_one_line_error(dg("worker", "--port", str(port)), f"cannot listen on 127.0.0.1:{port}")
    assert_one_line_error(dg("worker", "--port", "70000"), "invalid --port 70000")
    # --host's own words, not the --rpc parser's "invalid RPC worker address '::1:50052': expected HOST:PORT"
    for host in ("", "::1"):
        assert_one_line_error(dg("worker", "--host", host, timeout=30), f"invalid --host {host!r}: must be an IPv4 address")
    worker = Worker()
    worker.proc.send_signal(signal.SIGINT)
    assert worker.proc.wait(30) == 130


@pytest.mark.subprocess
def test_a_worker_listens_on_a_host_name(tiny_gguf):
    # ggml's server takes only a numeric address: --host localhost passed dg's own check, then
    # llama.cpp printed "Failed to create server socket" and the worker stopped
    worker = Worker(host="localhost")
    try:
        host, _, port = worker.endpoint.rpartition(":")
        assert host == "127.0.0.1"
        assert dg("generate", "hi", "-m", tiny_gguf, "--max-new-tokens", "16", "--rpc", f"localhost:{port}").returncode == 0
    finally:
        worker.kill()


def test_a_worker_whose_listening_socket_closes_just_after_the_abort_is_named():
    # the broken connection can arrive before the killed worker's listening socket is closed
    from dgcli.runtime import rpc

    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    threading.Timer(0.3, listener.close).start()
    assert rpc._refusing_workers([endpoint]) == [endpoint]


@pytest.mark.subprocess
def test_the_layers_kept_here_run_on_dgs_cpu_gemms_beside_rpc_workers(workers, tmp_path):
    """dg's CPU GEMMs stand aside where a GPU is in use (llama.cpp's scheduler would run a canvas's
    matmuls on host weights there), but RPC devices, though they report themselves as GPUs, take no
    such offload: the layers kept on this machine still run on the int8 GEMMs. The experts' GEMM is
    forced to the AVX2 kernel, which every x86 CPU this suite runs on has: the automatic choice
    depends on the CPU family (an AVX-512 VNNI CPU may leave them to ggml)."""
    from dgcli.testing.tiny import write_tiny_random_gguf

    kernel_env = dict(env(), DG_VERBOSE="1", DG_EXPERT_GEMM="avx2")
    probe = subprocess.run([sys.executable, "-c", "from dgcli.runtime import native; print(native.lib()._lib.dg_expert_kernel())"],
                           cwd=REPO, env=kernel_env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if probe.stdout.strip() != "1":
        pytest.skip("this CPU has no AVX2: dg's expert GEMM does not run here")

    q8 = write_tiny_random_gguf(tmp_path / "q8.gguf", seed=4, outtype="q8_0")
    script = ("import sys; from dgcli.runtime import native; from dgcli.runtime.model import DiffusionModel\n"
              "m = DiffusionModel(sys.argv[1], n_threads=2, n_ctx=128, n_gpu_layers=2, rpc_servers=[sys.argv[2]])\n"
              "lib = native.lib()._lib\n"
              "print(lib.dg_dense_repacked_count(m._model), lib.dg_expert_gemm_count(m._model))\n")
    endpoint = workers[0].endpoint
    p = subprocess.run([sys.executable, "-c", script, str(q8), endpoint], cwd=REPO, env=kernel_env,
                       capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-3000:]
    assert any(f"[{endpoint}] model buffer size" in line for line in p.stderr.splitlines())  # layers went there
    dense, experts = (int(v) for v in p.stdout.split())
    assert dense > 0 and experts > 0, p.stdout


@pytest.mark.subprocess
def test_verbose_names_the_rpc_workers_as_where_the_layers_went(workers):
    # it said "N/N layers offloaded to the GPU" when they went to other machines
    p = dg("generate", "reverse: HELLO", "--seed", "0", "--no-live", "-v", "--rpc", workers[0].endpoint)
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.search(r"diffusion model \S+: \d+/\d+ layers offloaded to the RPC workers", p.stderr), p.stderr[-2000:]
    assert "offloaded to the GPU" not in p.stderr


@pytest.mark.subprocess
def test_a_worker_on_every_interface_names_this_machine_for_clients():
    # --host 0.0.0.0 suggested `--rpc 0.0.0.0:P`, which no other machine can connect to
    worker = Worker(host="0.0.0.0")
    try:
        hint: list[str] = []

        def scan() -> None:
            for line in worker.proc.stderr:
                if "use it with" in line:
                    hint.append(line)
                    break

        reader = threading.Thread(target=scan, daemon=True)
        reader.start()
        reader.join(TIMEOUT_S)
        port = worker.endpoint.rpartition(":")[2]
        assert hint and f"--rpc {socket.gethostname()}:{port}`" in hint[0], hint
    finally:
        worker.kill()


def test_the_handshake_limit_holds_for_the_whole_reply():
    """A peer that sends a valid hello reply a byte at a time, each byte well within the limit, the
    whole past it: the limit is for the whole reply (it was per read, so such a peer held the client
    for as many limits as it sent bytes, while the error said 'within 5 s')."""
    import struct

    from dgcli.runtime import rpc

    reply = struct.pack("<QBBBB", rpc._HELLO_REPLY, rpc.RPC_PROTO_MAJOR, 0, 0, 0) + bytes(rpc._CONN_CAPS)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def trickle() -> None:
            conn, _ = listener.accept()
            with conn:
                try:
                    for i in range(len(reply)):  # 36 bytes, 0.1 s apart: 3.6 s in all
                        time.sleep(0.1)
                        conn.sendall(reply[i:i + 1])
                except OSError:
                    pass  # the client gave up and closed

        peer = threading.Thread(target=trickle, daemon=True)
        peer.start()
        with pytest.raises(rpc.RpcError, match="did not answer within 0.5 s"):
            rpc.probe(f"127.0.0.1:{listener.getsockname()[1]}", timeout=0.5)
        peer.join(10)


@pytest.mark.subprocess
@pytest.mark.pty
def test_ggml_s_lines_on_a_terminal_do_not_take_in_the_worker_s_own():
    # on a terminal C's stdout was line-buffered and glibc wrote ggml's "Client connection closed" and
    # its newline in two writes: the worker's "listening on" line, printed between them, joined it
    # ("Client connection closeddg worker: listening on ..."). C's lines now leave at ggml's fflush, whole.
    import pty

    script = ("import ctypes, os\n"
              "from dgcli.runtime import rpc\n"
              "rpc.native_stdout_to_stderr()\n"
              "libc = ctypes.CDLL(None)\n"
              "libc.printf(b'Client connection closed\\n')\n"
              "os.write(2, b'dg worker: listening\\n')\n"
              "libc.fflush(None)\n")
    main, sub = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-c", script], stdin=subprocess.DEVNULL, stdout=sub, stderr=sub,
                              env=env(), timeout=60)
        os.close(sub)
        out = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(main)
    assert proc.returncode == 0, out
    assert out.replace(b"\r\n", b"\n") == b"dg worker: listening\nClient connection closed\n"


@pytest.mark.subprocess
def test_gpu_layers_0_with_rpc_keeps_the_layers_here_as_asked():
    # --rpc offloads every layer "unless --gpu-layers says how many": `--gpu-layers 0` was taken for
    # "not given" and every layer went to the worker anyway
    worker = Worker()
    try:
        for extra, offloaded in ((["--gpu-layers", "0"], "0/7"), ([], "7/7"), (["-ngl", "2"], "2/7")):
            p = dg("generate", "reverse: HELLO", "-n", "4", "--seed", "0", "--no-live", "-v", "--rpc", worker.endpoint,
                   *extra)
            assert p.returncode == 0, p.stderr[-2000:]
            assert f": {offloaded} layers offloaded to the RPC workers" in p.stderr, (extra, p.stderr[-2000:])
    finally:
        worker.kill()


@pytest.mark.subprocess
def test_a_worker_refuses_more_threads_than_ggml_s_pool_takes():
    # --threads 100000 started a worker that died of a native std::bad_alloc at a client's first graph
    for threads in ("100000", "513", "100000000000"):
        assert_one_line_error(dg("worker", "--port", "0", "--threads", threads, timeout=30),
                              f"invalid --threads {threads}: must be an integer from 1 to 512")


@pytest.mark.subprocess
def test_a_cache_directory_that_cannot_be_made_is_one_line(tmp_path):
    # DG_CACHE_DIR naming a file: `dg worker --cache` ended in a NotADirectoryError traceback
    (tmp_path / "file").write_text("")
    p = subprocess.run([sys.executable, "-m", "dgcli.cli", "worker", "--port", "0", "--cache"], cwd=REPO,
                       env=dict(env(), DG_CACHE_DIR=str(tmp_path / "file")), capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=60)
    assert_one_line_error(p, f"cannot use {tmp_path / 'file' / 'rpc'} for --cache", "Not a directory")
