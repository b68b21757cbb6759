"""RPC workers that go silent or report values no device has (a scripted worker, tests/fake_rpc_worker.py):
`dg generate --rpc` ends within a bounded time with one line naming the worker and its exit status,
never a hang, a native abort or a flood of reconnections; Ctrl-C works while it waits. A real worker
busy for longer than the deadline is not taken for a frozen one (its keepalive frames)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from fake_rpc_worker import CMD_DEVICE_COUNT, CMD_GET_ALIGNMENT, CMD_GET_DEVICE_MEMORY, FakeWorker, WithoutKeepalives
import test_rpc
from test_rpc import REPO, Worker, assert_one_line_error, dg, env

# test_rpc's skips, and every test here starts dg or a worker in a process of its own
pytestmark = [*test_rpc.pytestmark, pytest.mark.subprocess]

# every case ends well within this; a hang is a subprocess.TimeoutExpired (a failure), not a stuck suite
BOUND_S = 120


@pytest.mark.parametrize("count", [4294967295, 20000, 17])
def test_a_worker_reporting_more_devices_than_llama_cpp_takes_is_one_line(tiny_gguf, count):
    # 4294967295 was a std::bad_alloc in ggml_backend_rpc_add_server (SIGABRT); 20000 ran past 60 s,
    # reconnecting once per device for each question asked of it (67,000 connections)
    with FakeWorker(device_count=count) as worker:
        p = dg("generate", "hi", "-m", tiny_gguf, "--rpc", worker.endpoint, timeout=BOUND_S)
    assert_one_line_error(p, f"RPC worker {worker.endpoint} reported {count} devices (at most 16")
    assert p.returncode == 1
    assert worker.commands.count(CMD_DEVICE_COUNT) == 1 and CMD_GET_DEVICE_MEMORY not in worker.commands


def test_workers_with_more_devices_in_all_than_llama_cpp_schedules_are_one_line(tiny_gguf):
    with FakeWorker(device_count=8) as first, FakeWorker(device_count=8) as second:
        p = dg("generate", "hi", "-m", tiny_gguf, "--rpc", f"{first.endpoint},{second.endpoint}", timeout=BOUND_S)
    assert_one_line_error(p, "the RPC workers offer 16 devices in all; llama.cpp schedules at most 15")


def test_a_worker_reporting_more_memory_than_any_device_has_is_one_line(tiny_gguf):
    with FakeWorker(total=1 << 63) as worker:
        p = dg("generate", "hi", "-m", tiny_gguf, "--rpc", worker.endpoint, timeout=BOUND_S)
    assert_one_line_error(p, f"RPC worker {worker.endpoint} reported 9223372036854775808 bytes of memory")
    assert p.returncode == 1


@pytest.mark.parametrize("values, said", [
    (dict(alignment=3), "reported an alignment of 3 bytes (a power of two up to 1048576 expected)"),
    (dict(alignment=0), "reported an alignment of 0 bytes"),
    (dict(alignment=1 << 40), "reported an alignment of 1099511627776 bytes"),
    (dict(max_size=0), "reported buffers of at most 0 bytes"),
])
def test_a_value_out_of_range_once_the_model_loads_is_a_lost_worker(tiny_gguf, values, said):
    from dgcli.runtime.rpc import WORKER_LOST_EXIT

    with FakeWorker(**values) as worker:
        p = dg("generate", "hi", "-m", tiny_gguf, "--rpc", worker.endpoint, timeout=BOUND_S)
    assert_one_line_error(p, f"error: lost RPC worker {worker.endpoint} mid-run: it {said}")
    assert p.returncode == WORKER_LOST_EXIT


def test_a_worker_silent_after_its_handshake_is_one_line_at_the_deadline(tiny_gguf):
    # dg's own 5 s probe covered only its handshake: ggml's client then waited forever
    with FakeWorker(silent_from=CMD_DEVICE_COUNT) as worker:
        p = dg("generate", "hi", "-m", tiny_gguf, "--rpc", worker.endpoint, timeout=BOUND_S, DG_RPC_TIMEOUT="1")
    assert_one_line_error(p, f"RPC worker {worker.endpoint} sent nothing for 1 s")
    assert p.returncode == 1


def test_a_worker_silent_once_the_model_loads_is_a_lost_worker(tiny_gguf):
    from dgcli.runtime.rpc import WORKER_LOST_EXIT

    with FakeWorker(silent_from=CMD_GET_ALIGNMENT) as worker:
        p = dg("generate", "hi", "-m", tiny_gguf, "--rpc", worker.endpoint, timeout=BOUND_S, DG_RPC_TIMEOUT="1.5")
    assert_one_line_error(p, f"error: lost RPC worker {worker.endpoint} mid-run: it sent nothing for 1.5 s (stopped, "
                             "frozen, or its machine or network is gone?")
    assert p.returncode == WORKER_LOST_EXIT


def start_on_a_silent_worker(worker: FakeWorker, tiny_gguf, timeout_s: str) -> subprocess.Popen:
    """`dg generate` waiting on `worker`, which has stopped answering while the model loads."""
    client = subprocess.Popen([sys.executable, "-m", "dgcli.cli", "generate", "hi", "-m", str(tiny_gguf),
                               "--rpc", worker.endpoint], cwd=REPO, env=dict(env(), DG_RPC_TIMEOUT=timeout_s),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + BOUND_S
    while CMD_GET_ALIGNMENT not in worker.commands:
        assert client.poll() is None, client.communicate()
        assert time.monotonic() < deadline, "dg never asked the worker for its alignment"
        time.sleep(0.05)
    return client


def ended(client: subprocess.Popen) -> tuple[int, str]:
    try:
        _, stderr = client.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        client.kill()
        raise AssertionError("dg did not end")
    return client.returncode, stderr


def test_ctrl_c_twice_ends_a_wait_on_a_silent_worker(tiny_gguf):
    with FakeWorker(silent_from=CMD_GET_ALIGNMENT) as worker:
        client = start_on_a_silent_worker(worker, tiny_gguf, timeout_s="600")
        client.send_signal(signal.SIGINT)  # the first waits for the native call (here: the deadline)
        time.sleep(0.5)
        client.send_signal(signal.SIGINT)
        rc, stderr = ended(client)
    assert rc == 130, stderr
    assert "Traceback" not in stderr and "Aborted" not in stderr


def test_ctrl_c_then_the_deadline_is_the_lost_worker(tiny_gguf):
    from dgcli.runtime.rpc import WORKER_LOST_EXIT

    with FakeWorker(silent_from=CMD_GET_ALIGNMENT) as worker:
        client = start_on_a_silent_worker(worker, tiny_gguf, timeout_s="2")
        client.send_signal(signal.SIGINT)
        rc, stderr = ended(client)
    assert rc == WORKER_LOST_EXIT, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: lost RPC worker {worker.endpoint} mid-run: it sent "
                                                   "nothing for 2 s"), stderr


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "1e9"])
def test_an_rpc_timeout_that_is_no_number_of_seconds_is_one_line(tiny_gguf, value):
    with FakeWorker() as worker:
        p = dg("generate", "hi", "-m", tiny_gguf, "--rpc", worker.endpoint, timeout=BOUND_S, DG_RPC_TIMEOUT=value)
    assert_one_line_error(p, f"invalid DG_RPC_TIMEOUT={value!r}: must be seconds from 0 to 1e+06")


@pytest.fixture(scope="module")
def slow_gguf(tmp_path_factory):
    """A random model whose forward of a long prompt takes seconds on one worker thread."""
    from dgcli.testing.tiny import write_synthetic_gguf

    return write_synthetic_gguf(tmp_path_factory.mktemp("slow") / "slow.gguf", n_layer=2, vocab_size=512, hidden=1024,
                                outtype="q8_0", num_experts=8, num_attention_heads=8, num_key_value_heads=4,
                                num_global_key_value_heads=2)


def test_a_worker_busy_for_longer_than_the_deadline_is_not_taken_for_a_frozen_one(slow_gguf):
    # a graph computation sends nothing until it is done: a long prompt's prefill on one worker thread
    # is about a second of silence, here against a deadline of 0.25 s (the keepalive frames then come
    # every 50 ms, the shortest interval a client asks for)
    from dgcli.runtime.rpc import WORKER_LOST_EXIT

    prompt = " ".join(["hello world reverse sort"] * 80)  # ~1450 tokens
    args = ("generate", prompt, "--raw", "-m", slow_gguf, "-n", "16", "--steps", "1", "--seed", "0", "--no-live", "--rpc")
    worker = Worker()
    try:
        # the same worker without its keepalive frames (as llama.cpp's rpc-server): the forward's silence
        # is then past the deadline, which is what this test needs to mean anything
        with WithoutKeepalives(worker.endpoint) as plain:
            unaided = dg(*args, plain.endpoint, DG_RPC_TIMEOUT="0.25")
        if unaided.returncode == 0:
            pytest.skip("the forward took less than 0.25 s on this machine: no silence to bridge")
        assert unaided.returncode == WORKER_LOST_EXIT, unaided.stderr[-2000:]
        assert unaided.stderr.splitlines()[-1].startswith(
            f"error: lost RPC worker {plain.endpoint} mid-run: it sent nothing for 0.25 s and sends no keepalive frames "
            "(llama.cpp's rpc-server, or an older dg): a forward longer than DG_RPC_TIMEOUT looks the same")
        kept_alive = dg(*args, worker.endpoint, DG_RPC_TIMEOUT="0.25")
    finally:
        worker.kill()
    assert kept_alive.returncode == 0, kept_alive.stderr[-2000:]


def test_a_server_whose_worker_freezes_stops_with_one_line(tiny_gguf):
    # a request cannot go on without the worker's layers: dg serve ends (exit 3) instead of hanging
    # every request, now and after
    from serve_helpers import ServeProcess, fetch_json

    from dgcli.runtime.rpc import WORKER_LOST_EXIT

    worker = Worker()
    try:
        with ServeProcess("-m", str(tiny_gguf), "--rpc", worker.endpoint, env={"DG_RPC_TIMEOUT": "2"}) as server:
            status, _ = fetch_json("POST", server.url + "/completions", {"prompt": "hi", "max_tokens": 8})
            assert status == 200
            worker.proc.send_signal(signal.SIGSTOP)
            try:
                fetch_json("POST", server.url + "/completions", {"prompt": "hi", "max_tokens": 8}, timeout=BOUND_S)
            except OSError:
                pass  # the connection ends with the server
            rc = server.proc.wait(BOUND_S)
            errors = [line for line in server.stderr_lines if line.startswith("error:")]
    finally:
        worker.kill()
    assert rc == WORKER_LOST_EXIT, server.stderr_lines[-5:]
    assert errors == [f"error: lost RPC worker {worker.endpoint} mid-run: it sent nothing for 2 s (stopped, frozen, "
                      "or its machine or network is gone? DG_RPC_TIMEOUT sets how long dg waits); the model's layers "
                      "there are gone: restart the worker and run again"], server.stderr_lines[-5:]
