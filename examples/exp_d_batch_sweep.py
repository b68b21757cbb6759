"""EXP D: batch sweep. The canvas/decode cost ratio and the 16-step speedup over batch sizes 1..16.

    python examples/exp_d_batch_sweep.py [--model demo]   # -> out/exp_d.json, .tsv, .png
"""

from __future__ import annotations

import json

from _common import parser, run_dg, threads_args, write_table


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / "exp_d.json"
    prompts = args.out / "exp_d.prompts.txt"
    prompts.write_text("trivial\twhat is 3+5\n")
    run_dg("bench", "-m", args.model, "--repeat", 1, "--max-new-tokens", 16, "--prompts", prompts,
           "--batch-sizes", args.batch_sizes, "--json", "-o", report_path, "--force", *threads_args(args.threads))
    sm = json.loads(report_path.read_text())["speed_model"]
    points = [pt for pt in sm["batch_sweep"] if pt["ratio"] is not None]
    write_table(args.out / "exp_d.tsv", ["batch", "canvas_ms", "decode_ms", "ratio", "speedup_at_16_steps"],
                [[pt["batch"], f"{pt['canvas_s'] * 1e3:.3f}", f"{pt['decode_s'] * 1e3:.3f}", f"{pt['ratio']:.2f}",
                  f"{pt['speedup_at_16_steps']:.2f}"] for pt in points])
    print(f"method: {sm['batch_method']}")

    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    bs = [pt["batch"] for pt in points]
    a.plot(bs, [pt["ratio"] for pt in points], marker="o")
    a.set_title("canvas forward / decode cost")
    b.plot(bs, [pt["speedup_at_16_steps"] for pt in points], marker="o", color="tab:green")
    b.axhline(1, color="black", linewidth=0.8)
    b.set_title("implied speedup at 16 steps")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(x) for x in bs])
        ax.set_xlabel("batch size")
    fig.suptitle("EXP D: batch sweep" + (" (emulated)" if sm["batch_method"].startswith("emulated") else ""))
    fig.tight_layout()
    fig.savefig(args.out / "exp_d.png", dpi=120)
    print(f"-> {args.out / 'exp_d.png'}")


if __name__ == "__main__":
    main()
