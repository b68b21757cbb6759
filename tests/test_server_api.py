"""dg serve's request validation and streamed text (dgcli/server/api.py, text.py): no model needed."""

from __future__ import annotations

import itertools

import pytest

from dgcli.engine.thinking import split_thinking
from dgcli.params import DiffusionParams
from dgcli.server.api import parse_request
from dgcli.server.bodies import chunk_body
from dgcli.server.request import ApiError
from dgcli.server.text import AnswerStream

DEFAULTS = DiffusionParams()


def parse(body, kind="chat"):
    return parse_request(body, kind, DEFAULTS, default_max_tokens=256, max_tokens_limit=4000)


def chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_a_plain_chat_request_takes_the_defaults():
    req = parse(chat())
    assert req.messages == [{"role": "user", "content": "hi"}] and req.params == DEFAULTS
    assert (req.max_new_tokens, req.max_tokens_given, req.stream, req.stop, req.seed) == (256, False, False, [], None)


def test_sampler_parameters_and_openai_fields():
    req = parse(chat(steps=12, t_min=0.3, t_max=0.9, entropy_bound=0.2, stability_threshold=2,
                     confidence_threshold=0.01, max_completion_tokens=64, seed=7, stop="\n\n", stream=True,
                     stream_options={"include_usage": True}, dg_steps=True, temperature=0.7, top_p=0.9))
    assert req.params == DiffusionParams(12, 0.3, 0.9, 0.2, 2, 0.01)
    assert (req.max_new_tokens, req.seed, req.stop, req.include_usage, req.dg_steps) == (64, 7, ["\n\n"], True, True)


def test_a_null_max_completion_tokens_leaves_max_tokens_in_charge():
    # a client that sends every field, unset ones as null: max_tokens 5 was ignored and the answer ran to
    # the server's default of 256 tokens
    req = parse(chat(max_completion_tokens=None, max_tokens=5))
    assert (req.max_new_tokens, req.max_tokens_given) == (5, True)
    with pytest.raises(ApiError, match="'max_tokens' must be an integer >= 1"):
        parse(chat(max_completion_tokens=None, max_tokens=0))
    assert parse(chat(max_completion_tokens=3, max_tokens=5)).max_new_tokens == 3
    assert parse(chat(max_completion_tokens=None, max_tokens=None)).max_new_tokens == 256


def test_message_forms():
    req = parse({"messages": [{"role": "developer", "content": "be brief"},
                              {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                              {"role": "assistant", "content": None}]})
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                            {"role": "assistant", "content": ""}]
    req = parse({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assert req.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": {"city": "Paris"}}}]}
    assert req.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("body,param,fragment", [
    ([1, 2], None, "JSON object"),
    ({"messages": []}, "messages", "non-empty array"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "answers a tool call"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string or an array"),
    (chat(max_tokens=0), "max_tokens", ">= 1"),
    (chat(max_tokens=True), "max_tokens", ">= 1"),
    (chat(max_tokens=5000), "max_tokens", "limit of 4000"),
    (chat(seed=-1), "seed", "[0, 4294967295]"),
    # past the engine's 32 bits the request was queued and failed when it ran: a stream got 200, then an error
    (chat(seed=2**32), "seed", "[0, 4294967295]"),
    (chat(seed="1"), "seed", "an integer"),
    (chat(stream="yes"), "stream", "true or false"),
    (chat(stream_options={"include_usage": True}), "stream_options", "stream: true"),
    (chat(dg_steps=True), "dg_steps", "stream: true"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    (chat(stop=[1]), "stop", "at most 4"),
    (chat(n=17), "n", "from 1 to 16"),
    (chat(n=0), "n", "from 1 to 16"),
    (chat(n=4, best_of=5), "best_of", "must equal n"),
    # a role that is no string: unhashable, it was a 500 and a traceback (TypeError)
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role", "got 'list'"),
    ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role", "got 'dict'"),
    # integers of hundreds of digits: float() overflowed, a 500 and a traceback
    (chat(steps=10**400), "steps", "sensible size"),
    (chat(t_min=10**400), "t_min", "sensible size"),
    (chat(confidence_threshold=10**400), "confidence_threshold", "sensible size"),
    (chat(stability_threshold=10**400), "stability_threshold", "sensible size"),
    (chat(stability_threshold=10**200), "stability_threshold", "a huge number"),
    (chat(max_tokens=10**400), "max_tokens", "a huge number"),
    (chat(temperature=2.5), "temperature", "from 0 to 2"),
    (chat(temperature=-0.1), "temperature", "from 0 to 2"),
    (chat(temperature="hot"), "temperature", "from 0 to 2"),
    (chat(temperature=10**400), "temperature", "from 0 to 2"),
    (chat(top_p=1.5), "top_p", "from 0 to 1"),
    (chat(presence_penalty=3), "presence_penalty", "from -2 to 2"),
    (chat(logit_bias=[1]), "logit_bias", "an object"),
    (chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name", "letters"),
    (chat(tools=[{"type": "retrieval"}]), "tools[0]", "functions only"),
    (chat(tool_choice="required"), "tool_choice", "needs 'tools'"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function",
                                                                                "function": {"name": "g"}}),
     "tool_choice", "not in 'tools'"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://x/y"}}}),
     "response_format", "cannot be turned into a grammar"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": 5}}), "response_format",
     "schema as a JSON object"),
    (chat(response_format={"type": "xml"}), "response_format", "json_schema"),
    (chat(steps=2.5), "steps", "an integer"),
    (chat(steps=10, max_denoising_steps=11), "max_denoising_steps", "contradicts"),
    (chat(t_min=0.9, t_max=0.5), "t_max", "at least t_min"),
    (chat(t_min=1e308, t_max=1e308), "t_min", "at most 1e+30"),  # inf in float32: was a 500
    (chat(t_min=1e-320, t_max=1e-320), "t_max", "between 1e-30 and 1e+30"),  # 0 in float32: was a 500
    (chat(entropy_bound=float("nan")), "entropy_bound", "a number"),
    (chat(confidence_threshold=0), "confidence_threshold", "> 0"),
    (chat(logprobs=True), "logprobs", "not supported"),
])
def test_bad_fields_are_400_naming_the_field(body, param, fragment):
    with pytest.raises(ApiError) as info:
        parse(body)
    err = info.value
    assert err.status == 400 and err.param == param and fragment in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,kind,param", [
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "chat", "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "chat", "messages[0].content"),
    ({"prompt": "x\udc80"}, "completion", "prompt"),
    ({"prompt": ["x\udc80"]}, "completion", "prompt"),
])
def test_a_lone_surrogate_is_a_400_not_a_500(body, kind, param):
    # JSON's "\ud800" escape decodes to a str the tokenizer cannot encode: it was a 500 (UnicodeEncodeError)
    with pytest.raises(ApiError) as info:
        parse(body, kind)
    assert info.value.status == 400 and info.value.param == param
    assert f"'{param}" in info.value.message and "is not UTF-8 text (byte " in info.value.message


def test_completion_prompts():
    assert parse({"prompt": "abc"}, "completion").prompt == "abc"
    assert parse({"prompt": ["abc"]}, "completion").prompt == "abc"
    assert parse({"prompt": [2, 5, 9]}, "completion").prompt == [2, 5, 9]
    assert parse({"prompt": ["a", [5, 6], "b"]}, "completion").prompts == ["a", [5, 6], "b"]
    for bad in ("  ", ["a", " "], [], None, [1.5], ["a", 5], [[]]):
        with pytest.raises(ApiError, match="prompt"):
            parse({"prompt": bad}, "completion")
    with pytest.raises(ApiError, match="echo"):
        parse({"prompt": "a", "echo": True}, "completion")


def test_chunks_have_the_openai_shapes():
    c = chunk_body("chat", "id", 1, "m", role=True)
    assert c["object"] == "chat.completion.chunk" and c["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert "-dg" in c["system_fingerprint"]
    c = chunk_body("chat", "id", 1, "m", reasoning="r", content="c", finish=None)
    assert c["choices"][0]["delta"] == {"reasoning_content": "r", "content": "c"}
    c = chunk_body("completion", "id", 1, "m", content="t", finish="length")
    assert c["object"] == "text_completion" and c["choices"][0] == {"index": 0, "text": "t", "logprobs": None,
                                                                    "finish_reason": "length"}


# ---- AnswerStream: deltas that only append and add up to the whole ------------------------------------

PIECES = {0: "<|channel>", 1: "thought", 2: "\n", 3: "I", 4: " think", 5: "<channel|>", 6: "The", 7: " answer",
          8: "é", 9: "!", 10: "<", 11: "|channel>"}


def detok(ids):
    return "".join(PIECES[i] for i in ids)


def utf8_detok(ids):
    """Pieces as bytes, decoded together: a character cut between canvases shows as U+FFFD."""
    raw = b"".join("é".encode()[:1] if i == 100 else "é".encode()[1:] if i == 101 else PIECES[i].encode() for i in ids)
    return raw.decode("utf-8", errors="replace")


def run_stream(ids, cuts, stop=(), thinking=True, detokenize=detok):
    stream = AnswerStream(detokenize, stop=stop, thinking=thinking)
    reasoning, content = [], []
    bounds = [0, *cuts, len(ids)]
    for a, b in zip(bounds, bounds[1:]):
        r, c = stream.feed(ids[a:b])
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    return "".join(reasoning + [r]), "".join(content + [c]), stream


THOUGHTFUL = [0, 1, 2, 3, 4, 2, 2, 5, 2, 6, 7, 9]  # "<|channel>thought\nI think\n\n<channel|>\nThe answer!"


def test_every_canvas_split_gives_the_same_reasoning_and_content():
    thought, answer = split_thinking(detok(THOUGHTFUL))
    for n_cuts in (1, 2, 3):
        for cuts in itertools.combinations(range(1, len(THOUGHTFUL)), n_cuts):
            r, c, _ = run_stream(THOUGHTFUL, list(cuts))
            assert (r, c) == (thought, answer) == ("I think", "The answer!"), cuts


def test_a_marker_or_a_character_cut_between_canvases_is_held_back():
    stream = AnswerStream(detok)
    assert stream.feed([10]) == ("", "")  # "<": maybe the start of "<|channel>"
    assert stream.feed([11, 1, 2, 3]) == ("I", "")
    stream = AnswerStream(utf8_detok, thinking=False)
    assert stream.feed([6, 100]) == ("", "The")  # half of "é" waits
    assert stream.feed([101, 9]) == ("", "é!")


def test_stop_strings_cut_the_content_even_across_canvases():
    ids = [6, 7, 9, 6]  # "The answer!The"
    for cuts in ([1], [2], [3], [1, 2]):
        r, c, stream = run_stream(ids, cuts, stop=["swer!"])
        assert c == "The an" and stream.stopped
    _, c, stream = run_stream(ids, [2], stop=["nowhere"])
    assert c == "The answer!The" and not stream.stopped


def test_usage_counts_the_tokens_up_to_the_one_that_completes_the_stop_string():
    # dg serve's usage counted the whole canvas that held the stop string: a 256-token canvas whose
    # answer was cut after 3 tokens reported completion_tokens 256
    from dgcli.engine.types import GenerationResult
    from dgcli.server.bodies import ChoiceOutcome, usage

    ids = [6, 7, 9, 6, 7]  # "The answer!The answer"
    for stop, through in (["swer!"], 3), ([" an"], 2), (["The"], 1), (["!The a"], 5):
        for cuts in ([], [1], [3]):
            _, _, stream = run_stream(ids, cuts, stop=stop)
            assert stream.stopped and stream.stop_tokens == through, (stop, cuts)
    _, _, stream = run_stream(THOUGHTFUL, [4], stop=["I"])  # thinking text is not content: no stop there
    assert not stream.stopped and stream.stop_tokens is None
    _, _, stream = run_stream(THOUGHTFUL, [4], stop=["answer"])
    assert stream.stop_tokens == len(THOUGHTFUL) - 1
    result = GenerationResult(mode="diffusion", text="", token_ids=ids, n_prompt_tokens=4)
    cut, whole = (ChoiceOutcome(0, result, 0.0, "stop", completion_tokens=n) for n in (3, None))
    assert {k: v for k, v in usage([cut], 4).items() if "details" not in k} == \
        {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert usage([whole], 4)["completion_tokens"] == 5 and usage([whole, cut], 4)["completion_tokens"] == 8


def test_without_thinking_split_the_markers_are_plain_text():
    r, c, _ = run_stream(THOUGHTFUL, [4], thinking=False)
    assert r == "" and c == detok(THOUGHTFUL)


def test_the_largest_seed_the_engine_takes_is_accepted():
    assert parse(chat(seed=2**32 - 1)).seed == 2**32 - 1 and parse(chat(seed=0)).seed == 0


def test_steps_past_the_served_canvas_are_refused_when_the_request_is_read():
    # steps=4000 passed (at most 4096 "for any canvas"), then failed once the request ran on the demo's
    # 32-token canvas (at most 128): a stream got 200 and an error event naming max_denoising_steps
    req = parse_request(chat(steps=128), "chat", DEFAULTS, 256, 4000, canvas_length=32)
    assert req.params.max_denoising_steps == 128
    with pytest.raises(ApiError) as info:
        parse_request(chat(steps=4000), "chat", DEFAULTS, 256, 4000, canvas_length=32)
    assert info.value.param == "steps" and "32-token canvas" in info.value.message
