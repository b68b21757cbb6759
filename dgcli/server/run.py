"""One HTTP request's generations in `dg serve`: a choice per prompt and `n`, each a GenerationRequest
of the scheduler (all queued together, their canvases denoised in the same forwards), and the
events they send back, turned into OpenAI's chunks.

A choice's sink runs on the scheduler's thread: it turns committed canvases (or a constrained
decode's tokens) into text deltas there (AnswerStream, ToolCallStream) and hands them to the event
loop through an asyncio.Queue (call_soon_threadsafe).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from dgcli.engine.rng import SEED_LIMIT
from dgcli.engine.types import CanvasEvent, StepEvent, TokenEvent
from dgcli.server.bodies import (
    ChoiceOutcome,
    chunk_body,
    completion_body,
    created_now,
    dg_field,
    finish_reason,
    new_id,
    step_payload,
    timings,
    usage,
)
from dgcli.server.request import ApiError, CompletionRequest
from dgcli.server.scheduler import GenerationRequest, RequestDone, RequestFailed
from dgcli.server.structured import CONSTRAINED, DIFFUSION
from dgcli.server.text import AnswerStream
from dgcli.server.tools import TOOL_RESPONSE_OPEN, ToolCallStream, parses_tool_calls

if TYPE_CHECKING:
    from dgcli.server.app import DgService


@dataclass
class Delta:
    """Text a choice adds (from a committed canvas or a decoded token)."""

    index: int
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    canvas: dict[str, Any] | None = None  # dg_canvas, when the client asked for dg_steps


@dataclass
class Step:
    index: int
    payload: dict[str, Any]


@dataclass
class Finished:
    index: int
    outcome: ChoiceOutcome


@dataclass
class Failed:
    index: int
    event: RequestFailed


class ChoiceRun:
    """One choice's generation and its text so far."""

    def __init__(self, job: "Job", index: int, prompt_ids: list[int], seed: int | None, grammar: str | None):
        self.job, self.index = job, index
        req = job.req
        tools = parses_tool_calls(req)
        # a model that writes <|tool_response> is waiting for a tool's answer: its turn is over
        stops = list(req.stop) + ([TOOL_RESPONSE_OPEN] if tools else [])
        self.answer = AnswerStream(job.service.detokenizer(req), stop=stops, thinking=req.kind != "completion")
        self.tools = ToolCallStream([t["function"]["name"] for t in req.tools]) if tools else None
        self.decoder = CONSTRAINED if grammar is not None else DIFFUSION
        self.request = GenerationRequest(
            prompt_ids=prompt_ids, params=req.params, max_new_tokens=req.max_new_tokens, seed=seed, sink=self._sink,
            want_steps=req.dg_steps, id=job.rid if job.n_choices == 1 else f"{job.rid}/{index}", grammar=grammar,
            temperature=req.temperature or 0.0)
        self.finished = False

    # ---- the scheduler's thread

    def _sink(self, event: Any) -> Any:
        job = self.job  # None once the job is released (the response is sent): nobody reads this event
        if job is None:
            return None
        if isinstance(event, StepEvent):
            job.put(Step(self.index, step_payload(event, job.service.piece, self.index)))
        elif isinstance(event, (CanvasEvent, TokenEvent)):
            ids = event.token_ids if isinstance(event, CanvasEvent) else [event.token_id]
            reasoning, content = self.answer.feed(ids)
            content, calls = self.tools.feed(content) if self.tools else (content, [])
            canvas = event.to_json() if isinstance(event, CanvasEvent) and job.req.dg_steps else None
            job.put(Delta(self.index, reasoning, content, calls or None, canvas))
            if self.answer.stopped:
                return False  # a stop string: no further canvases or tokens
        elif isinstance(event, RequestDone):
            job.put(Delta(self.index, *self._final_delta()))
            job.put(Finished(self.index, self._outcome(event)))
        elif isinstance(event, RequestFailed):
            job.put(Failed(self.index, event))
        return None

    def _final_delta(self) -> tuple[str, str, list[dict[str, Any]] | None]:
        """What the answer held back until its end (reasoning, content, tool calls)."""
        reasoning, content = self.answer.finish()
        calls: list[dict[str, Any]] = []
        if self.tools:
            more, calls = self.tools.feed(content)
            rest, last = self.tools.finish()
            content, calls = more + rest, calls + last
        return reasoning, content, calls or None

    def _outcome(self, done: RequestDone) -> ChoiceOutcome:
        calls = [{k: v for k, v in c.items() if k != "index"} for c in (self.tools.calls if self.tools else [])]
        return ChoiceOutcome(
            index=self.index, result=done.result, queued_s=done.queued_s,
            finish=finish_reason(done.result.stop_reason, done.stopped_by_client or self.answer.stopped, bool(calls)),
            reasoning=self.answer.reasoning,
            # with tools: the text around the calls, not the calls' own text
            content=self._content_without_calls() if self.tools else self.answer.content,
            completion_tokens=self.answer.stop_tokens, decoder=self.decoder, tool_calls=calls)

    def _content_without_calls(self) -> str:
        splitter = ToolCallStream(self.tools.names)
        text, _ = splitter.feed(self.answer.content)
        rest, _ = splitter.finish()
        return text + rest


class Job:
    """The choices of one request: queued together, waited for together, cancelled together."""

    def __init__(self, service: "DgService", req: CompletionRequest, prompts_ids: list[list[int]],
                 grammar: str | None = None):
        self.service, self.req = service, req
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rid, self.created = new_id(req.kind), created_now()
        self.model_name = service.config.model_name
        self.n_choices = len(prompts_ids) * req.n
        self.n_prompt_tokens = sum(len(ids) for ids in prompts_ids)
        self.choices = [ChoiceRun(self, p * req.n + j, ids, _choice_seed(req.seed, p * req.n + j), grammar)
                        for p, ids in enumerate(prompts_ids) for j in range(req.n)]
        self.outcomes: dict[int, ChoiceOutcome] = {}
        self.done = False

    @property
    def requests(self) -> list[GenerationRequest]:
        return [c.request for c in self.choices]

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is gone (shutdown): nobody is waiting for this request any more

    def release(self, rejected: bool = False) -> None:
        """Drop the references between the choices, their scheduler requests and this job, so that all
        of it (the prompts' token ids first) is freed as soon as the response is sent, not at the
        garbage collector's next full pass. The scheduler may still end a cancelled request: its
        events go nowhere then."""
        for choice in self.choices:
            choice.request.sink = _ignore
            choice.job = None
            if rejected:  # never queued: nobody reads its prompt
                choice.request.prompt_ids = []

    def cancel(self) -> None:
        """The client went away (or one choice failed): the choices still running stop and free their slots."""
        for choice in self.choices:
            if choice.index not in self.outcomes:
                self.service.scheduler.cancel(choice.request)

    def log_done(self, outcome: ChoiceOutcome) -> None:
        r = outcome.result
        canvases = len(r.steps_per_canvas)
        cut = f" ({outcome.n_completion} through the stop string)" if outcome.n_completion != r.n_new_tokens else ""
        where = f"{self.rid}/{outcome.index}" if self.n_choices > 1 else self.rid
        work = (f"{canvases} canvas{'es' if canvases != 1 else ''} {r.decoder_forwards} steps"
                if outcome.decoder == DIFFUSION else f"{r.decoder_forwards} grammar-constrained tokens")
        self.service.log(f"{where}  {r.n_prompt_tokens}+{r.n_new_tokens} tokens{cut}  {work}  {r.total_s:.2f}s "
                         f"(queued {outcome.queued_s:.2f}s)  {outcome.finish}")

    async def events(self) -> AsyncIterator[Step | Delta | Finished | Failed]:
        """Every choice's events until all have finished; a failure is the last event."""
        try:
            while len(self.outcomes) < self.n_choices:
                item = await self.queue.get()
                if isinstance(item, Finished):
                    self.outcomes[item.index] = item.outcome
                    self.log_done(item.outcome)
                yield item
                if isinstance(item, Failed):
                    return
            self.done = True
        finally:
            self.cancel()  # the client went away, or a choice failed: free the other slots

    async def outcome(self) -> list[ChoiceOutcome]:
        """Wait for every choice (non-streaming); a failure becomes an ApiError."""
        async for item in self.events():
            if isinstance(item, Failed):
                raise failure_error(item.event)
        return [self.outcomes[i] for i in sorted(self.outcomes)]

    def body(self, outcomes: list[ChoiceOutcome]) -> dict[str, Any]:
        return completion_body(self.req.kind, self.rid, self.created, self.model_name, outcomes,
                               self.n_prompt_tokens)

    async def _sse(self) -> AsyncIterator[str]:
        """Chat / completions streaming: OpenAI's chunks, then usage (if asked) and [DONE]."""
        req = self.req

        def chunk(**kw: Any) -> str:
            return sse_data(chunk_body(req.kind, self.rid, self.created, self.model_name, **kw))

        if req.kind == "chat":
            for i in range(self.n_choices):
                yield chunk(index=i, role=True)
        async for item in self.events():
            if isinstance(item, Step):
                yield chunk(index=item.index, extra={"dg_step": item.payload})
            elif isinstance(item, Delta):
                extra = {"dg_canvas": dict(item.canvas, choice=item.index)} if item.canvas else None
                if item.reasoning or item.content or item.tool_calls or extra:
                    yield chunk(index=item.index, reasoning=item.reasoning, content=item.content,
                                tool_calls=item.tool_calls, extra=extra)
            elif isinstance(item, Finished):
                yield chunk(index=item.index, finish=item.outcome.finish)
            elif isinstance(item, Failed):
                yield sse_data(failure_error(item.event).body())
                return
        if req.include_usage:
            outcomes = [self.outcomes[i] for i in sorted(self.outcomes)]
            yield chunk(no_choices=True, extra={"usage": usage(outcomes, self.n_prompt_tokens),
                                                "timings": timings(outcomes, self.n_prompt_tokens),
                                                "dg": dg_field(outcomes)})
        yield "data: [DONE]\n\n"

    async def sse(self) -> AsyncIterator[str]:
        try:
            async for text in self._sse():
                yield text
        finally:
            self.release()


def _ignore(event: Any) -> None:
    return None


def _choice_seed(seed: int | None, index: int) -> int | None:
    """A seeded request's choice i draws from seed + i: choice 0 is what `dg generate --seed` gives."""
    return None if seed is None else (seed + index) % SEED_LIMIT


def failure_error(failed: RequestFailed) -> ApiError:
    if failed.shutting_down:  # as a request that arrives once the server is stopping (SchedulerClosed)
        return ApiError(503, failed.message, type="server_error", code="shutting_down")
    if failed.internal:
        return ApiError(500, failed.message, type="server_error")
    return ApiError(400, failed.message)


def sse_data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
