"""The batch scheduler behind `dg serve`: requests share one model, and the canvases of every request
in flight are denoised together, one decoder forward per step.

One engine thread owns the model (a llama.cpp context is not thread-safe). Requests come from any
thread (`submit`), wait in a bounded queue, and get a KV-cache sequence (a slot) when one is free
and the cache has room for everything they may write; each keeps its own prompt and committed
canvases there, and its own canvas, step counter, self-conditioning, RNG and sampler parameters
(a `DiffusionSequence`). One iteration of the loop:

    admit     queued requests, in order, into free slots: prefill their prompts, start a canvas
    drop      requests whose client went away (cancelled): their slots are freed
    step      `denoising_step` over every active request: ONE decoder forward for all canvases
    finish    requests whose canvas is done commit it (encoder, their own sequence) and go on,
              or end: their result goes to them and their slot to the next request

The model should be loaded with kv_unified=False: each sequence then has its own cache stream, laid
out exactly as a single generation's, and a request's logits are bit-identical to what
`DiffusionEngine.generate` computes alone (tests/test_scheduler.py), whoever shares its forwards.
Prompts are encoded in the chunks a single generation uses (model.ENCODE_CHUNK) for the same reason.
The multi-sequence forward decodes canvas i after sequence i, so the active requests always own
sequences 0..n-1: when one leaves, the last moves into its sequence (a copy of its stream).

A request's events reach its `sink`, called on the engine thread: StepEvent and CanvasEvent as the
engine emits them, then exactly one RequestDone or RequestFailed.
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
from dgcli.engine.types import CanvasEvent, GenerationResult, StepEvent
from dgcli.errors import DgError
from dgcli.params import DiffusionParams
from dgcli.runtime.model import ENCODE_CHUNK
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
    after that canvas (its result then has stop_reason "stop")."""

    prompt_ids: list[int]
    params: DiffusionParams
    max_new_tokens: int
    sink: Sink
    seed: int | None = None
    want_steps: bool = False
    id: str = ""
    submitted_at: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)
    sequence: DiffusionSequence | None = field(default=None, repr=False)
    stop_requested: bool = False
    queued_s: float = 0.0  # from submit to admission
    kv_need: int = 0  # cells this request may occupy: prompt + every canvas it may commit or decode

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
    canvases_forwarded: int = 0  # canvas rows over all forwards (their mean is the batch size)
    max_batch: int = 0
    batch_histogram: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "submitted": self.submitted, "completed": self.completed, "failed": self.failed,
            "cancelled": self.cancelled, "forwards": self.forwards,
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
        self.log = log or (lambda line: None)
        self.stats = SchedulerStats()
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._active: list[GenerationRequest] = []  # request i owns KV-cache sequence i
        self._cond = threading.Condition()
        self._running = True
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="dg-scheduler", daemon=True)
        self._thread.start()

    # ---- any thread ----------------------------------------------------------------------------------

    def kv_need(self, n_prompt: int, max_new_tokens: int) -> int:
        """KV cells a request may hold at once: its prompt, every canvas but the last committed,
        and the canvas being decoded."""
        canvases = math.ceil(validate_max_new_tokens(max_new_tokens) / self.model.canvas_length)
        return n_prompt + canvases * self.model.canvas_length

    def submit(self, request: GenerationRequest) -> GenerationRequest:
        """Queue a request; raises RequestTooLong, QueueFull or SchedulerClosed (nothing queued then)."""
        request.params = request.params.validate()
        request.kv_need = self.kv_need(len(request.prompt_ids), request.max_new_tokens)
        if not request.prompt_ids:
            raise DgError("empty prompt: nothing to condition on")
        if request.kv_need > self.kv_capacity:
            raise RequestTooLong(
                f"this request needs {request.kv_need} tokens of context ({len(request.prompt_ids)} prompt + "
                f"{request.kv_need - len(request.prompt_ids)} for its canvases of {self.model.canvas_length}); "
                f"a request may use {self.kv_capacity} here: shorten the prompt or max_tokens")
        with self._cond:
            if not self._running:
                raise SchedulerClosed("the server is shutting down")
            free_slots = max(0, self.slots - len(self._active))
            waiting = self.n_waiting  # a request cancelled while queued gives its place back at once
            if waiting >= self.max_queue + free_slots:
                starting = min(waiting, free_slots)  # queued, but theirs are the free slots: not the queue
                raise QueueFull(f"the server is busy: {plural(len(self._active) + starting, 'request')} running, "
                                f"{waiting - starting} waiting (queue limit {self.max_queue}); retry later")
            request.id = request.id or f"req-{next(self._ids)}"
            request.submitted_at = time.perf_counter()
            self._waiting.append(request)
            self.stats.submitted += 1
            self._cond.notify_all()
        return request

    def cancel(self, request: GenerationRequest) -> None:
        request.cancel()
        with self._cond:
            self._cond.notify_all()

    @property
    def n_active(self) -> int:
        return len(self._active)

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
            while self._running and not self._active and not self._waiting:
                self._cond.wait()
            if not self._running:
                return False
            admitted = self._take_admissible()
        for request in admitted:
            self._admit(request)
        self._drop_cancelled()
        if self._active:
            self._step()
        return True

    def _take_admissible(self) -> list[GenerationRequest]:
        """Queued requests, in arrival order, that have a slot and room in the cache (called locked).
        The head of the queue is never overtaken, so a long request cannot starve."""
        taken: list[GenerationRequest] = []
        reserved = sum(r.kv_need for r in self._active)
        for request in [r for r in self._waiting if r.cancelled]:  # anywhere in the queue
            self._waiting.remove(request)
            self._end(request, RequestFailed("cancelled"), counted="cancelled")
        while self._waiting:
            head = self._waiting[0]
            if len(self._active) + len(taken) >= self.slots:
                break
            if self.shared_kv and reserved + head.kv_need > self.kv_capacity:
                break
            reserved += head.kv_need
            taken.append(self._waiting.popleft())
        return taken

    def _admit(self, request: GenerationRequest) -> None:
        slot = len(self._active)
        request.queued_s = time.perf_counter() - request.submitted_at
        try:
            seq = self.engine.new_sequence(request.prompt_ids, request.params, request.max_new_tokens,
                                           seed=request.seed, on_event=self._event_forwarder(request))
            self.model.clear_sequence(slot)
            began = time.perf_counter()
            chunk = max(ENCODE_CHUNK, self.model.canvas_length)
            for start in range(0, len(seq.prompt_ids), chunk):
                self.model.prefill(seq.prompt_ids[start:start + chunk], seq=slot)
            seq.state.prefill_s = time.perf_counter() - began
            seq.start_canvas()
        except DgError as err:
            self.model.clear_sequence(slot)
            self._end(request, RequestFailed(str(err)), counted="failed")
            return
        except Exception as err:  # noqa: BLE001 (a bug must not take the server down, as in _step)
            self.log(f"error: internal error admitting {request.id}: {type(err).__name__}: {err}")
            self.model.clear_sequence(slot)
            self._end(request, RequestFailed(f"internal error: {type(err).__name__}: {err}", internal=True),
                      counted="failed")
            return
        request.sequence = seq
        self._active.append(request)

    def _event_forwarder(self, request: GenerationRequest) -> Callable[[Any], None]:
        def forward(event: Any) -> None:
            if isinstance(event, StepEvent) and not request.want_steps:
                return
            if request.sink(event) is False and isinstance(event, CanvasEvent):
                request.stop_requested = True
        return forward

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._active if r.cancelled]:
            self._release(request)
            self._end(request, RequestFailed("cancelled"), counted="cancelled")

    def _step(self) -> None:
        batch = list(self._active)
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
                self.model.commit(to_commit, seq=self._active.index(request))
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

    def _release(self, request: GenerationRequest) -> None:
        """Free the request's sequence; the last active request moves into it (sequences stay 0..n-1)."""
        slot = self._active.index(request)
        last = len(self._active) - 1
        self.model.clear_sequence(slot)
        if slot != last:
            self.model.move_sequence(last, slot)
            self._active[slot] = self._active[last]
        self._active.pop()

    def _fail_batch(self, batch: Sequence[GenerationRequest], message: str, internal: bool) -> None:
        self.log(f"error: {message}")
        for request in batch:
            if request in self._active:
                self._release(request)
            self._end(request, RequestFailed(message, internal=internal), counted="failed")

    def _fail_everything(self, message: str, shutting_down: bool) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for request in list(self._active) + waiting:
            self._end(request, RequestFailed(message, internal=True, shutting_down=shutting_down), counted="failed")
        self._active.clear()

    def _end(self, request: GenerationRequest, outcome: RequestDone | RequestFailed, counted: str) -> None:
        setattr(self.stats, counted, getattr(self.stats, counted) + 1)
        try:
            request.sink(outcome)
        except Exception as err:  # noqa: BLE001 (a sink's bug must not stop the other requests)
            if os.environ.get("DG_VERBOSE"):
                print(f"dg serve: a request's sink failed: {err!r}", file=sys.stderr)
