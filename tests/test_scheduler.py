"""The batch scheduler behind `dg serve` (dgcli/server/scheduler.py), driven as a library.

What must hold: requests in flight together are denoised in ONE decoder forward per step, and each
request's answer is exactly what `DiffusionEngine.generate` gives alone with the same seed, whatever
else is in the batch (other prompts, other sampler parameters, requests that join mid-canvas or
leave early and move the last request into their KV-cache sequence)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from native_helpers import requires_native

from dgcli.engine.types import CanvasEvent, StepEvent
from dgcli.params import DiffusionParams

pytestmark = requires_native

DEMO = Path(__file__).resolve().parents[1] / "dgcli" / "models" / "demo-diffusion.gguf"
WAIT_S = 180  # every wait below is bounded


class Collector:
    """A request's sink: keeps its events; `done` is set by its RequestDone / RequestFailed."""

    def __init__(self, stop_after_canvases: int | None = None, hold_at_first_step: bool = False):
        self.events: list = []
        self.outcome = None
        self.done = threading.Event()
        self.stop_after = stop_after_canvases
        # hold_at_first_step: the scheduler's thread waits in this sink at the request's first step until
        # `release` is set, so that what the test does meanwhile happens while the request is mid-canvas
        self.hold = hold_at_first_step
        self.at_first_step = threading.Event()
        self.release = threading.Event()

    def __call__(self, event):
        from dgcli.server.scheduler import RequestDone, RequestFailed

        if isinstance(event, (RequestDone, RequestFailed)):
            self.outcome = event
            self.done.set()
            return None
        if self.hold and isinstance(event, StepEvent) and not self.at_first_step.is_set():
            self.at_first_step.set()
            assert self.release.wait(WAIT_S), "the test never let the request go on"
        self.events.append(event)
        if isinstance(event, CanvasEvent) and self.stop_after is not None:
            if sum(isinstance(e, CanvasEvent) for e in self.events) >= self.stop_after:
                return False
        return None


def open_scheduler(path, slots, n_ctx=None, self_cond_top_k=None, max_queue=64, kv_unified=False, sampler="auto",
                   exact=False):
    from dgcli.engine.diffusion import DiffusionEngine
    from dgcli.runtime.model import DiffusionModel
    from dgcli.server.scheduler import BatchScheduler

    model = DiffusionModel(str(path), n_seq_max=slots, n_ctx=n_ctx or 512 * slots, kv_unified=kv_unified, exact=exact)
    engine = DiffusionEngine(model, self_cond_top_k=self_cond_top_k, sampler=sampler)
    return BatchScheduler(engine, slots=slots, max_queue=max_queue), model


def solo_results(path, jobs, self_cond_top_k=None, sampler="auto", exact=False):
    """Each job alone through DiffusionEngine.generate (a model of its own, one sequence)."""
    from dgcli.engine.diffusion import DiffusionEngine

    with DiffusionEngine(str(path), self_cond_top_k=self_cond_top_k, sampler=sampler, exact=exact) as engine:
        return [engine.generate(ids, params=params, max_new_tokens=n, seed=seed) for ids, params, n, seed in jobs]


def run_jobs(scheduler, jobs, join_mid_run=False, sinks=None):
    """Submits the jobs at once, or with join_mid_run each after the one before has taken its first step
    (held there until the next is queued: it joins while that one is mid-canvas, on any machine's speed)."""
    from dgcli.server.scheduler import GenerationRequest

    sinks = sinks or [Collector(hold_at_first_step=join_mid_run and k + 1 < len(jobs)) for k in range(len(jobs))]
    requests = []
    before = None
    for (ids, params, n, seed), sink in zip(jobs, sinks):
        requests.append(scheduler.submit(GenerationRequest(prompt_ids=list(ids), params=params, max_new_tokens=n,
                                                           seed=seed, sink=sink, want_steps=True)))
        if before is not None:
            before.release.set()
        if sink.hold:
            assert sink.at_first_step.wait(WAIT_S), "a request never took its first step"
            before = sink
    deadline = time.monotonic() + WAIT_S
    for sink in sinks:
        assert sink.done.wait(max(0.0, deadline - time.monotonic())), "a request did not finish in time"
    return sinks, requests


def run_batched(path, jobs, join_mid_run=False, **open_kwargs):
    """jobs through a fresh scheduler: (sinks, stats, the step backend it used), closed afterwards."""
    scheduler, model = open_scheduler(path, **open_kwargs)
    try:
        sinks, _ = run_jobs(scheduler, jobs, join_mid_run=join_mid_run)
        return sinks, scheduler.stats, scheduler.engine.step_backend
    finally:
        scheduler.close()
        model.close()


def demo_jobs():
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(str(DEMO)) as m:
        prompts = [m.chat_prompt(p) for p in ("reverse: HELLO", "sort: QWERTY", "add: 123+45", "sort: DBCA",
                                              "reverse: WORLD", "sort: ZYX")]
        base = m.default_params
    params = [base, base.replace(max_denoising_steps=20), base, base.replace(t_max=1.0, t_min=0.5),
              base.replace(entropy_bound=0.5), base]
    return [(ids, p, 32, seed) for ids, p, seed in zip(prompts, params, (0, 1, 2, 3, 4, 5))]


def test_batched_answers_equal_solo_generate_on_the_demo():
    jobs = demo_jobs()
    expected = solo_results(DEMO, jobs)
    sinks, stats, _ = run_batched(DEMO, jobs, slots=4)
    for sink, want in zip(sinks, expected):
        got = sink.outcome.result
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.steps_per_canvas == want.steps_per_canvas
        steps = [e for e in sink.events if isinstance(e, StepEvent)]
        assert len(steps) == got.decoder_forwards
    # six requests, four slots: they ran together, more than one canvas per forward
    assert stats.max_batch == 4 and stats.completed == 6
    assert stats.canvases_forwarded == sum(s.outcome.result.decoder_forwards for s in sinks)
    assert stats.forwards < stats.canvases_forwarded


def test_multi_canvas_requests_joining_and_leaving_mid_run_equal_solo(tiny_gguf):
    """Random tiny model: every canvas runs its full step budget, requests need 1-3 canvases, so
    sequences commit canvases, finish early and are moved while others are mid-canvas."""
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(str(tiny_gguf)) as m:
        prompts = [m.tokenize(t) for t in ("alpha", "beta gamma", "delta", "epsilon zeta eta", "theta")]
    params = DiffusionParams(max_denoising_steps=5)
    jobs = [(ids, params.replace(max_denoising_steps=3 + i), n, 10 + i)
            for i, (ids, n) in enumerate(zip(prompts, (48, 16, 40, 32, 16)))]
    expected = solo_results(tiny_gguf, jobs)
    assert max(len(r.steps_per_canvas) for r in expected) >= 2  # the check needs commits
    sinks, stats, _ = run_batched(tiny_gguf, jobs, join_mid_run=True, slots=3)
    for sink, want in zip(sinks, expected):
        assert sink.outcome.result.token_ids == want.token_ids
        assert sink.outcome.result.steps_per_canvas == want.steps_per_canvas
    assert stats.max_batch >= 2


def test_top_k_self_conditioning_batched_equals_solo(tiny_gguf):
    """The sparse self-conditioning form: rows on a canvas's first step ride along with zero probabilities."""
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(str(tiny_gguf)) as m:
        prompts = [m.tokenize(t) for t in ("one", "two three", "four")]
    jobs = [(ids, DiffusionParams(max_denoising_steps=4), n, seed)
            for ids, n, seed in zip(prompts, (32, 16, 32), (7, 8, 9))]
    expected = solo_results(tiny_gguf, jobs, self_cond_top_k=8)
    sinks, _, _ = run_batched(tiny_gguf, jobs, join_mid_run=True, slots=3, self_cond_top_k=8)
    for sink, want in zip(sinks, expected):
        assert sink.outcome.result.token_ids == want.token_ids
    dropped = [e.sc_dropped_mass for e in sinks[0].events if isinstance(e, StepEvent)]
    assert dropped[0] == 0.0 and max(dropped) > 0.0  # the top-k form was really used


@pytest.mark.parametrize("self_cond_top_k", [None, 8])
@pytest.mark.parametrize("batched, solo", [("graph", "native"), ("native", "graph")])
def test_batched_step_backend_equals_solo_on_the_other_backend(tiny_gguf, self_cond_top_k, batched, solo):
    """The server's step on either backend: canvases batched through the one-graph step (each with its
    own temperature, uniforms and self-conditioning, in its own sequence) give what each request gives
    alone with the forward + host sampler, and the other way round. Exact mode: there the two
    backends' softcap is the same libm tanh (elsewhere the graph's is a vectorised one, ~2 ulp)."""
    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(str(tiny_gguf)) as m:
        prompts = [m.tokenize(t) for t in ("one", "two three", "four five six")]
    jobs = [(ids, DiffusionParams(max_denoising_steps=3 + i), n, 20 + i)
            for i, (ids, n) in enumerate(zip(prompts, (32, 16, 32)))]
    expected = solo_results(tiny_gguf, jobs, self_cond_top_k=self_cond_top_k, sampler=solo, exact=True)
    sinks, stats, backend = run_batched(tiny_gguf, jobs, join_mid_run=True, slots=3, self_cond_top_k=self_cond_top_k,
                                        sampler=batched, exact=True)
    assert backend == batched
    for sink, want in zip(sinks, expected):
        got = sink.outcome.result
        assert got.token_ids == want.token_ids and got.steps_per_canvas == want.steps_per_canvas
        assert got.canvas_token_ids == want.canvas_token_ids
    assert stats.max_batch >= 2


def test_a_cancelled_request_frees_its_slot_and_the_others_are_unaffected(tiny_gguf):
    from dgcli.runtime.model import DiffusionModel
    from dgcli.server.scheduler import GenerationRequest, RequestFailed

    with DiffusionModel(str(tiny_gguf)) as m:
        ids = m.tokenize("cancel me")
    params = DiffusionParams(max_denoising_steps=6)
    keep = [(ids, params, 32, 1), (ids, params, 32, 2)]
    expected = solo_results(tiny_gguf, keep)
    scheduler, model = open_scheduler(tiny_gguf, slots=2)
    try:
        victim_sink = Collector()
        victim = scheduler.submit(GenerationRequest(prompt_ids=ids, params=params, max_new_tokens=16 * 25, seed=0,
                                                    sink=victim_sink, want_steps=True))
        deadline = time.monotonic() + WAIT_S
        while not any(isinstance(e, StepEvent) for e in victim_sink.events):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        scheduler.cancel(victim)
        assert victim_sink.done.wait(WAIT_S)
        assert isinstance(victim_sink.outcome, RequestFailed) and victim_sink.outcome.message == "cancelled"
        sinks, _ = run_jobs(scheduler, keep)  # both slots are free again
        assert scheduler.n_active == 0 and model.cached_tokens() == 0
    finally:
        scheduler.close()
        model.close()
    assert [s.outcome.result.token_ids for s in sinks] == [r.token_ids for r in expected]
    assert scheduler.stats.cancelled == 1


def test_a_sink_returning_false_ends_the_request_after_that_canvas(tiny_gguf):
    from dgcli.server.scheduler import RequestDone

    jobs = [([2, 10, 11], DiffusionParams(max_denoising_steps=3), 64, 0)]
    scheduler, model = open_scheduler(tiny_gguf, slots=1)
    try:
        sinks, _ = run_jobs(scheduler, jobs, sinks=[Collector(stop_after_canvases=1)])
    finally:
        scheduler.close()
        model.close()
    outcome = sinks[0].outcome
    assert isinstance(outcome, RequestDone) and outcome.stopped_by_client
    assert len(outcome.result.steps_per_canvas) == 1 and outcome.result.stop_reason in ("stop", "end_token")


def test_queue_limit_and_requests_that_can_never_fit(tiny_gguf):
    from dgcli.server.scheduler import GenerationRequest, QueueFull, RequestTooLong

    scheduler, model = open_scheduler(tiny_gguf, slots=1, n_ctx=256, max_queue=1)
    params = DiffusionParams(max_denoising_steps=48)
    try:
        with pytest.raises(RequestTooLong, match="needs 259 tokens of context .* may use 256"):
            scheduler.submit(GenerationRequest(prompt_ids=[2, 3, 4], params=params, max_new_tokens=256,
                                               sink=Collector()))
        sinks = [Collector() for _ in range(3)]
        requests = [scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=params, max_new_tokens=16 * 8,
                                                       seed=0, sink=s)) for s in sinks[:2]]
        with pytest.raises(QueueFull, match="busy"):
            scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=params, max_new_tokens=16, sink=sinks[2]))
        for r in requests:
            scheduler.cancel(r)
        for s in sinks[:2]:
            assert s.done.wait(WAIT_S)
    finally:
        scheduler.close()
        model.close()


def test_queue_full_counts_the_requests_taking_free_slots_as_running(tiny_gguf):
    # with 2 slots, 1 running and 3 just submitted, the 503 said "1 request running, 3 waiting (queue
    # limit 2)": more waiting than the limit allows; one of the three has the free slot
    from dgcli.server.scheduler import GenerationRequest, QueueFull

    scheduler, model = open_scheduler(tiny_gguf, slots=2, max_queue=2)
    params = DiffusionParams(max_denoising_steps=4)
    in_step, release = threading.Event(), threading.Event()

    def running_sink(event):  # holds the engine thread (no admissions) inside the running request's first step
        if isinstance(event, StepEvent):
            in_step.set()
            release.wait(WAIT_S)

    try:
        scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=params, max_new_tokens=16, seed=0,
                                           sink=running_sink, want_steps=True))
        assert in_step.wait(WAIT_S)
        sinks = [Collector() for _ in range(3)]
        for s in sinks:
            scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=params, max_new_tokens=16, seed=0, sink=s))
        with pytest.raises(QueueFull, match=r"busy: 2 requests running, 2 waiting \(queue limit 2\)"):
            scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=params, max_new_tokens=16, sink=Collector()))
        release.set()
        for s in sinks:
            assert s.done.wait(WAIT_S)
    finally:
        release.set()
        scheduler.close()
        model.close()


def test_a_request_cancelled_while_queued_gives_back_its_place_in_the_queue(tiny_gguf):
    """A client that gave up waiting (a timeout, a closed connection) no longer counts against --queue:
    the next request is queued, not refused with 503, even while the engine is busy in a long step."""
    from dgcli.server.scheduler import GenerationRequest, RequestFailed

    scheduler, model = open_scheduler(tiny_gguf, slots=1, max_queue=2)
    params = DiffusionParams(max_denoising_steps=4)
    in_step, release = threading.Event(), threading.Event()

    def running_sink(event):  # holds the engine thread inside the running request's first step
        if isinstance(event, StepEvent):
            in_step.set()
            release.wait(WAIT_S)

    try:
        running = scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=params, max_new_tokens=16,
                                                     seed=0, sink=running_sink, want_steps=True))
        assert in_step.wait(WAIT_S)
        sinks = [Collector() for _ in range(3)]
        waiting, gave_up = [scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=params, max_new_tokens=16,
                                                               seed=0, sink=s)) for s in sinks[:2]]
        scheduler.cancel(gave_up)
        assert scheduler.n_waiting == 1
        scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=params, max_new_tokens=16, seed=0,
                                           sink=sinks[2]))  # was QueueFull: the cancelled one held a place
        assert scheduler.n_waiting == 2
        release.set()
        for s in sinks:
            assert s.done.wait(WAIT_S)
        assert isinstance(sinks[1].outcome, RequestFailed) and sinks[1].outcome.message == "cancelled"
        assert not isinstance(sinks[0].outcome, RequestFailed) and not isinstance(sinks[2].outcome, RequestFailed)
        scheduler.cancel(running)
    finally:
        release.set()
        scheduler.close()
        model.close()


def test_an_unexpected_error_admitting_a_request_fails_it_and_the_scheduler_goes_on(tiny_gguf):
    """An exception that is no DgError while a request was admitted (its prefill) ended the engine
    thread: every later request was queued for nobody and waited for ever."""
    from dgcli.server.scheduler import GenerationRequest, RequestDone, RequestFailed

    scheduler, model = open_scheduler(tiny_gguf, slots=1)
    params = DiffusionParams(max_denoising_steps=2)
    prefill, calls = model.prefill, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return prefill(*args, **kwargs)

    model.prefill = failing_once
    try:
        sinks = [Collector(), Collector()]
        for s in sinks:
            scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=params, max_new_tokens=16, seed=0, sink=s))
        for s in sinks:
            assert s.done.wait(30), "a request waited for ever"
    finally:
        scheduler.close()
        model.close()
    assert isinstance(sinks[0].outcome, RequestFailed) and sinks[0].outcome.internal
    assert "RuntimeError: a bug" in sinks[0].outcome.message
    assert isinstance(sinks[1].outcome, RequestDone)


def test_a_scheduler_whose_thread_died_refuses_requests_instead_of_queueing_them(tiny_gguf):
    from dgcli.server.scheduler import GenerationRequest, RequestFailed, SchedulerClosed

    scheduler, model = open_scheduler(tiny_gguf, slots=1)
    lines = []
    scheduler.log = lines.append

    def broken():
        raise RuntimeError("a bug outside any request")

    scheduler._drop_cancelled = broken
    try:
        sink = Collector()
        scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=DiffusionParams(max_denoising_steps=2),
                                           max_new_tokens=16, seed=0, sink=sink))
        assert sink.done.wait(30) and isinstance(sink.outcome, RequestFailed)
        scheduler._thread.join(30)
        with pytest.raises(SchedulerClosed):  # a 503, not a request that waits for ever
            scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=DiffusionParams(max_denoising_steps=2),
                                               max_new_tokens=16, seed=0, sink=Collector()))
    finally:
        scheduler.close()
        model.close()
    assert any("RuntimeError: a bug outside any request" in line for line in lines), lines


def test_requests_in_flight_when_the_server_stops_get_a_503_not_a_500(tiny_gguf):
    """Ctrl-C or SIGTERM to dg serve: the requests running or waiting then are told the server is
    shutting down as a 503 (code shutting_down, what a request arriving a moment later gets), not as
    500, the status of the server's own failures."""
    from dgcli.server.scheduler import GenerationRequest, RequestFailed

    scheduler, model = open_scheduler(tiny_gguf, slots=1)
    params = DiffusionParams(max_denoising_steps=48)
    try:
        sinks = [Collector(), Collector()]  # one running, one waiting
        for s in sinks:
            scheduler.submit(GenerationRequest(prompt_ids=[2, 3], params=params, max_new_tokens=16 * 30, seed=3,
                                               sink=s, want_steps=True))
        deadline = time.monotonic() + WAIT_S
        while not any(isinstance(e, StepEvent) for e in sinks[0].events):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        scheduler.close()
        for s in sinks:
            assert s.done.wait(WAIT_S)
    finally:
        scheduler.close()
        model.close()
    for s in sinks:
        assert isinstance(s.outcome, RequestFailed) and s.outcome.shutting_down, s.outcome
    pytest.importorskip("starlette")
    from dgcli.server.run import failure_error

    error = failure_error(sinks[0].outcome)
    assert (error.status, error.body()["error"]["code"]) == (503, "shutting_down")


def test_requests_wait_for_kv_room_instead_of_overflowing(tiny_gguf):
    """A unified cache (shared cells) with two slots but room for one long request: the second
    waits, then runs; both equal solo."""
    params = DiffusionParams(max_denoising_steps=3)
    jobs = [([2, 5, 6, 7], params, 16 * 9, 3), ([2, 8, 9], params, 16 * 9, 4)]
    expected = solo_results(tiny_gguf, jobs)
    scheduler, model = open_scheduler(tiny_gguf, slots=2, n_ctx=256, kv_unified=True)
    assert model.n_ctx == 256 and scheduler.kv_capacity == 256
    try:
        sinks, _ = run_jobs(scheduler, jobs)
    finally:
        scheduler.close()
        model.close()
    assert [s.outcome.result.token_ids for s in sinks] == [r.token_ids for r in expected]
    assert scheduler.stats.max_batch == 1  # never both at once: 2 x 148 cells > 256
    assert sinks[1].outcome.queued_s > 0


def test_per_sequence_forward_is_bit_identical_to_each_sequence_alone(tiny_gguf):
    """The model API the scheduler stands on: with a stream per sequence, canvas s decoded after
    sequence s's own cache in a shared forward gives exactly the logits of a model holding that
    sequence alone; a zero-probability self-conditioning row equals none; a moved sequence decodes
    as before. (Default mode: flash attention and an F16 cache, whose sums depend on cell order.)"""
    from dgcli.runtime.model import DiffusionModel
    from dgcli.runtime.self_cond import SelfCond, batched_self_cond

    rng = np.random.default_rng(0)
    C, V = 16, 500
    prompts = [rng.integers(5, V, size=n) for n in (7, 20, 3)]
    committed = rng.integers(5, V, size=C)
    canvases = rng.integers(0, V, size=(3, C))
    sc = SelfCond(logits=rng.standard_normal((C, V)).astype(np.float32))
    with DiffusionModel(str(tiny_gguf), n_seq_max=3, n_ctx=3 * 256, kv_unified=False) as m:
        assert (m.canvas_length, m.vocab_size) == (C, V)
        for s, p in enumerate(prompts):
            m.prefill(p, seq=s)
        m.commit(committed, seq=1)
        plain = m.decode_canvases(canvases, per_sequence=True)
        mixed = m.decode_canvases(canvases, per_sequence=True, **batched_self_cond([None, sc, None]))
        assert [m.cached_tokens(s) for s in range(3)] == [7, 20 + C, 3]  # forwards leave the caches as they were
        m.move_sequence(2, 0)
        moved = m.decode_canvas(canvases[2])
        assert [m.cached_tokens(s) for s in range(3)] == [3, 20 + C, 0]
    alone_plain, alone_mixed = [], []
    for s in range(3):
        with DiffusionModel(str(tiny_gguf), n_ctx=256) as one:
            one.prefill(prompts[s])
            if s == 1:
                one.commit(committed)
            alone_plain.append(one.decode_canvas(canvases[s]))
            alone_mixed.append(one.decode_canvas(canvases[s], sc.logits if s == 1 else None))
    for s in range(3):
        np.testing.assert_array_equal(plain[s], alone_plain[s])
        np.testing.assert_array_equal(mixed[s], alone_mixed[s])
    np.testing.assert_array_equal(moved, alone_plain[2])


def test_a_long_prompt_is_prefilled_a_chunk_at_a_time_between_the_other_requests_steps(tiny_gguf):
    """A prompt of several encoder chunks held up every running request for its whole prefill; now
    one chunk runs per iteration, between the steps of the others, and both answers are unchanged."""
    from dgcli.server.scheduler import GenerationRequest

    params = DiffusionParams(max_denoising_steps=4)
    long_ids = [2] + [10 + i % 50 for i in range(3 * 512 + 100)]  # four chunks of 512
    jobs = [([2, 5, 6], params, 16 * 8, 1), (long_ids, params, 16, 2)]
    expected = solo_results(tiny_gguf, jobs)
    scheduler, model = open_scheduler(tiny_gguf, slots=2, n_ctx=2 * 2560)
    timeline = []  # ("step", request) and ("chunk", n tokens), in the order the engine thread ran them
    prefill = model.prefill

    def logged_prefill(tokens, *args, **kwargs):
        timeline.append(("chunk", len(tokens)))
        return prefill(tokens, *args, **kwargs)

    model.prefill = logged_prefill
    running, long_sink = Collector(), Collector()

    def running_sink(event):
        if isinstance(event, StepEvent):
            timeline.append(("step", "running"))
        return running(event)

    try:
        first = scheduler.submit(GenerationRequest(prompt_ids=jobs[0][0], params=params, max_new_tokens=jobs[0][2],
                                                   seed=1, sink=running_sink, want_steps=True))
        deadline = time.monotonic() + WAIT_S
        while ("step", "running") not in timeline:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        scheduler.submit(GenerationRequest(prompt_ids=long_ids, params=params, max_new_tokens=16, seed=2,
                                           sink=long_sink))
        for sink in (running, long_sink):
            assert sink.done.wait(WAIT_S)
    finally:
        scheduler.close()
        model.close()
    assert running.outcome.result.token_ids == expected[0].token_ids
    assert long_sink.outcome.result.token_ids == expected[1].token_ids
    chunks = [i for i, (kind, n) in enumerate(timeline) if kind == "chunk" and n != len(jobs[0][0])]
    assert [timeline[i][1] for i in chunks] == [512, 512, 512, 101], timeline
    steps_between = [kind for kind, _ in timeline[chunks[0]:chunks[-1]] if kind == "step"]
    assert len(steps_between) >= 3, timeline  # a step of the running request after each chunk
    assert scheduler.stats.prefill_chunks == 4


def test_a_grammar_constrained_request_decodes_beside_canvases_and_conforms(tiny_gguf):
    """Structured output: a request with a grammar is decoded token by token through the encoder, in
    the same iterations as the other requests' canvases; its text is what the grammar allows, the
    same alone or batched, and the canvases' answers are unchanged."""
    import json as json_module

    from dgcli.engine.grammar import json_schema_grammar
    from dgcli.server.scheduler import GenerationRequest, RequestDone

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    grammar = json_schema_grammar(schema)
    params = DiffusionParams(max_denoising_steps=3)
    diffusion_jobs = [([2, 5, 6], params, 32, 4), ([2, 7, 8, 9], params, 16, 5)]
    expected = solo_results(tiny_gguf, diffusion_jobs)

    def constrained(sink):
        return GenerationRequest(prompt_ids=[2, 11, 12], params=params, max_new_tokens=64, seed=0, sink=sink,
                                 grammar=grammar)

    outcomes = []
    for together in (False, True):
        scheduler, model = open_scheduler(tiny_gguf, slots=3)
        try:
            sinks = [Collector() for _ in range(3)]
            scheduler.submit(constrained(sinks[0]))
            if together:
                for (ids, p, n, seed), sink in zip(diffusion_jobs, sinks[1:]):
                    scheduler.submit(GenerationRequest(prompt_ids=ids, params=p, max_new_tokens=n, seed=seed,
                                                       sink=sink))
            for sink in sinks[:3 if together else 1]:
                assert sink.done.wait(WAIT_S)
        finally:
            scheduler.close()
            model.close()
        outcomes.append(sinks)
    alone, batched = outcomes[0][0].outcome, outcomes[1][0].outcome
    assert isinstance(batched, RequestDone) and batched.result.mode == "autoregressive"
    value = json_module.loads(batched.result.text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    assert batched.result.stop_reason == "end_token"
    assert batched.result.token_ids == alone.result.token_ids
    tokens = [e.token_id for e in outcomes[1][0].events]
    assert tokens == batched.result.token_ids  # one TokenEvent per token
    for sink, want in zip(outcomes[1][1:], expected):
        assert sink.outcome.result.token_ids == want.token_ids


def test_a_sink_that_raises_ends_its_own_request_not_the_batch(tiny_gguf):
    """A request's event handler that failed mid-step (a client's job released while its events were
    being delivered) raised out of the shared forward's step and failed every request in the batch."""
    from dgcli.server.scheduler import GenerationRequest, RequestDone, RequestFailed

    params = DiffusionParams(max_denoising_steps=4)
    keep = ([2, 5, 6], params, 32, 1)
    expected = solo_results(tiny_gguf, [keep])[0]
    scheduler, model = open_scheduler(tiny_gguf, slots=2)
    lines = []
    scheduler.log = lines.append
    broken_outcome = Collector()

    def broken(event):
        if isinstance(event, StepEvent):
            raise AttributeError("'NoneType' object has no attribute 'put'")
        return broken_outcome(event)

    try:
        good = Collector()
        scheduler.submit(GenerationRequest(prompt_ids=[2, 7, 8], params=params, max_new_tokens=32, seed=2,
                                           sink=broken, want_steps=True))
        scheduler.submit(GenerationRequest(prompt_ids=keep[0], params=params, max_new_tokens=32, seed=1, sink=good,
                                           want_steps=True))
        assert good.done.wait(WAIT_S) and broken_outcome.done.wait(WAIT_S)
    finally:
        scheduler.close()
        model.close()
    assert isinstance(good.outcome, RequestDone) and good.outcome.result.token_ids == expected.token_ids
    assert isinstance(broken_outcome.outcome, RequestFailed) and broken_outcome.outcome.message == "cancelled"
    assert any("internal error in req-1's events: AttributeError" in line for line in lines), lines
