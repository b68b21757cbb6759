"""EXP C: the speed model. Canvas forward vs one-token decode, and the implied speedup vs steps.

Runs `dg bench --json` (prompts x repeats on the diffusion model and its AR pair, then the speed
model on the diffusion weights) and plots the speedup-vs-steps curve with the measured steps.

    python examples/exp_c_speed_model.py [--model demo] [--repeat 3]   # -> out/exp_c.json, .tsv, .png
"""

from __future__ import annotations

import json

from _common import parser, run_dg, threads_args, write_table


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / "exp_c.json"
    run_dg("bench", "-m", args.model, "--repeat", args.repeat, "--max-new-tokens", args.max_new_tokens,
           "--batch-sizes", "1", "--json", "-o", report_path, "--force", *threads_args(args.threads))
    report = json.loads(report_path.read_text())
    sm = report["speed_model"]
    write_table(args.out / "exp_c.tsv", ["steps", "implied_speedup"],
                [[pt["steps"], f"{pt['speedup']:.2f}"] for pt in sm["speedup_vs_steps"]])
    print(f"canvas forward {sm['canvas_forward_s'] * 1e3:.3f} ms, one-token decode {sm['decode_s'] * 1e3:.3f} ms, "
          f"ratio {sm['ratio']:.2f} (canvas of {sm['canvas_length']})")
    measured = [r["mean_steps_per_canvas"] for r in report["runs"] if r["mode"] == "diffusion"]

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [pt["steps"] for pt in sm["speedup_vs_steps"]]
    ax.plot(xs, [pt["speedup"] for pt in sm["speedup_vs_steps"]], marker="o", label="implied speedup")
    ax.axvspan(12, 16, color="tab:green", alpha=0.15, label="vendor's typical 12-16 steps")
    ax.axvline(48, color="grey", linestyle="--", label="48-step cap")
    ax.axhline(1, color="black", linewidth=0.8)
    for s in measured:
        ax.axvline(s, color="tab:orange", alpha=0.4)
    ax.plot([], [], color="tab:orange", label="measured steps/canvas")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("denoising steps per canvas")
    ax.set_ylabel("speedup over AR (x)")
    ax.set_title(f"EXP C: canvas/decode cost ratio {sm['ratio']:.2f} ({report['config']['diffusion_model']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "exp_c.png", dpi=120)
    print(f"-> {args.out / 'exp_c.png'}")


if __name__ == "__main__":
    main()
