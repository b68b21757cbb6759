"""The shipped demo pair (dgcli/models/demo-*.gguf, trained by training/train_demo.py).

What the demo is for: behave like the real model in miniature at the DEFAULT sampler settings, on
its own held-out bench set (dgcli/data/demo-prompts.tsv, what `dg bench --model demo` runs): answer
right, commit several answer tokens per decoder forward, continue a long answer on a second canvas
from the KV cache, take more steps on harder inputs, and answer anything else with its help line.
Thresholds are the measured numbers (training/README.md) minus a margin for other seeds.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from dgcli.bench import load_prompts
from dgcli.registry import Registry
from dgcli.testing.tiny import tiny_vocab
from training import evaluate, tasks

MODELS = Path(__file__).resolve().parents[1] / "dgcli" / "models"
DIFFUSION_GGUF = MODELS / "demo-diffusion.gguf"
AR_GGUF = MODELS / "demo-ar.gguf"
MAX_SHIPPED_BYTES = 8 * 1024 * 1024
CAP = 48
README_PROMPT, README_ANSWER = "reverse: HELLO", "OLLEH"  # the README's and `make demo`'s command

# Measured over the bench set, one run per prompt, seed = prompt index (training/README.md).
MEASURED_DIFFUSION_ACCURACY = 1.0
MEASURED_AR_ACCURACY = 1.0
ACCURACY_MARGIN = 0.05
MIN_TOKENS_PER_FORWARD = 4.0


def _native_reason() -> str | None:
    from dgcli.runtime import native

    ok, reason = native.available()
    return None if ok else reason


def _bench_prompts():
    return load_prompts(Registry.load().get("demo").bench_prompts)


# -- the tasks and the held-out set (no model needed) -------------------------------------------


def test_training_prompts_are_the_chat_template_ids():
    """The model was trained on exactly the ids the engine's chat template produces."""
    vocab = tiny_vocab()
    for task in tasks.TASKS:
        for example in tasks.evaluation_set(task, 1, 5):
            assert tasks.prompt_ids(example, vocab) == vocab.chat_prompt_ids(example.question)


def test_held_out_split_is_disjoint_from_training():
    rng = random.Random(0)
    training = {tasks.sample_example(rng, held_out=False).question for _ in range(3000)}
    held_out = {e.question for task in tasks.TASKS for e in tasks.evaluation_set(task, tasks.MAX_DIFFICULTY[task], 20)}
    assert held_out and not training & held_out


def test_task_questions_and_help_questions_never_overlap():
    """A task's question is in its form, and the help reply is only trained on questions that are not."""
    rng = random.Random(1)
    for _ in range(3000):
        example = tasks.sample_example(rng, held_out=False)
        assert tasks.is_task_question(example.question) == (example.task != "help"), example


def test_answers_fit_at_most_two_canvases_and_end():
    vocab = tiny_vocab()
    canvases = set()
    for task in tasks.TASKS:
        for example in tasks.evaluation_set(task, tasks.MAX_DIFFICULTY[task], 20):
            count = tasks.canvas_count(example)
            canvases.add(count)
            last = tasks.canvas_ids(example, count - 1)
            assert len(last) == tasks.CANVAS_LENGTH and vocab.eos_id in last
    assert canvases == {1, 2}, "some answers must span two canvases, none three"


def test_the_shipped_bench_set_is_the_one_training_writes():
    path = Registry.load().get("demo").bench_prompts
    assert path.read_text(encoding="utf-8").splitlines() == evaluate.bench_prompt_lines()
    questions = [p.text for p in _bench_prompts()]
    assert all(tasks.is_held_out(q) for q in questions if tasks.is_task_question(q))


# -- the shipped files ------------------------------------------------------------------------


@pytest.mark.parametrize("path,arch", [(DIFFUSION_GGUF, "diffusion-gemma"), (AR_GGUF, "gemma4")])
def test_shipped_file_is_small_and_in_the_published_layout(path, arch):
    import gguf

    assert path.is_file(), f"{path} missing: run training/README.md's convert step"
    assert path.stat().st_size < MAX_SHIPPED_BYTES
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields["tokenizer.ggml.model"].contents() == "gemma4"
    # the tokenizer as the published converter writes dg-tiny's (byte tokens BYTE, scores -1000), so
    # a re-export through an older `dg convert` shows here
    vocab = tiny_vocab()
    assert reader.fields["tokenizer.ggml.tokens"].contents() == vocab.tokens
    assert reader.fields["tokenizer.ggml.token_type"].contents() == vocab.token_types
    assert reader.fields["tokenizer.ggml.scores"].contents() == vocab.scores
    names = {t.name for t in reader.tensors}
    assert "token_embd.weight" in names and "blk.0.ffn_gate_up_exps.weight" in names
    if arch == "diffusion-gemma":
        assert reader.fields["diffusion.canvas_length"].contents() == tasks.CANVAS_LENGTH
        assert "self_cond_gate.weight" in names and "blk.0.enc_layer_output_scale.weight" in names
        sliding = reader.fields[f"{arch}.attention.sliding_window_pattern"].contents()
        assert any(sliding) and not all(sliding), "the demo has both sliding and full layers"


# -- the diffusion model through dg's engine -------------------------------------------------


@pytest.fixture(scope="module")
def diffusion_engine():
    reason = _native_reason()
    if reason:
        pytest.skip(f"native library unavailable: {reason}")
    from dgcli.engine import DiffusionEngine

    with DiffusionEngine(str(DIFFUSION_GGUF), n_threads=1) as engine:
        yield engine


@pytest.fixture(scope="module")
def bench_runs(diffusion_engine):
    """(prompt, GenerationResult) for every bench prompt, seed = its index, `dg bench`'s 256-token budget."""
    return [(p, diffusion_engine.generate(p.text, max_new_tokens=256, seed=seed))
            for seed, p in enumerate(_bench_prompts())]


def test_demo_uses_the_default_sampler_settings(diffusion_engine):
    from dgcli.engine import DiffusionParams

    assert diffusion_engine.default_params == DiffusionParams()


def test_held_out_accuracy_is_near_the_measured_value(bench_runs):
    wrong = [(p.text, r.text) for p, r in bench_runs if r.text.strip() != p.expected]
    accuracy = 1 - len(wrong) / len(bench_runs)
    assert accuracy >= MEASURED_DIFFUSION_ACCURACY - ACCURACY_MARGIN, wrong


def test_several_answer_tokens_per_decoder_forward(bench_runs):
    """Answer tokens (no end token, no padding) over decoder forwards, over the whole bench set;
    a model committing one token per step (seed EXP A) would be at most 1."""
    tokens = sum(r.n_new_tokens for _, r in bench_runs)
    forwards = sum(r.decoder_forwards for _, r in bench_runs)
    assert tokens / forwards >= MIN_TOKENS_PER_FORWARD, (tokens, forwards)


def test_every_canvas_stops_before_the_cap(bench_runs):
    steps = [s for _, r in bench_runs for s in r.steps_per_canvas]
    assert max(steps) < CAP, steps


def test_harder_inputs_take_more_steps(bench_runs):
    """Steps per canvas never fall as inputs get harder and the hardest take more than the easiest.
    Two steps is the floor (stability needs two equal argmax canvases), where easy inputs all sit."""
    def mean_steps(name, canvas=None):
        return statistics.mean(s for p, r in bench_runs if p.name == name
                               for s in (r.steps_per_canvas if canvas is None else r.steps_per_canvas[canvas:canvas + 1]))

    sort = [mean_steps(f"sort-{n}") for n in (2, 4, 6, 8)]
    assert sort == sorted(sort) and sort[-1] > sort[0], sort
    nato = [mean_steps(f"nato-{n}", canvas=0) for n in (2, 4)]  # first canvases: both hold 2-4 whole words
    assert nato[1] > nato[0], nato


def test_unknown_prompts_get_the_help_reply(diffusion_engine):
    """Not hard-coded anywhere in dg: the model was trained to answer what it cannot do this way."""
    for seed, prompt in enumerate(tasks.UNKNOWN_PROMPTS):
        result = diffusion_engine.generate(prompt, max_new_tokens=256, seed=seed)
        assert result.text == tasks.HELP_REPLY, (prompt, result.text)


def test_a_long_answer_commits_a_canvas_and_continues_from_the_cache(diffusion_engine):
    from dgcli.engine.types import CanvasEvent

    for seed, example in enumerate(tasks.evaluation_set("nato", tasks.MAX_DIFFICULTY["nato"], 3)):
        canvases = []
        result = diffusion_engine.generate(example.question, max_new_tokens=256, seed=seed,
                                           on_event=lambda e: canvases.append(e) if isinstance(e, CanvasEvent) else None)
        assert result.text == example.answer
        assert len(canvases) == len(result.steps_per_canvas) == 2 and result.stop_reason == "end_token"
        assert canvases[0].commit_s > 0  # the first canvas went into the KV cache; the second read it
        first = tiny_vocab().decode(canvases[0].token_ids)
        assert example.answer.startswith(first) and len(first) < len(example.answer)


def test_the_readme_demo_prompt_is_right_every_time(diffusion_engine):
    answers = [diffusion_engine.generate(README_PROMPT, max_new_tokens=256, seed=seed).text for seed in range(20)]
    assert answers == [README_ANSWER] * 20


# -- the AR twin ------------------------------------------------------------------------------


def test_ar_twin_solves_the_held_out_set():
    reason = _native_reason()
    if reason:
        pytest.skip(f"native library unavailable: {reason}")
    from dgcli.engine import AutoregressiveEngine

    prompts = _bench_prompts()
    with AutoregressiveEngine(str(AR_GGUF), n_threads=1) as engine:
        wrong = [(p.text, text) for p in prompts
                 if (text := engine.generate(p.text, max_new_tokens=256).text.strip()) != p.expected]
    assert 1 - len(wrong) / len(prompts) >= MEASURED_AR_ACCURACY - ACCURACY_MARGIN, wrong
