"""`dg serve` end to end: a server started here on 127.0.0.1, driven by the official `openai` client
(and the stdlib HTTP client for what openai does not send). Answers are checked against
`DiffusionEngine.generate` run alone with the same seed; every request and wait is bounded."""

from __future__ import annotations

import http.client
import importlib.util
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from native_helpers import requires_native
from serve_helpers import InProcessServer, ServeProcess, fetch_json, wait_until

from dgcli.cli import render
from dgcli.engine.types import StepEvent
from dgcli.params import DiffusionParams

SERVE_DEPS = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "openai"))
pytestmark = [requires_native, pytest.mark.skipif(
    not SERVE_DEPS, reason="dg serve's test dependencies are missing: pip install -e '.[test]' (starlette, uvicorn, openai)")]

DEMO = Path(__file__).resolve().parents[1] / "dgcli" / "models" / "demo-diffusion.gguf"
TIMEOUT_S = 120


def client_for(url: str, api_key: str = "unused"):
    import openai

    return openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=TIMEOUT_S)


def solo(prompt, seed, chat=True, params=None, max_new_tokens=256, path=DEMO):
    """What `dg generate` computes for this prompt alone (raw prompts: markers parsed, as /v1/completions)."""
    from dgcli.engine.diffusion import DiffusionEngine

    with DiffusionEngine(str(path)) as engine:
        return engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, seed=seed, chat=chat,
                               parse_special=not chat)


@pytest.fixture(scope="module")
def demo_server():
    with ServeProcess("--parallel", "4") as server:  # the default model: the shipped demo
        yield server


# ---- the OpenAI endpoints with the official client ----------------------------------------------------


@pytest.mark.subprocess
def test_chat_completion_equals_generate_alone_and_counts_answer_tokens(demo_server):
    client = client_for(demo_server.url)
    want = solo("reverse: HELLO", seed=0)
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "reverse: HELLO"}], seed=0)
    assert r.object == "chat.completion" and r.model == "demo"
    message = r.choices[0].message
    assert message.role == "assistant" and message.content == want.text.strip() == "OLLEH"
    assert r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.n_prompt_tokens, want.n_new_tokens)
    assert r.usage.total_tokens == want.n_prompt_tokens + want.n_new_tokens
    assert r.model_extra["dg"]["steps_per_canvas"] == want.steps_per_canvas


@pytest.mark.subprocess
def test_chat_stream_deltas_add_up_to_the_answer_then_usage(demo_server):
    client = client_for(demo_server.url)
    want = solo("sort: QWERTY", seed=3)
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "sort: QWERTY"}],
                                            seed=3, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text == "EQRTWY"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.n_new_tokens


@pytest.mark.subprocess
def test_completions_endpoint_takes_raw_text_streaming_or_not(demo_server):
    client = client_for(demo_server.url)
    prompt = "<|turn>user\nsort: QWERTY<turn|>\n<|turn>model\n"
    want = solo(prompt, seed=5, chat=False)
    r = client.completions.create(model="demo", prompt=prompt, seed=5, max_tokens=32)
    assert r.object == "text_completion" and r.choices[0].text == want.text == "EQRTWY"
    assert r.usage.completion_tokens == want.n_new_tokens and r.usage.prompt_tokens == want.n_prompt_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="demo", prompt=prompt, seed=5, max_tokens=32, stream=True) if c.choices)
    assert streamed == want.text


@pytest.mark.subprocess
def test_concurrent_requests_share_forwards_and_each_equals_generate_alone(demo_server):
    """Six clients at once on four slots, with different prompts, seeds and sampler parameters."""
    prompts = ["reverse: HELLO", "sort: QWERTY", "add: 12+34", "sort: DBCA", "reverse: ABCDEF", "sort: ZYXW"]
    extras = [{"steps": 48, "confidence_threshold": 1e-9}, {"steps": 30, "confidence_threshold": 1e-9},
              {"t_max": 1.0}, {"entropy_bound": 0.3, "confidence_threshold": 1e-9}, {}, {"steps": 40}]
    base = DiffusionParams(max_denoising_steps=48)  # the demo's own defaults, but for the extras
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(str(DEMO)) as m:
        base = m.default_params
    fields = {"steps": "max_denoising_steps"}
    wants = [solo(p, seed=i, params=base.replace(**{fields.get(k, k): v for k, v in e.items()}))
             for i, (p, e) in enumerate(zip(prompts, extras))]
    before = fetch_json("GET", demo_server.root + "/health")[1]["requests"]
    client = client_for(demo_server.url)
    barrier = threading.Barrier(len(prompts), timeout=TIMEOUT_S)

    def ask(i):
        barrier.wait()
        return client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompts[i]}],
                                              seed=i, extra_body=extras[i])

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, range(len(prompts)), timeout=TIMEOUT_S))
    for answer, want in zip(answers, wants):
        assert answer.choices[0].message.content == want.text.strip()
        assert answer.usage.completion_tokens == want.n_new_tokens
        assert answer.model_extra["dg"]["steps_per_canvas"] == want.steps_per_canvas
    after = fetch_json("GET", demo_server.root + "/health")[1]["requests"]
    assert after["completed"] - before["completed"] == len(prompts)
    assert after["max_batch"] >= 2  # canvases of different requests went through one forward


@pytest.mark.subprocess
def test_dg_steps_stream_carries_the_canvas_for_a_live_view(demo_server):
    client = client_for(demo_server.url)
    want = solo("reverse: WORLD", seed=2)
    chunks = list(client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "reverse: WORLD"}], seed=2, stream=True,
        extra_body={"dg_steps": True}))
    steps = [c.model_extra["dg_step"] for c in chunks if "dg_step" in (c.model_extra or {})]
    canvases = [c.model_extra["dg_canvas"] for c in chunks if "dg_canvas" in (c.model_extra or {})]
    assert len(steps) == sum(want.steps_per_canvas) and len(canvases) == len(want.steps_per_canvas)
    first, last = steps[0], steps[-1]
    assert first["step"] == 1 and last["stopped"] and len(last["argmax_canvas"]) == 32 == len(last["pieces"])
    assert canvases[-1]["token_ids"] == want.token_ids
    # what the CLI's live view draws, from the stream alone (pieces come with it: no tokenizer needed)
    pieces = {t: p for s in steps for t, p in zip(s["argmax_canvas"], s["pieces"])}
    view = render.DiffusionLiveView(pieces.__getitem__, lambda ids: "".join(pieces[t] for t in ids), end_token_ids=[1, 106])
    view.on_event(StepEvent.from_json(last))
    drawn = render.canvas_text(view.last_step, pieces.__getitem__, [1, 106]).plain
    assert drawn.replace(" ", "").startswith(want.text)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text


# ---- errors: the right status, OpenAI's shape, and the server stays up -----------------------------------


@pytest.mark.subprocess
def test_bad_requests_get_openai_errors_and_the_server_survives(demo_server):
    import openai

    client = client_for(demo_server.url)
    msgs = [{"role": "user", "content": "sort: AB"}]
    cases = [
        (dict(extra_body={"t_min": 0.9, "t_max": 0.5}), "t_max", "at least t_min"),
        (dict(extra_body={"steps": 0}), "steps", "invalid steps=0"),
        (dict(n=17), "n", "from 1 to 16"),
        (dict(max_tokens=10**6), "max_tokens", "exceeds this server's limit"),
        # the demo's chat template has no place for tools: the model would never see them
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools",
         "does not render tools"),
        (dict(logprobs=True), "logprobs", "not supported"),
        (dict(temperature=3), "temperature", "from 0 to 2"),
    ]
    for kwargs, param, fragment in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="demo", messages=msgs, **kwargs)
        err = info.value.body
        assert err["param"] == param and fragment in err["message"] and err["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as info:  # it answered as the demo, "model": "demo"
        client.chat.completions.create(model="gpt-4o", messages=msgs)
    assert info.value.body["code"] == "model_not_found" and "GET /v1/models" in info.value.body["message"]
    assert fetch_json("GET", demo_server.url + "/models/gpt-4o")[1]["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "A " * 3000}])
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="text part"):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])

    status, body = fetch_json("POST", demo_server.url + "/chat/completions", raw=b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = fetch_json("POST", demo_server.url + "/chat/completions", body={"messages": "hi"})
    assert status == 400 and body["error"]["param"] == "messages"
    host, port = demo_server.root.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(64 << 20))  # refused from the header, before any body is read
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and "exceeds the limit" in json.loads(resp.read())["error"]["message"]
    conn.close()
    status, body = fetch_json("GET", demo_server.url + "/nothing-here")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = fetch_json("GET", demo_server.url + "/chat/completions")
    assert status == 405 and "error" in body
    assert fetch_json("GET", demo_server.root + "/health")[0] == 200
    assert client.models.list().data[0].id == "demo"


@pytest.mark.subprocess
def test_queue_full_is_503_and_a_client_that_disconnects_frees_its_slot(tiny_gguf):
    """One slot, no queue: a second request while a stream runs gets 503 (Retry-After); closing the
    stream cancels its request and the next one is served."""
    import openai

    with ServeProcess("-m", tiny_gguf, "--parallel", "1", "--queue", "0", "--alias", "x") as server:
        assert " 1 slot of " in server.banner, server.banner  # was "1 slots"
        host, port = server.root.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "messages": [{"role": "user", "content": "hi"}], "stream": True, "dg_steps": True, "steps": 48,
            "max_tokens": 16 * 60, "seed": 0}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        first_step = None
        for _ in range(50):
            line = resp.readline()
            if line.startswith(b"data: ") and b"dg_step" in line:
                first_step = json.loads(line[6:])
                break
        assert first_step is not None

        client = client_for(server.url)
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=16)
        assert info.value.status_code == 503 and info.value.body["code"] == "queue_full"
        assert "busy: 1 request running, 0 waiting" in info.value.body["message"], info.value.body  # "1 requests"
        assert info.value.response.headers.get("retry-after") == "1"

        conn.close()  # the client goes away mid-stream
        assert wait_until(lambda: fetch_json("GET", server.root + "/health")[1]["slots"]["busy"] == 0, timeout=TIMEOUT_S)
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                                           extra_body={"steps": 2})
        assert r.choices[0].finish_reason in ("stop", "length")
        health = fetch_json("GET", server.root + "/health")[1]["requests"]
        assert health["cancelled"] == 1 and health["completed"] == 1


@pytest.mark.subprocess
def test_ctrl_c_stops_the_server_with_streams_in_flight(tiny_gguf):
    with ServeProcess("-m", tiny_gguf, "--parallel", "2") as server:
        host, port = server.root.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
        # seed 3 runs this tiny model to max_tokens (60 canvases of 48 steps); unseeded, a draw that
        # ends after one canvas could finish the stream before the Ctrl-C (seen in a full run)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "stream": True, "max_tokens": 16 * 60,
                                                            "steps": 48, "seed": 3}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        resp.readline()
        rc = server.stop()
        rest = resp.read().decode()
        conn.close()
    assert rc == 130
    assert "shutting down" in rest or rest == "" or "error" in rest
    assert server.stderr_lines[-2:] == ["dg serve: stopped", "interrupted"], server.stderr_lines
    assert not any("Traceback" in line for line in server.stderr_lines)


@pytest.mark.subprocess
def test_sigterm_stops_the_server_with_a_log_line_and_dies_of_the_signal(tiny_gguf):
    """What a service manager sends: the same graceful shutdown, then "dg serve: stopped" in the log
    (it never printed: uvicorn raises the signal again after shutting down) and death by SIGTERM, which
    service managers count as a clean stop (an exit status of 143 they do not)."""
    import signal

    with ServeProcess("-m", tiny_gguf) as server:
        assert fetch_json("GET", server.root + "/health")[0] == 200
        rc = server.stop(signal.SIGTERM)
    assert rc == -signal.SIGTERM
    assert server.stderr_lines[-1] == "dg serve: stopped", server.stderr_lines
    assert not any("Traceback" in line for line in server.stderr_lines)


def test_serve_usage_errors_are_one_line():
    import socket

    from typer.testing import CliRunner

    from dgcli import cli

    runner = CliRunner()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = runner.invoke(cli.app, ["serve", "--port", str(port)])
    assert r.exit_code == 1 and r.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}")
    assert len(r.stderr.strip().splitlines()) == 1
    r = runner.invoke(cli.app, ["serve", "--parallel", "0"])
    assert r.exit_code == 1 and "invalid --parallel 0" in r.stderr
    r = runner.invoke(cli.app, ["serve", "--max-tokens", "0"])  # it named max_new_tokens, generate's flag
    assert r.exit_code == 1 and r.stderr.startswith("error: invalid --max-tokens 0: must be an integer >= 1")


@pytest.mark.subprocess
def test_a_chat_template_that_does_not_parse_is_refused_at_start(tmp_path):
    """Such a server started, then failed every chat request; it stops at start with one error line,
    as dg generate and dg chat report the template."""
    import subprocess
    import sys

    from dgcli.testing.tiny import write_tiny_random_gguf

    bad = write_tiny_random_gguf(tmp_path / "bad-template.gguf", chat_template="{% for %}")
    r = subprocess.run([sys.executable, "-m", "dgcli.cli", "serve", "-m", str(bad), "--port", "0"],
                       capture_output=True, text=True, timeout=TIMEOUT_S, cwd=DEMO.parents[2])
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith("error: the chat template of bad-template.gguf does not parse: ")


def test_an_empty_api_key_is_refused_at_start(monkeypatch):
    # `--api-key "$KEY"` with KEY unset started a server that let in 'Authorization: Bearer ', without the
    # warning a keyless server on another interface gives
    from typer.testing import CliRunner

    from dgcli import cli
    from dgcli.runtime import model as model_module

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model_module, "DiffusionModel", no_load)
    for key in ("", " "):
        r = CliRunner().invoke(cli.app, ["serve", "--api-key", key, "--host", "0.0.0.0", "--port", "0"])
        assert r.exit_code == 1 and r.stderr.startswith("error: --api-key is empty"), (r.stderr, r.exception)
        assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.subprocess
def test_a_model_without_a_chat_template_serves_completions_and_says_chat_is_refused(tmp_path):
    """Such a server started silently, then answered every chat request with advice to pass --raw, a
    flag no HTTP client has. It says at start that chat is refused, and a chat request's error names
    /v1/completions, which still answers."""
    from dgcli.testing.tiny import write_tiny_random_gguf

    path = write_tiny_random_gguf(tmp_path / "plain.gguf", chat_template=None)
    with ServeProcess("-m", path) as server:
        assert wait_until(lambda: any("/v1/chat/completions answers 400" in line for line in server.stderr_lines),
                          timeout=10), server.stderr_lines
        status, body = fetch_json("POST", server.url + "/chat/completions",
                                  {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert status == 400 and body["error"]["code"] == "no_chat_template", body
        assert "/v1/completions" in body["error"]["message"] and "--raw" not in body["error"]["message"]
        status, body = fetch_json("POST", server.url + "/completions", {"prompt": "hi", "max_tokens": 4, "seed": 0})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1, body


def test_a_context_the_machine_cannot_hold_is_refused_before_loading(monkeypatch):
    # --ctx-size 10000000 --parallel 64 asked the demo for 164 GB of KV cache: llama.cpp cleared it page
    # by page until the OOM killer ended the process; and a context past int32 named n_ctx, not --ctx-size.
    # On a CPU alone the attention scores of a micro-batch against 10^7 cells add half as much again.
    from collections import namedtuple

    from typer.testing import CliRunner

    from dgcli import cli
    from dgcli.runtime import model as model_module

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model_module, "DiffusionModel", no_load)
    VM = namedtuple("VM", "total available")
    monkeypatch.setattr("psutil.virtual_memory", lambda: VM(16 * 1000**3, 8 * 1000**3))
    monkeypatch.delenv("DG_SKIP_MEMORY_CHECK", raising=False)
    runner = CliRunner()
    r = runner.invoke(cli.app, ["serve", "--port", "0", "--ctx-size", "10000000", "--parallel", "64"])
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "64 sequences of 10000000 tokens needs about 245.9 GB of RAM" in r.stderr
    assert "use a smaller --ctx-size or --parallel" in r.stderr
    r = runner.invoke(cli.app, ["serve", "--port", "0", "--ctx-size", "999999999999"])
    assert r.exit_code == 1 and "invalid --ctx-size 999999999999: must be an integer from 1 to 536870911" in r.stderr


# ---- the thinking channel, through a scripted model in-process ---------------------------------------------

PIECES = ["<pad>", "<eos>", "<bos>", "<|channel>", "thought", "\n", "I", " think", "<channel|>", "The", " answer",
          ".", "u", "<turn|>"]
THINKING_CANVASES = [[3, 4, 5, 6], [7, 5, 8, 9], [10, 11, 1, 0]]  # "<|channel>thought\nI| think\n<channel|>The| answer."


class ThinkingModel:
    """A one-sequence step-level model whose canvases spell a thinking channel, then an answer."""

    canvas_length, vocab_size, n_seq_max, n_ctx, n_ctx_seq, kv_unified = 4, len(PIECES), 1, 64, 64, False
    end_token_ids, pad_token_id = [1], 0

    def __init__(self):
        from dgcli.params import DiffusionParams

        self.default_params = DiffusionParams()
        self.canvas_index = 0

    def chat_tokens(self, messages, add_generation_prompt=True, parse_special=False):
        return [2] + [12] * len(messages)

    def detokenize(self, ids):
        return "".join(PIECES[int(t)] for t in ids)

    def clear_sequence(self, seq):
        self.canvas_index = 0

    def prefill(self, tokens, seq=0):
        pass

    def commit(self, canvas, seq=0):
        self.canvas_index += 1

    def decode_canvas(self, canvas, sc_logits=None, sc_topk=None):
        logits = np.full((4, self.vocab_size), -20.0, dtype=np.float32)
        logits[np.arange(4), THINKING_CANVASES[min(self.canvas_index, 2)]] = 20.0
        return logits


@pytest.fixture
def thinking_server():
    from dgcli.engine.diffusion import DiffusionEngine
    from dgcli.server.app import DgService, ServeConfig
    from dgcli.server.scheduler import BatchScheduler

    scheduler = BatchScheduler(DiffusionEngine(ThinkingModel(), sampler="numpy"), slots=1)
    server = InProcessServer(DgService(scheduler, ServeConfig(model_name="thinker", api_key="sesame"),
                                       log=lambda line: None))
    yield server
    server.stop()
    scheduler.close()


def test_thinking_is_reasoning_content_not_content(thinking_server):
    client = client_for(thinking_server.url, api_key="sesame")
    msgs = [{"role": "user", "content": "why?"}]
    r = client.chat.completions.create(model="thinker", messages=msgs, seed=0)
    message = r.choices[0].message
    assert message.content == "The answer." and message.model_extra["reasoning_content"] == "I think"
    chunks = list(client.chat.completions.create(model="thinker", messages=msgs, seed=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")]
    content = [d.content for d in deltas if d.content]
    assert reasoning == ["I", " think"] and content == ["The", " answer."]  # one delta per committed canvas


def test_json_that_python_cannot_read_is_a_400_not_a_500(thinking_server):
    # 100000 nested arrays (RecursionError) and a 5000-digit integer (ValueError) got "500 internal server
    # error" and a traceback in the server's log
    auth = {"Authorization": "Bearer sesame"}
    for raw, fragment in [(b"[" * 100000 + b"]" * 100000, "nested too deeply"),
                          (b'{"prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}", "number too long")]:
        status, body = fetch_json("POST", thinking_server.url + "/completions", raw=raw, headers=auth)
        assert status == 400 and fragment in body["error"]["message"], (status, body)
    status, body = fetch_json("POST", thinking_server.url + "/chat/completions",
                              {"messages": [{"role": "user", "content": "q"}]}, headers=auth)
    assert status == 200, body  # the server is still up


def test_stop_strings_cut_the_answer_and_end_the_request(thinking_server):
    client = client_for(thinking_server.url, api_key="sesame")
    r = client.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "q"}], stop=["he"])
    assert r.choices[0].message.content == "T" and r.choices[0].finish_reason == "stop"
    assert len(r.model_extra["dg"]["steps_per_canvas"]) == 2  # no third canvas after the stop string


def test_the_log_line_says_how_many_tokens_the_usage_counts_through_a_stop_string():
    """The server's log counted the whole answer (27+5 tokens) where the client's usage, cut at the stop
    string, said 3: the log now gives both."""
    from dgcli.engine.diffusion import DiffusionEngine
    from dgcli.server.app import DgService, ServeConfig
    from dgcli.server.scheduler import BatchScheduler

    lines: list[str] = []
    scheduler = BatchScheduler(DiffusionEngine(ThinkingModel(), sampler="numpy"), slots=1)
    server = InProcessServer(DgService(scheduler, ServeConfig(model_name="thinker"), log=lines.append))
    try:
        client = client_for(server.url)
        # " ans" completes on the first token of the last canvas, which is committed whole
        r = client.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "q"}], stop=[" ans"])
        cut = r.usage.completion_tokens
        r = client.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "q"}])
        whole = r.usage.completion_tokens
    finally:
        server.stop()
        scheduler.close()
    done = [line for line in lines if line.startswith("chatcmpl-")]
    assert cut < whole and len(done) == 2
    assert f" ({cut} through the stop string) " in done[0] and "through the stop" not in done[1]


def test_api_key_is_required_when_set(thinking_server):
    import openai

    with pytest.raises(openai.AuthenticationError) as info:
        client_for(thinking_server.url, api_key="wrong").models.list()
    assert info.value.body["code"] == "invalid_api_key"
    assert fetch_json("GET", thinking_server.root + "/health")[0] == 200  # health needs no key
