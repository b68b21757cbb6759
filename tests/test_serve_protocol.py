"""`dg serve` speaks the protocol clients expect: every malformed request is a 4xx in OpenAI's error
shape (never a 500, never a traceback in the log), an unknown model is a 404 as /v1/models says,
responses carry system_fingerprint and x-request-id, and the API key is checked the same way
whether it comes from --api-key or DG_API_KEY."""

from __future__ import annotations

import http.client
import importlib.util
import json

import pytest

from native_helpers import requires_native
from serve_helpers import ServeProcess, fetch_json

SERVE_DEPS = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "openai"))
pytestmark = [requires_native, pytest.mark.skipif(
    not SERVE_DEPS, reason="dg serve's test dependencies are missing: pip install -e '.[test]' (starlette, uvicorn, openai)")]

TIMEOUT_S = 60
HUGE = "1" * 400  # an integer of 400 digits, as JSON text


@pytest.fixture(scope="module")
def tiny_server(tiny_gguf):
    with ServeProcess("-m", tiny_gguf, "--alias", "tiny", "--parallel", "2") as server:
        yield server


def raw(server, method, path, body=b"", headers=None):
    """(status, headers, parsed JSON or text) for exactly these bytes."""
    host, port = server.root.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = data.decode("utf-8", "replace")
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed
    finally:
        conn.close()


def chat(**fields):
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
                       **fields}).encode()


def with_raw_number(field):
    return ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "%s": %s}'
            % (field, HUGE)).encode()


BAD_REQUESTS = [
    # (path, body, extra headers, status)
    ("/v1/chat/completions", chat(messages=[{"role": ["user"], "content": "hi"}]), None, 400),
    ("/v1/chat/completions", chat(messages=[{"role": {"x": 1}, "content": "hi"}]), None, 400),
    ("/v1/chat/completions", chat(messages=[{"role": 7, "content": "hi"}]), None, 400),
    *[("/v1/chat/completions", with_raw_number(f), None, 400)
      for f in ("steps", "t_min", "t_max", "entropy_bound", "confidence_threshold", "stability_threshold",
                "max_tokens", "temperature", "top_p", "seed", "n")],
    ("/v1/chat/completions", chat(temperature=2.5), None, 400),
    ("/v1/chat/completions", chat(temperature=-1), None, 400),
    ("/v1/chat/completions", chat(model="gpt-4o"), None, 404),
    ("/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode(), None, 404),
    ("/v1/chat/completions", chat(messages="hi"), None, 400),
    ("/v1/chat/completions", chat(messages=[5]), None, 400),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), None, 400),
    ("/v1/chat/completions", b"[" * 100000 + b"]" * 100000, None, 400),
    ("/v1/chat/completions", b'{"messages": ' + b"1" * 5000 + b"}", None, 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None, 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None, 400),
    ("/v1/chat/completions", b"", None, 400),
    ("/v1/chat/completions", b"null", None, 400),
    ("/v1/chat/completions", b'"hi"', None, 400),
    ("/v1/completions", json.dumps({"prompt": ["a", 5]}).encode(), None, 400),
    ("/v1/completions", json.dumps({"prompt": [[1, "x"]]}).encode(), None, 400),
    ("/v1/completions", json.dumps({"prompt": "a", "n": 16, "max_tokens": 10**9}).encode(), None, 400),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": ["x"]}}]), None, 400),
    ("/v1/chat/completions", chat(tools="all"), None, 400),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": 3}}]),
     None, 400),
    ("/v1/chat/completions", chat(tool_choice={"type": "function", "function": {"name": ["f"]}}), None, 400),
    ("/v1/chat/completions", chat(messages=[{"role": "assistant", "content": "", "tool_calls": [{"function": 1}]}]),
     None, 400),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}), None, 400),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"schema": json.loads(
        '{"items": ' * 500 + "{}" + "}" * 500)}}), None, 400),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"schema": {
        "type": "string", "pattern": "(("}}}), None, 400),
    ("/v1/chat/completions", chat(stream_options={"include_usage": "yes"}, stream=True), None, 400),
    ("/v1/chat/completions", chat(stop={"a": 1}), None, 400),
    ("/v1/chat/completions", chat(n=[2]), None, 400),
    ("/v1/chat/completions", chat(seed=-5), None, 400),
    ("/v1/responses", json.dumps({"model": "tiny", "input": [{"type": "input_image"}]}).encode(), None, 400),
    ("/v1/responses", json.dumps({"model": "tiny", "input": [{"role": ["user"], "content": "x"}]}).encode(), None,
     400),
    ("/v1/responses", json.dumps({"model": "tiny", "input": "x", "previous_response_id": "resp_1"}).encode(), None,
     400),
    ("/v1/responses", json.dumps({"model": "tiny", "input": "x", "max_output_tokens": HUGE}).encode(), None, 400),
    ("/v1/chat/completions", chat(), {"Content-Type": "text/plain"}, 415),
    ("/v1/chat/completions", chat(), {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("/v1/chat/completions", chat(), {"Host": "evil.example:8080"}, 403),
    ("/v1/chat/completions", chat(), {"Origin": "http://evil.example"}, 403),
    ("/v1/chat/completions", b"{" + b" " * (5 << 20) + b"}", None, 413),
    ("/v1/nothing", chat(), None, 404),
]


@pytest.mark.subprocess
def test_the_bad_request_set_gets_4xx_in_openai_shape_no_500_and_no_traceback(tiny_server):
    """Each of these was a 500 with a traceback, a 200 for the wrong model, or served anyway."""
    for path, body, headers, want in BAD_REQUESTS:
        status, response_headers, parsed = raw(tiny_server, "POST", path, body, headers)
        assert status == want, (path, body[:120], headers, status, parsed)
        assert isinstance(parsed, dict) and set(parsed["error"]) == {"message", "type", "param", "code"}, parsed
        assert response_headers["x-request-id"].startswith("req_")
    assert fetch_json("GET", tiny_server.root + "/health")[0] == 200
    log = "\n".join(tiny_server.stderr_lines)
    assert "Traceback" not in log and "internal error" not in log and " 500 " not in log, log[-3000:]


@pytest.mark.subprocess
def test_responses_carry_system_fingerprint_and_x_request_id(tiny_server):
    status, headers, body = raw(tiny_server, "POST", "/v1/chat/completions", chat(seed=1),
                                {"X-Request-Id": "trace-42"})
    assert status == 200 and headers["x-request-id"] == "trace-42"
    fingerprint = body["system_fingerprint"]
    # "b" and the native build's key (as llama-server's "b" and its build number), then dg's version
    assert fingerprint.startswith("b") and len(fingerprint.split("-dg")[0]) >= 9 and "-dg0." in fingerprint, \
        fingerprint
    status, headers, _ = raw(tiny_server, "GET", "/v1/models", headers={"X-Request-Id": "bad id with spaces"})
    assert status == 200 and headers["x-request-id"].startswith("req_")
    status, _, text = raw(tiny_server, "POST", "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 16, "stream": True, "seed": 1}).encode())
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert status == 200 and chunks and all(c["system_fingerprint"] == fingerprint for c in chunks)
    assert fetch_json("GET", tiny_server.root + "/health")[1]["system_fingerprint"] == fingerprint
    assert fetch_json("GET", tiny_server.url + "/models")[1]["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("env,args,message", [
    ({"DG_API_KEY": ""}, [], "DG_API_KEY is empty"),  # served with no authentication at all
    ({"DG_API_KEY": "  "}, [], "DG_API_KEY is empty"),
    ({"DG_API_KEY": "clé"}, [], "DG_API_KEY must be printable ASCII"),  # a UTF-8 key could never match
    ({}, ["--api-key", "pass word"], "--api-key must be printable ASCII"),
    ({}, ["--api-key", ""], "--api-key is empty"),
])
def test_an_api_key_no_client_can_send_is_refused_at_start_from_the_flag_or_the_environment(monkeypatch, env, args,
                                                                                            message):
    from typer.testing import CliRunner

    from dgcli import cli
    from dgcli.runtime import model as model_module

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model_module, "DiffusionModel", no_load)
    monkeypatch.delenv("DG_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    r = CliRunner().invoke(cli.app, ["serve", "--port", "0", *args])
    assert r.exit_code == 1 and r.stderr.startswith(f"error: {message}"), (r.stderr, r.exception)
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.subprocess
def test_the_key_from_the_environment_is_required(tiny_gguf):
    with ServeProcess("-m", tiny_gguf, "--alias", "tiny", env={"DG_API_KEY": "s3cret-Key"}) as server:
        assert fetch_json("GET", server.url + "/models")[0] == 401
        status, body = fetch_json("GET", server.url + "/models", headers={"Authorization": "Bearer s3cret-Key"})
        assert status == 200 and body["data"][0]["id"] == "tiny"
        assert fetch_json("GET", server.root + "/health")[1]["auth"] is True
