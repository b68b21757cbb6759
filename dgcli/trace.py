"""The per-step trace of a diffusion generation (`dg generate --trace FILE`, `--json`'s "trace"),
and reading it back (`dg replay`). Schema `dg-trace/1`, one JSON object per line:

    {"kind": "header", "schema": "dg-trace/1", "model": {...}, "prompt": ..., "system": ..., "params": {...},
     "max_new_tokens": N, "seed": S, "canvas_length": C, "end_token_ids": [...], "pad_token_id": P}
    {"kind": "step", ... StepEvent.to_json() ..., "pieces": {"id": "text", ...}}   # pieces of ids first seen
    {"kind": "canvas", ... CanvasEvent.to_json() ..., "text": "the canvas's answer text"}
    {"kind": "result", ... GenerationResult.to_json() ...}                      # absent if the run failed

A trace carries the text of every token it shows, so `dg replay` needs no model file.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import numpy as np

from dgcli.engine.types import CanvasEvent, StepEvent
from dgcli.errors import DgError
from dgcli.params import is_int, is_real

TRACE_SCHEMA = "dg-trace/1"
# A trace line is one canvas of ids and flags: 256 tokens of the real model is ~10 kB.
MAX_LINE_BYTES = 64 << 20


class TraceRecorder:
    """Engine events -> trace lines, each handed to every sink (a file's write_line, a list's append)."""

    def __init__(self, piece_of: Callable[[int], str], detokenize: Callable[[list[int]], str],
                 sinks: list[Callable[[dict], Any]]):
        self.piece_of, self.detokenize, self.sinks = piece_of, detokenize, sinks
        self._seen: set[int] = set()

    def _write(self, line: dict) -> None:
        for sink in self.sinks:
            sink(line)

    def header(self, **fields: Any) -> None:
        self._write({"kind": "header", "schema": TRACE_SCHEMA, **fields})

    def on_event(self, ev: Any) -> None:
        line = ev.to_json()
        if isinstance(ev, StepEvent):
            new = sorted({int(t) for t in ev.argmax_canvas} - self._seen)
            self._seen.update(new)
            line["pieces"] = {str(t): self.piece_of(t) for t in new}
        elif isinstance(ev, CanvasEvent):
            line["text"] = self.detokenize(ev.token_ids) if ev.token_ids else ""
        self._write(line)

    def result(self, result_json: dict) -> None:
        self._write({"kind": "result", **result_json})


@dataclass
class Trace:
    """A trace read back: its header, its events (StepEvent / CanvasEvent), the text of its tokens."""

    header: dict
    events: list[Any] = field(default_factory=list)
    pieces: dict[int, str] = field(default_factory=dict)
    canvas_texts: list[str] = field(default_factory=list)  # per CanvasEvent, in order
    result: dict | None = None
    cut_short: bool = False  # the last line ended mid-way (its writer was killed): it was left out


def read_trace(path: Path | str) -> Trace:
    """Read and check a dg-trace/1 file ('-': stdin; a pipe, e.g. `<(...)`, too); DgError naming the
    line for anything else."""
    if str(path) == "-":
        return _read_trace(sys.stdin.buffer, "stdin")
    path = Path(path)
    if not path.exists():
        raise DgError(f"trace file not found: {path}")
    if not (path.is_file() or path.is_fifo()):
        raise DgError(f"not a regular file: {path}")
    with open(path, "rb") as f:
        return _read_trace(f, str(path))


def _read_trace(f: BinaryIO, path: str) -> Trace:
    trace: Trace | None = None
    for number, line in _lines(f, path):
        where = f"{path}:{number}"
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as err:
            if trace is not None and not line.endswith("\n"):  # the last line, cut off: replay up to it
                trace.cut_short = True
                break
            raise DgError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(doc, dict):
            raise DgError(f"{where}: expected a JSON object per line")
        if trace is None:
            schema = doc.get("schema")
            if doc.get("kind") == "header" and isinstance(schema, str) and schema.startswith("dg-trace/") \
                    and schema != TRACE_SCHEMA:
                raise DgError(f"{path} is a {' '.join(schema.split())[:40]} trace, which this dg cannot read "
                              f"(it reads {TRACE_SCHEMA}; a newer dg wrote it?)")
            if doc.get("kind") != "header" or schema != TRACE_SCHEMA:
                raise DgError(f"{path} is not a {TRACE_SCHEMA} trace (its first line is not a {TRACE_SCHEMA} header; "
                              "write one with `dg generate --trace FILE`)")
            problem = _header_problem(doc)
            if problem:
                raise DgError(f"{where}: malformed header line ({problem})")
            trace = Trace(header=doc)
            continue
        try:
            _add_line(trace, doc)
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            raise DgError(f"{where}: malformed {doc.get('kind', '?')} line ({err})") from None
    if trace is None:
        raise DgError(f"{path} is empty")
    return trace


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(v) for v in value)


def _header_problem(doc: dict) -> str | None:
    """What is wrong with the header's fields that `dg replay` uses (None: nothing)."""
    model = doc.get("model")
    if model is not None and not (isinstance(model, dict) and isinstance(model.get("name", ""), str)):
        return "model must be an object with a name"
    if doc.get("end_token_ids") is not None and not _is_int_list(doc["end_token_ids"]):
        return "end_token_ids must be a list of token ids"
    if doc.get("pad_token_id") is not None and not is_int(doc["pad_token_id"]):
        return "pad_token_id must be a token id"
    return None


# The result line's fields and what each must be (GenerationResult.to_json()).
_RESULT_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{name: (lambda v: isinstance(v, str), "a string") for name in ("mode", "text", "stop_reason")},
    **{name: (_is_int_list, "a list of integers") for name in ("token_ids", "steps_per_canvas")},
    **{name: (is_int, "an integer") for name in ("n_prompt_tokens", "decoder_forwards", "n_cached_prompt_tokens")},
    "prefill_answer_tokens": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),  # tok/s subtracts it
    **{name: (is_real, "a finite number") for name in ("tokens_per_forward", "prefill_s", "total_s", "forward_s",
                                                   "sampling_s", "display_s")},
    "interrupted": (lambda v: isinstance(v, bool), "true or false"),
    **{name: (lambda v: v is None or is_int(v), "an integer or null") for name in ("seed", "timed_forwards")},
}


# The step line's figures that the status line shows, and what each must be (StepEvent.to_json()).
_STEP_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "canvas": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    **{name: (lambda v: is_int(v) and v >= 1, "an integer >= 1") for name in ("step", "max_steps")},
    "n_accepted": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    **{name: (lambda v: is_real(v) and v >= 0, "a finite number >= 0") for name in ("temperature", "mean_entropy",
                                                                                 "forward_s", "sampling_s")},
}


def _check_step(doc: dict, length: int) -> None:
    for name, (ok, what) in _STEP_FIELDS.items():
        if not ok(doc[name]):
            raise ValueError(f"{name} must be {what}")
    if doc["step"] > doc["max_steps"]:
        raise ValueError(f"step {doc['step']} is past max_steps {doc['max_steps']}")
    if doc["n_accepted"] > length:
        raise ValueError(f"n_accepted {doc['n_accepted']} is more than the canvas's {length} tokens")


def _check_result(doc: dict) -> None:
    for name, (ok, what) in _RESULT_FIELDS.items():
        if name in doc and not ok(doc[name]):
            raise ValueError(f"{name} must be {what}")
    # tok/s subtracts them from the answer's tokens: more than the answer has would make the rate negative
    if doc.get("prefill_answer_tokens", 0) > len(doc.get("token_ids", [])):
        raise ValueError(f"prefill_answer_tokens {doc['prefill_answer_tokens']} is more than the answer's "
                         f"{len(doc.get('token_ids', []))} tokens")


def _lines(f: BinaryIO, path: str) -> Iterator[tuple[int, str]]:
    for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
        if len(raw) > MAX_LINE_BYTES:
            raise DgError(f"{path}:{number}: line longer than {MAX_LINE_BYTES >> 20} MB")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DgError(f"{path}:{number}: not UTF-8") from None
        if text.strip():
            yield number, text


def _add_line(trace: Trace, doc: dict) -> None:
    kind = doc["kind"]
    if kind == "step":
        canvas = np.asarray(doc["argmax_canvas"], dtype=np.int64)
        accepted = np.asarray(doc["accepted"], dtype=bool)
        if canvas.ndim != 1 or canvas.shape != accepted.shape:
            raise ValueError("argmax_canvas and accepted must be lists of one length")
        _check_step(doc, len(canvas))
        pieces = doc.get("pieces", {})
        if not isinstance(pieces, dict):
            raise ValueError("pieces must be an object of token id: text")
        for key, piece in pieces.items():
            trace.pieces[int(key)] = str(piece)
        trace.events.append(StepEvent(
            canvas_index=int(doc["canvas"]), step=int(doc["step"]), max_steps=int(doc["max_steps"]),
            temperature=float(doc["temperature"]), argmax_canvas=canvas, accepted_mask=accepted,
            n_accepted=int(doc["n_accepted"]), mean_entropy=float(doc["mean_entropy"]),
            forward_s=float(doc["forward_s"]), sampling_s=float(doc["sampling_s"]), stopped=bool(doc["stopped"]),
            sc_dropped_mass=float(doc.get("sc_dropped_mass", 0.0))))
    elif kind == "canvas":
        trace.events.append(CanvasEvent(canvas_index=int(doc["canvas"]), token_ids=[int(t) for t in doc["token_ids"]],
                                        steps=int(doc["steps"]), commit_s=float(doc["commit_s"])))
        trace.canvas_texts.append(str(doc.get("text", "")))
    elif kind == "result":
        _check_result(doc)
        trace.result = doc
    else:
        raise ValueError(f"unknown kind {kind!r}")
