"""Run by tests/test_rpc.py in a child process (ggml's RPC client state, and its abort handling, stay
out of pytest's process): the same generation and decoder forwards locally and over RPC workers.

    python tests/rpc_compare.py MODEL HOST:PORT[,HOST:PORT] -> one JSON line on stdout
(with DG_VERBOSE=1, llama.cpp's log on stderr shows where each layer's weights went)
"""

from __future__ import annotations

import json
import sys

import numpy as np

from dgcli.engine.diffusion import DiffusionEngine
from dgcli.params import DiffusionParams
from dgcli.runtime.model import DiffusionModel


def forwards(model: DiffusionModel) -> list[np.ndarray]:
    """Logits of a fixed sequence of forwards: prefill, a canvas, self-conditioned, commit, another."""
    rng = np.random.default_rng(0)
    C, V = model.canvas_length, model.vocab_size
    prompt = rng.integers(5, V, size=40)
    canvas_a, canvas_b = rng.integers(0, V, size=C), rng.integers(0, V, size=C)
    out = [model.prefill(prompt, return_logits=True)[None]]
    first = model.decode_canvas(canvas_a)
    out.append(first)
    out.append(model.decode_canvas(canvas_a, first))
    model.commit(canvas_a)
    out.append(model.decode_canvas(canvas_b))
    return out


def main() -> int:
    path, endpoints = sys.argv[1], sys.argv[2].split(",")
    params = DiffusionParams(max_denoising_steps=6)
    doc: dict = {}
    runs = {}
    for where, rpc in (("local", None), ("rpc", endpoints)):
        with DiffusionModel(path, exact=True, n_gpu_layers=-1 if rpc else 0, rpc_servers=rpc) as model:
            runs[where] = forwards(model)
            model.reset()
            engine = DiffusionEngine(model)
            result = engine.generate("sort: QWERTY", params=params, max_new_tokens=model.canvas_length * 2, seed=0)
            doc[f"{where}_tokens"] = result.token_ids
            if rpc:
                doc["devices"] = model.rpc_devices.labels
    doc["max_abs_diff"] = [float(np.max(np.abs(a - b))) for a, b in zip(runs["local"], runs["rpc"])]
    doc["max_abs_logit"] = max(float(np.max(np.abs(a))) for a in runs["local"])
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
