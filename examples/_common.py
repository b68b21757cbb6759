"""Shared bits of the experiment scripts: run the installed `dg`, read its JSON, save figures."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed

HERE = Path(__file__).resolve().parent


def dg_executable() -> str:
    exe = Path(sys.executable).parent / "dg"
    return str(exe) if exe.exists() else (shutil.which("dg") or "dg")


def run_dg(*args: str) -> str:
    """Run `dg ARGS`; on failure show dg's one-line error and stop."""
    proc = subprocess.run([dg_executable(), *map(str, args)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        sys.exit(f"dg {' '.join(map(str, args))} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    return proc.stdout


def parser(description: str, default_model: str = "demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=default_model, help="registry name or .gguf path (default: %(default)s)")
    p.add_argument("--out", type=Path, default=HERE / "out", help="where tables and figures go (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None)
    return p


def threads_args(threads: int | None) -> list[str]:
    return ["--threads", str(threads)] if threads else []


def read_trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_table(path: Path, header: list[str], rows: list[list]) -> None:
    """A tab-separated table, also echoed to the terminal."""
    lines = ["\t".join(header)] + ["\t".join(str(c) for c in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"-> {path}")
