"""The batch scheduler behind `dg serve`: requests share one model, and the canvases of every request
in flight are denoised together, one decoder forward per step.

One engine thread owns the model (a llama.cpp context is not thread-safe). Requests come from any
thread (`submit`), wait in a bounded queue, and get a KV-cache sequence (a slot) when one is free
and the cache has room for everything they may write; each keeps its own prompt and committed
canvases there, and its own canvas, step counter, self-conditioning, RNG and sampler parameters
(a `DiffusionSequence`). One iteration of the loop:

    admit     queued requests, in order, into free slots: prefill their prompts, start a canvas
    drop      requests whose client went away (cancelled): their slots are freed
    prefill   one chunk of the long prompt being prefilled, if any
    step      `denoising_step` over every denoising request: ONE decoder forward for all canvases
    finish    requests whose canvas is done commit it (encoder, their own sequence) and go on,
              or end: their result goes to them and their slot to the next request
    decode    one grammar-constrained token for each request that has a grammar

The model should be loaded with kv_unified=False: each sequence then has its own cache stream, laid
out exactly as a single generation's, and a request's logits are bit-identical to what
`DiffusionEngine.generate` computes alone (tests/test_scheduler.py), whoever shares its forwards.
Prompts are encoded in the chunks a single generation uses (model.ENCODE_CHUNK) for the same reason.
The multi-sequence forward decodes canvas i after sequence i, so the active requests always own
sequences 0..n-1: when one leaves, the last moves into its sequence (a copy of its stream).

A prompt longer than one encoder chunk is prefilled a chunk per iteration, between the steps of
the requests already running, so a long prompt does not hold them up (the chunks are those a single
generation uses, so its answer is unchanged). A request with a grammar (structured output) is
decoded token by token through the encoder instead, one token per iteration
(dgcli/engine/grammar.py). Which request owns which sequence: slots.py.

A request's events reach its `sink`, called on the engine thread: StepEvent and CanvasEvent as the
engine emits them (TokenEvent for a grammar-constrained request), then exactly one RequestDone or
RequestFailed.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from dgcli.engine.diffusion import DiffusionEngine, DiffusionSequence, denoising_step, validate_max_new_tokens
from dgcli.engine.grammar import ConstrainedSequence, GrammarSampler
from dgcli.engine.rng import RngStream, resolve_seed
from dgcli.engine.types import CanvasEvent, GenerationResult, StepEvent, TokenEvent
from dgcli.errors import ContextFull, DgError
from dgcli.params import DiffusionParams
from dgcli.runtime.model import ENCODE_CHUNK
from dgcli.server.slots import DECODING, DENOISING, PREFILLING, SlotLayout
from dgcli.units import plural


class QueueFull(DgError):
    """Every slot is busy and the waiting queue is at its limit."""


class RequestTooLong(DgError):
    """The request could never fit the server's KV cache (prompt + the canvases it may commit)."""


class SchedulerClosed(DgError):
    """The scheduler is shutting down or stopped."""


@dataclass
class RequestDone:
    result: GenerationResult
    queued_s: float  # from submit to the prefill's start
    stopped_by_client: bool = False  # the sink asked to stop (a stop string): result holds what was committed


@dataclass
class RequestFailed:
    message: str
    internal: bool = False  # a failure of the server, not of the request
    shutting_down: bool = False  # the server stopped (Ctrl-C, SIGTERM): no failure, a client may retry


Sink = Callable[[Any], Any]


@dataclass
class GenerationRequest:
    """One generation to run. The sink gets StepEvents (when want_steps), CanvasEvents, then one
    RequestDone or RequestFailed; a sink that returns False for a CanvasEvent ends the request
    after that canvas (its result then has stop_reason "stop"). With a `grammar` (GBNF) the
    request is decoded token by token through the encoder instead, each token one the grammar
    allows (TokenEvents; False for one ends the request there); `temperature` 0 is greedy."""

    prompt_ids: list[int]
    params: DiffusionParams
    max_new_tokens: int
    sink: Sink
    seed: int | None = None
    want_steps: bool = False
    id: str = ""
    submitted_at: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)
    grammar: str | None = None
    temperature: float = 0.0
    sequence: DiffusionSequence | ConstrainedSequence | None = field(default=None, repr=False)
    stage: int | None = None  # slots.DENOISING / PREFILLING / DECODING once admitted
    prefilled: int = 0  # prompt tokens in its KV-cache sequence so far
    logits: Any = field(default=None, repr=False)  # a grammar-constrained request's next-token logits
    forward_s: float = 0.0  # and the time of the forward that gave them
    stop_requested: bool = False
    queued_s: float = 0.0  # from submit to admission
    kv_need: int = 0  # cells this request may occupy: prompt + every canvas it may commit or decode

    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    def cancel(self) -> None:
        """Any thread: stop this request at the engine's next iteration and free its slot."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class SchedulerStats:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    forwards: int = 0  # batched decoder forwards
    prefill_chunks: int = 0  # encoder chunks of long prompts, run between steps
    constrained_tokens: int = 0  # grammar-constrained tokens decoded
    canvases_forwarded: int = 0  # canvas rows over all forwards (their mean is the batch size)
    max_batch: int = 0
    batch_histogram: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "submitted": self.submitted, "completed": self.completed, "failed": self.failed,
            "cancelled": self.cancelled, "forwards": self.forwards, "prefill_chunks": self.prefill_chunks,
            "constrained_tokens": self.constrained_tokens,
            "mean_batch": self.canvases_forwarded / self.forwards if self.forwards else 0.0,
            "max_batch": self.max_batch,
            "batch_histogram": {str(k): v for k, v in sorted(self.batch_histogram.items())},
        }


class BatchScheduler:
    """Runs GenerationRequests on one DiffusionEngine whose model has n_seq_max >= slots sequences."""

    def __init__(self, engine: DiffusionEngine, slots: int | None = None, max_queue: int = 64,
                 log: Callable[[str], None] | None = None):
        model = engine.model
        self.engine, self.model = engine, model
        self.slots = int(slots or getattr(model, "n_seq_max", 1))
        if self.slots < 1 or self.slots > getattr(model, "n_seq_max", 1):
            raise DgError(f"{self.slots} slots need a model loaded with n_seq_max >= {self.slots}")
        if max_queue < 0:
            raise DgError(f"invalid queue size {max_queue}: must be >= 0")
        self.max_queue = max_queue
        # separate streams: every request has its own n_ctx_seq cells; unified: all share n_ctx
        self.shared_kv = bool(getattr(model, "kv_unified", True))
        self.kv_capacity = int(model.n_ctx if self.shared_kv else model.n_ctx_seq)
        # prompts go through the encoder in the chunks a single generation uses (bit-identical caches)
        self.prefill_chunk = max(ENCODE_CHUNK, model.canvas_length)
        self.log = log or (lambda line: None)
        self.stats = SchedulerStats()
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        # request i owns sequence i (a one-slot stand-in model needs no move_sequence)
        self._layout = SlotLayout(lambda src, dst: model.move_sequence(src, dst), lambda seq: model.clear_sequence(seq))
        self._cond = threading.Condition()
        self._running = True
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="dg-scheduler", daemon=True)
        self._thread.start()

    # ---- any thread ----------------------------------------------------------------------------------

    def kv_need(self, n_prompt: int, max_new_tokens: int, constrained: bool = False) -> int:
        """KV cells a request may hold at once: its prompt, every canvas but the last committed,
        and the canvas being decoded; a grammar-constrained one: its prompt, its tokens, and the
        canvas of room the encoder keeps free."""
        max_new_tokens = validate_max_new_tokens(max_new_tokens)
        if constrained:
            return n_prompt + max_new_tokens + self.model.canvas_length
        canvases = math.ceil(max_new_tokens / self.model.canvas_length)
        return n_prompt + canvases * self.model.canvas_length

    def submit(self, request: GenerationRequest) -> GenerationRequest:
        """Queue a request; raises RequestTooLong, QueueFull or SchedulerClosed (nothing queued then)."""
        return self.submit_group([request])[0]

    def submit_group(self, requests: Sequence[GenerationRequest]) -> list[GenerationRequest]:
        """Queue several requests (one HTTP request's choices) together, or none of them: raises
        RequestTooLong, QueueFull or SchedulerClosed."""
        for request in requests:
            self._check(request)
        with self._cond:
            if not self._running:
                raise SchedulerClosed("the server is shutting down")
            free_slots = max(0, self.slots - len(self._layout))
            waiting = self.n_waiting  # a request cancelled while queued gives its place back at once
            if waiting + len(requests) > self.max_queue + free_slots:
                starting = min(waiting, free_slots)  # queued, but theirs are the free slots: not the queue
                group = f" for {len(requests)} more" if len(requests) > 1 else ""
                raise QueueFull(f"the server is busy: {plural(len(self._layout) + starting, 'request')} running, "
                                f"{waiting - starting} waiting (queue limit {self.max_queue}){group}; retry later")
            for request in requests:
                request.id = request.id or f"req-{next(self._ids)}"
                request.submitted_at = time.perf_counter()
                self._waiting.append(request)
                self.stats.submitted += 1
            self._cond.notify_all()
        return list(requests)

    def _check(self, request: GenerationRequest) -> None:
        request.params = request.params.validate()
        request.kv_need = self.kv_need(len(request.prompt_ids), request.max_new_tokens, request.constrained)
        if not request.prompt_ids:
            raise DgError("empty prompt: nothing to condition on")
        if request.kv_need > self.kv_capacity:
            n = len(request.prompt_ids)
            what = (f"{request.max_new_tokens} tokens + {self.model.canvas_length} kept free" if request.constrained
                    else f"{request.kv_need - n} for its canvases of {self.model.canvas_length}")
            raise RequestTooLong(f"this request needs {request.kv_need} tokens of context ({n} prompt + {what}); "
                                 f"a request may use {self.kv_capacity} here: shorten the prompt or max_tokens")

    def cancel(self, request: GenerationRequest) -> None:
        request.cancel()
        with self._cond:
            self._cond.notify_all()

    @property
    def n_active(self) -> int:
        return len(self._layout)

    @property
    def n_waiting(self) -> int:
        """Requests waiting for a slot; not those cancelled there (the engine thread drops them)."""
        return sum(not r.cancelled for r in list(self._waiting))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; every request still here fails."""
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        crashed = False
        try:
            while self._next_iteration():
                pass
        except Exception as err:  # noqa: BLE001 (one line in the log; the requests get their errors below)
            crashed = True
            self.log(f"error: the scheduler stopped: {type(err).__name__}: {err}")
        finally:
            with self._cond:
                self._running = False  # from now on submit() refuses, instead of queueing for nobody
            self._fail_everything("internal error: the scheduler stopped" if crashed
                                  else "the server is shutting down", shutting_down=not crashed)

    def _next_iteration(self) -> bool:
        with self._cond:
            while self._running and not len(self._layout) and not self._waiting:
                self._cond.wait()
            if not self._running:
                return False
            admitted = self._take_admissible()
        for request in admitted:
            self._admit(request)
        self._drop_cancelled()
        for request in self._layout.stage(PREFILLING):
            self._prefill_next_chunk(request)
        if self._layout.stage(DENOISING):
            self._step()
        for request in self._layout.stage(DECODING):
            self._decode_token(request)
        return True

    def _is_long(self, request: GenerationRequest) -> bool:
        return len(request.prompt_ids) > self.prefill_chunk

    def _take_admissible(self) -> list[GenerationRequest]:
        """Queued requests, in arrival order, that have a slot and room in the cache (called locked).
        The head of the queue is never overtaken, so a long request cannot starve; a long prompt
        waits while another is being prefilled."""
        taken: list[GenerationRequest] = []
        reserved = sum(r.kv_need for r in self._layout.requests)
        prefilling = bool(self._layout.stage(PREFILLING))
        for request in [r for r in self._waiting if r.cancelled]:  # anywhere in the queue
            self._waiting.remove(request)
            self._end(request, RequestFailed("cancelled"), counted="cancelled")
        while self._waiting:
            head = self._waiting[0]
            if len(self._layout) + len(taken) >= self.slots:
                break
            if self.shared_kv and reserved + head.kv_need > self.kv_capacity:
                break
            if self._is_long(head):
                if prefilling:
                    break
                prefilling = True
            reserved += head.kv_need
            taken.append(self._waiting.popleft())
        return taken

    def _admit(self, request: GenerationRequest) -> None:
        """A slot for the request and its generation's state; a prompt of one chunk is prefilled now,
        a longer one a chunk per iteration (`_prefill_next_chunk`)."""
        request.queued_s = time.perf_counter() - request.submitted_at
        try:
            request.sequence = self._new_sequence(request)
            if self._is_long(request):
                self._layout.insert(request, PREFILLING)
                return
            self._layout.insert(request, DECODING if request.constrained else DENOISING)
            self._prefill(request, request.prompt_ids)
            self._prefilled(request)
        except Exception as err:  # noqa: BLE001 (a bug must not take the server down, as in _step)
            self._fail(request, err, "admitting")

    def _new_sequence(self, request: GenerationRequest) -> DiffusionSequence | ConstrainedSequence:
        forward = self._event_forwarder(request)
        if request.constrained:
            sampler = GrammarSampler(self.model, request.grammar)
            return ConstrainedSequence(self.model, list(request.prompt_ids), sampler, request.max_new_tokens,
                                       temperature=request.temperature, rng=RngStream(resolve_seed(request.seed)),
                                       on_event=forward)
        return self.engine.new_sequence(request.prompt_ids, request.params, request.max_new_tokens,
                                        seed=request.seed, on_event=forward)

    def _prefill(self, request: GenerationRequest, tokens: Sequence[int]) -> None:
        """Encoder over the next prompt tokens; the last chunk of a constrained request keeps its logits."""
        began = time.perf_counter()
        last = request.prefilled + len(tokens) == len(request.prompt_ids)
        seq = self._layout.index(request)
        if last and request.constrained:
            logits = self.model.prefill(tokens, return_logits=True, seq=seq)
        else:
            logits = self.model.prefill(tokens, seq=seq)
        request.prefilled += len(tokens)
        seconds = time.perf_counter() - began
        if request.constrained:
            request.sequence.prefill_s += seconds
            request.logits = logits
        else:
            request.sequence.state.prefill_s += seconds

    def _prefill_next_chunk(self, request: GenerationRequest) -> None:
        try:
            start = request.prefilled
            self._prefill(request, request.prompt_ids[start:start + self.prefill_chunk])
            self.stats.prefill_chunks += 1
            if request.prefilled == len(request.prompt_ids):
                self._layout.promote(request, DECODING if request.constrained else DENOISING)
                self._prefilled(request)
        except Exception as err:  # noqa: BLE001
            self._fail(request, err, "prefilling")

    def _prefilled(self, request: GenerationRequest) -> None:
        if not request.constrained:
            request.sequence.start_canvas()

    def _fail(self, request: GenerationRequest, err: Exception, doing: str) -> None:
        """The request ends with its error (a DgError is the request's; anything else a bug, logged)."""
        if request in self._layout:
            self._layout.remove(request)
        if isinstance(err, DgError):
            self._end(request, RequestFailed(str(err)), counted="failed")
            return
        self.log(f"error: internal error {doing} {request.id}: {type(err).__name__}: {err}")
        self._end(request, RequestFailed(f"internal error: {type(err).__name__}: {err}", internal=True),
                  counted="failed")

    def _event_forwarder(self, request: GenerationRequest) -> Callable[[Any], None]:
        def forward(event: Any) -> None:
            if isinstance(event, StepEvent) and not request.want_steps:
                return
            try:
                answer = request.sink(event)
            except Exception as err:  # noqa: BLE001 (a sink's bug ends its request, not the whole batch)
                self.log(f"error: internal error in {request.id}'s events: {type(err).__name__}: {err}")
                request.cancel()
                return
            if answer is False and isinstance(event, (CanvasEvent, TokenEvent)):
                request.stop_requested = True
        return forward

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._layout.requests if r.cancelled]:
            self._release(request)
            self._end(request, RequestFailed("cancelled"), counted="cancelled")

    def _step(self) -> None:
        batch = self._layout.stage(DENOISING)
        self.stats.forwards += 1
        self.stats.canvases_forwarded += len(batch)
        self.stats.max_batch = max(self.stats.max_batch, len(batch))
        self.stats.batch_histogram[len(batch)] = self.stats.batch_histogram.get(len(batch), 0) + 1
        try:
            finished = denoising_step(self.model, [r.sequence for r in batch])
        except DgError as err:
            self._fail_batch(batch, f"the denoising step failed: {err}", internal=True)
            return
        except Exception as err:  # noqa: BLE001 (a bug must not take the server down)
            self._fail_batch(batch, f"internal error in the denoising step: {type(err).__name__}: {err}",
                             internal=True)
            return
        for request, canvas_finished in zip(batch, finished):
            if canvas_finished:
                self._finish_canvas(request)

    def _finish_canvas(self, request: GenerationRequest) -> None:
        seq = request.sequence
        try:
            to_commit = seq.finish_canvas()
            commit_s = 0.0
            if to_commit is not None and not request.cancelled:
                began = time.perf_counter()
                self.model.commit(to_commit, seq=self._layout.index(request))
                commit_s = time.perf_counter() - began
            seq.canvas_done(commit_s)
        except DgError as err:
            self._release(request)
            self._end(request, RequestFailed(f"committing a canvas failed: {err}", internal=True), counted="failed")
            return
        if seq.done or request.stop_requested:
            self._release(request)
            result = seq.result("stop" if request.stop_requested and not seq.done else None)
            self._end(request, RequestDone(result, request.queued_s,
                                           stopped_by_client=request.stop_requested), counted="completed")
        else:
            seq.start_canvas()

    def _decode_token(self, request: GenerationRequest) -> None:
        """One grammar-constrained token: picked from the last forward's logits, then the encoder over it."""
        seq: ConstrainedSequence = request.sequence
        try:
            token = seq.next_token(request.logits, request.forward_s)
            self.stats.constrained_tokens += token is not None
            stop = "stop" if request.stop_requested else None
            if token is not None and stop is None:
                began = time.perf_counter()
                try:
                    request.logits = self.model.prefill([token], return_logits=True, seq=self._layout.index(request))
                    request.forward_s = time.perf_counter() - began
                    return
                except ContextFull:
                    stop = "context_full"
        except Exception as err:  # noqa: BLE001
            self._fail(request, err, "decoding")
            return
        self._release(request)
        self._end(request, RequestDone(seq.result(stop), request.queued_s, stopped_by_client=request.stop_requested),
                  counted="completed")

    def _release(self, request: GenerationRequest) -> None:
        """Free the request's sequence (the others keep theirs: slots.SlotLayout)."""
        self._layout.remove(request)
        if isinstance(request.sequence, ConstrainedSequence):
            request.sequence.close()

    def _fail_batch(self, batch: Sequence[GenerationRequest], message: str, internal: bool) -> None:
        self.log(f"error: {message}")
        for request in batch:
            if request in self._layout:
                self._release(request)
            self._end(request, RequestFailed(message, internal=internal), counted="failed")

    def _fail_everything(self, message: str, shutting_down: bool) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for request in list(self._layout.requests) + waiting:
            self._end(request, RequestFailed(message, internal=True, shutting_down=shutting_down), counted="failed")
        self._layout.requests.clear()

    def _end(self, request: GenerationRequest, outcome: RequestDone | RequestFailed, counted: str) -> None:
        setattr(self.stats, counted, getattr(self.stats, counted) + 1)
        request.logits = None
        try:
            request.sink(outcome)
        except Exception as err:  # noqa: BLE001 (a sink's bug must not stop the other requests)
            if os.environ.get("DG_VERBOSE"):
                print(f"dg serve: a request's sink failed: {err!r}", file=sys.stderr)
        request.sequence = None  # its state refers back to the request (its events' forwarder)
