"""The benchmark library behind `dg bench` (usable from scripts and examples/).

Two measurements, the seed write-up's EXP C/D and F made repeatable:
- generation runs: each prompt x repeat on the diffusion model and its AR pair -> tok/s, steps per
  canvas, tokens per forward (median and spread);
- the speed model: the cost of one canvas forward vs one AR decode step on the same weights, the
  speedup that implies as a function of steps per canvas, and that ratio over batch sizes.

Numbers are reported, never judged: nothing here asserts on time.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from dgcli.engine.types import GenerationResult
from dgcli.errors import WORKER_LOST, DgError, WorkerLost
from dgcli.params import DiffusionParams
from dgcli.textfile import read_text_file
from dgcli.units import format_bytes, format_figure


@dataclass(frozen=True)
class BenchPrompt:
    name: str  # prompts sharing a name are summarised together (e.g. one difficulty level)
    text: str
    expected: Optional[str] = None  # the right answer, when the prompt has one: bench reports accuracy


# Like the seed's set (EXP E/F): math, Korean, code, and a trivial smoke prompt.
BUILTIN_PROMPTS: list[BenchPrompt] = [
    BenchPrompt("math", "A train travels 120 km in 1.5 hours. What is its average speed in km/h? Show the steps."),
    BenchPrompt("korean", "한국의 사계절에 대해 세 문장으로 설명해 주세요."),
    BenchPrompt("code", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    BenchPrompt("trivial", "what is 3+5"),
]

# 2: new tokens count answer tokens only (GenerationResult.token_ids); ratios carry their spread
# 3: AR tokens_per_second counts only the answer tokens made after the prefill (null when none were)
BENCH_SCHEMA = "dg-bench/4"
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
SPEEDUP_STEPS = (1, 2, 4, 8, 12, 16, 24, 32, 48)
# the speed model loads one context with a sequence per canvas of the largest batch: llama.cpp refuses
# more than LLAMA_MAX_SEQ (256) sequences, and only when that context is made, after every generation
# run: checked before the first
MAX_BATCH_SIZE = 256


MAX_PROMPT_FILE_BYTES = 16 << 20


def load_prompts(path: Path | str) -> list[BenchPrompt]:
    """One prompt per line: `prompt`, `name<TAB>prompt` or `name<TAB>prompt<TAB>expected answer`;
    blank lines and `#` comments skipped."""
    path = Path(path)
    lines = read_text_file(path, what="prompt file", max_bytes=MAX_PROMPT_FILE_BYTES).splitlines()
    prompts = []
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) == 1:
            fields = [f"prompt-{len(prompts) + 1}", line]
        if len(fields) > 3 or not fields[1].strip():
            raise DgError(f"{path}: expected `prompt`, `name<TAB>prompt` or `name<TAB>prompt<TAB>answer`: {line[:60]!r}")
        expected = fields[2].strip() if len(fields) == 3 else None
        prompts.append(BenchPrompt(fields[0].strip(), fields[1].strip(), expected))
    if not prompts:
        raise DgError(f"prompt file has no prompts: {path}")
    return prompts


def parse_batch_sizes(spec: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise DgError(f"invalid --batch-sizes {spec!r}: expected comma-separated integers like 1,2,4") from None
    if not sizes or sizes[0] < 1:
        raise DgError(f"invalid --batch-sizes {spec!r}: sizes must be integers >= 1")
    if sizes[-1] > MAX_BATCH_SIZE:
        raise DgError(f"invalid --batch-sizes {spec!r}: sizes must be at most {MAX_BATCH_SIZE} (llama.cpp's limit "
                      "of sequences in one context)")
    return sizes


class PeakRss:
    """Peak resident memory of this process while the block runs (polled with psutil)."""

    def __init__(self, interval: float = 0.02):
        import psutil

        self._proc = psutil.Process()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakRss":
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        return False


@dataclass
class BenchConfig:
    diffusion_model: str
    diffusion_path: str
    ar_model: str
    ar_path: str
    repeat: int = 3
    max_new_tokens: int = 256
    seed: int = 0
    params: DiffusionParams = field(default_factory=DiffusionParams)
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES
    speed_model: bool = True
    speed_model_repeat: int = 5
    n_threads: Optional[int] = None
    n_gpu_layers: int = 0
    n_cpu_moe: int = 0  # expert tensors of the first N layers kept in system memory (-1: all)
    rpc_servers: Optional[Sequence[str]] = None  # llama.cpp RPC workers holding the offloaded layers
    # the two files' quantization types (dgcli.modelfile.info.QuantPair.to_json()): {diffusion, autoregressive, match}
    quantization: Optional[dict[str, Any]] = None
    # the self-conditioning width of the diffusion runs and the speed model (None: the engine's default;
    # 0: dense; k: top-k); every run records the form it ran (RunRecord.self_conditioning)
    self_cond_top_k: Optional[int] = None


@dataclass
class RunRecord:
    mode: str  # "diffusion" | "autoregressive"
    prompt: str
    run: int
    n_new_tokens: int
    total_s: float
    tokens_per_second: Optional[float]  # None: every answer token came from the prefill (AR at -n 1)
    tokens_per_forward: float
    decoder_forwards: int
    steps_per_canvas: list[int]
    mean_forward_s: Optional[float]  # mean decoder forward: a canvas forward (diffusion) or one decode (AR); None: none ran
    stop_reason: str
    correct: Optional[bool] = None  # the answer equals the prompt's expected answer (None: no answer given)
    prefill_s: float = 0.0  # tokens_per_second = (n_new_tokens - prefill_answer_tokens) / (total_s - prefill_s)
    prefill_answer_tokens: int = 0  # AR: 1 when its first answer token came from the prefill's logits
    self_conditioning: Optional[str] = None  # diffusion: "dense" or "top-K", the form its steps fed back

    @property
    def mean_steps_per_canvas(self) -> Optional[float]:
        return statistics.fmean(self.steps_per_canvas) if self.steps_per_canvas else None


@dataclass
class Spread:
    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Optional["Spread"]:
        values = [v for v in values if v is not None]
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, digits: int = 2) -> str:
        if self.n == 1 or self.min == self.max:
            return format_figure(self.median, digits)
        return f"{format_figure(self.median, digits)} [{format_figure(self.min, digits)}–{format_figure(self.max, digits)}]"


@dataclass
class PromptSummary:
    mode: str
    prompt: str
    tokens_per_second: Optional[Spread]
    steps_per_canvas: Optional[Spread]
    tokens_per_forward: Optional[Spread]
    new_tokens: Optional[Spread]
    accuracy: Optional[float] = None  # fraction of runs with the expected answer


@dataclass
class BatchPoint:
    batch: int
    canvas_s: Optional[float]  # median
    decode_s: Optional[float]  # median
    ratio: Optional[float]  # median over paired samples (a canvas forward and a decode timed back to back)
    speedup_at_16_steps: Optional[float]
    error: Optional[str] = None
    ratio_min: Optional[float] = None
    ratio_max: Optional[float] = None


@dataclass
class SpeedModel:
    canvas_length: int
    canvas_forward_s: float  # decoder forward over one canvas (median)
    decode_s: float  # one-token forward on the same weights (median)
    commit_s: Optional[float]  # encoder pass appending a canvas to the cache (median)
    ratio: float  # canvas forward / decode: median over paired samples (the batch sweep's batch 1 is this sample)
    speedup_vs_steps: list[dict[str, float]]
    batch_sweep: list[BatchPoint]
    batch_method: str
    ar_pair_decode_s: Optional[float] = None  # the AR pair's own decode step, from the generation runs
    ratio_min: Optional[float] = None
    ratio_max: Optional[float] = None
    canvas_step: str = "decoder forward, logits copied to the host"  # what canvas_forward_s times


@dataclass
class BenchReport:
    config: dict[str, Any]
    runs: list[RunRecord]
    summaries: list[PromptSummary]
    speed_model: Optional[SpeedModel]
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C ended it early: the runs finished before it
    # where llama.cpp put each loaded model's weights (runtime.offload.LoadReport.to_json()), by role:
    # the figures are the devices' these say, not the ones --gpu-layers asked for
    placement: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {
            "schema": BENCH_SCHEMA,
            "interrupted": self.interrupted,
            "config": self.config,
            "placement": self.placement,
            "runs": [asdict(r) | {"mean_steps_per_canvas": r.mean_steps_per_canvas} for r in self.runs],
            "summaries": [asdict(s) for s in self.summaries],
            "speed_model": asdict(self.speed_model) if self.speed_model else None,
            "notes": self.notes,
        }
        return out


def speedup_model(canvas_length: int, canvas_s: float, decode_s: float, commit_s: Optional[float],
                  steps: int) -> float:
    """Implied speedup of one canvas over AR: C decodes vs `steps` canvas forwards (+ the commit pass)."""
    return canvas_length * decode_s / (steps * canvas_s + (commit_s or 0.0))


def total_units(config: BenchConfig, prompts: Sequence[BenchPrompt]) -> int:
    return 2 * len(prompts) * config.repeat + (1 if config.speed_model else 0)


def _record(mode: str, prompt: BenchPrompt, run: int, res: GenerationResult) -> RunRecord:
    correct = None if prompt.expected is None else res.text.strip() == prompt.expected
    return RunRecord(mode=mode, prompt=prompt.name, run=run, n_new_tokens=res.n_new_tokens, total_s=res.total_s,
                     tokens_per_second=res.tokens_per_second, tokens_per_forward=res.tokens_per_forward,
                     decoder_forwards=res.decoder_forwards, steps_per_canvas=list(res.steps_per_canvas),
                     mean_forward_s=res.mean_forward_s, stop_reason=res.stop_reason, correct=correct,
                     prefill_s=res.prefill_s, prefill_answer_tokens=res.prefill_answer_tokens,
                     self_conditioning=res.self_conditioning)


def summarize(runs: Sequence[RunRecord]) -> list[PromptSummary]:
    out = []
    keys = []
    for r in runs:
        if (r.mode, r.prompt) not in keys:
            keys.append((r.mode, r.prompt))
    for mode, prompt in keys:
        rs = [r for r in runs if r.mode == mode and r.prompt == prompt]
        out.append(PromptSummary(
            mode=mode, prompt=prompt,
            tokens_per_second=Spread.of([r.tokens_per_second for r in rs]),
            steps_per_canvas=Spread.of([r.mean_steps_per_canvas for r in rs]) if mode == "diffusion" else None,
            tokens_per_forward=Spread.of([r.tokens_per_forward for r in rs]),
            new_tokens=Spread.of([float(r.n_new_tokens) for r in rs]),
            accuracy=_accuracy(rs),
        ))
    return out


def _accuracy(runs: Sequence[RunRecord]) -> Optional[float]:
    graded = [r.correct for r in runs if r.correct is not None]
    return sum(graded) / len(graded) if graded else None


@dataclass
class _Paired:
    """Canvas-forward and decode times taken in pairs."""

    canvas_times: list[float]
    decode_times: list[float]

    @property
    def canvas_s(self) -> float:
        return statistics.median(self.canvas_times)

    @property
    def decode_s(self) -> float:
        return statistics.median(self.decode_times)

    def ratio(self) -> Optional[Spread]:
        return Spread.of([c / d for c, d in zip(self.canvas_times, self.decode_times) if d > 0])

    def point(self, batch: int, canvas_length: int, error: Optional[str] = None) -> BatchPoint:
        ratio = self.ratio()
        speedup = speedup_model(canvas_length, self.canvas_s, self.decode_s, None, 16) if ratio else None
        return BatchPoint(batch, self.canvas_s, self.decode_s, ratio.median if ratio else None, speedup, error=error,
                          ratio_min=ratio.min if ratio else None, ratio_max=ratio.max if ratio else None)


def _logits_bytes(n_tokens: int, vocab: int) -> int:
    return n_tokens * vocab * 4


def measure_speed_model(model, *, batch_sizes: Sequence[int], repeat: int = 5, seed: int = 0,
                        self_cond_top_k: Optional[int] = None) -> tuple[SpeedModel, list[str]]:
    """Canvas step vs one-token decode on one DiffusionModel (the same weights for both).

    The canvas side is a denoising step as `dg generate` runs it: where the model has the one-graph
    step (`denoise_step`, what the engine's "auto" backend picks), the decoder forward with the
    sampler's per-position pass and the self-conditioning input of a canvas's later steps (the
    engine's form, or `self_cond_top_k`'s: dense or top-k, each also forming the next step's), only
    per-position results leaving the graph; else the decoder forward with its logits copied out.
    Each sample is timed on its second run of that shape, as in a generation, where steps and
    decodes run back to back: the first run of a shape after a prefill is slower than the warm ones a
    generation makes (docs/json.md has the figures).

    With the native multi-sequence forward (`decode_canvases`, up to the model's n_seq_max rows),
    batch b is b canvases in one decoder forward vs b one-token rows in one forward (a batched AR
    decode step, logits included). Without it (or past n_seq_max), batch b is emulated as one causal
    forward over b*C tokens vs b tokens, which prices the compute but not the attention layout.
    """
    import numpy as np
    import psutil

    notes: list[str] = []
    rng = np.random.default_rng(seed)
    C = int(model.canvas_length)
    V = int(model.vocab_size)
    prompt = model.chat_prompt("what is 3+5")
    multi = getattr(model, "decode_canvases", None)
    n_seq_max = int(getattr(model, "n_seq_max", 1) or 1) if callable(multi) else 0

    def fresh() -> None:
        model.reset()
        model.prefill(prompt)

    def tokens(*shape: int):
        return rng.integers(0, V, size=shape).astype(np.int32)

    def timed(fn: Callable[[], Any], reps: int, warm: bool = True) -> float:
        """Median of `reps` samples, each after a fresh prompt; warm: fn's second run (the first builds
        the graph for this shape; fn must leave room in the cache for a second run)."""
        times = []
        for _ in range(reps):
            fresh()
            if warm:
                fn()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def paired(canvas_fn: Callable[[], Any], decode_fn: Callable[[], Any], reps: int, warm: bool = True) -> _Paired:
        """A canvas forward and a decode timed back to back, `reps` times: their ratio comes from
        samples taken under the same load, and is reported with its spread."""
        canvas_times, decode_times = [], []
        for _ in range(reps):
            canvas_times.append(timed(canvas_fn, 1, warm))
            decode_times.append(timed(decode_fn, 1, warm))
        return _Paired(canvas_times, decode_times)

    def one_decode() -> None:
        # the encoder's causal one-token step with its logits: an AR decode on these weights. (The
        # decoder over a one-token row costs the same on a CPU, but more on a GPU: docs/json.md.)
        model.prefill([int(tokens(1)[0])], return_logits=True)

    from dgcli.runtime.self_cond import resolve_self_cond_top_k, self_cond_form

    graph_step = callable(getattr(model, "denoise_step", None))
    # the width the engine would run (an explicit setting, else its default)
    sc_k = resolve_self_cond_top_k(self_cond_top_k, V, exact=bool(getattr(model, "exact", False)))

    def canvas_step(b: int) -> Callable[[], Any]:
        """One denoising step of b canvases in one forward, as the engine runs it (see above), with
        its self-conditioning form: top-k, or dense (the previous step's soft embedding in, this
        step's product out)."""
        if not graph_step:
            return (lambda: model.decode_canvas(tokens(C))) if b == 1 else (lambda: multi(tokens(b, C)))
        if sc_k:
            self_cond = {"sc_topk": (rng.integers(0, V, (b, C, sc_k)).astype(np.int32),
                                     np.full((b, C, sc_k), 1.0 / sc_k, np.float32)), "top_k": sc_k}
        else:
            n_embd = int(model.n_embd)
            self_cond = {"sc_soft": rng.standard_normal((b, C, n_embd)).astype(np.float32), "next_soft": True}
        return lambda: model.denoise_step(tokens(b, C), np.float32(0.6), rng.random((b, C)), **self_cond)

    base = paired(canvas_step(1), one_decode, repeat)
    commit_s = timed(lambda: model.commit(tokens(C)), max(1, repeat // 2))

    if n_seq_max > 1:
        method = f"native multi-sequence forward (decode_canvases, up to {n_seq_max} sequences)"
    else:
        method = ("emulated: no multi-sequence forward loaded; batch b = one causal forward over "
                  "b x canvas tokens (diffusion) vs b tokens (AR) on the same weights")
    points: list[BatchPoint] = []
    budget = psutil.virtual_memory().available // 4
    for b in batch_sizes:
        if _logits_bytes(b * C, V) > budget:
            msg = f"skipped: {b} canvases of logits need {format_bytes(_logits_bytes(b * C, V))}"
            points.append(BatchPoint(b, None, None, None, None, error=msg))
            notes.append(f"batch {b} {msg}")
            continue
        try:
            note = None
            if b == 1:
                sample = base  # batch 1 is the speed model's own sample: one figure, not two
            elif b <= n_seq_max:
                sample = paired(canvas_step(b), lambda: multi(tokens(b, 1)), repeat)
            else:
                # not warmed: a second b x C prefill would need twice the room
                sample = paired(lambda: model.prefill([int(t) for t in tokens(b * C)]),
                                lambda: model.prefill([int(t) for t in tokens(b)]), max(1, repeat // 2), warm=False)
                note = "emulated (past n_seq_max)" if n_seq_max > 1 else None
            points.append(sample.point(b, C, error=note))
        except DgError as err:
            points.append(BatchPoint(b, None, None, None, None, error=str(err)))
            notes.append(f"batch {b} skipped: {err}")
    if n_seq_max <= 1:
        notes.append("batch sweep " + method)
    model.reset()
    canvas_s, decode_s = base.canvas_s, base.decode_s
    curve = [{"steps": s, "speedup": speedup_model(C, canvas_s, decode_s, commit_s, s)} for s in SPEEDUP_STEPS]
    ratio = base.ratio()
    step = ("one-graph step: decoder forward + the sampler's per-position pass, "
            + self_cond_form(sc_k) + " self-conditioning" if graph_step
            else "decoder forward, logits copied to the host")
    return SpeedModel(canvas_length=C, canvas_forward_s=canvas_s, decode_s=decode_s, commit_s=commit_s,
                      ratio=ratio.median if ratio else float("nan"), speedup_vs_steps=curve, batch_sweep=points,
                      batch_method=method, ratio_min=ratio.min if ratio else None,
                      ratio_max=ratio.max if ratio else None, canvas_step=step), notes


def quantization_words(quantization: Optional[dict[str, Any]]) -> Optional[str]:
    """The sentence saying the two files' quantization types differ (None when they match or are unknown)."""
    from dgcli.modelfile.info import QuantPair

    if not quantization:
        return None
    return QuantPair(quantization.get("diffusion"), quantization.get("autoregressive")).mismatch_words()


def run_bench(config: BenchConfig, prompts: Sequence[BenchPrompt], *,
              open_diffusion: Callable[[str], Any], open_ar: Callable[[str], Any],
              open_speed_model: Optional[Callable[[str, int], Any]] = None,
              on_progress: Callable[[str], None] = lambda desc: None) -> BenchReport:
    """Run every prompt `repeat` times on each model (one model loaded at a time), then the speed model.

    `open_speed_model(path, n_seq_max)` loads the diffusion weights for the speed model with room for
    the largest batch (a separate load, after the generation engine is closed); without it the
    generation engine's own model is measured (batch sizes it cannot hold are emulated).
    Ctrl-C ends the bench early: the report holds the runs finished so far, `interrupted=True`.
    """
    runs: list[RunRecord] = []
    notes: list[str] = [words] if (words := quantization_words(config.quantization)) else []
    speed: Optional[SpeedModel] = None
    interrupted = False
    placement: dict[str, Any] = {}

    def record_placement(role: str, model: Any) -> None:
        report = getattr(model, "load_report", None)
        if report is None:
            return
        placement[role] = report.to_json()
        missed = report.offload_missed(config.n_gpu_layers)
        if missed:
            notes.append(f"--gpu-layers {config.n_gpu_layers}: the {role} model ran on the CPU: {missed}")

    def generation_runs(engine: Any, mode: str) -> None:
        for p in prompts:
            for i in range(config.repeat):
                on_progress(f"{mode} {p.name} #{i + 1}")
                if mode == "diffusion":
                    res = engine.generate(p.text, params=config.params, max_new_tokens=config.max_new_tokens,
                                          seed=config.seed + i, self_cond_top_k=config.self_cond_top_k)
                else:
                    res = engine.generate(p.text, max_new_tokens=config.max_new_tokens, seed=config.seed + i)
                if res.stop_reason == WORKER_LOST:  # the worker's own error: see rpc.check_workers
                    raise WorkerLost("an RPC worker was lost")
                if res.interrupted:  # the engine returned what it had: not a complete run
                    raise KeyboardInterrupt
                runs.append(_record(mode, p, i, res))

    try:
        engine = open_diffusion(config.diffusion_path)
        record_placement("diffusion", getattr(engine, "model", None))
        try:
            generation_runs(engine, "diffusion")
            if config.speed_model and open_speed_model is None:
                on_progress("speed model: canvas forward vs one-token decode")
                speed, speed_notes = measure_speed_model(engine.model, batch_sizes=config.batch_sizes,
                                                         repeat=config.speed_model_repeat, seed=config.seed,
                                                         self_cond_top_k=config.self_cond_top_k)
                notes.extend(speed_notes)
        finally:
            engine.close()
        if config.speed_model and open_speed_model is not None:
            on_progress("speed model: canvas forward vs one-token decode")
            model = open_speed_model(config.diffusion_path, max(config.batch_sizes))
            record_placement("speed", model)
            try:
                speed, speed_notes = measure_speed_model(model, batch_sizes=config.batch_sizes,
                                                         repeat=config.speed_model_repeat, seed=config.seed,
                                                         self_cond_top_k=config.self_cond_top_k)
                notes.extend(speed_notes)
            finally:
                if hasattr(model, "close"):
                    model.close()

        ar = open_ar(config.ar_path)
        record_placement("autoregressive", getattr(ar, "model", None))
        try:
            generation_runs(ar, "autoregressive")
        finally:
            ar.close()
    except KeyboardInterrupt:
        interrupted = True
        notes.append("interrupted (Ctrl-C): the report holds the runs finished before it")
    except WorkerLost:
        interrupted = True
        notes.append("an RPC worker was lost: the report holds the runs finished before it")

    if speed is not None:
        ar_decodes = [r.mean_forward_s for r in runs if r.mode == "autoregressive" and r.mean_forward_s is not None]
        speed.ar_pair_decode_s = statistics.median(ar_decodes) if ar_decodes else None
    cfg = asdict(config)
    cfg["params"] = asdict(config.params)
    cfg["batch_sizes"] = list(config.batch_sizes)
    cfg["prompts"] = [asdict(p) for p in prompts]
    return BenchReport(config=cfg, runs=runs, summaries=summarize(runs), speed_model=speed, notes=notes,
                       interrupted=interrupted, placement=placement)


def report_tables(report: BenchReport):
    """Rich tables for `dg bench`, one per concern so each fits 80 columns: speed per prompt, the
    diffusion sampler per prompt, accuracy (graded prompts), then the speed model and its batch sweep.
    Cells are the median, with [min–max] over the runs when they differ."""
    from rich.markup import escape
    from rich.table import Table

    def cell(s: Optional[Spread], digits: int = 2) -> str:
        return s.fmt(digits) if s is not None else "-"

    def count(s: Optional[Spread]) -> str:
        # a median of an even number of runs can fall between two counts: 2.5, not "2"
        def one(v: float) -> str:
            return str(int(v)) if v == int(v) else f"{v:.1f}"
        if s is None:
            return "-"
        return one(s.median) if s.n == 1 or s.min == s.max else f"{one(s.median)} [{one(s.min)}–{one(s.max)}]"

    def pct(value: Optional[float]) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    def table(title: str, *columns: str, caption: Optional[str] = None) -> Table:
        t = Table(title=escape(title), caption=escape(caption) if caption else None)
        for i, col in enumerate(columns):
            # narrow terminals wrap and fold cells; nothing is cut to `diffu…`
            t.add_column(col, justify="left" if i == 0 else "right", overflow="fold")
        return t

    by_prompt: dict[str, dict[str, PromptSummary]] = {}
    for s in report.summaries:
        by_prompt.setdefault(s.prompt, {})[s.mode] = s
    cfg = report.config
    runs = f"{cfg['repeat']} run{'s' if cfg['repeat'] != 1 else ''} per prompt"
    if any(s.tokens_per_second is not None and s.tokens_per_second.n > cfg["repeat"] for s in report.summaries):
        runs += ", every prompt of a row's name together"  # the demo's set: 3 prompts x 3 runs per row
    pair = f"diffusion: {cfg['diffusion_model']}, AR: {cfg['ar_model']}"
    tables = []

    quant = cfg.get("quantization") or {}
    if quant.get("diffusion") or quant.get("autoregressive"):
        pair += f" ({quant.get('diffusion') or '?'} vs {quant.get('autoregressive') or '?'})"
    mismatch = quantization_words(quant)
    speed_caption = pair + "; speedup = diffusion tok/s ÷ AR tok/s" + (f"; {mismatch}" if mismatch else "")
    speed = table(f"tok/s (answer tokens), median [min–max] of {runs}", "prompt", "diffusion", "AR", "speedup",
                  caption=speed_caption)
    partial = False  # a rate or speedup over only some of its row's runs (*)
    forms = sorted({r.self_conditioning for r in report.runs if r.mode == "diffusion" and r.self_conditioning})
    sampler = table("diffusion sampler per prompt", "prompt", "steps/canvas", "tokens/forward", "answer tokens",
                    caption="tokens/forward: answer tokens per decoder forward (AR: 1.00); answer tokens: diffusion/AR"
                            + (f"; self-conditioning: {', '.join(forms)}" if forms else ""))
    graded = any(s.accuracy is not None for s in report.summaries)
    accuracy = table("accuracy (graded prompts)", "prompt", "diffusion", "AR")
    for prompt, modes in by_prompt.items():
        d, a = modes.get("diffusion"), modes.get("autoregressive")
        sp = "-"
        # the medians of the same runs: run i of a prompt on each side, where both have a rate (an AR run whose
        # only token came from the prefill has none; a row of several prompts then divided diffusion's median
        # over all of them by AR's over the others). As compare's: none when a side has no rate, not "0.00x"
        rates = {mode: [r.tokens_per_second for r in report.runs if r.mode == mode and r.prompt == prompt]
                 for mode in ("diffusion", "autoregressive")}
        both = [(dr, ar) for dr, ar in zip(rates["diffusion"], rates["autoregressive"])
                if dr is not None and ar is not None]
        if both:
            d_rate, a_rate = statistics.median(x for x, _ in both), statistics.median(y for _, y in both)
            if d_rate > 0 and a_rate > 0:
                mark = "*" if len(both) < max(map(len, rates.values())) else ""
                partial = partial or bool(mark)
                sp = f"{format_figure(d_rate / a_rate)}x{mark}"
        tok_s = []
        for mode, summary in (("diffusion", d), ("autoregressive", a)):
            rate = summary.tokens_per_second if summary else None
            # a median over only the runs with a rate (the others' only token came from the prefill)
            mark = "*" if rate is not None and rate.n < len(rates[mode]) else ""
            partial = partial or bool(mark)
            tok_s.append(cell(rate, 1) + mark)
        speed.add_row(prompt, *tok_s, sp)
        sampler.add_row(prompt, cell(d.steps_per_canvas if d else None, 1), cell(d.tokens_per_forward if d else None),
                        f"{count(d.new_tokens if d else None)}/{count(a.new_tokens if a else None)}")
        accuracy.add_row(prompt, pct(d.accuracy if d else None), pct(a.accuracy if a else None))
    if partial:
        speed.caption = escape(speed_caption + "; *over only the runs with a tok/s (for the speedup: on both sides)")
    tables += [speed, sampler] + ([accuracy] if graded else [])

    sm = report.speed_model
    if sm is not None:
        def ratio(median: Optional[float], lo: Optional[float], hi: Optional[float]) -> str:
            if median is None:
                return "-"
            if lo is None or hi is None or lo == hi:
                return format_figure(median)
            return f"{format_figure(median)} [{format_figure(lo)}–{format_figure(hi)}]"

        c = table("speed model: one canvas step vs one decode step", "quantity", "value",
                  caption=f"same weights; canvas step: {sm.canvas_step}; each timed warm (the graph built); "
                          "ratio: median [min–max] of paired samples; *for canvases full of answer (C decodes "
                          "vs steps canvas steps + the commit pass)")
        c.add_row(f"canvas step ({sm.canvas_length} tokens)", f"{sm.canvas_forward_s * 1e3:.3f} ms")
        c.add_row("one-token decode", f"{sm.decode_s * 1e3:.3f} ms")
        if sm.commit_s is not None:
            c.add_row("commit pass (encode canvas)", f"{sm.commit_s * 1e3:.3f} ms")
        if sm.ar_pair_decode_s is not None:
            c.add_row("AR pair decode step (from runs)", f"{sm.ar_pair_decode_s * 1e3:.3f} ms")
        c.add_row("canvas / decode cost ratio", ratio(sm.ratio, sm.ratio_min, sm.ratio_max))
        c.add_row("implied speedup at 1 / 4 / 16 steps*",
                  " / ".join(f"{format_figure(p['speedup'])}x" for p in sm.speedup_vs_steps if p["steps"] in (1, 4, 16)))
        measured = [r.mean_steps_per_canvas for r in report.runs if r.mode == "diffusion" and r.mean_steps_per_canvas]
        if measured:
            steps = statistics.median(measured)
            implied = speedup_model(sm.canvas_length, sm.canvas_forward_s, sm.decode_s, sm.commit_s, steps)
            c.add_row(f"implied speedup at the runs' {steps:.1f} steps*", f"{format_figure(implied)}x")
        tables.append(c)
        b = table("batch sweep", "batch", "canvas", "decode", "ratio", "@16 steps",
                  caption=sm.batch_method + "; canvas, decode: one step of `batch` canvases, of `batch` "
                          "one-token rows (not per canvas); batch 1 is the speed model's sample (its decode: "
                          "the encoder's one-token step); @16 steps: the implied speedup without the commit pass")
        for p in sm.batch_sweep:
            if p.ratio is None:
                b.add_row(str(p.batch), "-", "-", "-", p.error or "-")
            else:
                b.add_row(str(p.batch), f"{p.canvas_s * 1e3:.2f} ms", f"{p.decode_s * 1e3:.2f} ms",
                          ratio(p.ratio, p.ratio_min, p.ratio_max), f"{format_figure(p.speedup_at_16_steps)}x")
        tables.append(b)
    return tables
