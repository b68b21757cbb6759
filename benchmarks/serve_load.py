#!/usr/bin/env python3
"""Load generator for `dg serve`: N concurrent clients vs the same requests one at a time.

Starts `dg serve` on 127.0.0.1 (a free port) with --parallel = the largest N, then, in interleaved
rounds, sends the same R chat requests (fixed prompts and seeds) through the official `openai`
client: once by one client, one request after the other, and once by N clients at a time. Per mode
and round: wall time, total answer tokens per second (usage.completion_tokens, the CLI's count),
per-request latency, the server process's CPU time per answer token (on a shared machine the wall
clock also measures the neighbours); the concurrent/sequential ratios per round (min and median).
It also checks that every answer is the same in both modes (same seed, same answer, whatever the batch).

    python benchmarks/serve_load.py --model demo --clients 2,4,8 --requests 16 --rounds 3
    python benchmarks/serve_load.py --synthetic --clients 4 --requests 8 --steps 4   # real vocabulary (262144)

--synthetic writes a random diffusion-gemma GGUF with the real vocabulary (262144 tokens) but a
small body (two layers: one sliding, one full; hidden 256, 4 experts, 32-token canvas) so that it runs on a CPU; a random
model never stops a canvas early, so --steps caps the denoising steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dgcli.server.process import ServeProcess  # noqa: E402

DEMO_PROMPTS = ["reverse: HELLO", "sort: QWERTY", "add: 12+34", "sort: DBCA", "reverse: WORLD", "sort: ZYXWV",
                "reverse: ABCDEFG", "add: 7+5", "sort: MNBVCX", "reverse: PYTHON", "sort: LKJH", "add: 99+1"]


def synthetic_model(directory: Path) -> Path:
    from dgcli.testing.tiny import write_synthetic_gguf

    return write_synthetic_gguf(directory / "synthetic-vocab262k.gguf", n_layer=2, vocab_size=262144, hidden=256,
                                outtype="q8_0", canvas_length=32, intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
                                num_experts=4, top_k_experts=2, moe_intermediate_size=256, sliding_window=128)


def one_request(client, index: int, args) -> dict:
    extra = {"steps": args.steps} if args.steps else {}
    began = time.perf_counter()
    r = client.chat.completions.create(model="bench", seed=index, max_tokens=args.max_tokens, extra_body=extra,
                                       messages=[{"role": "user", "content": DEMO_PROMPTS[index % len(DEMO_PROMPTS)]}])
    return {"index": index, "latency_s": time.perf_counter() - began, "tokens": r.usage.completion_tokens,
            "answer": r.choices[0].message.content, "queued_s": r.model_extra["dg"]["queued_s"]}


def run_mode(client, server, n_clients: int, args) -> dict:
    cpu_before = sum(server.cpu_times()[:2])
    began = time.perf_counter()
    with ThreadPoolExecutor(n_clients) as pool:
        done = list(pool.map(lambda i: one_request(client, i, args), range(args.requests), timeout=args.timeout))
    wall = time.perf_counter() - began
    cpu = sum(server.cpu_times()[:2]) - cpu_before
    tokens = sum(d["tokens"] for d in done)
    latencies = [d["latency_s"] for d in done]
    return {"clients": n_clients, "wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall,
            "server_cpu_ms_per_token": 1000 * cpu / tokens,
            "latency_median_s": statistics.median(latencies), "latency_max_s": max(latencies),
            "answers": [d["answer"] for d in sorted(done, key=lambda d: d["index"])]}


def summarize(rounds: list[dict], n: int) -> dict:
    seq = [r["sequential"] for r in rounds]
    conc = [r["concurrent"] for r in rounds]
    ratios = [c["tok_per_s"] / s["tok_per_s"] for s, c in zip(seq, conc)]
    lat = [c["latency_median_s"] / s["latency_median_s"] for s, c in zip(seq, conc)]
    cpu = [s["server_cpu_ms_per_token"] / c["server_cpu_ms_per_token"] for s, c in zip(seq, conc)]

    def spread(values):
        return {"min": min(values), "median": statistics.median(values)}

    return {
        "clients": n,
        "sequential_tok_per_s": spread([s["tok_per_s"] for s in seq]),
        "concurrent_tok_per_s": spread([c["tok_per_s"] for c in conc]),
        "throughput_ratio": spread(ratios),
        "sequential_latency_median_s": spread([s["latency_median_s"] for s in seq]),
        "concurrent_latency_median_s": spread([c["latency_median_s"] for c in conc]),
        "latency_ratio": spread(lat),
        "sequential_cpu_ms_per_token": spread([s["server_cpu_ms_per_token"] for s in seq]),
        "concurrent_cpu_ms_per_token": spread([c["server_cpu_ms_per_token"] for c in conc]),
        "cpu_efficiency_ratio": spread(cpu),  # server CPU per token, sequential / concurrent
        "answers_identical": all(s["answers"] == c["answers"] for s, c in zip(seq, conc)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="registry name or .gguf (default: the demo)")
    source.add_argument("--synthetic", action="store_true", help="a random real-vocabulary model (see above)")
    parser.add_argument("--clients", default="4", help="concurrent clients, comma-separated (e.g. 2,4,8)")
    parser.add_argument("--requests", type=int, default=12, help="requests per mode and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved sequential/concurrent rounds")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request")
    parser.add_argument("--steps", type=int, default=None, help="denoising step cap per canvas (extra field)")
    parser.add_argument("--threads", type=int, default=None, help="dg serve --threads")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a mode may take")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    clients = sorted({int(c) for c in args.clients.split(",")})

    import openai
    import psutil

    with tempfile.TemporaryDirectory() as tmp:
        model = str(synthetic_model(Path(tmp))) if args.synthetic else (args.model or "demo")
        # the id the requests name (a server answers 404 for another model)
        serve_args = ["-m", model, "--alias", "bench", "--parallel", str(max(clients)), "--queue", str(args.requests)]
        if args.threads:
            serve_args += ["--threads", str(args.threads)]
        with ServeProcess(*serve_args, start_timeout=args.timeout) as served:
            server = psutil.Process(served.proc.pid)
            client = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=args.timeout)
            one_request(client, 0, args)  # warm-up
            report = {"model": "synthetic vocab 262144, 2 layers, hidden 256" if args.synthetic else model,
                      "requests": args.requests, "max_tokens": args.max_tokens, "steps": args.steps, "by_clients": []}
            for n in clients:
                rounds = []
                for _ in range(args.rounds):  # A/B interleaved, so drift hits both alike
                    rounds.append({"sequential": run_mode(client, server, 1, args),
                                   "concurrent": run_mode(client, server, n, args)})
                report["by_clients"].append(summarize(rounds, n))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model: {report['model']}; {args.requests} requests per mode, max_tokens {args.max_tokens}, "
          f"steps {args.steps or 'model default'}, {args.rounds} interleaved rounds (min / median)")
    print(f"{'clients':>7}  {'1-at-a-time tok/s':>18}  {'concurrent tok/s':>17}  {'ratio':>11}  "
          f"{'latency 1-at-a-time':>20}  {'latency concurrent':>19}  {'CPU ms/token 1 / N':>19}  same answers")
    for row in report["by_clients"]:
        def mm(d, fmt="{:.1f}"):
            return f"{fmt.format(d['min'])} / {fmt.format(d['median'])}"
        print(f"{row['clients']:>7}  {mm(row['sequential_tok_per_s']):>18}  {mm(row['concurrent_tok_per_s']):>17}  "
              f"{mm(row['throughput_ratio'], '{:.2f}'):>11}  {mm(row['sequential_latency_median_s'], '{:.3f}s'):>20}  "
              f"{mm(row['concurrent_latency_median_s'], '{:.3f}s'):>19}  "
              f"{row['sequential_cpu_ms_per_token']['median']:>8.1f} / {row['concurrent_cpu_ms_per_token']['median']:<8.1f}  "
              f"{'yes' if row['answers_identical'] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
