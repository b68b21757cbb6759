"""Structured output through `dg serve`: response_format json_object and json_schema always give JSON
that conforms (the answer is decoded under a grammar on the encoder's causal path: the demo model
was never trained to write JSON that way, so what it writes there is the test), whole or
streamed, with the openai client's parse() and a pydantic model; the response says which
decoder ran."""

from __future__ import annotations

import importlib.util
import json
import random
from typing import Literal

import numpy as np
import pytest

from native_helpers import requires_native
from serve_helpers import ServeProcess

from dgcli.engine.grammar import closing_class, integer_range_rule, json_schema_grammar

SERVE_DEPS = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "openai", "pydantic"))
needs_serve = pytest.mark.skipif(not SERVE_DEPS, reason="dg serve's test dependencies are missing: "
                                                        "pip install -e '.[test]' (starlette, uvicorn, openai)")
TIMEOUT_S = 120
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "mood": {"enum": ["happy", "sad"]}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "mood", "tags"], "additionalProperties": False}


def conforms(value) -> bool:
    return (isinstance(value, dict) and set(value) == set(PERSON["properties"]) and isinstance(value["name"], str)
            and len(value["name"]) <= 12 and isinstance(value["age"], int) and 0 <= value["age"] <= 130
            and value["mood"] in ("happy", "sad") and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(isinstance(t, str) for t in value["tags"]))


# ---- the grammar ----------------------------------------------------------------------------------------


@requires_native
def test_integer_bounds_are_part_of_the_grammar(tiny_gguf):
    """llama-cpp-python's schema converter leaves minimum / maximum out: any integer passed."""
    from dgcli.engine.grammar import GrammarSampler
    from dgcli.runtime.model import DiffusionModel

    rng = random.Random(0)
    with DiffusionModel(str(tiny_gguf)) as model:
        char_id = {c: model.tokenize(c, add_bos=False, special=False)[0] for c in "-0123456789"}

        def accepts(grammar, text):
            sampler = GrammarSampler(model, grammar)
            try:
                for c in text:
                    if not np.isfinite(sampler.mask(np.zeros(model.vocab_size, np.float32))[char_id[c]]):
                        return False
                    sampler.accept(char_id[c])
                return bool(np.isfinite(sampler.mask(np.zeros(model.vocab_size, np.float32))[1]))  # <eos>: complete
            finally:
                sampler.close()

        for low, high in [(5, 123), (-20, 7), (-300, -17), (1, None), (None, 40), (99, 101), (7, 7050)]:
            schema = {"type": "integer", **({"minimum": low} if low is not None else {}),
                      **({"maximum": high} if high is not None else {})}
            grammar = json_schema_grammar(schema)
            lo, hi = (low if low is not None else high - 400), (high if high is not None else low + 400)
            for v in list(range(lo - 12, hi + 13, max(1, (hi - lo) // 150))) + [rng.randint(-10**5, 10**5)
                                                                              for _ in range(10)]:
                assert accepts(grammar, str(v)) == ((low is None or v >= low) and (high is None or v <= high)), \
                    (low, high, v)
            assert not accepts(grammar, "-0") and not accepts(grammar, "007")
    assert json_schema_grammar({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 5}).count("[4-4]") \
        + json_schema_grammar({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 5}).count('"4"') >= 1
    assert "(" in integer_range_rule(0, 9)


@requires_native
def test_control_characters_cannot_enter_a_json_string(tiny_gguf):
    """llama-cpp-python's converter let any character but a quote or backslash into a string: a
    random model's byte tokens (0x1e) made JSON that no parser reads."""
    from dgcli.engine.grammar import GrammarSampler
    from dgcli.runtime.model import DiffusionModel

    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    with DiffusionModel(str(tiny_gguf)) as model:
        sampler = GrammarSampler(model, grammar)
        for c in '{"a":"x':
            sampler.accept(model.tokenize(c, add_bos=False, special=False)[0])
        allowed = np.isfinite(sampler.mask(np.zeros(model.vocab_size, np.float32)))
        for c in "\x1e\x00\n\t\x7f":
            (token,) = model.tokenize(c, add_bos=False, special=False)
            assert not allowed[token], repr(c)
        assert allowed[model.tokenize("y", add_bos=False, special=False)[0]]
        sampler.close()


def test_tokens_that_close_rank_first_near_the_end_of_the_budget():
    assert [closing_class(t) for t in ('"', '"}', "}]", ",", "12", "abc", " x", "")] == [1, 1, 2, 3, 4, 5, 6, 6]


# ---- through the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_server():
    with ServeProcess("--parallel", "2") as server:
        yield server


def client_for(url):
    import openai

    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@requires_native
@needs_serve
@pytest.mark.subprocess
def test_json_object_mode_answers_json_whole_and_streamed(demo_server):
    client = client_for(demo_server.url)
    msgs = [{"role": "user", "content": "reverse: HELLO"}]
    for max_tokens in (None, 40):
        extra = {"max_tokens": max_tokens} if max_tokens else {}
        r = client.chat.completions.create(model="demo", messages=msgs, response_format={"type": "json_object"},
                                           seed=0, **extra)
        value = json.loads(r.choices[0].message.content)
        assert isinstance(value, dict) and r.choices[0].finish_reason == "stop"
        assert r.model_extra["dg"]["decoder"] == "autoregressive+grammar"
        assert r.usage.completion_tokens <= (max_tokens or 10**9)
    chunks = list(client.chat.completions.create(model="demo", messages=msgs, response_format={"type": "json_object"},
                                                 seed=0, stream=True, max_tokens=40))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(streamed) == value
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 5  # token by token
    plain = client.chat.completions.create(model="demo", messages=msgs, seed=0)
    assert plain.model_extra["dg"]["decoder"] == "diffusion" and plain.choices[0].message.content == "OLLEH"


@requires_native
@needs_serve
@pytest.mark.subprocess
def test_json_schema_through_the_clients_parse_conforms_to_the_pydantic_model(demo_server):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=130)
        mood: Literal["happy", "sad"]
        tags: list[str] = Field(max_length=3)

    client = client_for(demo_server.url)
    for seed, temperature in ((0, None), (1, 1.0), (2, 1.5)):
        extra = {"temperature": temperature} if temperature is not None else {}
        r = client.chat.completions.parse(model="demo", messages=[{"role": "user", "content": "a person, as JSON"}],
                                          response_format=Person, seed=seed, max_tokens=120, **extra)
        person = r.choices[0].message.parsed
        assert isinstance(person, Person), r.choices[0].message.content
        assert conforms(json.loads(r.choices[0].message.content))
    raw = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "a person"}], seed=3,
                                         max_tokens=100, response_format={"type": "json_schema", "json_schema": {
                                             "name": "person", "schema": PERSON, "strict": True}})
    assert conforms(json.loads(raw.choices[0].message.content))
    again = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "a person"}], seed=3,
                                           max_tokens=100, response_format={"type": "json_schema", "json_schema": {
                                               "name": "person", "schema": PERSON, "strict": True}})
    assert again.choices[0].message.content == raw.choices[0].message.content  # greedy: the same answer
