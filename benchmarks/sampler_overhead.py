"""Sampler and host work per denoising step as a fraction of the decoder forward: numpy vs native,
and the graph step (the sampler's pass inside the decoder graph: only the rules left on the host).

Runs the real DiffusionEngine loop for a few steps of one canvas on a synthetic GGUF with the real
vocabulary (262144) and hidden size (2816), so each step yields 256 x 262144 logits, and reads the
forward and sampling times from the StepEvents. The adaptive stop is disabled (confidence
threshold ~0) so every step runs.

    .venv/bin/python benchmarks/sampler_overhead.py [--gguf PATH] [--steps 4] [--threads N] [--json]

Without --gguf a 2-layer synthetic model (one sliding, one full) (few experts, Q8_0) is written to a temp dir first.
`--forward lmhead` replaces the model by a numpy stand-in (LM head matmul + softcap only), for
machines without the patched llama.cpp: a lower bound of the forward, so an upper bound of the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dgcli.engine.diffusion import DiffusionEngine  # noqa: E402
from dgcli.engine.sampler import native_library  # noqa: E402
from dgcli.params import DiffusionParams  # noqa: E402

REAL_VOCAB, REAL_HIDDEN, REAL_CANVAS = 262144, 2816, 256


class LmHeadStandIn:
    """Step-level API whose 'forward' is only the tied LM head + softcap over random hidden states."""

    def __init__(self, vocab: int, hidden: int, canvas: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.vocab_size, self.canvas_length = vocab, canvas
        self.end_token_ids, self.pad_token_id = [1, 106], 0
        self.default_params = DiffusionParams()
        self._embed = (rng.standard_normal((vocab, hidden), dtype=np.float32) * 0.02)
        self._hidden = rng.standard_normal((canvas, hidden), dtype=np.float32)

    def reset(self):
        pass

    def prefill(self, tokens):
        pass

    def commit(self, canvas):
        pass

    def detokenize(self, ids):
        return ""

    def decode_canvas(self, canvas, sc_logits=None, sc_topk=None):
        logits = self._hidden @ self._embed.T
        np.tanh(logits / 30.0, out=logits)
        logits *= 30.0
        return logits


def open_model(args, workdir: Path):
    if args.forward == "lmhead":
        return LmHeadStandIn(REAL_VOCAB, REAL_HIDDEN, REAL_CANVAS), "numpy LM-head stand-in"
    from dgcli.runtime.model import DiffusionModel

    path = args.gguf
    if path is None:
        from dgcli.testing.tiny import write_synthetic_gguf

        path = workdir / "synthetic.gguf"
        print(f"writing synthetic GGUF (vocab {REAL_VOCAB}, hidden {REAL_HIDDEN}) to {path} ...", file=sys.stderr)
        write_synthetic_gguf(path, n_layer=2, num_experts=8, top_k_experts=2)
    model = DiffusionModel(path, n_threads=args.threads)
    return model, f"{Path(path).name} (llama.cpp)"


def measure(model, backend: str, steps: int, threads: int | None) -> dict:
    engine = DiffusionEngine(model, sampler=backend, n_threads=threads)
    params = DiffusionParams(max_denoising_steps=steps, confidence_threshold=1e-30)
    events = []
    engine.generate([2, 105, 120, 121, 106], params=params, max_new_tokens=1, seed=0, on_event=events.append)
    step_events = [e for e in events if e.kind == "step"]
    # the first step has no self-conditioning input and warms caches: report the rest when possible
    timed = step_events[1:] if len(step_events) > 1 else step_events
    forward = statistics.median(e.forward_s for e in timed)
    sampling = statistics.median(e.sampling_s for e in timed)
    return {
        "backend": engine.step_backend,
        "steps": len(timed),
        "forward_ms": forward * 1e3,
        "sampling_ms": sampling * 1e3,
        "sampling_over_forward": sampling / forward,
        # the engine's default on this vocabulary: the sampler's top-64 feeds the next forward
        "sc_dropped_mass_max": max(e.sc_dropped_mass for e in timed),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="a diffusion-gemma GGUF with the real vocab")
    parser.add_argument("--forward", choices=("gguf", "lmhead"), default="gguf")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per backend (first one not timed)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)

    backends = ["numpy"] + (["native"] if native_library() is not None else [])
    if args.forward == "gguf" and native_library() is not None:
        backends.append("graph")
    with tempfile.TemporaryDirectory(prefix="dg-bench-") as tmp:
        model, label = open_model(args, Path(tmp))
        rows = [measure(model, backend, args.steps, args.threads) for backend in backends]
        if hasattr(model, "close"):
            model.close()
    report = {"model": label, "canvas": REAL_CANVAS, "vocab": REAL_VOCAB, "threads": args.threads or os.cpu_count(),
              "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model: {label}; logits per step {REAL_CANVAS} x {REAL_VOCAB}; threads {report['threads']}")
    print(f"{'sampler':<8} {'forward ms':>11} {'sampling ms':>12} {'sampling/forward':>17} {'sc dropped':>11}")
    for row in rows:
        print(f"{row['backend']:<8} {row['forward_ms']:>11.1f} {row['sampling_ms']:>12.1f} "
              f"{row['sampling_over_forward']:>16.1%} {row['sc_dropped_mass_max']:>11.3f}")
    if len(backends) == 1:
        print("(native sampler not available: build the patched llama.cpp, or set DG_SAMPLER_LIB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
