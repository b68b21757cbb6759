"""Rich tables for `dg bench`'s report (dgcli.bench.BenchReport): one per concern so that each fits
80 columns."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Optional

from rich.markup import escape

from dgcli.bench import BenchReport, PromptSummary, Spread, quantization_words, speedup_model, summarize
from dgcli.units import format_figure


def prompts_table(prompts: list[dict], table):
    """The prompts a file gave (name, text, expected answer), as the tables below name them."""
    t = table("prompts", "name", "prompt", *(["answer"] if any(p.get("expected") for p in prompts) else []))
    for column in t.columns:
        column.justify = "left"
    for p in prompts:
        t.add_row(escape(p["name"]), escape(p["text"]), *([escape(p.get("expected") or "-")] if len(t.columns) > 2 else []))
    return t


# the aggregate row's name: every run of every prompt together
ALL_PROMPTS = "all prompts"


def report_tables(report: BenchReport, show_prompts: bool = False):
    """Rich tables for `dg bench`, one per concern so each fits 80 columns: the prompts (show_prompts:
    a file's), speed per prompt, the diffusion sampler per prompt, accuracy (graded prompts), each with
    a row for all prompts together when there are several, then the speed model and its batch sweep.
    Cells are the median, with [min–max] over the runs when they differ."""
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
    groups = [(prompt, modes, [r for r in report.runs if r.prompt == prompt]) for prompt, modes in by_prompt.items()]
    if len(by_prompt) > 1:
        pooled = [replace(r, prompt=ALL_PROMPTS) for r in report.runs]
        groups.append((ALL_PROMPTS, {s.mode: s for s in summarize(pooled)}, pooled))
    cfg = report.config
    runs = f"{cfg['repeat']} run{'s' if cfg['repeat'] != 1 else ''} per prompt"
    if any(s.tokens_per_second is not None and s.tokens_per_second.n > cfg["repeat"] for s in report.summaries):
        runs += ", every prompt of a row's name together"  # the demo's set: 3 prompts x 3 runs per row
    pair = f"diffusion: {cfg['diffusion_model']}, AR: {cfg['ar_model']}"
    tables = [prompts_table(report.config.get("prompts") or [], table)] if show_prompts else []

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
                    caption="tokens/forward: answer tokens per forward, denoising steps and commit passes "
                            "(AR: 1.00); answer tokens: diffusion/AR"
                            + (f"; self-conditioning: {', '.join(forms)}" if forms else ""))
    graded = any(s.accuracy is not None for s in report.summaries)
    accuracy = table("accuracy (graded prompts)", "prompt", "diffusion", "AR")
    for prompt, modes, runs_of_row in groups:
        if prompt == ALL_PROMPTS:
            for t in (speed, sampler, accuracy):
                t.rows[-1].end_section = True
        d, a = modes.get("diffusion"), modes.get("autoregressive")
        sp = "-"
        # the medians of the same runs: run i of a prompt on each side, where both have a rate (an AR run whose
        # only token came from the prefill has none; a row of several prompts then divided diffusion's median
        # over all of them by AR's over the others). As compare's: none when a side has no rate, not "0.00x"
        rates = {mode: [r.tokens_per_second for r in runs_of_row if r.mode == mode]
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
