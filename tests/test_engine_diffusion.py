"""DiffusionEngine over a scripted step-level model: the loop's wiring, events, interrupts, errors."""

from __future__ import annotations

import numpy as np
import pytest

from dgcli.engine.diffusion import DiffusionEngine
from dgcli.engine.rng import RngStream
from dgcli.engine.sampler import NumpyStepSampler, count_valid_tokens, schedule_temperature
from dgcli.engine.types import CanvasEvent, StepEvent
from dgcli.errors import DgError, InvalidParameter
from dgcli.params import DiffusionParams

VOCAB, CANVAS, EOS, PAD = 12, 4, 1, 0


class ScriptedModel:
    """Logits that favour `targets[canvas_index]` with a margin growing per step (or flat noise)."""

    def __init__(self, targets, margin_per_step=4.0, flat=False, raise_in_forward_at=None):
        self.vocab_size, self.canvas_length = VOCAB, CANVAS
        self.end_token_ids, self.pad_token_id = [EOS], PAD
        self.default_params = DiffusionParams(max_denoising_steps=10)
        self.targets = [np.asarray(t) for t in targets]
        self.margin_per_step, self.flat = margin_per_step, flat
        self.raise_in_forward_at = raise_in_forward_at
        self.log: list[tuple] = []
        self.topk_log: list[tuple] = []  # (canvas, step, ids, probs) of each top-k self-conditioned decode
        self.n_past = 0
        self._canvas_index = 0
        self._step = 0
        self._noise = np.random.default_rng(0)

    def tokenize(self, text, add_bos=True, special=True):
        return [2] + [3 + (ord(c) % 8) for c in text]

    def detokenize(self, ids):
        return "".join(chr(ord("a") + int(t)) for t in ids)

    def chat_prompt(self, user_text):
        return [2, 9] + self.tokenize(user_text)[1:] + [10]

    def reset(self):
        self.log.append(("reset",))
        self.n_past, self._canvas_index, self._step = 0, 0, 0

    def prefill(self, tokens):
        self.log.append(("prefill", list(tokens)))
        self.n_past += len(tokens)

    def commit(self, canvas):
        self.log.append(("commit", [int(t) for t in canvas]))
        self.n_past += len(canvas)
        self._canvas_index += 1
        self._step = 0

    def decode_canvas(self, canvas, sc_logits=None, sc_topk=None):
        self._step += 1
        self.log.append(("decode", self._canvas_index, None if sc_logits is None else sc_logits.copy()))
        if sc_topk is not None:
            self.topk_log.append((self._canvas_index, self._step, sc_topk[0].copy(), sc_topk[1].copy()))
        if self.raise_in_forward_at == (self._canvas_index, self._step):
            raise KeyboardInterrupt
        if self.flat:
            logits = self._noise.standard_normal((CANVAS, VOCAB)).astype(np.float32) * 0.01
            logits[:, EOS] = -10.0  # never the argmax: a flat model must not end by chance
            return logits
        logits = np.zeros((CANVAS, VOCAB), dtype=np.float32)
        target = self.targets[min(self._canvas_index, len(self.targets) - 1)]
        logits[np.arange(CANVAS), target] = self.margin_per_step * self._step
        return logits


def make_engine(model):
    return DiffusionEngine(model, sampler="numpy")


def test_canvases_chain_until_an_end_token_and_the_end_is_trimmed():
    model = ScriptedModel([[5, 6, 7, 8], [9, EOS, 4, 4]])
    events = []
    result = make_engine(model).generate([2, 3], max_new_tokens=100, seed=0, on_event=events.append)
    assert result.token_ids == [5, 6, 7, 8, 9]
    assert result.stop_reason == "end_token" and not result.interrupted
    assert result.text == model.detokenize([5, 6, 7, 8, 9])
    # one commit: the first canvas (argmax), never the last
    assert [entry for entry in model.log if entry[0] == "commit"] == [("commit", [5, 6, 7, 8])]
    canvases = [e for e in events if isinstance(e, CanvasEvent)]
    assert [c.token_ids for c in canvases] == [[5, 6, 7, 8], [9]]
    assert canvases[0].commit_s >= 0 and canvases[1].commit_s == 0.0
    # tokens per forward counts the answer (no end token, no padding); the reference's figure (end
    # token kept) is still there to compute from the canvases
    assert result.decoder_forwards == sum(result.steps_per_canvas)
    assert result.tokens_per_forward == pytest.approx(5 / result.decoder_forwards)
    assert result.canvas_token_ids == [5, 6, 7, 8, 9, EOS, 0, 0]
    assert count_valid_tokens(np.array(result.canvas_token_ids), 0) == 4 + 2


def test_max_new_tokens_sets_the_number_of_canvases_and_cuts_the_answer():
    model = ScriptedModel([[5, 6, 7, 8]])
    events = []
    result = make_engine(model).generate([2], max_new_tokens=5, seed=0, on_event=events.append)
    assert len(result.steps_per_canvas) == 2  # ceil(5 / 4) canvases, each denoised whole (the reference's)
    assert len(result.canvas_token_ids) == 8
    assert result.token_ids == [5, 6, 7, 8, 5]  # but the answer stops at 5 tokens
    assert result.n_new_tokens == 5 and result.tokens_per_forward == pytest.approx(5 / result.decoder_forwards)
    assert [e.token_ids for e in events if isinstance(e, CanvasEvent)] == [[5, 6, 7, 8], [5]]
    assert result.stop_reason == "length"


def test_ignore_eos_runs_past_end_tokens_and_pad_canvases_to_max_new_tokens():
    model = ScriptedModel([[5, EOS, 6, 7], [0, 0, 0, 0], [8, 9, EOS, 4]])
    result = make_engine(model).generate([2], max_new_tokens=10, seed=0, ignore_eos=True)
    # the end token is an answer token; the canvas of pads adds nothing but does not stop it
    assert result.token_ids == [5, EOS, 6, 7, 8, 9, EOS, 4]
    assert result.stop_reason == "length" and len(result.steps_per_canvas) == 3
    assert make_engine(ScriptedModel([[5, EOS, 6, 7]])).generate([2], max_new_tokens=10, seed=0).token_ids == [5]


def test_pads_are_not_answer_tokens_and_a_canvas_of_pads_ends_the_generation():
    # The demo model's habit: the answer, then padding without an end token, then canvases of pads.
    model = ScriptedModel([[5, 0, 6, 0], [0, 0, 0, 0], [7, 8, 9, 5]])
    events = []
    result = make_engine(model).generate([2], max_new_tokens=100, seed=0, on_event=events.append)
    assert result.token_ids == [5, 6] and result.n_new_tokens == 2
    assert result.stop_reason == "pad_canvas"
    assert len(result.steps_per_canvas) == 2  # the third canvas never runs
    assert result.tokens_per_forward == pytest.approx(2 / result.decoder_forwards)
    assert [e.token_ids for e in events if isinstance(e, CanvasEvent)] == [[5, 6], []]
    # the all-pad canvas is the last: it is not committed to the cache
    assert [entry[1] for entry in model.log if entry[0] == "commit"] == [[5, 0, 6, 0]]


def test_the_seed_is_picked_and_reported_when_none_is_given():
    first = make_engine(ScriptedModel([[5, 6, 7, 8]], flat=True)).generate([2], max_new_tokens=4)
    assert isinstance(first.seed, int) and 0 <= first.seed < 2**32
    again = make_engine(ScriptedModel([[5, 6, 7, 8]], flat=True)).generate([2], max_new_tokens=4, seed=first.seed)
    assert again.seed == first.seed and again.token_ids == first.token_ids
    with pytest.raises(InvalidParameter, match="seed"):
        make_engine(ScriptedModel([[5, 6, 7, 8]])).generate([2], seed=-1)


def test_first_step_has_no_self_conditioning_then_gets_the_processed_logits():
    model = ScriptedModel([[5, 6, 7, 8]], flat=True)
    params = DiffusionParams(max_denoising_steps=3, t_min=0.5, t_max=2.0)
    make_engine(model).generate([2], params=params, max_new_tokens=4, seed=0)
    decodes = [entry for entry in model.log if entry[0] == "decode"]
    assert decodes[0][2] is None
    # replay the scripted logits to know what step 1 produced, then check step 2's input
    noise = np.random.default_rng(0)
    first_logits = noise.standard_normal((CANVAS, VOCAB)).astype(np.float32) * 0.01
    first_logits[:, EOS] = -10.0
    expected = first_logits / schedule_temperature(3, 3, 0.5, 2.0)
    assert np.array_equal(decodes[1][2], expected)


def test_step_events_describe_each_step():
    model = ScriptedModel([[5, 6, 7, 8]])
    events = []
    params = DiffusionParams(max_denoising_steps=6)
    result = make_engine(model).generate([2], params=params, max_new_tokens=4, seed=1, on_event=events.append)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    assert len(steps) == result.steps_per_canvas[0]
    assert steps[0].temperature == pytest.approx(0.8) and steps[0].max_steps == 6
    assert all(s.n_accepted == int(s.accepted_mask.sum()) >= 1 for s in steps)
    assert steps[-1].argmax_canvas.tolist() == [5, 6, 7, 8]
    assert steps[-1].stopped == (len(steps) < 6)
    assert all(s.forward_s >= 0 and s.sampling_s >= 0 for s in steps)
    assert events[-1].kind == "canvas"


def test_confident_scripted_model_stops_early():
    model = ScriptedModel([[5, 6, 7, 8]], margin_per_step=20.0)
    result = make_engine(model).generate([2], max_new_tokens=4, seed=0)
    assert result.steps_per_canvas[0] < 10


def test_flat_model_runs_to_the_step_cap():
    model = ScriptedModel([[5, 6, 7, 8]], flat=True)
    result = make_engine(model).generate([2], max_new_tokens=8, seed=0)
    assert result.steps_per_canvas == [10, 10]


def test_same_seed_same_result_and_different_seed_different_draws():
    def run(seed):
        model = ScriptedModel([[5, 6, 7, 8]], flat=True)
        stream = RngStream(seed)
        result = make_engine(model).generate([2], max_new_tokens=4, rng=stream)
        return result.token_ids, [e[2] is None or e[2].sum() for e in model.log if e[0] == "decode"]

    assert run(3) == run(3)
    a, b = RngStream(3).canvas_init(CANVAS, VOCAB), RngStream(4).canvas_init(CANVAS, VOCAB)
    assert a.tolist() != b.tolist()


def test_on_event_false_stops_and_returns_the_partial_canvas():
    model = ScriptedModel([[5, 6, EOS, 8]], flat=False)

    def stop_at_second_step(event):
        return not (isinstance(event, StepEvent) and event.step == 2)

    result = make_engine(model).generate([2], max_new_tokens=40, seed=0, on_event=stop_at_second_step)
    assert result.interrupted and result.stop_reason == "interrupted"
    assert result.token_ids == [5, 6]  # the current argmax up to its first end token
    assert result.steps_per_canvas == [2]


def test_keyboard_interrupt_in_the_forward_keeps_committed_canvases():
    model = ScriptedModel([[5, 6, 7, 8], [9, 9, 9, 9]], margin_per_step=20.0, raise_in_forward_at=(1, 1))
    result = make_engine(model).generate([2], max_new_tokens=40, seed=0)
    assert result.interrupted
    assert result.token_ids == [5, 6, 7, 8]


def test_keyboard_interrupt_inside_on_event():
    model = ScriptedModel([[5, 6, 7, 8]])

    def interrupt(event):
        if isinstance(event, CanvasEvent):
            raise KeyboardInterrupt

    result = make_engine(model).generate([2], max_new_tokens=40, seed=0, on_event=interrupt)
    assert result.interrupted and result.token_ids == [5, 6, 7, 8]


def test_chat_prompt_is_applied_to_text():
    model = ScriptedModel([[5, 6, 7, 8]])
    make_engine(model).generate("hi", max_new_tokens=4, seed=0)
    assert ("prefill", model.chat_prompt("hi")) in model.log
    make_engine(model).generate("hi", max_new_tokens=4, seed=0, chat=False)
    assert ("prefill", model.tokenize("hi")) in model.log


def test_defaults_come_from_the_model():
    model = ScriptedModel([[5, 6, 7, 8]], flat=True)
    engine = make_engine(model)
    assert engine.default_params.max_denoising_steps == 10
    assert engine.generate([2], max_new_tokens=4, seed=0).steps_per_canvas == [10]


@pytest.mark.parametrize("kwargs, message", [
    (dict(params=DiffusionParams(confidence_threshold=0.0)), "confidence_threshold=0.0"),
    (dict(params=DiffusionParams(t_min=0.9, t_max=0.8)), "t_max=0.8"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(max_new_tokens=2.5), "max_new_tokens=2.5"),
])
def test_bad_parameters_raise_invalid_parameter(kwargs, message):
    with pytest.raises(InvalidParameter, match=message):
        make_engine(ScriptedModel([[5, 6, 7, 8]])).generate([2], **kwargs)


@pytest.mark.parametrize("prompt, message", [([], "empty prompt"), ([2, 99], "outside the vocabulary")])
def test_bad_prompts_are_clear_errors(prompt, message):
    with pytest.raises(DgError, match=message):
        make_engine(ScriptedModel([[5, 6, 7, 8]])).generate(prompt)


def test_the_numpy_sampler_is_used_when_asked():
    assert isinstance(make_engine(ScriptedModel([[1, 2, 3, 4]])).step_sampler, NumpyStepSampler)


# ---- self-conditioning form --------------------------------------------------------------------


def test_self_cond_top_k_setting_resolves_to_dense_or_a_width():
    from dgcli.runtime.self_cond import DEFAULT_SC_TOP_K, resolve_self_cond_top_k

    # the default at every vocabulary size: the reference's dense form (chosen by measurement: docs/design.md)
    assert DEFAULT_SC_TOP_K == 0
    assert resolve_self_cond_top_k(None, 4096) == 0
    assert resolve_self_cond_top_k(None, 262144) == 0
    assert resolve_self_cond_top_k(None, 262144, exact=True) == 0  # exact mode: always the reference's form
    assert resolve_self_cond_top_k(64, 262144, exact=True) == 64  # an explicit width is honoured
    assert resolve_self_cond_top_k("dense", 262144) == 0
    assert resolve_self_cond_top_k(0, 262144) == 0
    assert resolve_self_cond_top_k(8, 262144) == 8
    assert resolve_self_cond_top_k(12, 12) == 0  # nothing to drop
    for bad in (-1, 2.5, "sparse", True):
        with pytest.raises(InvalidParameter, match="self_cond_top_k"):
            resolve_self_cond_top_k(bad, 100)
    with pytest.raises(InvalidParameter, match="self_cond_top_k"):
        DiffusionEngine(ScriptedModel([[5, 6, 7, 8]]), sampler="numpy", self_cond_top_k=-3)


def test_top_k_self_conditioning_feeds_the_samplers_top_k_and_reports_the_dropped_mass():
    model = ScriptedModel([[5, 6, 7, 8]], flat=True)
    params = DiffusionParams(max_denoising_steps=3, t_min=0.5, t_max=2.0)
    events = []
    DiffusionEngine(model, sampler="numpy", self_cond_top_k=3).generate(
        [2], params=params, max_new_tokens=4, seed=0, on_event=events.append)
    decodes = [entry for entry in model.log if entry[0] == "decode"]
    assert decodes[0][2] is None and all(entry[2] is None for entry in decodes)  # no dense logits
    assert [(c, s) for c, s, _, _ in model.topk_log] == [(0, 2), (0, 3)]
    # step 2's input is the top-3 of softmax(step 1's logits / t)
    noise = np.random.default_rng(0)
    first_logits = noise.standard_normal((CANVAS, VOCAB)).astype(np.float32) * 0.01
    first_logits[:, EOS] = -10.0
    z = first_logits.astype(np.float64) / float(schedule_temperature(3, 3, 0.5, 2.0))
    softmax = np.exp(z - z.max(axis=1, keepdims=True))
    softmax /= softmax.sum(axis=1, keepdims=True)
    _, _, ids, probs = model.topk_log[0]
    assert ids.shape == probs.shape == (CANVAS, 3)
    assert [set(row) for row in ids.tolist()] == [set(np.argsort(-row)[:3].tolist()) for row in softmax]
    np.testing.assert_allclose(probs, np.take_along_axis(softmax, ids.astype(np.int64), axis=1), rtol=1e-5)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert steps[0].sc_dropped_mass == 0.0  # first step: no self-conditioning input
    expected = float(np.max(1.0 - probs.astype(np.float64).sum(axis=1)))
    assert steps[1].sc_dropped_mass == pytest.approx(expected, abs=1e-6)
    assert steps[1].sc_dropped_mass > 0.5  # a flat 12-token softmax keeps ~3/12 in its top 3
    assert steps[1].to_json()["sc_dropped_mass"] == steps[1].sc_dropped_mass


def test_dense_self_conditioning_reports_no_dropped_mass():
    model = ScriptedModel([[5, 6, 7, 8]], flat=True)
    events = []
    result = make_engine(model).generate([2], params=DiffusionParams(max_denoising_steps=3), max_new_tokens=4,
                                         seed=0, on_event=events.append)
    assert not model.topk_log
    assert all(e.sc_dropped_mass == 0.0 for e in events if isinstance(e, StepEvent))
    assert result.self_conditioning == "dense" and result.to_json()["self_conditioning"] == "dense"


def test_the_result_records_the_self_conditioning_form():
    model = ScriptedModel([[5, 6, 7, 8]], flat=True)
    result = DiffusionEngine(model, sampler="numpy", self_cond_top_k=3).generate(
        [2], params=DiffusionParams(max_denoising_steps=2), max_new_tokens=4, seed=0)
    assert result.self_conditioning == "top-3"
    # a per-call setting overrides the engine's
    result = DiffusionEngine(model, sampler="numpy", self_cond_top_k=3).generate(
        [2], params=DiffusionParams(max_denoising_steps=2), max_new_tokens=4, seed=0, self_cond_top_k=0)
    assert result.self_conditioning == "dense"


def test_the_chat_template_and_tokenizer_are_not_generation_time():
    # dg bench hands the engine text: the first run waited ~0.2 s for the chat template's renderer,
    # counted in total_s and after the prefill, and its tok/s read 2.6 where the next runs read 45
    import time

    class SlowTemplate(ScriptedModel):
        def chat_prompt(self, user_text):
            time.sleep(0.3)
            return super().chat_prompt(user_text)

    result = make_engine(SlowTemplate([[5, 6, EOS, 4]])).generate("hi", max_new_tokens=8, seed=0)
    assert result.token_ids == [5, 6]
    assert result.total_s < 0.3 and result.tokens_per_second > 2 / 0.3
