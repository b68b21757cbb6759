"""EXP B: commit waves. Which canvas positions are accepted at each step, as a heatmap.

    python examples/exp_b_commit_waves.py [--model demo] [--prompt "..."]   # -> out/exp_b.tsv, exp_b.png
"""

from __future__ import annotations

from _common import parser, read_trace, run_dg, threads_args, write_table


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    # Hard for the demo (8 letters, reversed order): it commits over 7 steps at seed 0, easy positions first.
    p.add_argument("--prompt", default="sort: ZYXWVUTS")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trace_path = args.out / "exp_b.trace.jsonl"
    run_dg("generate", args.prompt, "-m", args.model, "--no-live", "--seed", args.seed, "--trace", trace_path,
           "--force",  # the trace of the previous run: this script's own file
           *threads_args(args.threads))
    events = read_trace(trace_path)
    steps = [e for e in events if e["kind"] == "step" and e["canvas"] == 0]
    final = steps[-1]["argmax_canvas"]
    # "settled": the position's argmax already equals its final value (and stays so).
    settled = []
    for i, e in enumerate(steps):
        settled.append([all(s["argmax_canvas"][j] == final[j] for s in steps[i:]) for j in range(len(final))])
    rows = [[e["step"], e["n_accepted"], f"{e['mean_entropy']:.4f}", sum(row)] for e, row in zip(steps, settled)]
    write_table(args.out / "exp_b.tsv", ["step", "accepted", "mean_entropy", "settled_positions"], rows)

    import matplotlib.pyplot as plt
    import numpy as np

    accepted = np.array([e["accepted"] for e in steps], dtype=float)
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.3 * len(steps) + 2), sharey=True)
    # fixed 0..1 scale: a step where every position is accepted must show all black, not a blank
    axes[0].imshow(accepted, aspect="auto", cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    axes[0].set_title("accepted this step (black)")
    axes[1].imshow(np.array(settled, dtype=float), aspect="auto", cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    axes[1].set_title("argmax already final (black)")
    for ax in axes:
        ax.set_xlabel("canvas position")
    axes[0].set_ylabel("denoising step")
    axes[0].set_yticks(range(len(steps)), [e["step"] for e in steps])
    fig.suptitle(f"EXP B: commit waves ({args.model}, canvas 1, {len(steps)} steps)")
    fig.tight_layout()
    fig.savefig(args.out / "exp_b.png", dpi=120)
    print(f"-> {args.out / 'exp_b.png'}")


if __name__ == "__main__":
    main()
