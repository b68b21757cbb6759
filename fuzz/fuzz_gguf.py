#!/usr/bin/env python3
"""Fuzz dg with malformed GGUFs made from the shipped demo pair; print what each run ended as.

    python fuzz/fuzz_gguf.py                      # 750 mutants (the issue-9 goal), fork mode
    python fuzz/fuzz_gguf.py --sample 16 --seed 1 # a seeded subset (tests/test_fuzz.py runs one)
    python fuzz/fuzz_gguf.py --exec               # each run a fresh `python -m dgcli.cli` (slower, exact)
    python fuzz/fuzz_gguf.py --only 17 --keep out # one mutant, its file and output kept in out/

The dg under test is whatever `import dgcli` finds: run this with another checkout first on
PYTHONPATH to measure it (e.g. `PYTHONPATH=/work/main python fuzz/fuzz_gguf.py`).

Each mutant (fuzz/mutants.py) is run through `dg info` and, for a diffusion base, `dg generate`,
for an AR base, `dg compare` with the demo diffusion model on the other side. Every run gets a
wall-clock limit and an address-space limit, in its own process group. Outcomes:
  clean      non-zero exit, and the last line on stderr is `error: ...` (one line, nothing native)
  completed  exit 0
  crash      killed by a signal (SIGABRT from GGML_ASSERT, SIGSEGV, ...), or native abort text
  hang       still running at the time limit (killed)
  memory     peak RSS over the memory threshold, or an allocation failure (MemoryError, bad_alloc)
  traceback  a Python traceback
  other      a non-zero exit that fits none of the above (e.g. a message not in the one-line form)

Fork mode imports dgcli once and forks a child per run (a run costs what dg does, not Python's
start-up); the child calls the same `dgcli.cli.main` a `dg` process would.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants import CATEGORIES, Mutant, make_mutants  # noqa: E402

OUTCOMES = ("clean", "completed", "crash", "hang", "memory", "traceback", "other")
BAD = ("crash", "hang", "memory", "traceback", "other")
NATIVE_ABORT_MARKERS = ("GGML_ASSERT", "terminate called", "Aborted", "Segmentation fault", "core dumped",
                        "GGML_ABORT", "libggml-base.so(", "libllama.so(")
MEMORY_MARKERS = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "failed to allocate", "out of memory",
                  "unable to allocate")


@dataclass
class Run:
    mutant: int
    category: str
    base: str
    description: str
    command: str
    outcome: str
    exit_code: int | None
    signal: int | None
    seconds: float
    max_rss_mb: float
    last_line: str


def shipped_models() -> Path:
    """The demo pair shipped with the dg under test (the mutants' bases)."""
    import dgcli

    return Path(dgcli.__file__).resolve().parent / "models"


def dg_commands(mutant_path: str, base: str, demo_diffusion: str) -> list[list[str]]:
    if base == "diffusion":
        return [["info", mutant_path],
                ["generate", "hello", "-m", mutant_path, "-n", "8", "--seed", "0", "--no-live"]]
    return [["info", mutant_path],
            ["compare", "hello", "-m", demo_diffusion, "--ar-model", mutant_path, "-n", "8", "--seed", "0",
             "--no-live"]]


def _limit_child(mem_bytes: int) -> None:
    os.setpgid(0, 0)
    resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _wait(pid: int, timeout: float) -> tuple[int | None, bool, float]:
    """(wait status, timed out, peak RSS in MB) of a child in its own process group."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, False, usage.ru_maxrss / 1024
        if time.monotonic() > deadline:
            for sig in (signal.SIGKILL,):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
            _, status, usage = os.wait4(pid, 0)
            return status, True, usage.ru_maxrss / 1024
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def run_forked(args: list[str], out_path: str, timeout: float, mem_bytes: int) -> tuple[int | None, bool, float]:
    pid = os.fork()
    if pid == 0:  # child: become `dg ARGS`
        code = 1
        try:
            _limit_child(mem_bytes)
            fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.argv = ["dg", *args]
            from dgcli.cli import main
            try:
                main()
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            except BaseException:  # noqa: BLE001 - what an uncaught exception does to a real `dg`
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    return _wait(pid, timeout)


def run_exec(args: list[str], out_path: str, timeout: float, mem_bytes: int) -> tuple[int | None, bool, float]:
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dgcli.cli", *args], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=lambda: _limit_child(mem_bytes))
    return _wait(proc.pid, timeout)


def classify(status: int | None, timed_out: bool, rss_mb: float, output: str, rss_limit_mb: float) -> str:
    if timed_out:
        return "hang"
    if "Traceback (most recent call last)" in output:
        return "traceback"
    if rss_mb > rss_limit_mb or any(m in output for m in MEMORY_MARKERS):
        return "memory"
    if status is not None and os.WIFSIGNALED(status):
        return "memory" if os.WTERMSIG(status) == signal.SIGKILL else "crash"
    if any(m in output for m in NATIVE_ABORT_MARKERS):
        return "crash"
    code = os.WEXITSTATUS(status) if status is not None else None
    if code == 0:
        return "completed"
    lines = [line for line in output.splitlines() if line.strip()]
    if code in (1, 2) and lines and lines[-1].startswith("error: "):
        return "clean"
    return "other"


# What dg imports on the way to a model load; imported once in the parent so that each forked run
# pays only for its own work. llama_cpp is only loaded (dlopen), never run, before a fork.
PRELOAD = ("dgcli.cli", "dgcli.modelfile.info", "dgcli.runtime.model", "dgcli.engine.diffusion", "dgcli.engine.autoregressive",
           "dgcli.modelfile.header", "dgcli.cli.render", "dgcli.bench", "gguf", "numpy", "psutil", "jinja2",
           "jinja2.sandbox", "rich.table", "rich.live", "llama_cpp.llama_cpp")


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this version of dg does not have
            pass


def run_mutants(mutants: Iterable[Mutant], *, mode: str, timeout: float, mem_mb: int, rss_limit_mb: float,
                keep: Path | None, progress: bool) -> tuple[list[Run], list[Mutant]]:
    runner = run_forked if mode == "fork" else run_exec
    if mode == "fork":
        _preload()
    demo = str(shipped_models() / "demo-diffusion.gguf")
    runs: list[Run] = []
    done: list[Mutant] = []
    with tempfile.TemporaryDirectory(prefix="dg-fuzz-") as tmp:
        for i, m in enumerate(mutants):
            path = os.path.join(tmp, f"mutant-{m.index}.gguf")
            with open(path, "wb") as f:
                f.write(m.data)
            # only the file keeps the bytes: a forked run counts the parent's resident pages in its
            # own peak RSS, and the caller's generator still holds this Mutant, so it is emptied in place
            m.data = b""
            done.append(m)
            bad_here = False
            for args in dg_commands(path, m.base, demo):
                out_path = os.path.join(tmp, "out.txt")
                t0 = time.monotonic()
                status, timed_out, rss = runner(args, out_path, timeout, mem_mb << 20)
                seconds = time.monotonic() - t0
                output = Path(out_path).read_text(encoding="utf-8", errors="replace")
                outcome = classify(status, timed_out, rss, output, rss_limit_mb)
                lines = [line for line in output.splitlines() if line.strip()]
                runs.append(Run(m.index, m.category, m.base, m.description, args[0], outcome,
                                os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None,
                                os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None,
                                round(seconds, 3), round(rss, 1), (lines[-1] if lines else "")[:300]))
                if outcome in BAD and keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    (keep / f"mutant-{m.index}-{args[0]}.txt").write_text(
                        f"{m.category} / {m.base}: {m.description}\n$ dg {' '.join(args)}\n{outcome}\n\n{output}")
                    bad_here = True
                if progress:
                    sys.stderr.write(f"\r{i + 1} mutants  {len(runs)} runs  "
                                     f"last: {m.category} {args[0]} {outcome:<9}")
                    sys.stderr.flush()
            if bad_here and keep is not None:
                shutil.copyfile(path, keep / f"mutant-{m.index}.gguf")
    if progress:
        sys.stderr.write("\n")
    return runs, done


def table(runs: list[Run], mutants: list[Mutant]) -> str:
    by_cat: dict[str, Counter] = defaultdict(Counter)
    n_mut = Counter(m.category for m in mutants)
    for r in runs:
        by_cat[r.category][r.outcome] += 1
    cols = ("category", "mutants", "runs", *OUTCOMES)
    rows = []
    total: Counter = Counter()
    for cat in CATEGORIES:
        if cat not in n_mut:
            continue
        c = by_cat[cat]
        row = [cat, n_mut[cat], sum(c.values()), *(c[o] for o in OUTCOMES)]
        total.update(c)
        rows.append(row)
    rows.append(["total", len(mutants), sum(total.values()), *(total[o] for o in OUTCOMES)])
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    fmt = lambda row: "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w)  # noqa: E731
                                for i, (x, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(cols), fmt(["-" * w for w in widths]), *map(fmt, rows[:-1]),
                      fmt(["-" * w for w in widths]), fmt(rows[-1])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=750, help="mutants (default 750)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="comma-separated mutant indices to run")
    ap.add_argument("--sample", type=int, default=None,
                    help="run only this many of the mutants, chosen by --seed (a fast subset: tests/test_fuzz.py)")
    ap.add_argument("--category", choices=CATEGORIES, action="append", help="only these categories")
    ap.add_argument("--exec", dest="mode", action="store_const", const="exec", default="fork",
                    help="a fresh `python -m dgcli.cli` per run instead of forking")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per run before it counts as a hang")
    ap.add_argument("--mem-mb", type=int, default=4096, help="address-space limit per run (MB)")
    ap.add_argument("--rss-limit-mb", type=float, default=1024.0, help="peak RSS above this counts as memory")
    ap.add_argument("--keep", type=Path, default=None, help="save each bad run's mutant and output here")
    ap.add_argument("--json", type=Path, default=None, help="write every run as JSON here")
    ap.add_argument("--bases", type=Path, default=None,
                    help="folder with the demo-diffusion.gguf / demo-ar.gguf to mutate (default: the shipped pair); "
                         "the same bases and seed give the same mutants, e.g. to compare two versions of dg")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    args = ap.parse_args(argv)
    if args.count < 1:
        ap.error("--count must be >= 1")
    models = args.bases or shipped_models()
    bases = {"diffusion": (models / "demo-diffusion.gguf").read_bytes(), "ar": (models / "demo-ar.gguf").read_bytes()}
    wanted = {int(x) for x in args.only.split(",")} if args.only else None
    if args.sample is not None:
        picked = set(random.Random(f"sample:{args.seed}").sample(range(args.count), min(args.sample, args.count)))
        wanted = picked if wanted is None else wanted & picked
    mutants = (m for m in make_mutants(bases, args.count, args.seed)
               if (wanted is None or m.index in wanted) and (not args.category or m.category in args.category))
    t0 = time.monotonic()
    runs, mutants = run_mutants(mutants, mode=args.mode, timeout=args.timeout, mem_mb=args.mem_mb,
                                rss_limit_mb=args.rss_limit_mb, keep=args.keep, progress=not args.quiet)
    print(f"dg under test: {shipped_models().parent}  bases: {models}  mode: {args.mode}  seed: {args.seed}  "
          f"{len(mutants)} mutants, {len(runs)} runs in {time.monotonic() - t0:.0f} s")
    print(table(runs, mutants))
    bad = [r for r in runs if r.outcome in BAD]
    for r in bad:
        print(f"  {r.outcome:<9} #{r.mutant} {r.category}/{r.base} {r.command}: {r.description}  -> {r.last_line[:160]}")
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "count": args.count, "mode": args.mode,
                                         "runs": [asdict(r) for r in runs]}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
