"""EXP A: an untrained (random-weight) DiffusionGemma degenerates to one token per step.

Writes a tiny freshly initialised GGUF in the published layout (Transformers' init: N(0, 0.02)
matrices, unit norms), generates with `dg generate --trace`, and shows
per-step accepted tokens (the entropy bound's at-least-one guarantee) and the mean entropy, which
stays near the uniform bound log(V) so adaptive stopping never fires.

    python examples/exp_a_untrained.py            # -> examples/out/exp_a.tsv, exp_a.png
"""

from __future__ import annotations

import json
import math

from _common import parser, read_trace, run_dg, threads_args, write_table


def main() -> None:
    p = parser(__doc__.splitlines()[0], default_model="")
    p.add_argument("--steps", type=int, default=48)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model:
        from dgcli.testing.tiny import write_tiny_random_gguf

        model = str(write_tiny_random_gguf(args.out / "untrained-tiny.gguf", seed=0, init="untrained"))
    info = json.loads(run_dg("info", model, "--json"))
    trace_path = args.out / "exp_a.trace.jsonl"
    result = json.loads(run_dg("generate", "what is 3+5", "-m", model, "--steps", args.steps,
                               "--max-new-tokens", 2 * info["canvas_length"], "--seed", 0, "--json",
                               "--trace", trace_path, "--force", *threads_args(args.threads)))["result"]
    steps = [e for e in read_trace(trace_path) if e["kind"] == "step"]
    rows = [[e["canvas"], e["step"], e["n_accepted"], f"{e['mean_entropy']:.4f}", e["stopped"]] for e in steps]
    write_table(args.out / "exp_a.tsv", ["canvas", "step", "accepted", "mean_entropy", "stopped"], rows)
    uniform = math.log(info["vocab_size"])
    mean_accepted = sum(e["n_accepted"] for e in steps) / len(steps)
    print(f"steps per canvas: {result['steps_per_canvas']} (cap {args.steps}); "
          f"tokens/forward {result['tokens_per_forward']:.2f}; "
          f"accepted per step: mean {mean_accepted:.2f}; "
          f"uniform entropy log(V) = {uniform:.2f} nats")

    import matplotlib.pyplot as plt

    canvas0 = [e for e in steps if e["canvas"] == 0]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([e["step"] for e in canvas0], [e["n_accepted"] for e in canvas0], color="tab:blue", label="accepted tokens")
    ax.set_xlabel("denoising step (canvas 1)")
    ax.set_ylabel("tokens accepted")
    ax2 = ax.twinx()
    ax2.plot([e["step"] for e in canvas0], [e["mean_entropy"] for e in canvas0], color="tab:red", label="mean entropy")
    ax2.axhline(uniform, color="tab:red", linestyle=":", label="uniform log(V)")
    ax2.set_ylabel("mean entropy (nats)")
    ax2.set_ylim(0, uniform * 1.1)
    fig.legend(loc="upper right", bbox_to_anchor=(0.88, 0.88), fontsize="small")
    ax.set_title(f"EXP A: untrained model: {mean_accepted:.2f} tokens accepted per step, "
                 f"steps per canvas {result['steps_per_canvas']}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(args.out / "exp_a.png", dpi=120)
    print(f"-> {args.out / 'exp_a.png'}")


if __name__ == "__main__":
    main()
