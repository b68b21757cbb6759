"""DiffusionEngine: the block-diffusion loop of Transformers' `DiffusionGemmaGenerationMixin.generate`.

Outer loop, one canvas at a time (at most ceil(max_new_tokens / canvas_length) canvases):
    initialize a uniform random canvas; denoise it (inner loop); finalize it (end-token padding);
    stop at an end token, else commit it (encoder pass appending it to the KV cache) and go on.
Inner loop, cur_step from max_denoising_steps down to 1 (`_denoising_step`):
    decoder forward (self-conditioned on the previous step's processed logits: dense as the
    reference on small vocabularies, else the sampler's top-k of their softmax); temperature,
    entropy, argmax and multinomial sample per position (native or numpy, see sampler.py);
    entropy-bound acceptance; renoise; adaptive stop.

The committed canvas is the ARGMAX canvas of the last step. Like the reference, max_new_tokens sets
the number of canvases and a canvas is always denoised whole; the answer (`answer_token_ids`: before
the end token, pads dropped) is cut at max_new_tokens. Unlike the reference, a canvas of padding only
ends the generation as an end token would (stop_reason "pad_canvas"): the reference would go on
denoising canvases nobody reads. Every random draw comes from an RngStream, in the reference's order,
so a run can be replayed against the reference (tests/test_replay_*).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from dgcli.engine.rng import RngStream, resolve_seed
from dgcli.engine.sampler import (
    StableAndConfidentStop,
    StepSampler,
    entropy_bound_accept_mask,
    finalize_canvas,
    make_step_sampler,
    mean_entropy,
    renoise_canvas,
    schedule_temperature,
)
from dgcli.engine.types import (
    CanvasEvent,
    DgError,
    DiffusionParams,
    GenerationResult,
    InvalidParameter,
    StepEvent,
    answer_token_ids,
)

EventCallback = Callable[[Any], Any]

# Gemma's <pad>; used when a model object does not say (the reference reads generation_config.pad_token_id)
GEMMA_PAD_TOKEN_ID = 0

# Self-conditioning input (the previous step's softmax over the vocabulary, times E): dense, as the
# reference, up to this vocabulary size (tiny and demo models: exact reference behaviour, cheap);
# above it the sampler's top SPARSE_SC_TOP_K tokens per position. On the real vocabulary (262144)
# the dense product is ~190 G multiply-adds per step, 10x the rest of a 2-layer forward; the
# dropped tail mass is reported per step (StepEvent.sc_dropped_mass).
DENSE_SC_MAX_VOCAB = 4096
SPARSE_SC_TOP_K = 64


def resolve_self_cond_top_k(value: Any, vocab_size: int) -> int:
    """The top-k width for a `self_cond_top_k` setting; 0 means dense (the reference's form).
    None: dense when vocab_size <= DENSE_SC_MAX_VOCAB, else SPARSE_SC_TOP_K. 0 or "dense": dense.
    k >= vocab_size is dense too (nothing would be dropped)."""
    if value is None:
        return 0 if vocab_size <= DENSE_SC_MAX_VOCAB else min(SPARSE_SC_TOP_K, vocab_size)
    if isinstance(value, str) and value.strip().lower() == "dense":
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidParameter("self_cond_top_k", value, 'an integer >= 0 (0 = dense), "dense" or None (auto)')
    return 0 if value >= vocab_size else int(value)


@dataclass
class _SelfCond:
    """The next decoder forward's self-conditioning input: dense processed logits, or top-k."""

    logits: np.ndarray | None = None  # float32 [C, V]
    ids: np.ndarray | None = None  # int32 [C, k]
    probs: np.ndarray | None = None  # float32 [C, k]
    dropped_mass: float = 0.0  # largest probability mass left out of a position's top-k


class _StopRequested(Exception):
    """on_event returned False."""


@dataclass
class _LoopState:
    """Everything generate() has produced so far, so an interruption can still return it."""

    limit: int = 0  # max_new_tokens: the answer stops there
    prompt_ids: list[int] = field(default_factory=list)
    n_cached_prompt: int = 0  # prompt tokens already in the KV cache (not prefilled again)
    committed: list[np.ndarray] = field(default_factory=list)  # finalized canvases (padded after the end token)
    answer: list[int] = field(default_factory=list)  # answer tokens of the finalized canvases
    current_argmax: np.ndarray | None = None  # the in-progress canvas's argmax after its latest step
    steps_per_canvas: list[int] = field(default_factory=list)
    decoder_forwards: int = 0
    forward_s: float = 0.0
    sampling_s: float = 0.0
    prefill_s: float = 0.0
    found_end: bool = False


@dataclass
class _StepOutcome:
    canvas: np.ndarray  # the next step's input canvas
    argmax: np.ndarray
    accepted_mask: np.ndarray
    self_cond: _SelfCond  # the next step's self-conditioning input
    stopped: bool
    mean_entropy: float
    temperature: float
    forward_s: float
    sampling_s: float


def validate_max_new_tokens(max_new_tokens: Any) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InvalidParameter("max_new_tokens", max_new_tokens, "an integer >= 1")
    return int(max_new_tokens)



def prompt_token_ids(model: Any, prompt: Any, chat: bool = True, parse_special: bool = False) -> list[int]:
    """A prompt as token ids. A string goes through the model's chat template as one user message
    (chat=True) or is tokenized as it is after a bos (chat=False: GGUFs without a template); a list of
    {"role", "content"} messages goes through the template; a list of ints is taken as token ids.
    Control-token text in the user's text stays text unless parse_special."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DgError("empty prompt")
        if not chat:
            ids = model.tokenize(prompt, add_bos=True, special=parse_special)
        elif hasattr(model, "chat_tokens"):
            ids = model.chat_tokens([{"role": "user", "content": prompt}], parse_special=parse_special)
        else:  # a step-level stand-in with only the one-message form
            ids = model.chat_prompt(prompt)
    elif prompt and all(isinstance(m, dict) for m in prompt):
        ids = model.chat_tokens(list(prompt), parse_special=parse_special)
    else:
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if bad:
            raise DgError(f"prompt token id {bad[0]} outside the vocabulary [0, {model.vocab_size})")
    if not ids:
        raise DgError("empty prompt: nothing to condition on")
    return list(ids)


def _emit(on_event: EventCallback | None, event: Any) -> None:
    if on_event is not None and on_event(event) is False:
        raise _StopRequested


class TimedEvents:
    """The caller's on_event, timed: what it spends drawing (or pacing) is not generation time."""

    def __init__(self, on_event: EventCallback | None):
        self.on_event, self.seconds = on_event, 0.0

    def __call__(self, event: Any) -> Any:
        if self.on_event is None:
            return None
        began = time.perf_counter()
        try:
            return self.on_event(event)
        finally:
            self.seconds += time.perf_counter() - began


class DiffusionEngine:
    """Block-diffusion generation over a DiffusionGemma GGUF (or any object with the step-level API)."""

    def __init__(self, model: str | os.PathLike | Any, n_threads: int | None = None, n_gpu_layers: int = 0,
                 exact: bool = False, n_ctx: int | None = None, sampler: str | StepSampler = "auto",
                 self_cond_top_k: int | str | None = None, n_cpu_moe: int = 0):
        if isinstance(model, (str, os.PathLike)):
            from dgcli.engine.model import DiffusionModel

            self.model = DiffusionModel(os.fspath(model), n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                                        exact=exact, n_ctx=n_ctx, n_cpu_moe=n_cpu_moe)
            self._owns_model = True
        else:
            self.model = model
            self._owns_model = False
        # "auto" | "native" | "numpy", or a StepSampler object (tests hand in a freshly compiled one)
        self.step_sampler: StepSampler = (make_step_sampler(sampler, n_threads=n_threads)
                                          if isinstance(sampler, str) else sampler)
        # an engine option, not a DiffusionParams knob: the reference has no such setting
        resolve_self_cond_top_k(self_cond_top_k, self.model.vocab_size)  # fail early on a bad value
        self.self_cond_top_k = self_cond_top_k

    # ---- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        if self._owns_model and hasattr(self.model, "close"):
            self.model.close()

    def __enter__(self) -> "DiffusionEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def default_params(self) -> DiffusionParams:
        return getattr(self.model, "default_params", None) or DiffusionParams()

    @property
    def pad_token_id(self) -> int | None:
        return getattr(self.model, "pad_token_id", GEMMA_PAD_TOKEN_ID)

    # ---- generate ----------------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], params: DiffusionParams | None = None, max_new_tokens: int = 256,
                 seed: int | None = None, chat: bool = True, on_event: EventCallback | None = None,
                 rng: RngStream | None = None, self_cond_top_k: int | str | None = None,
                 reuse_cache: bool = False, parse_special: bool = False) -> GenerationResult:
        """One generation. prompt: see `prompt_token_ids`. seed None: a random seed, reported in the
        result. reuse_cache: keep the KV cache's longest prefix shared with the prompt's tokens and
        prefill only the rest (chat turns)."""
        started = time.perf_counter()
        params = (params or self.default_params).validate()
        setting = self.self_cond_top_k if self_cond_top_k is None else self_cond_top_k
        top_k = resolve_self_cond_top_k(setting, self.model.vocab_size)
        limit = validate_max_new_tokens(max_new_tokens)
        max_new_canvases = math.ceil(limit / self.model.canvas_length)
        state = _LoopState(limit=limit)
        if rng is None:
            seed = resolve_seed(seed)
            rng = RngStream(seed)
        else:
            seed = rng.seed
        events = TimedEvents(on_event)
        stop_reason = "length"
        try:
            state.prompt_ids = prompt_token_ids(self.model, prompt, chat, parse_special)
            self._prefill(state, reuse_cache)
            for canvas_index in range(max_new_canvases):
                argmax_canvas = self._denoise_canvas(canvas_index, params, rng, state, events, top_k)
                stop = self._finish_canvas(canvas_index, argmax_canvas, state, events,
                                           last=canvas_index + 1 == max_new_canvases)
                if stop is not None:
                    stop_reason = stop
                    break
        except (KeyboardInterrupt, _StopRequested):
            stop_reason = "interrupted"
        return self._build_result(state, stop_reason, started, seed, events.seconds)

    # ---- stages ------------------------------------------------------------------------------------

    def _prefill(self, state: _LoopState, reuse_cache: bool = False) -> None:
        began = time.perf_counter()
        kept = self._reuse_cached_prefix(state.prompt_ids) if reuse_cache else 0
        if kept == 0:
            self.model.reset()
        if kept < len(state.prompt_ids):
            self.model.prefill(state.prompt_ids[kept:])
        state.n_cached_prompt = kept
        state.prefill_s = time.perf_counter() - began

    def _reuse_cached_prefix(self, prompt_ids: list[int]) -> int:
        """How many leading prompt tokens the model's KV cache already holds (the rest is dropped
        from the cache); 0 for a model that cannot say."""
        keep = getattr(self.model, "keep_cached_prefix", None)
        return int(keep(prompt_ids)) if callable(keep) else 0

    def _finish_canvas(self, canvas_index: int, argmax_canvas: np.ndarray, state: _LoopState,
                       on_event: EventCallback | None, last: bool) -> str | None:
        """Finalize a denoised canvas and take its answer tokens; commit it to the cache when another
        canvas follows, else return why the generation stops."""
        canvas, state.found_end = finalize_canvas(argmax_canvas, self.model.end_token_ids, self.pad_token_id)
        state.committed.append(canvas)
        state.current_argmax = None
        whole = answer_token_ids(canvas, self.model.end_token_ids, self.pad_token_id)
        answer = whole[:state.limit - len(state.answer)]
        state.answer.extend(answer)
        if len(answer) < len(whole):
            stop = "length"  # cut at max_new_tokens, whatever the canvas went on to say
        elif state.found_end:
            stop = "end_token"
        elif self._only_padding(canvas):
            stop = "pad_canvas"
        elif last or len(state.answer) >= state.limit:
            stop = "length"
        else:
            stop = None
        commit_s = 0.0 if stop is not None else self._commit_canvas(argmax_canvas)
        _emit(on_event, CanvasEvent(canvas_index=canvas_index, token_ids=answer,
                                    steps=state.steps_per_canvas[-1], commit_s=commit_s))
        return stop

    def _answer_tokens(self, canvas: np.ndarray, state: _LoopState) -> list[int]:
        return answer_token_ids(canvas, self.model.end_token_ids, self.pad_token_id,
                                limit=state.limit - len(state.answer))

    def _only_padding(self, canvas: np.ndarray) -> bool:
        return self.pad_token_id is not None and bool(np.all(canvas == self.pad_token_id))

    def _commit_canvas(self, argmax_canvas: np.ndarray) -> float:
        began = time.perf_counter()
        self.model.commit(argmax_canvas)
        return time.perf_counter() - began

    def _denoise_canvas(self, canvas_index: int, params: DiffusionParams, rng: RngStream, state: _LoopState,
                        on_event: EventCallback | None, top_k: int = 0) -> np.ndarray:
        """The inner loop; returns the argmax canvas of its last step. top_k: 0 dense self-conditioning."""
        canvas = rng.canvas_init(self.model.canvas_length, self.model.vocab_size)
        stop_rule = StableAndConfidentStop(params.stability_threshold, params.confidence_threshold)
        self_cond = None  # no self-conditioning signal on a canvas's first step
        state.steps_per_canvas.append(0)
        for step, cur_step in enumerate(range(params.max_denoising_steps, 0, -1), start=1):
            state.decoder_forwards += 1
            used_dropped = self_cond.dropped_mass if self_cond is not None else 0.0
            outcome = self._denoising_step(canvas, self_cond, cur_step, params, rng, stop_rule, top_k)
            canvas, self_cond = outcome.canvas, outcome.self_cond
            state.current_argmax = outcome.argmax
            state.steps_per_canvas[-1] = step
            state.forward_s += outcome.forward_s
            state.sampling_s += outcome.sampling_s
            _emit(on_event, StepEvent(
                canvas_index=canvas_index, step=step, max_steps=params.max_denoising_steps,
                temperature=outcome.temperature,
                argmax_canvas=outcome.argmax.astype(np.int32), accepted_mask=outcome.accepted_mask,
                n_accepted=int(outcome.accepted_mask.sum()), mean_entropy=outcome.mean_entropy,
                forward_s=outcome.forward_s, sampling_s=outcome.sampling_s, stopped=outcome.stopped,
                sc_dropped_mass=used_dropped))
            if outcome.stopped:
                break
        return state.current_argmax

    def _denoising_step(self, canvas: np.ndarray, self_cond: _SelfCond | None, cur_step: int,
                        params: DiffusionParams, rng: RngStream, stop_rule: StableAndConfidentStop,
                        top_k: int = 0) -> _StepOutcome:
        """One decoder forward and the sampler rules (reference: `_denoising_step`)."""
        began = time.perf_counter()
        if self_cond is not None and self_cond.ids is not None:
            logits = self.model.decode_canvas(canvas, sc_topk=(self_cond.ids, self_cond.probs))
        else:
            logits = self.model.decode_canvas(canvas, None if self_cond is None else self_cond.logits)
        forwarded = time.perf_counter()
        temperature = schedule_temperature(cur_step, params.max_denoising_steps, params.t_min, params.t_max)
        uniforms = rng.multinomial_uniforms(len(canvas))
        if top_k:
            stats = self.step_sampler.process_logits(logits, temperature, uniforms, top_k=top_k)
            next_sc = _SelfCond(ids=stats.topk_ids, probs=stats.topk_probs,
                                dropped_mass=float(np.max(stats.dropped_mass)))
        else:
            stats = self.step_sampler.process_logits(logits, temperature, uniforms)
            next_sc = _SelfCond(logits=stats.processed)
        accepted = entropy_bound_accept_mask(stats.entropy, params.entropy_bound)
        next_canvas = renoise_canvas(stats.sampled, accepted, rng.renoise(len(canvas), self.model.vocab_size))
        stopped = stop_rule(stats.argmax, stats.entropy)
        return _StepOutcome(canvas=next_canvas, argmax=stats.argmax, accepted_mask=accepted,
                            self_cond=next_sc, stopped=stopped, mean_entropy=mean_entropy(stats.entropy),
                            temperature=float(temperature),
                            forward_s=forwarded - began, sampling_s=time.perf_counter() - forwarded)

    def _build_result(self, state: _LoopState, stop_reason: str, started: float, seed: int | None,
                      display_s: float) -> GenerationResult:
        interrupted = stop_reason == "interrupted"
        answer = list(state.answer)
        if interrupted and state.current_argmax is not None and not state.found_end:
            answer.extend(self._answer_tokens(state.current_argmax, state))
        forwards = state.decoder_forwards
        canvases = [int(t) for canvas in state.committed for t in canvas]
        return GenerationResult(
            mode="diffusion",
            text=self.model.detokenize(answer),
            token_ids=answer,
            n_prompt_tokens=len(state.prompt_ids),
            steps_per_canvas=list(state.steps_per_canvas),
            decoder_forwards=forwards,
            tokens_per_forward=len(answer) / forwards if forwards else 0.0,
            prefill_s=state.prefill_s,
            total_s=time.perf_counter() - started - display_s,
            forward_s=state.forward_s,
            sampling_s=state.sampling_s,
            stop_reason=stop_reason,
            interrupted=interrupted,
            seed=seed,
            display_s=display_s,
            n_cached_prompt_tokens=state.n_cached_prompt,
            canvas_token_ids=canvases,
        )
