"""dg bench's prompt sets: graded prompts (with an expected answer) give accuracy per prompt name."""

from __future__ import annotations

import pytest

from dgcli import bench
from dgcli.engine.types import GenerationResult
from dgcli.errors import DgError
from dgcli.registry import Registry


def test_prompt_file_forms(tmp_path):
    path = tmp_path / "p.tsv"
    path.write_text("# comment\nplain prompt\nnamed\tnamed prompt\ngraded\tsort: BA\tAB\n\n", encoding="utf-8")
    prompts = bench.load_prompts(path)
    assert [(p.name, p.text, p.expected) for p in prompts] == [
        ("prompt-1", "plain prompt", None), ("named", "named prompt", None), ("graded", "sort: BA", "AB")]
    bad = tmp_path / "bad.tsv"
    bad.write_text("a\tb\tc\td\n", encoding="utf-8")
    with pytest.raises(DgError, match="name<TAB>prompt<TAB>answer"):
        bench.load_prompts(bad)


def _result(text: str) -> GenerationResult:
    return GenerationResult(mode="diffusion", text=text, token_ids=[5] * len(text), n_prompt_tokens=3,
                            steps_per_canvas=[2], decoder_forwards=2, tokens_per_forward=1.5, total_s=1.0)


def test_accuracy_is_per_prompt_name_over_all_its_prompts_and_runs():
    prompts = [bench.BenchPrompt("sort-2", "sort: BA", "AB"), bench.BenchPrompt("sort-2", "sort: DC", "CD"),
               bench.BenchPrompt("free", "hello")]
    answers = {"sort: BA": "AB", "sort: DC": "DD", "hello": "hi"}
    runs = [bench._record("diffusion", p, i, _result(answers[p.text])) for p in prompts for i in range(2)]
    summaries = {s.prompt: s for s in bench.summarize(runs)}
    assert summaries["sort-2"].accuracy == 0.5
    assert summaries["free"].accuracy is None
    tables = bench.report_tables(bench.BenchReport(
        config={"repeat": 2, "diffusion_model": "d", "ar_model": "a"}, runs=runs,
        summaries=list(summaries.values()), speed_model=None))
    accuracy = [t for t in tables if str(t.title).startswith("accuracy")][0]
    assert [c.header for c in accuracy.columns] == ["prompt", "diffusion", "AR"]
    assert [list(c.cells) for c in accuracy.columns][1:] == [["50%", "-"], ["-", "-"]]


def test_the_demo_declares_its_own_graded_prompt_set():
    entry = Registry.load().get("demo")
    prompts = bench.load_prompts(entry.bench_prompts)
    assert prompts and all(p.expected for p in prompts)
    assert {p.name.split("-")[0] for p in prompts} == {"reverse", "sort", "nato", "json", "help", "unknown"}
    assert Registry.load().get("diffusiongemma-26b").bench_prompts is None


def _tables(runs, speed_model=None, repeat=2):
    return {str(t.title): t for t in bench.report_tables(bench.BenchReport(
        config={"repeat": repeat, "diffusion_model": "d", "ar_model": "a"}, runs=runs,
        summaries=bench.summarize(runs), speed_model=speed_model))}


def _column(table, header):
    return [list(c.cells) for c in table.columns if c.header == header][0]


def test_answer_tokens_median_between_two_counts_is_not_rounded_to_either():
    # two runs of 2 and 3 answer tokens: the median is 2.5 (the table showed "2 [2–3]", Python's
    # round-half-to-even), AR's 4 and 4 stay a plain count
    p = bench.BenchPrompt("p", "sort: BA")
    runs = [bench._record("diffusion", p, 0, _result("ab")), bench._record("diffusion", p, 1, _result("abc")),
            bench._record("autoregressive", p, 0, _result("abcd")), bench._record("autoregressive", p, 1, _result("abcd"))]
    sampler = _tables(runs)["diffusion sampler per prompt"]
    assert _column(sampler, "answer tokens") == ["2.5 [2–3]/4"]


def _timed(text: str, total_s: float, mode: str = "diffusion") -> GenerationResult:
    r = _result(text)
    r.mode, r.total_s = mode, total_s
    return r


def test_slow_rates_and_small_speedups_are_not_rounded_to_zero():
    # 3 answer tokens in 75 s (a 26B canvas on a CPU) is 0.04 tok/s: the table said "0.0", and its
    # speedup over 40 tok/s "0.00x"
    p = bench.BenchPrompt("math", "2+2?")
    runs = [bench._record("diffusion", p, 0, _timed("abc", 75.0)),
            bench._record("autoregressive", p, 0, _timed("abcd", 0.1, "autoregressive"))]
    speed = [t for t in _tables(runs, repeat=1).values() if str(t.title).startswith("tok/s")][0]
    assert _column(speed, "diffusion") == ["0.040"]
    assert _column(speed, "AR") == ["40.0"]
    assert _column(speed, "speedup") == ["0.0010x"]


def test_ar_pair_decode_step_is_the_mean_decode_not_spread_over_the_prefills_token(monkeypatch):
    # -n 1: the AR side's only token comes from the prefill and no decode runs; the speed model's
    # "AR pair decode step (from runs)" read 0.000 ms (runs' mean_forward_s 0.0)
    p = bench.BenchPrompt("p", "x")
    one = GenerationResult(mode="autoregressive", text="a", token_ids=[5], n_prompt_tokens=3, decoder_forwards=1,
                           tokens_per_forward=1.0, total_s=0.1, forward_s=0.0, timed_forwards=0, stop_reason="length")
    four = GenerationResult(mode="autoregressive", text="abcd", token_ids=[5] * 4, n_prompt_tokens=3,
                            decoder_forwards=4, tokens_per_forward=1.0, total_s=0.1, forward_s=0.03, timed_forwards=3,
                            stop_reason="length")
    assert bench._record("autoregressive", p, 0, one).mean_forward_s is None
    assert bench._record("autoregressive", p, 0, four).mean_forward_s == pytest.approx(0.01)
    diffusion = bench._record("diffusion", p, 0, _result("ab"))  # forward_s over its 2 steps
    assert diffusion.mean_forward_s == 0.0

    class Engine:
        def __init__(self, results):
            self.results, self.model = iter(results), None

        def generate(self, *a, **k):
            return next(self.results)

        def close(self):
            pass

    speed = bench.SpeedModel(canvas_length=4, canvas_forward_s=1.0, decode_s=0.5, commit_s=None, ratio=2.0,
                             speedup_vs_steps=[], batch_sweep=[], batch_method="-")
    monkeypatch.setattr(bench, "measure_speed_model", lambda model, **kw: (speed, []))
    config = bench.BenchConfig("d", "d.gguf", "a", "a.gguf", repeat=2, speed_model=True)
    report = bench.run_bench(config, [p], open_diffusion=lambda path: Engine([_result("a"), _result("a")]),
                             open_ar=lambda path: Engine([one, four]), open_speed_model=lambda path, n: object())
    assert report.speed_model is not None
    assert report.speed_model.ar_pair_decode_s == pytest.approx(0.01)


def test_speedup_is_none_when_either_side_produced_no_answer_tokens():
    # compare says "n/a" for either side; bench said "0.00x" when diffusion's median run had no tokens
    p = bench.BenchPrompt("p", "x")
    runs = [bench._record("diffusion", p, 0, _timed("", 1.0)),
            bench._record("autoregressive", p, 0, _timed("abcd", 0.1, "autoregressive")),
            bench._record("diffusion", bench.BenchPrompt("q", "y"), 0, _timed("ab", 1.0)),
            bench._record("autoregressive", bench.BenchPrompt("q", "y"), 0, _timed("", 0.1, "autoregressive"))]
    speed = [t for t in _tables(runs, repeat=1).values() if str(t.title).startswith("tok/s")][0]
    assert _column(speed, "speedup") == ["-", "-"]


def test_the_batch_sweep_says_its_times_are_whole_batches():
    # "canvas fwd 27.30 ms" at batch 4 is one forward of four canvases; nothing said so
    speed = bench.SpeedModel(canvas_length=4, canvas_forward_s=0.007, decode_s=0.001, commit_s=None, ratio=7.0,
                             speedup_vs_steps=[], batch_method="native",
                             batch_sweep=[bench.BatchPoint(4, 0.0273, 0.002, 13.6, 0.5)])
    sweep = _tables([], speed_model=speed)["batch sweep"]
    assert _column(sweep, "canvas") == ["27.30 ms"]
    assert "one step of `batch` canvases" in " ".join(str(sweep.caption).split())


def test_a_run_record_holds_what_its_tok_s_divides_by():
    # tokens_per_second divides by the time after the prefill, but a run's record had only total_s:
    # 8 tokens in 2 s read 8 tok/s in the JSON, with nothing to check it against
    r = GenerationResult(mode="diffusion", text="x", token_ids=[5] * 8, n_prompt_tokens=3, steps_per_canvas=[2],
                         decoder_forwards=2, tokens_per_forward=4.0, prefill_s=1.0, total_s=2.0)
    doc = bench.BenchReport(config={}, runs=[bench._record("diffusion", bench.BenchPrompt("p", "x"), 0, r)],
                            summaries=[], speed_model=None).to_json()["runs"][0]
    assert doc["tokens_per_second"] == 8.0
    assert doc["n_new_tokens"] / (doc["total_s"] - doc["prefill_s"]) == doc["tokens_per_second"]


def test_the_speed_title_says_when_a_row_holds_more_than_one_prompt():
    # the demo's set has 3 prompts per name: each row's median is over 9 runs, titled "of 3 runs per prompt"
    runs = [bench._record(mode, bench.BenchPrompt("sort-2", text), i, _timed("ab", 1.0, mode))
            for mode in ("diffusion", "autoregressive") for text in ("sort: BA", "sort: DC") for i in range(3)]
    title = [t.replace("\\[", "[") for t in _tables(runs, repeat=3) if t.startswith("tok/s")][0]
    assert title == "tok/s (answer tokens), median [min–max] of 3 runs per prompt, every prompt of a row's name together"
    one = runs[:3] + runs[6:9]  # one prompt: 3 runs per row
    assert [t.replace("\\[", "[") for t in _tables(one, repeat=3) if t.startswith("tok/s")][0] == \
        "tok/s (answer tokens), median [min–max] of 3 runs per prompt"


def _ar_answer(n_tokens: int, total_s: float) -> GenerationResult:
    """An AR answer of n_tokens after a 5 ms prefill, its first token from the prefill's logits."""
    return GenerationResult(mode="autoregressive", text="a" * n_tokens, token_ids=[5] * n_tokens, n_prompt_tokens=3,
                            decoder_forwards=n_tokens, tokens_per_forward=1.0, total_s=total_s, prefill_s=0.005,
                            stop_reason="end_token", timed_forwards=n_tokens, prefill_answer_tokens=1)


def test_a_row_s_speedup_divides_the_medians_of_the_same_runs():
    # a row of two prompts where AR's answer to one is a single token (from the prefill: no tok/s): the
    # speedup divided diffusion's median over both prompts (slow 1-token runs included) by AR's over the
    # other prompt alone, 0.26x where the same runs give 0.50x
    short, long = bench.BenchPrompt("x", "sort: A"), bench.BenchPrompt("x", "reverse: ABCDEFGH")
    one, eight = _ar_answer(1, 0.01), _ar_answer(8, 0.015)  # no tok/s; 700 tok/s
    runs = [bench._record("diffusion", short, i, _timed("a", 0.02)) for i in range(3)]  # 50 tok/s
    runs += [bench._record("diffusion", long, i, _timed("abcdefgh", 0.0228)) for i in range(3)]  # 350.9 tok/s
    runs += [bench._record("autoregressive", short, i, one) for i in range(3)]
    runs += [bench._record("autoregressive", long, i, eight) for i in range(3)]
    assert [r.tokens_per_second for r in runs[6:9]] == [None] * 3
    speed = [t for t in _tables(runs, repeat=3).values() if str(t.title).startswith("tok/s")][0]
    assert _column(speed, "AR") == ["700.0*"]
    assert _column(speed, "speedup") == ["0.50x*"]
    assert "*over only the runs with a tok/s (for the speedup: on both sides)" in str(speed.caption)
    # every run with a rate on both sides: a plain speedup, no mark
    full = runs[3:6] + runs[9:12]
    speed = [t for t in _tables(full, repeat=3).values() if str(t.title).startswith("tok/s")][0]
    assert _column(speed, "speedup") == ["0.50x"] and "*" not in str(speed.caption)


def test_a_tok_s_cell_over_only_some_of_its_row_s_runs_says_so():
    # the title says "median of 3 runs per prompt, every prompt of a row's name together", but AR's
    # cell for a row of two prompts, one answered with the prefill's token alone, was over 3 of its 6 runs
    short, long = bench.BenchPrompt("x", "sort: A"), bench.BenchPrompt("x", "reverse: ABCD")
    one, four = _ar_answer(1, 0.01), _ar_answer(4, 0.011)  # no tok/s; 500 tok/s
    runs = [bench._record("diffusion", p, i, _timed("abcd", 0.04)) for p in (short, long) for i in range(3)]
    runs += [bench._record("autoregressive", p, i, r) for p, r in ((short, one), (long, four)) for i in range(3)]
    speed = [t for t in _tables(runs, repeat=3).values() if str(t.title).startswith("tok/s")][0]
    assert _column(speed, "diffusion") == ["100.0"]  # every run has a rate: no mark
    assert _column(speed, "AR") == ["500.0*"]
    assert "*over only the runs with a tok/s" in str(speed.caption)


class _ClockedModel:
    """A diffusion model on a fake clock: a call costs its warm time, plus 100 when its shape differs
    from the previous call's (a graph rebuilt, as llama.cpp does between shapes)."""

    canvas_length, vocab_size, n_seq_max, n_embd = 4, 50, 2, 8  # the default: dense self-conditioning
    WARM = {"denoise_step": 3.0, "decode_canvas": 7.0, "decode_canvases": 1.0, "prefill": 0.5, "commit": 2.0}

    def __init__(self, graph_step: bool):
        self.now, self.last = 0.0, None
        if not graph_step:
            self.denoise_step = None

    def _call(self, name, shape=()):
        self.now += self.WARM[name] + (100.0 if (name, shape) != self.last else 0.0)
        self.last = (name, shape)

    def chat_prompt(self, text):
        return [2, 3, 4]

    def reset(self):
        pass

    def prefill(self, tokens, return_logits=False):
        self._call("prefill", (len(tokens), return_logits))

    def commit(self, canvas):
        self._call("commit")

    def decode_canvas(self, canvas, sc_logits=None, sc_topk=None):
        self._call("decode_canvas")

    def decode_canvases(self, canvases, sc_logits=None, sc_topk=None):
        self._call("decode_canvases", canvases.shape)

    def denoise_step(self, canvases, temperatures, uniforms, sc_topk=None, sc_soft=None, top_k=0, next_soft=False):
        # a later step's self-conditioning input, and the next step's made in the same graph
        assert (sc_topk is None) != (sc_soft is None) and bool(top_k) == (sc_topk is not None) != next_soft
        self._call("denoise_step", canvases.shape)


@pytest.mark.parametrize("graph_step", [True, False])
def test_the_speed_model_times_warm_steps_as_the_engine_runs_them(monkeypatch, graph_step):
    # On an H200 the one-token decoder row read 17.4 ms as the first run after a prefill, 13.0 ms
    # warm, and the canvas side was the forward with its 268 MB of logits copied out, 1.9x the
    # one-graph step the engine runs: the ratio read 8.0 where it is 14. (The decode side is now the
    # encoder's causal one-token step, 4.9 ms there.)
    model = _ClockedModel(graph_step)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: model.now)
    speed, notes = bench.measure_speed_model(model, batch_sizes=[1, 2], repeat=3)
    canvas = 3.0 if graph_step else 7.0
    # the decode side of the speed model's sample: the encoder's one-token step (an AR decode)
    assert (speed.canvas_forward_s, speed.decode_s, speed.commit_s, speed.ratio) == (canvas, 0.5, 2.0, canvas / 0.5)
    assert speed.batch_sweep[1].canvas_s == (3.0 if graph_step else 1.0) and speed.batch_sweep[1].decode_s == 1.0
    assert speed.canvas_step.startswith("one-graph step" if graph_step else "decoder forward, logits")
