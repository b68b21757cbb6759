"""Measure the demo pair on held-out examples: accuracy, denoising steps per canvas, tokens per forward.

    .venv/bin/python -m training.evaluate --checkpoint build/demo-hf              # Transformers reference
    .venv/bin/python -m training.evaluate --gguf dgcli/models/demo-diffusion.gguf \\
        --ar-gguf dgcli/models/demo-ar.gguf                                    # through dg's engines

Both back-ends run the default sampler settings (entropy bound 0.1, temperature 0.8 -> 0.4,
confidence 0.005, stability 1, 48-step cap), batch 1, one seed per example, up to MAX_CANVASES
canvases, and print one table row per (task, difficulty): accuracy of the diffusion decode, mean
steps per canvas, canvases per answer, tokens per forward (answer tokens, without the end token and
padding, over decoder forwards, summed over the cell), the share of canvases stopped before the cap,
and the AR twin's accuracy.

    .venv/bin/python -m training.evaluate --write-bench-prompts dgcli/data/demo-prompts.tsv

writes the held-out set `dg bench --model demo` runs (tasks.BENCH_LEVELS, 3 prompts per level).

    .venv/bin/python -m training.evaluate --gguf dgcli/models/demo-diffusion.gguf --no-ar \\
        --self-cond-top-k 0,1,4,16,64

runs the diffusion side once per self-conditioning form (0: dense, the reference's and dg's default;
k: the k most probable tokens per position) and ends with one summary row per form.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from training import tasks


# Two canvases hold every answer; a third shows a model that does not stop, without waiting for eight.
MAX_CANVASES = 3


@dataclass
class Outcome:
    answer: str
    steps_per_canvas: list[int]
    answer_tokens: int  # tokens before the end token

    @property
    def forwards(self) -> int:
        return sum(self.steps_per_canvas)


@dataclass
class Row:
    task: str
    difficulty: int
    variant: int | None  # the task's second knob (json: digits of every value), None where it has none
    n: int
    accuracy: float
    mean_steps: float  # per canvas
    mean_canvases: float
    tokens_per_forward: float  # answer tokens / decoder forwards over the cell
    stopped_early: float  # share of canvases stopped before the cap
    ar_accuracy: float | None


def load_reference(checkpoint: Path):
    """The checkpoint as a Transformers model with the reference's default sampler settings.

    The generation config is passed explicitly: a generation_config.json whose sampler_config lacks
    Transformers' `_cls_name` tag does not load through from_pretrained.
    """
    from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    from dgcli.testing.tiny import tiny_vocab

    vocab = tiny_vocab()
    generation_config = DiffusionGemmaGenerationConfig(eos_token_id=list(vocab.end_token_ids), pad_token_id=vocab.pad_id,
                                                       bos_token_id=vocab.bos_id)
    return DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint, generation_config=generation_config).eval()


# -- back-ends: each returns a function example -> Outcome (diffusion) or example -> str (AR) ------


def reference_backends(checkpoint: Path, threads: int = 1):
    """Transformers' DiffusionGemmaForBlockDiffusion.generate and a greedy AR loop on the encoder."""
    import torch

    from dgcli.testing.tiny import tiny_vocab

    torch.set_num_threads(threads)
    vocab = tiny_vocab()
    model = load_reference(checkpoint)
    canvas_length = model.config.canvas_length
    decoder_calls = [0]
    original_forward = model.forward

    def counting_forward(*args, **kwargs):
        decoder_calls[0] += 1
        return original_forward(*args, **kwargs)

    model.forward = counting_forward  # generate() calls self.forward once per denoising step

    def diffusion(example: tasks.Example, seed: int) -> Outcome:
        ids = torch.tensor([tasks.prompt_ids(example, vocab)])
        torch.manual_seed(seed)
        decoder_calls[0] = 0
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=MAX_CANVASES * canvas_length,
                                 eos_token_id=list(vocab.end_token_ids), pad_token_id=vocab.pad_id)
        generated = out.sequences[0, ids.shape[1]:].tolist()
        answer = _before_end(generated, vocab.end_token_ids)
        # generate() does not report steps per canvas; the mean over its canvases is what is known
        canvases = max(1, -(-len(generated) // canvas_length))
        steps = [decoder_calls[0] / canvases] * canvases
        return Outcome(tasks.parse_answer(generated, vocab), steps, len(answer))

    def autoregressive(example: tasks.Example) -> str:
        from transformers.cache_utils import DynamicCache

        ids = tasks.prompt_ids(example, vocab)
        cache = DynamicCache(config=model.config.text_config)
        generated: list[int] = []
        step_input = torch.tensor([ids])
        cap = model.config.text_config.final_logit_softcapping
        with torch.no_grad():
            for _ in range(MAX_CANVASES * canvas_length):
                hidden = model.model.encoder(input_ids=step_input, past_key_values=cache).last_hidden_state
                logits = torch.tanh(model.lm_head(hidden[:, -1]).float() / cap) * cap
                token = int(logits.argmax(-1))
                if token in vocab.end_token_ids:
                    break
                generated.append(token)
                step_input = torch.tensor([[token]])
        return tasks.parse_answer(generated, vocab)

    return diffusion, autoregressive


def engine_over_reference_backend(checkpoint: Path, threads: int = 1):
    """dg's DiffusionEngine loop (its numpy sampler and random stream) over the Transformers forward."""
    import torch

    from dgcli.engine import DiffusionEngine
    from dgcli.testing.tiny import tiny_vocab
    from dgcli.testing.torch_model import TorchDiffusionModel

    torch.set_num_threads(threads)
    vocab = tiny_vocab()
    model = load_reference(checkpoint)
    engine = DiffusionEngine(TorchDiffusionModel(model, end_token_ids=vocab.end_token_ids, pad_token_id=vocab.pad_id),
                             sampler="numpy")

    def diffusion(example: tasks.Example, seed: int) -> Outcome:
        result = engine.generate(tasks.prompt_ids(example, vocab), max_new_tokens=MAX_CANVASES * model.config.canvas_length,
                                 seed=seed, chat=False)
        return Outcome(tasks.parse_answer(result.token_ids, vocab), list(result.steps_per_canvas),
                       result.n_new_tokens)

    return diffusion


def engine_backends(gguf: Path, ar_gguf: Path | None, threads: int | None = None, self_cond_top_k: int | None = None):
    """dg's DiffusionEngine / AutoregressiveEngine over the patched llama.cpp (self_cond_top_k: the
    engine's setting; None: its default)."""
    from dgcli.engine import AutoregressiveEngine, DiffusionEngine

    engine = DiffusionEngine(str(gguf), n_threads=threads, self_cond_top_k=self_cond_top_k)
    ar_engine = AutoregressiveEngine(str(ar_gguf), n_threads=threads) if ar_gguf else None

    def diffusion(example: tasks.Example, seed: int) -> Outcome:
        result = engine.generate(example.question, max_new_tokens=MAX_CANVASES * engine.model.canvas_length,
                                 seed=seed, chat=True)
        return Outcome(result.text.strip(), list(result.steps_per_canvas), result.n_new_tokens)

    def autoregressive(example: tasks.Example) -> str:
        result = ar_engine.generate(example.question, max_new_tokens=MAX_CANVASES * tasks.CANVAS_LENGTH, chat=True)
        return result.text.strip()

    return diffusion, (autoregressive if ar_engine else None)


def _before_end(ids: list[int], end_ids) -> list[int]:
    for i, token in enumerate(ids):
        if token in end_ids:
            return ids[:i]
    return ids


# -- measurement -----------------------------------------------------------------------------


def measure(diffusion: Callable, autoregressive: Callable | None, per_cell: int, max_steps: int = 48,
            difficulties: dict[str, list[int]] | None = None, seed: int = 0,
            graded: list[tuple[tasks.Example, bool]] | None = None) -> list[Row]:
    """One row per evaluation cell (tasks.evaluation_cells) of the chosen tasks and difficulties.
    `graded`, when given, receives every example with whether the diffusion answer was right."""
    rows = []
    for task in (difficulties or {t: None for t in tasks.TASKS}):
        levels = (difficulties or {}).get(task)
        for difficulty, variant in tasks.evaluation_cells(task):
            if levels and difficulty not in levels:
                continue
            examples = tasks.evaluation_set(task, difficulty, per_cell, variant=variant)
            outcomes = [diffusion(e, seed + i) for i, e in enumerate(examples)]
            if graded is not None:
                graded += [(e, o.answer == e.answer) for o, e in zip(outcomes, examples)]
            ar_correct = None
            if autoregressive is not None:
                ar_correct = statistics.mean(autoregressive(e) == e.answer for e in examples)
            canvas_steps = [s for o in outcomes for s in o.steps_per_canvas]
            rows.append(Row(
                task=task, difficulty=difficulty, variant=variant, n=len(examples),
                accuracy=statistics.mean(o.answer == e.answer for o, e in zip(outcomes, examples)),
                mean_steps=statistics.mean(canvas_steps),
                mean_canvases=statistics.mean(len(o.steps_per_canvas) for o in outcomes),
                tokens_per_forward=sum(o.answer_tokens for o in outcomes) / sum(o.forwards for o in outcomes),
                stopped_early=statistics.mean(s < max_steps for s in canvas_steps),
                ar_accuracy=ar_correct,
            ))
            print(json.dumps(asdict(rows[-1])), flush=True)
    return rows


def markdown_table(rows: list[Row]) -> str:
    lines = ["| task | difficulty | n | diffusion acc | steps/canvas | canvases | tokens/forward | stopped < cap "
             "| AR acc |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ar = "-" if r.ar_accuracy is None else f"{r.ar_accuracy:.2f}"
        lines.append(f"| {r.task} | {tasks.cell_label(r.task, r.difficulty, r.variant)} | {r.n} | {r.accuracy:.2f} | "
                     f"{r.mean_steps:.1f} | {r.mean_canvases:.1f} | {r.tokens_per_forward:.2f} | "
                     f"{r.stopped_early:.2f} | {ar} |")
    total = sum(r.n for r in rows)
    weighted = lambda attr: sum(getattr(r, attr) * r.n for r in rows) / total  # noqa: E731
    ar_rows = [r for r in rows if r.ar_accuracy is not None]
    ar_total = (sum(r.ar_accuracy * r.n for r in ar_rows) / sum(r.n for r in ar_rows)) if ar_rows else None
    lines.append(f"| **all** | | {total} | {weighted('accuracy'):.2f} | {weighted('mean_steps'):.1f} | "
                 f"{weighted('mean_canvases'):.1f} | | {weighted('stopped_early'):.2f} | "
                 f"{'-' if ar_total is None else f'{ar_total:.2f}'} |")
    return "\n".join(lines)


def form_table(by_form: dict[int | None, list[Row]]) -> str:
    """One row per self-conditioning form over the whole set: accuracy, steps per canvas (over every
    canvas), tokens per forward (answer tokens over decoder forwards, summed over the set)."""
    lines = ["| self-conditioning | n | diffusion acc | steps/canvas | tokens/forward |", "| --- | --- | --- | --- | --- |"]
    for k, rows in by_form.items():
        n = sum(r.n for r in rows)
        canvases = sum(r.mean_canvases * r.n for r in rows)
        forwards = sum(r.mean_steps * r.mean_canvases * r.n for r in rows)
        tokens = sum(r.tokens_per_forward * r.mean_steps * r.mean_canvases * r.n for r in rows)
        name = "default" if k is None else "dense" if k == 0 else f"top-{k}"
        lines.append(f"| {name} | {n} | {sum(r.accuracy * r.n for r in rows) / n:.3f} | {forwards / canvases:.2f} | "
                     f"{tokens / forwards:.2f} |")
    return "\n".join(lines)


def task_summary_table(rows: list[Row]) -> str:
    """Accuracy per task over all its cells (each cell weighted by its examples)."""
    lines = ["| task | n | diffusion acc | worst cell | AR acc |", "| --- | --- | --- | --- | --- |"]
    for task in dict.fromkeys(r.task for r in rows):
        cells = [r for r in rows if r.task == task]
        n = sum(r.n for r in cells)
        worst = min(cells, key=lambda r: r.accuracy)
        ar = [r for r in cells if r.ar_accuracy is not None]
        ar_text = f"{sum(r.ar_accuracy * r.n for r in ar) / sum(r.n for r in ar):.3f}" if ar else "-"
        lines.append(f"| {task} | {n} | {sum(r.accuracy * r.n for r in cells) / n:.3f} | "
                     f"{worst.accuracy:.2f} ({tasks.cell_label(task, worst.difficulty, worst.variant)}) | {ar_text} |")
    return "\n".join(lines)


def _distinct(examples: list[tasks.Example], count: int) -> list[tasks.Example]:
    return list({e.question: e for e in examples}.values())[:count]


def range_table(graded: list[tuple[tasks.Example, bool]]) -> str:
    """Diffusion accuracy per value of every documented knob (tasks.DOCUMENTED_RANGES): an example
    counts towards each value its question holds (a JSON question with a one-letter and a two-letter
    key counts for both); JSON values are grouped by their digit count."""
    lines = ["| task | range | n | diffusion acc |", "| --- | --- | --- | --- |"]
    for task, ranges in tasks.DOCUMENTED_RANGES.items():
        of_task = [(tasks.knob_values(e), ok) for e, ok in graded if e.task == task]
        for _, knob, _, _ in ranges:
            buckets: dict[str, list[bool]] = {}
            for knobs, ok in of_task:
                values = knobs[knob]
                labels = {f"{len(str(v))}-digit" for v in values} if knob == "value" else {str(v) for v in values}
                for label in labels:
                    buckets.setdefault(label, []).append(ok)
            for label in sorted(buckets, key=lambda b: int(b.split("-")[0])):
                results = buckets[label]
                lines.append(f"| {task} | {knob} {label} | {len(results)} | {statistics.mean(results):.3f} |")
    return "\n".join(lines)


def bench_examples(per_level: int = 3) -> list[tuple[str, tasks.Example]]:
    """(bench name, held-out example) at tasks.BENCH_LEVELS: `per_level` distinct questions each, or
    as many as a short level holds out (one-character reversal has one). A task with variants cycles
    through them, so each level holds every variant once when per_level is their count."""
    chosen = []
    for task, levels in tasks.BENCH_LEVELS.items():
        variants = tasks.TASK_BY_NAME[task].variants
        for level in levels:
            name = task if task == "help" else f"{task}-{level}"
            if not variants:
                chosen += [(name, e) for e in _distinct(tasks.evaluation_set(task, level, 10 * per_level), per_level)]
                continue
            for i in range(per_level):
                variant = variants[i % len(variants)]
                chosen.append((name, tasks.evaluation_set(task, level, i // len(variants) + 1, variant=variant)[-1]))
    return chosen


def bench_prompt_lines(per_level: int = 3) -> list[str]:
    """dg bench's prompt file for the demo: name<TAB>prompt<TAB>answer, held-out examples at
    tasks.BENCH_LEVELS, then the hand-written unknown prompts (tasks.UNKNOWN_PROMPTS)."""
    lines = ["# dg bench prompts for the shipped demo pair: held-out examples of its tasks (training/tasks.py",
             f"# evaluation_set), {per_level} per difficulty (json: values of 1, 2 and 3 digits), and prompts",
             "# that are no task (answer: the help reply).",
             "# name<TAB>prompt<TAB>expected answer; runs sharing a name are summarised together.",
             "# Written by: python -m training.evaluate --write-bench-prompts dgcli/data/demo-prompts.tsv"]
    lines += [f"{name}\t{e.question}\t{e.answer}" for name, e in bench_examples(per_level)]
    lines += [f"unknown\t{q}\t{tasks.HELP_REPLY}" for q in tasks.UNKNOWN_PROMPTS]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="HF checkpoint (Transformers reference back-end)")
    parser.add_argument("--gguf", type=Path, help="diffusion GGUF (dg engine back-end)")
    parser.add_argument("--ar-gguf", type=Path, help="AR twin GGUF (dg engine back-end)")
    parser.add_argument("--per-cell", type=int, default=10, help="held-out examples per task and difficulty")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--via-engine", action="store_true",
                        help="with --checkpoint: run dg's DiffusionEngine loop over the Transformers forward")
    parser.add_argument("--no-ar", action="store_true")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--levels", help="difficulties to run, e.g. 1,4,8 (default: all)")
    parser.add_argument("--tasks", help="tasks to run, e.g. sort,nato (default: all)")
    parser.add_argument("--write-bench-prompts", type=Path, metavar="TSV", help="write dg bench's demo prompt set and exit")
    parser.add_argument("--self-cond-top-k", metavar="K[,K...]",
                        help="with --gguf: self-conditioning forms to run, each on the whole set (0: dense; "
                             "default: the engine's)")
    args = parser.parse_args(argv)
    if args.write_bench_prompts:
        args.write_bench_prompts.write_text("\n".join(bench_prompt_lines()) + "\n", encoding="utf-8")
        return
    if args.checkpoint and args.via_engine:
        diffusion, autoregressive = engine_over_reference_backend(args.checkpoint, args.threads), None
    elif args.checkpoint:
        diffusion, autoregressive = reference_backends(args.checkpoint, args.threads)
    elif not args.gguf:
        parser.error("give --checkpoint or --gguf")
    if args.self_cond_top_k and not args.gguf:
        parser.error("--self-cond-top-k runs dg's engine: give --gguf")
    chosen = args.tasks.split(",") if args.tasks else list(tasks.TASKS)
    wanted = [int(x) for x in args.levels.split(",")] if args.levels else None
    levels = {t: [d for d in (wanted or range(1, tasks.MAX_DIFFICULTY[t] + 1)) if d <= tasks.MAX_DIFFICULTY[t]]
              or [tasks.MAX_DIFFICULTY[t]] for t in chosen}
    if args.gguf:
        forms = [int(k) for k in args.self_cond_top_k.split(",")] if args.self_cond_top_k else [None]
    else:
        forms = [None]
    by_form: dict[int | None, list[Row]] = {}
    rows: list[dict] = []
    for k in forms:
        if args.gguf:
            diffusion, autoregressive = engine_backends(args.gguf, args.ar_gguf, args.threads, k)
            if k is not None:
                print(f"self-conditioning: {'dense' if k == 0 else f'top-{k}'}", flush=True)
        graded: list[tuple[tasks.Example, bool]] = []
        by_form[k] = measure(diffusion, None if args.no_ar else autoregressive, args.per_cell, difficulties=levels,
                             graded=graded)
        print(markdown_table(by_form[k]))
        print()
        print(task_summary_table(by_form[k]))
        print()
        print(range_table(graded))
        rows += [asdict(r) | ({"self_cond_top_k": k} if k is not None else {}) for r in by_form[k]]
    if len(forms) > 1:
        print(form_table(by_form))
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
