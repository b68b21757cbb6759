"""Clients people use, against `dg serve`: the Node openai SDK, langchain-openai and litellm (the
Python openai client is in every other test_serve*.py). Each runs as its own process from
tests/clients/ against three servers: a scripted model that calls tools, the demo (structured
output, responses, several prompts) and a tiny GGUF with Gemma 4's template (LangChain's
function-calling structured output forces a call). The Node SDK lives in .clients-node (`make test`
installs it when npm is there, 20 MB); langchain-openai and litellm in .venv-clients, ~430 MB, which
`make test-clients` builds and runs: elsewhere those tests are skipped, saying so."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from native_helpers import requires_native
from serve_helpers import InProcessServer, ServeProcess
from test_serve_tools import ToolCallingModel, gemma4_template

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = Path(__file__).resolve().parent / "clients"
NODE_OPENAI = ROOT / ".clients-node" / "node_modules" / "openai"
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"
SERVE_DEPS = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "openai"))
pytestmark = [requires_native, pytest.mark.skipif(
    not SERVE_DEPS, reason="dg serve's test dependencies are missing: pip install -e '.[test]' (starlette, uvicorn, openai)")]
TIMEOUT_S = 600
WEATHER_ARGS = {"location": "Paris", "days": 2}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from dgcli.engine.diffusion import DiffusionEngine
    from dgcli.runtime.model import DiffusionModel
    from dgcli.server.app import DgService, ServeConfig
    from dgcli.server.scheduler import BatchScheduler
    from dgcli.testing.tiny import write_tiny_random_gguf

    tool_scheduler = BatchScheduler(DiffusionEngine(ToolCallingModel(), sampler="numpy"), slots=1)
    tools = InProcessServer(DgService(tool_scheduler, ServeConfig(model_name="caller"), log=lambda line: None))
    path = write_tiny_random_gguf(tmp_path_factory.mktemp("gemma4") / "gemma4.gguf", chat_template=gemma4_template())
    model = DiffusionModel(str(path), n_ctx=2048)
    gemma_scheduler = BatchScheduler(DiffusionEngine(model), slots=1)
    gemma = InProcessServer(DgService(gemma_scheduler, ServeConfig(model_name="tiny"), log=lambda line: None))
    with ServeProcess("--parallel", "4") as demo:
        yield {"tools": tools.url, "demo": demo.url, "gemma": gemma.url}
    for server, scheduler in ((tools, tool_scheduler), (gemma, gemma_scheduler)):
        server.stop()
        scheduler.close()
    model.close()


def run_client(command: list[str]) -> dict:
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=CLIENTS)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("node") is None or not NODE_OPENAI.is_dir(),
                    reason="the Node openai SDK is not installed: `make test` installs it into .clients-node "
                           "where npm is available")
@pytest.mark.subprocess
def test_the_node_openai_sdk(servers):
    script = NODE_OPENAI.parents[1] / "node_openai.mjs"  # beside node_modules: where ESM imports look
    shutil.copy(CLIENTS / "node_openai.mjs", script)
    got = run_client(["node", str(script), servers["tools"], servers["demo"]])
    assert got["calls"] == got["streamed"] == [["get_weather", WEATHER_ARGS], ["get_time", {}]]
    assert got["finish"] == "tool_calls"
    person = got["structured"]
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and 0 <= person["age"] <= 120
    assert got["decoder"] == "autoregressive+grammar" and got["responses"] == "OLLEH"
    assert [i for i, _ in got["batch"]] == [0, 1] and got["batch"][0][1] == "BA"


@pytest.mark.skipif(not CLIENTS_PYTHON.exists(), reason="langchain-openai and litellm (~430 MB) are kept out of "
                                                        "make test: `make test-clients` installs and runs them")
@pytest.mark.subprocess
def test_langchain_openai_and_litellm(servers):
    got = run_client([str(CLIENTS_PYTHON), str(CLIENTS / "python_clients.py"), servers["tools"], servers["demo"],
                      servers["gemma"]])
    assert got["langchain_tools"] == got["langchain_tools_streamed"] == [["get_weather", WEATHER_ARGS],
                                                                         ["get_time", {}]]
    person = got["langchain_json_schema"]
    assert 0 <= person["age"] <= 120 and len(person["name"]) <= 12
    weather = got["langchain_function_calling"]
    assert set(weather) == {"location", "days"} and 1 <= weather["days"] <= 3
    batch = got["langchain_legacy_batch"]  # both prompts in one request: choices 0 and 1
    assert len(batch) == 2 and batch[0] == "BA" and len(batch[1]) == 4 and batch[1].isupper()
    assert got["langchain_responses"] == "OLLEH"
    assert got["litellm_tools"] == [["get_weather", WEATHER_ARGS]]  # get_time was not offered: its call stays text
    assert 0 <= got["litellm_json_schema"]["age"] <= 120
    assert got["litellm_stream"] == "OLLEH" and got["litellm_responses"] == "OLLEH"
