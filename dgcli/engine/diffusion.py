"""DiffusionEngine: the block-diffusion loop of Transformers' `DiffusionGemmaGenerationMixin.generate`.

Outer loop, one canvas at a time (at most ceil(max_new_tokens / canvas_length) canvases):
    initialize a uniform random canvas; denoise it (inner loop); finalize it (end-token padding);
    stop at an end token, else commit it (encoder pass appending it to the KV cache) and go on.
Inner loop, cur_step from max_denoising_steps down to 1 (`denoising_step`):
    decoder forward (self-conditioned on the previous step's processed logits: dense as the
    reference, or the sampler's top-k of their softmax; runtime/self_cond.py); temperature,
    entropy, argmax and multinomial sample per position; entropy-bound acceptance; renoise;
    adaptive stop. The forward and the per-position pass are one graph when the model offers
    `denoise_step` (the "graph" step: only per-position results leave llama.cpp), else the model's
    logits go through a host sampler (native or numpy, see sampler.py).

The committed canvas is the ARGMAX canvas of the last step. Like the reference, max_new_tokens sets
the number of canvases and a canvas is always denoised whole; the answer (`answer_token_ids`: before
the end token, pads dropped) is cut at max_new_tokens. Unlike the reference, a canvas of padding only
ends the generation as an end token would (stop_reason "pad_canvas"): the reference would go on
denoising canvases nobody reads. Every random draw comes from an RngStream, in the reference's order,
so a run can be replayed against the reference (tests/test_replay_*).

A generation's state lives in a `DiffusionSequence`; `denoising_step` advances several of them with
one decoder forward (the server batches independent requests that way), and `generate` is the same
loop over one sequence.
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
from dgcli.engine.types import CanvasEvent, GenerationResult, StepEvent, answer_token_ids
from dgcli.errors import WORKER_LOST, ContextFull, DgError, InvalidParameter, WorkerLost
from dgcli.params import DiffusionParams
from dgcli.runtime.forward import StepStats
from dgcli.runtime.self_cond import SelfCond, batched_self_cond, resolve_self_cond_top_k, self_cond_form

EventCallback = Callable[[Any], Any]

# Gemma's <pad>; used when a model object does not say (the reference reads generation_config.pad_token_id)
GEMMA_PAD_TOKEN_ID = 0


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
class _StepPlan:
    """What a step fixes before its forward: its number, the schedule's temperature and the
    multinomial sample's uniforms (the forward draws nothing, so the RNG order stays the
    reference's: the uniforms, then the renoise)."""

    step: int  # 1-based within the canvas
    cur_step: int  # the reference's countdown: max_denoising_steps .. 1
    temperature: np.float32
    uniforms: np.ndarray  # float64 [C]


@dataclass
class _StepOutcome:
    canvas: np.ndarray  # the next step's input canvas
    argmax: np.ndarray
    accepted_mask: np.ndarray
    self_cond: SelfCond  # the next step's self-conditioning input
    stopped: bool
    mean_entropy: float
    temperature: float
    sampling_s: float


STEP_BACKENDS = ("auto", "graph", "native", "numpy")


def _resolve_step_backend(sampler: str | StepSampler, model: Any, n_threads: int | None) -> StepSampler | None:
    """The host sampler for `sampler`, or None when the step runs inside the model's graph.
    "auto": the graph step when the model has one (`denoise_step`) that this placement can run
    (`graph_step_refused`), else the best host sampler; "graph": the graph step (error without it);
    "native" / "numpy": host logits, that sampler."""
    if not isinstance(sampler, str):
        return sampler  # a StepSampler object (tests hand in a freshly compiled one)
    if sampler not in STEP_BACKENDS:
        raise DgError(f"invalid sampler backend {sampler!r}: must be one of {', '.join(STEP_BACKENDS)}")
    has_graph_step = callable(getattr(model, "denoise_step", None))
    if sampler == "graph" and not has_graph_step:
        raise DgError(f"{type(model).__name__} has no in-graph denoising step (denoise_step)")
    refused = getattr(model, "graph_step_refused", lambda: None)() if has_graph_step else None
    if sampler == "graph" and refused:
        raise DgError(refused)
    has_graph_step = has_graph_step and not refused
    if sampler in ("graph", "auto") and has_graph_step:
        return None
    return make_step_sampler(sampler, n_threads=n_threads)


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


class DiffusionSequence:
    """One generation's own state: its prompt, canvas, step counter, self-conditioning, RNG and
    sampler parameters. `DiffusionEngine.generate` runs one alone; the server's scheduler runs many,
    their canvases denoised together by `denoising_step`. Per canvas the stages are:

        start_canvas -> (plan_step, decoder forward, sample_step or apply_step) until the canvas is finished
        -> finish_canvas -> [commit the returned canvas] -> canvas_done -> start_canvas unless done
    """

    def __init__(self, model: Any, prompt_ids: Sequence[int], params: DiffusionParams, max_new_tokens: int,
                 rng: RngStream, step_sampler: StepSampler | None, top_k: int = 0, pad_token_id: int | None = GEMMA_PAD_TOKEN_ID,
                 on_event: EventCallback | None = None, ignore_eos: bool = False):
        self.model = model
        # ignore_eos (llama.cpp's --ignore-eos): end tokens are answer tokens like any other and a
        # canvas of padding does not end it either, so a generation runs to max_new_tokens
        self.ignore_eos = ignore_eos
        self.end_token_ids = [] if ignore_eos else [int(t) for t in model.end_token_ids]
        self.params = params.validate(canvas_length=model.canvas_length)
        limit = validate_max_new_tokens(max_new_tokens)
        self.max_new_canvases = math.ceil(limit / model.canvas_length)
        self.rng, self.step_sampler, self.top_k = rng, step_sampler, top_k
        self.pad_token_id = pad_token_id
        self.events = on_event if isinstance(on_event, TimedEvents) else TimedEvents(on_event)
        self.state = _LoopState(limit=limit, prompt_ids=[int(t) for t in prompt_ids])
        self.canvas_index = 0
        self.canvas: np.ndarray | None = None  # the next forward's input canvas
        self.self_cond: SelfCond | None = None  # None: no self-conditioning signal (a canvas's first step)
        self.stop_rule: StableAndConfidentStop | None = None
        self.stop_reason: str | None = None  # set when the generation is over
        self.started = time.perf_counter()

    @property
    def prompt_ids(self) -> list[int]:
        return self.state.prompt_ids

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    # ---- stages ------------------------------------------------------------------------------------

    def start_canvas(self) -> None:
        """A uniform random canvas, a fresh stop rule, no self-conditioning yet."""
        self.canvas = self.rng.canvas_init(self.model.canvas_length, self.model.vocab_size)
        self.stop_rule = StableAndConfidentStop(self.params.stability_threshold, self.params.confidence_threshold)
        self.self_cond = None
        self.state.steps_per_canvas.append(0)

    def plan_step(self) -> _StepPlan:
        """This step's temperature and uniforms, drawn before the forward (the graph step needs them)."""
        step = self.state.steps_per_canvas[-1] + 1
        cur_step = self.params.max_denoising_steps - step + 1
        temperature = schedule_temperature(cur_step, self.params.max_denoising_steps, self.params.t_min,
                                           self.params.t_max)
        return _StepPlan(step=step, cur_step=cur_step, temperature=temperature,
                         uniforms=self.rng.multinomial_uniforms(len(self.canvas)))

    def sample_step(self, logits: np.ndarray, forward_s: float, plan: _StepPlan | None = None) -> bool:
        """The host sampler's pass over this canvas's decoder logits (temperature, entropy, argmax,
        sample, the next top-k), then `apply_step`. True when the canvas is finished."""
        plan = plan if plan is not None else self.plan_step()
        began = time.perf_counter()
        if self.top_k:
            stats = self.step_sampler.process_logits(logits, plan.temperature, plan.uniforms, top_k=self.top_k)
        else:
            stats = self.step_sampler.process_logits(logits, plan.temperature, plan.uniforms)
        return self.apply_step(plan, stats, forward_s, sampler_s=time.perf_counter() - began)

    def apply_step(self, plan: _StepPlan, stats: StepStats, forward_s: float, sampler_s: float = 0.0) -> bool:
        """The sampler rules on a step's per-position results (reference: the rest of
        `_denoising_step`): entropy-bound acceptance, renoise, adaptive stop; emits the StepEvent.
        sampler_s: the host sampler's time (0 when the pass ran inside the graph). True when the
        canvas is finished (adaptive stop, or its last step)."""
        state = self.state
        used_dropped = self.self_cond.dropped_mass if self.self_cond is not None else 0.0
        outcome = self._apply_rules(plan, stats, sampler_s)
        self.canvas, self.self_cond = outcome.canvas, outcome.self_cond
        state.current_argmax = outcome.argmax
        state.steps_per_canvas[-1] = plan.step
        state.decoder_forwards += 1
        state.forward_s += forward_s
        state.sampling_s += outcome.sampling_s
        _emit(self.events, StepEvent(
            canvas_index=self.canvas_index, step=plan.step, max_steps=self.params.max_denoising_steps,
            temperature=outcome.temperature,
            argmax_canvas=outcome.argmax.astype(np.int32), accepted_mask=outcome.accepted_mask,
            n_accepted=int(outcome.accepted_mask.sum()), mean_entropy=outcome.mean_entropy,
            forward_s=forward_s, sampling_s=outcome.sampling_s, stopped=outcome.stopped,
            sc_dropped_mass=used_dropped))
        return outcome.stopped or plan.cur_step == 1

    def _apply_rules(self, plan: _StepPlan, stats: StepStats, sampler_s: float) -> _StepOutcome:
        began = time.perf_counter()
        if self.top_k:
            next_sc = SelfCond(ids=stats.topk_ids, probs=stats.topk_probs,
                               dropped_mass=float(np.max(stats.dropped_mass)))
        elif stats.soft is not None:
            next_sc = SelfCond(soft=stats.soft)  # the graph step formed the product already
        else:
            next_sc = SelfCond(logits=stats.processed)
        accepted = entropy_bound_accept_mask(stats.entropy, self.params.entropy_bound)
        next_canvas = renoise_canvas(stats.sampled, accepted, self.rng.renoise(len(self.canvas), self.model.vocab_size))
        stopped = self.stop_rule(stats.argmax, stats.entropy)
        return _StepOutcome(canvas=next_canvas, argmax=stats.argmax, accepted_mask=accepted,
                            self_cond=next_sc, stopped=stopped, mean_entropy=mean_entropy(stats.entropy),
                            temperature=float(plan.temperature),
                            sampling_s=sampler_s + time.perf_counter() - began)

    def finish_canvas(self) -> np.ndarray | None:
        """Finalize the canvas (its argmax, padded after the first end token) and take its answer
        tokens. Returns the argmax canvas to commit before the next canvas, or None when the
        generation stops here (stop_reason says why)."""
        state = self.state
        argmax_canvas = state.current_argmax
        canvas, state.found_end = finalize_canvas(argmax_canvas, self.end_token_ids, self.pad_token_id)
        state.committed.append(canvas)
        state.current_argmax = None
        whole = answer_token_ids(canvas, self.end_token_ids, self.pad_token_id)
        self._canvas_answer = whole[:state.limit - len(state.answer)]
        state.answer.extend(self._canvas_answer)
        if len(self._canvas_answer) < len(whole):
            self.stop_reason = "length"  # cut at max_new_tokens, whatever the canvas went on to say
        elif state.found_end:
            self.stop_reason = "end_token"
        elif not self.ignore_eos and self.pad_token_id is not None and bool(np.all(canvas == self.pad_token_id)):
            self.stop_reason = "pad_canvas"
        elif self.canvas_index + 1 == self.max_new_canvases or len(state.answer) >= state.limit:
            self.stop_reason = "length"
        return None if self.done else argmax_canvas

    def canvas_done(self, commit_s: float) -> None:
        """Emit the CanvasEvent (the canvas's answer tokens); the next canvas follows unless done."""
        _emit(self.events, CanvasEvent(canvas_index=self.canvas_index, token_ids=self._canvas_answer,
                                       steps=self.state.steps_per_canvas[-1], commit_s=commit_s))
        if not self.done:
            self.canvas_index += 1

    # ---- result ------------------------------------------------------------------------------------

    def result(self, stop_reason: str | None = None, seed: int | None = None) -> GenerationResult:
        """What this generation produced so far; stop_reason "interrupted" (or WORKER_LOST) adds the
        current canvas's answer."""
        state = self.state
        stop_reason = stop_reason or self.stop_reason or "length"
        interrupted = stop_reason in ("interrupted", WORKER_LOST)
        answer = list(state.answer)
        if interrupted and state.current_argmax is not None and not state.found_end:
            answer.extend(answer_token_ids(state.current_argmax, self.end_token_ids, self.pad_token_id,
                                           limit=state.limit - len(state.answer)))
        forwards = state.decoder_forwards
        display_s = self.events.seconds
        return GenerationResult(
            mode="diffusion",
            text=self.model.detokenize(answer),
            token_ids=answer,
            n_prompt_tokens=len(state.prompt_ids),
            steps_per_canvas=list(state.steps_per_canvas),
            decoder_forwards=forwards,
            tokens_per_forward=len(answer) / forwards if forwards else 0.0,
            prefill_s=state.prefill_s,
            total_s=time.perf_counter() - self.started - display_s,
            forward_s=state.forward_s,
            sampling_s=state.sampling_s,
            stop_reason=stop_reason,
            interrupted=interrupted,
            seed=seed if seed is not None else self.rng.seed,
            display_s=display_s,
            n_cached_prompt_tokens=state.n_cached_prompt,
            self_conditioning=self_cond_form(self.top_k),
            canvas_token_ids=[int(t) for canvas in state.committed for t in canvas],
        )


def denoising_step(model: Any, sequences: Sequence[DiffusionSequence]) -> list[bool]:
    """One denoising step for every sequence: ONE decoder forward over all their canvases, then each
    sequence's sampler rules on its own rows. Sequences without a host sampler (the engine's "graph"
    step) run the per-position pass inside that forward (`model.denoise_step`): only its per-position
    results leave the graph. Sequence i must own KV-cache sequence i (its prompt and committed
    canvases). Returns, per sequence, whether its canvas is finished."""
    plans = [seq.plan_step() for seq in sequences]
    in_graph = [seq.step_sampler is None for seq in sequences]
    if any(in_graph) and not all(in_graph):
        raise DgError("canvases in one forward need the same step backend (all in the graph or all on the host)")
    began = time.perf_counter()
    if all(in_graph):
        stats = _graph_step(model, sequences, plans)
        forward_s = time.perf_counter() - began
        return [seq.apply_step(plan, rows, forward_s) for seq, plan, rows in zip(sequences, plans, stats)]
    if len(sequences) == 1:
        # a single generation: the step-level API every model object has (the torch reference too)
        seq = sequences[0]
        sc = seq.self_cond
        if sc is not None and sc.ids is not None:
            logits = model.decode_canvas(seq.canvas, sc_topk=(sc.ids, sc.probs))[None]
        else:
            logits = model.decode_canvas(seq.canvas, None if sc is None else sc.logits)[None]
    else:
        canvases = np.stack([seq.canvas for seq in sequences])
        logits = model.decode_canvases(canvases, per_sequence=True,
                                       **batched_self_cond([seq.self_cond for seq in sequences]))
    forward_s = time.perf_counter() - began
    return [seq.sample_step(rows, forward_s, plan) for seq, plan, rows in zip(sequences, plans, logits)]


def _graph_step(model: Any, sequences: Sequence[DiffusionSequence], plans: Sequence[_StepPlan]) -> list[StepStats]:
    """The decoder forward and the per-position pass in one graph, for every sequence's canvas. The
    next step's self-conditioning input comes out of the same graph: the top-k, or (dense) the soft
    embedding, this step's probabilities times E."""
    top_k = sequences[0].top_k
    if any(seq.top_k != top_k for seq in sequences):
        raise DgError("canvases in one forward need the same self-conditioning form (dense or the same top-k)")
    canvases = np.stack([seq.canvas for seq in sequences])
    temperatures = np.array([plan.temperature for plan in plans], dtype=np.float32)
    uniforms = np.stack([plan.uniforms for plan in plans])
    self_cond = batched_self_cond([seq.self_cond for seq in sequences])
    if len(sequences) > 1:
        self_cond["per_sequence"] = True
    return model.denoise_step(canvases, temperatures, uniforms, top_k=top_k, next_soft=not top_k, **self_cond)


class DiffusionEngine:
    """Block-diffusion generation over a DiffusionGemma GGUF (or any object with the step-level API)."""

    def __init__(self, model: str | os.PathLike | Any, n_threads: int | None = None, n_gpu_layers: int = 0,
                 exact: bool = False, n_ctx: int | None = None, sampler: str | StepSampler = "auto",
                 self_cond_top_k: int | str | None = None, n_cpu_moe: int = 0,
                 rpc_servers: Sequence[str] | None = None):
        if isinstance(model, (str, os.PathLike)):
            from dgcli.runtime.model import DiffusionModel

            self.model = DiffusionModel(os.fspath(model), n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                                        exact=exact, n_ctx=n_ctx, n_cpu_moe=n_cpu_moe, rpc_servers=rpc_servers)
            self._owns_model = True
        else:
            self.model = model
            self._owns_model = False
        # "auto" | "graph" | "native" | "numpy", or a StepSampler object; None: the graph step
        self.step_sampler: StepSampler | None = _resolve_step_backend(sampler, self.model, n_threads)
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
    def step_backend(self) -> str:
        """Where a step's per-position pass runs: "graph" (inside the decoder graph) or the host sampler's name."""
        return "graph" if self.step_sampler is None else self.step_sampler.name

    @property
    def default_params(self) -> DiffusionParams:
        return getattr(self.model, "default_params", None) or DiffusionParams()

    @property
    def pad_token_id(self) -> int | None:
        return getattr(self.model, "pad_token_id", GEMMA_PAD_TOKEN_ID)

    # ---- generate ----------------------------------------------------------------------------------

    def new_sequence(self, prompt_ids: Sequence[int], params: DiffusionParams | None = None, max_new_tokens: int = 256,
                     seed: int | None = None, on_event: EventCallback | None = None, rng: RngStream | None = None,
                     self_cond_top_k: int | str | None = None, ignore_eos: bool = False) -> DiffusionSequence:
        """A generation's state with every setting validated; nothing runs yet. seed None: a random
        seed (rng.seed reports it). ignore_eos: end tokens do not end the answer."""
        setting = self.self_cond_top_k if self_cond_top_k is None else self_cond_top_k
        top_k = resolve_self_cond_top_k(setting, self.model.vocab_size, exact=getattr(self.model, "exact", False))
        return DiffusionSequence(
            self.model, prompt_ids, params or self.default_params, max_new_tokens,
            rng if rng is not None else RngStream(resolve_seed(seed)), self.step_sampler,
            top_k=top_k, pad_token_id=self.pad_token_id, on_event=on_event, ignore_eos=ignore_eos)

    def generate(self, prompt: str | Sequence[int], params: DiffusionParams | None = None, max_new_tokens: int = 256,
                 seed: int | None = None, chat: bool = True, on_event: EventCallback | None = None,
                 rng: RngStream | None = None, self_cond_top_k: int | str | None = None,
                 reuse_cache: bool = False, parse_special: bool = False, ignore_eos: bool = False) -> GenerationResult:
        """One generation. prompt: see `prompt_token_ids`. seed None: a random seed, reported in the
        result. reuse_cache: keep the KV cache's longest prefix shared with the prompt's tokens and
        prefill only the rest (chat turns)."""
        seq = self.new_sequence([], params, max_new_tokens, seed, on_event, rng, self_cond_top_k, ignore_eos)
        stop_reason = None
        try:
            seq.state.prompt_ids = prompt_token_ids(self.model, prompt, chat, parse_special)
            # the clock starts here: rendering the chat template and tokenizing are not generation time
            # (given token ids, as the CLI gives them, there is none of either)
            seq.started = time.perf_counter()
            self._prefill(seq.state, reuse_cache)
            seq.start_canvas()
            while not seq.done:
                if denoising_step(self.model, [seq])[0]:
                    to_commit = seq.finish_canvas()
                    if to_commit is not None and not self._room_for_another_canvas():
                        seq.stop_reason, to_commit = "context_full", None
                    seq.canvas_done(0.0 if to_commit is None else self._commit_canvas(to_commit))
                    if not seq.done:
                        seq.start_canvas()
        except (KeyboardInterrupt, _StopRequested):
            stop_reason = "interrupted"
        except WorkerLost:  # the worker's error is the caller's to report (rpc.check_workers raises it again)
            stop_reason = WORKER_LOST
        except ContextFull:
            if not seq.state.steps_per_canvas:
                raise  # the prompt alone does not fit: nothing was generated
            stop_reason = "context_full"  # a model that only says so when a forward would overflow
        return seq.result(stop_reason)

    def _room_for_another_canvas(self) -> bool:
        """Room to commit this canvas and denoise the next one (models without n_ctx: assumed)."""
        n_ctx, n_past = getattr(self.model, "n_ctx", None), getattr(self.model, "n_past", None)
        if not isinstance(n_ctx, int) or not isinstance(n_past, int):
            return True
        return n_past + 2 * self.model.canvas_length <= n_ctx

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

    def _commit_canvas(self, argmax_canvas: np.ndarray) -> float:
        began = time.perf_counter()
        self.model.commit(argmax_canvas)
        return time.perf_counter() - began
