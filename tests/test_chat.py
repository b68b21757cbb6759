"""The chat session (dgcli/engine/chat.py): turns, /commands, and the KV cache of earlier turns kept.

The KV-cache tests run through llama.cpp on the tiny random GGUF: a turn that reuses the cache must
answer exactly as a fresh engine prefilling the whole conversation does (in exact mode: F32 cache).
"""

from __future__ import annotations

import numpy as np
import pytest

from dgcli.engine.chat import ChatSession
from dgcli.errors import DgError
from dgcli.params import DiffusionParams
needs_native = pytest.mark.native  # skipped where the patched llama.cpp is not built (conftest.py)
PARAMS = DiffusionParams(max_denoising_steps=4)


class RecordingEngine:
    """Engine stand-in: records each generate call; answers "answer N"."""

    def __init__(self):
        self.calls = []
        self.model = self

    def chat_tokens(self, messages, parse_special=False):
        self.calls.append(("render", [dict(m) for m in messages], parse_special))
        return [ord(c) % 50 for m in messages for c in m["content"]] or [1]

    def generate(self, ids, **kw):
        from dgcli.engine.types import GenerationResult

        self.calls.append(("generate", kw))
        n = sum(1 for c in self.calls if c[0] == "generate")
        return GenerationResult(mode="diffusion", text=f"answer {n}", token_ids=[5], n_prompt_tokens=len(ids),
                                seed=kw["seed"])


def test_turns_carry_the_history_the_system_prompt_and_one_seed_per_turn():
    engine = RecordingEngine()
    session = ChatSession(engine, system="Be brief.", seed=41, params=PARAMS, max_new_tokens=9)
    session.ask("first")
    session.ask("second")
    renders = [c[1] for c in engine.calls if c[0] == "render"]
    assert renders[1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"},
                          {"role": "assistant", "content": "answer 1"}, {"role": "user", "content": "second"}]
    generates = [c[1] for c in engine.calls if c[0] == "generate"]
    assert [g["seed"] for g in generates] == [41, 42]
    assert all(g["reuse_cache"] and g["max_new_tokens"] == 9 and g["params"] is PARAMS for g in generates)


def test_slash_commands():
    session = ChatSession(RecordingEngine(), seed=0)
    session.ask("hi")
    assert session.command("/system Answer in French.").message == "system prompt set"
    assert session.messages[0] == {"role": "system", "content": "Answer in French."}
    assert session.command("/system").message == "system prompt: Answer in French."
    assert "stays" in session.command("/clear").message and session.turns == []
    assert session.command("/system -").message == "system prompt removed" and session.messages == []
    assert "/clear" in session.command("/help").message
    assert "unknown command /nope" in session.command("/nope").message
    for word in ("/exit", "/quit", "/bye"):
        assert session.command(word).exit
    with pytest.raises(DgError, match="empty message"):
        session.ask("   ")


@pytest.fixture(scope="module")
def engines(tiny_gguf):
    from dgcli.engine.diffusion import DiffusionEngine

    # exact: F32 KV cache, no flash attention. With the default F16 cache a prompt prefilled in two
    # batches already differs from one batch by ~1e-3 in the logits (llama.cpp's own rounding),
    # which a random model's sampler turns into other tokens.
    with DiffusionEngine(str(tiny_gguf), n_threads=1, exact=True) as chat, \
            DiffusionEngine(str(tiny_gguf), n_threads=1, exact=True) as fresh:
        yield chat, fresh


@needs_native
@pytest.mark.parametrize("seed", [0, 5])
def test_a_turn_reusing_the_cache_answers_as_a_fresh_prefill_does(engines, seed):
    chat, fresh = engines
    chat.model.reset()
    session = ChatSession(chat, seed=seed, params=PARAMS, max_new_tokens=40, system="Be brief.")
    first = session.ask("what is 3+5")
    assert first.n_cached_prompt_tokens == 0
    ids = session.prompt_ids("and 4+4")
    second = session.ask("and 4+4")
    # the earlier turn's prompt and committed canvases came from the cache, not a new prefill
    assert second.n_cached_prompt_tokens >= first.n_prompt_tokens
    again = fresh.generate(ids, params=PARAMS, max_new_tokens=40, seed=second.seed)
    assert again.n_cached_prompt_tokens == 0
    assert second.token_ids == again.token_ids and second.steps_per_canvas == again.steps_per_canvas


@needs_native
def test_the_cache_keeps_only_its_matching_prefix(engines):
    chat, _ = engines
    model = chat.model
    model.reset()
    model.prefill(list(range(10, 60)))
    assert model.keep_cached_prefix(list(range(10, 40)) + [7, 7]) == 30
    assert model.n_past == 30 and model.cache_tokens == list(range(10, 40))
    canvas = np.arange(20, 20 + model.canvas_length)
    kept = model.decode_canvas(canvas)
    model.reset()
    model.prefill(list(range(10, 40)))
    np.testing.assert_array_equal(kept, model.decode_canvas(canvas))
    assert model.keep_cached_prefix([3, 4]) == 0 and model.n_past == 0


@needs_native
def test_a_rollback_past_the_sliding_window_clears_the_cache(engines):
    # A sliding-window layer keeps window + n_ubatch cells: going back further than that finds the
    # window before the kept end gone, so the prefix cannot be kept (llama-server does the same).
    chat, _ = engines
    model = chat.model
    model.reset()
    long = [int(t) for t in np.random.default_rng(0).integers(10, 400, size=3 * model.n_ubatch)]
    model.prefill(long)
    assert model.keep_cached_prefix(long[:40] + [5]) == 0
    assert model.n_past == 0 and model.cache_tokens == []


def test_text_that_is_not_utf8_is_refused_and_the_session_goes_on():
    # bytes that are not UTF-8 arrive as lone surrogates; the tokenizer raised UnicodeEncodeError
    session = ChatSession(RecordingEngine(), system="Be brief.", seed=0)
    with pytest.raises(DgError, match="the message is not UTF-8 text"):
        session.ask("hi \udcff")
    assert "not UTF-8" in session.command("/system a\udcffb").message
    assert session.system == "Be brief."
    assert session.ask("hi").text == "answer 1"


@needs_native
def test_a_piped_line_that_is_not_utf8_is_that_turns_error_not_a_traceback():
    from typer.testing import CliRunner

    from dgcli import cli

    r = CliRunner().invoke(cli.app, ["chat", "--seed", "1"], input=b"reverse: HELLO\n\xff\xfe\nreverse: AB\n")
    assert r.stdout.split()[0] == "OLLEH" and len(r.stdout.splitlines()) == 2  # both other turns answered
    assert "error: the message is not UTF-8 text" in r.stderr
    # piped messages are a script: one left unanswered fails the run, saying so last
    assert r.exit_code == 1, (r.stderr, r.exception)
    assert r.stderr.splitlines()[-1] == "error: 1 message of 3 got no answer (see the errors above)"


def test_a_command_s_reply_quoting_brackets_is_text_not_rich_markup():
    # "/system [/red] ..." then "/system" ended in rich.errors.MarkupError (a traceback), and at a
    # terminal "[bold]" vanished from the shown prompt
    from typer.testing import CliRunner

    from dgcli import cli

    r = CliRunner().invoke(cli.app, ["chat"], input="/system [/red] be [bold]brief\n/system\n/foo[/b]\n")
    assert r.exit_code == 1, (r.stderr, r.exception)  # piped, the unknown /foo[/b] was a lost message
    assert r.stderr.splitlines() == ["system prompt set", "system prompt: [/red] be [bold]brief",
                                     "error: unknown command /foo[/b]; /help lists them (//TEXT sends /TEXT as a "
                                     "message)",
                                     "error: 1 message of 1 got no answer (see the errors above)"]


def test_a_piped_message_starting_with_a_slash_is_sent_with_two_and_never_lost_silently():
    # "/usr/lib explain" piped was taken for an unknown command: skipped, and the run exited 0
    from typer.testing import CliRunner

    from dgcli import cli

    runner = CliRunner()
    escaped = runner.invoke(cli.app, ["chat", "--seed", "1"], input="//reverse: HELLO\n")
    alone = runner.invoke(cli.app, ["generate", "/reverse: HELLO", "--seed", "1"])
    assert escaped.exit_code == 0 and alone.exit_code == 0, (escaped.stderr, alone.stderr)
    assert escaped.stdout == alone.stdout  # the message "/reverse: HELLO", answered as generate answers it
    lost = runner.invoke(cli.app, ["chat", "--seed", "1"], input="/usr/lib explain\nreverse: HELLO\n")
    assert lost.exit_code == 1 and lost.stdout.split() == ["OLLEH"], lost.stderr
    assert lost.stderr.splitlines()[-1] == "error: 1 message of 2 got no answer (see the errors above)"
    assert lost.stderr.splitlines()[0].startswith("error: unknown command /usr/lib;")  # one of "the errors above"


@needs_native
def test_a_piped_answer_is_printed_as_it_is_and_an_error_stays_one_line(tiny_gguf):
    # Rich wrapped a piped answer at 120 columns (newlines inside the answer) and an error at 80
    from typer.testing import CliRunner

    from dgcli import cli

    runner = CliRunner()
    args = ["-m", str(tiny_gguf), "--seed", "1", "-n", "200", "--thinking", "hide"]
    alone = runner.invoke(cli.app, ["generate", "hi there", *args])
    assert alone.exit_code == 0, alone.stderr
    assert len(alone.stdout) > 130  # a random model's answer, long enough to have been wrapped
    r = runner.invoke(cli.app, ["chat", *args, "-c", "256"], input="hi there\n" + "a b c d e f g h " * 40 + "\n")
    assert r.exit_code == 1, (r.stderr, r.exception)  # a message got no answer
    assert r.stdout == alone.stdout  # the first turn answers as generate does; the second does not fit
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and errors[0].endswith("restart with a larger -c/--ctx-size"), r.stderr
    assert errors[1] == "error: 1 message of 2 got no answer (see the errors above)"


@needs_native
@pytest.mark.parametrize("template,error", [
    ("{% for %}", "error: the chat template of t.gguf does not parse: "),
    (None, "error: t.gguf has no chat template (tokenizer.chat_template), which dg chat needs"),
])
def test_a_template_that_cannot_render_is_one_error_before_the_session(tmp_path, template, error):
    # each message failed on its own, then the run said that it had: two lines for one problem
    from typer.testing import CliRunner

    from dgcli import cli
    from dgcli.testing.tiny import write_tiny_random_gguf

    path = write_tiny_random_gguf(tmp_path / "t.gguf", chat_template=template)
    r = CliRunner().invoke(cli.app, ["chat", "-m", str(path), "-n", "8"], input="hi\nhello\n")
    assert r.exit_code == 1, (r.stderr, r.exception)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1 and r.stderr.startswith(error), r.stderr
