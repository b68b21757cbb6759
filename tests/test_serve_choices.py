"""Several choices in one request to `dg serve` (n > 1, several prompts in a legacy completion) and
OpenAI's Responses API. The choices' canvases are denoised together in the scheduler's shared
forward, and each equals `DiffusionEngine.generate` alone with its own seed (seed + its index)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from native_helpers import requires_native
from serve_helpers import ServeProcess, fetch_json

SERVE_DEPS = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "openai"))
pytestmark = [requires_native, pytest.mark.skipif(
    not SERVE_DEPS, reason="dg serve's test dependencies are missing: pip install -e '.[test]' (starlette, uvicorn, openai)")]

DEMO = Path(__file__).resolve().parents[1] / "dgcli" / "models" / "demo-diffusion.gguf"
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def demo_server():
    with ServeProcess("--parallel", "4") as server:
        yield server


@pytest.fixture(scope="module")
def solo():
    """What `dg generate` computes alone: a chat prompt, or a raw one (markers parsed, as /v1/completions)."""
    from dgcli.engine.diffusion import DiffusionEngine

    engine = DiffusionEngine(str(DEMO))

    def run(prompt, seed, chat=True):
        return engine.generate(prompt, seed=seed, chat=chat, parse_special=not chat)

    yield run
    engine.close()


def client_for(url):
    import openai

    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def batching(server):
    return fetch_json("GET", server.root + "/health")[1]["requests"]


@pytest.mark.subprocess
def test_n_choices_are_denoised_together_and_each_equals_generate_with_its_seed(demo_server, solo):
    client = client_for(demo_server.url)
    before = batching(demo_server)
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "sort: QWERTY"}], n=3,
                                       seed=10)
    wants = [solo("sort: QWERTY", 10 + i) for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [w.text.strip() for w in wants]
    assert r.usage.prompt_tokens == wants[0].n_prompt_tokens  # the prompt once
    assert r.usage.completion_tokens == sum(w.n_new_tokens for w in wants)
    assert len(r.model_extra["dg"]["choices"]) == 3
    after = batching(demo_server)
    assert after["max_batch"] >= 3 and after["completed"] - before["completed"] == 3

    chunks = list(client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "sort: QWERTY"}],
                                                 n=3, seed=10, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [w.text for w in wants]
    finishes = sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason)
    assert finishes == [0, 1, 2] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


@pytest.mark.subprocess
def test_several_prompts_in_one_legacy_completion_each_get_n_choices(demo_server, solo):
    client = client_for(demo_server.url)
    prompts = ["<|turn>user\nreverse: ABC<turn|>\n<|turn>model\n", "<|turn>user\nsort: DBCA<turn|>\n<|turn>model\n"]
    r = client.completions.create(model="demo", prompt=prompts, n=2, seed=4, max_tokens=32)
    wants = [solo(p, 4 + p_i * 2 + j, chat=False) for p_i, p in enumerate(prompts) for j in range(2)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [w.text for w in wants]
    assert r.usage.prompt_tokens == wants[0].n_prompt_tokens + wants[2].n_prompt_tokens
    token_prompts = [[2, 105, 300], [2, 105]]  # token ids are prompts too
    r = client.completions.create(model="demo", prompt=token_prompts, seed=1, max_tokens=32)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == 5


@pytest.mark.subprocess
def test_a_group_larger_than_the_queue_allows_is_refused_whole(tiny_gguf):
    import openai

    with ServeProcess("-m", tiny_gguf, "--alias", "tiny", "--parallel", "2", "--queue", "1") as server:
        client = client_for(server.url)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="tiny", prompt="x", n=4, max_tokens=16)
        assert info.value.status_code == 503 and "for 4 more" in info.value.body["message"]
        r = client.completions.create(model="tiny", prompt="x", n=3, max_tokens=16, extra_body={"steps": 2})
        assert len(r.choices) == 3
        assert batching(server)["submitted"] == 3  # nothing of the refused group was queued


# ---- /v1/responses ------------------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_responses_api_text_in_and_out_streamed_and_not(demo_server, solo):
    client = client_for(demo_server.url)
    want = solo("reverse: HELLO", 0)
    r = client.responses.create(model="demo", input="reverse: HELLO", extra_body={"seed": 0})
    assert r.object == "response" and r.status == "completed" and r.output_text == want.text.strip() == "OLLEH"
    assert r.usage.input_tokens == want.n_prompt_tokens and r.usage.output_tokens == want.n_new_tokens
    assert r.output[-1].type == "message" and r.output[-1].content[0].type == "output_text"

    events = list(client.responses.create(model="demo", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "reverse: HELLO"}]}], stream=True, extra_body={"seed": 0}))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert events[-1].response.output_text == "OLLEH"
    assert [e.sequence_number for e in events] == list(range(len(events)))

    short = client.responses.create(model="demo", input="reverse: HELLO", max_output_tokens=2, extra_body={"seed": 0})
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    structured = client.responses.create(model="demo", input="a JSON object", max_output_tokens=40,
                                         text={"format": {"type": "json_schema", "name": "o", "schema": {
                                             "type": "object", "properties": {"n": {"type": "integer"}},
                                             "required": ["n"]}}})
    assert isinstance(json.loads(structured.output_text)["n"], int)


@pytest.mark.subprocess
def test_responses_api_refuses_what_it_cannot_do_by_name(demo_server):
    import openai

    client = client_for(demo_server.url)
    for kwargs, param in ((dict(tools=[{"type": "function", "name": "f", "parameters": {}}]), "tools"),
                          (dict(previous_response_id="resp_1"), "previous_response_id")):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="demo", input="hi", **kwargs)
        assert info.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="hi")
