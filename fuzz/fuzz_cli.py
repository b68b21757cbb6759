"""dg against hostile use: unsafe output paths, a hostile hub, concurrent pulls, a full context,
signals, bad command lines and malformed checkpoints (issue 9, part A). Each case runs the real
`dg` (or, for the hub, `dgcli.hub.download`) in a process of its own with a time and an
address-space limit, then checks what must hold afterwards (the model file intact, the device
still a device, nothing outside the cache ...), and the table says what each run ended as:

  clean      the expected outcome: a one-line `error: ...`, or completed / interrupted as it should,
             and every check afterwards held
  crash      killed by a signal it was not sent
  hang       still running at the time limit
  memory     MemoryError or an allocation failure under the address-space limit
  traceback  a Python traceback (or "Exception ignored")
  other      anything else: a wrong exit status, a missing partial answer, a file lost or replaced

    python fuzz/fuzz_cli.py                 # every case (about 200 runs, a few minutes)
    python fuzz/fuzz_cli.py --only Ctrl-C  # one category (Ctrl-C, SIGTERM, SIGHUP)
    PYTHONPATH=/other/checkout python fuzz/fuzz_cli.py   # another dg, the same cases

Exit status 1 when any run is not clean. Needs the native layer; the checkpoint cases need torch.
Cases that replace /dev nodes use device nodes of their own (mknod, as root) or are skipped.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the fake hub

OUTCOMES = ("clean", "crash", "hang", "memory", "traceback", "other")
MEM_LIMIT = 6 << 30
TIMEOUT_S = 90.0
FORWARD_MARK = b"set_causal_attn"  # llama.cpp logs it around each decoder forward (DG_VERBOSE=1)


@dataclass
class Case:
    category: str
    name: str
    args: list[str]
    expect: str = "error"  # "error" (one line, exit 1) | "ok" (exit 0) | "interrupted" (130) | a number
    check: Callable[["Result"], Optional[str]] = lambda r: None  # a message when something is wrong
    stdin: bytes = b""
    env: dict = field(default_factory=dict)
    signals: list[tuple[int, int]] = field(default_factory=list)  # (forward marks to wait for, signal)
    terminal: bool = False
    python: Optional[str] = None  # run this Python snippet instead of dg


@dataclass
class Result:
    status: Optional[int]
    output: str
    stdout: str
    timed_out: bool


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT, MEM_LIMIT))
    os.setsid()


def run(case: Case) -> Result:
    argv = [sys.executable, "-c", case.python] if case.python else [sys.executable, "-m", "dgcli.cli", *case.args]
    env = dict(os.environ, COLUMNS="100", **case.env)
    if case.signals:
        env["DG_VERBOSE"] = "1"
    if case.terminal:
        import pty

        master, slave = pty.openpty()
        proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, preexec_fn=_limit)
        os.close(slave)
        streams = {master: bytearray()}
        out_fd = err_fd = master
    else:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                preexec_fn=_limit)
        proc.stdin.write(case.stdin)
        proc.stdin.close()
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        streams = {out_fd: bytearray(), err_fd: bytearray()}
    import select

    pending = list(case.signals)
    deadline = time.monotonic() + TIMEOUT_S
    open_fds = set(streams)
    while open_fds:
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Result(None, b"".join(streams.values()).decode("utf-8", "replace"), "", True)
        ready, _, _ = select.select(list(open_fds), [], [], 0.05)
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if data:
                streams[fd].extend(data)
            else:
                open_fds.discard(fd)
        seen = sum(s.count(FORWARD_MARK) for s in streams.values())
        while pending and seen >= pending[0][0] and proc.poll() is None:
            proc.send_signal(pending.pop(0)[1])
            time.sleep(0.05)
    try:
        status = proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return Result(None, "", "", True)
    text = {fd: s.decode("utf-8", "replace") for fd, s in streams.items()}
    return Result(status, text[err_fd] if err_fd != out_fd else text[out_fd], text[out_fd], False)


def classify(case: Case, r: Result) -> tuple[str, str]:
    both = r.output + r.stdout
    if r.timed_out:
        return "hang", ""
    if "Traceback (most recent call last)" in both or "Exception ignored" in both:
        return "traceback", both[-400:]
    if "MemoryError" in both or "bad_alloc" in both:
        return "memory", ""
    sent = {s for _, s in case.signals}
    if r.status < 0 and not (-r.status in sent and -r.status == signal.SIGINT):
        return ("memory" if r.status == -signal.SIGKILL else "crash"), f"signal {-r.status}"
    lines = [line for line in r.output.splitlines() if line.strip() and FORWARD_MARK.decode() not in line
             and not line.startswith(("canvas ", "llama", "load", "print_info", "~llama", "graph", "sched", "."))]
    if case.expect == "error":
        if r.status != 1 or not lines or not lines[-1].startswith("error: "):
            return "other", f"exit {r.status}: {lines[-1:]}"
    elif case.expect == "ok" and r.status != 0:
        return "other", f"exit {r.status}: {lines[-2:]}"
    elif case.expect == "interrupted" and r.status not in (130, -signal.SIGINT):
        return "other", f"exit {r.status}, not 130"
    elif isinstance(case.expect, int) and r.status != case.expect:
        return "other", f"exit {r.status}, not {case.expect}"
    problem = case.check(r)
    return ("other", problem) if problem else ("clean", "")


# ----------------------------------------------------------------------------------------- cases


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_cases(work: Path, model: Path, ar: Path) -> list[Case]:
    cases = []
    gen = ["generate", "hi", "-m", str(model), "-n", "8", "--steps", "2", "--seed", "0", "--threads", "1"]
    model_sha = sha(model)

    def model_intact(r):
        return None if sha(model) == model_sha else "the model file was changed"

    def no_partials(folder):
        return lambda r: (f"left {[p.name for p in folder.iterdir() if p.name.endswith('.partial')]}"
                          if any(p.name.endswith(".partial") for p in folder.iterdir()) else None)

    existing = work / "existing.jsonl"
    existing.write_text("keep me\n")
    cases.append(Case("writes", "--trace an existing file", gen + ["--trace", str(existing)],
                      check=lambda r: None if existing.read_text() == "keep me\n" else "existing file replaced"))
    forced = work / "forced.jsonl"
    forced.write_text("old\n")
    cases.append(Case("writes", "--trace an existing file --force", gen + ["--trace", str(forced), "--force"], "ok",
                      check=lambda r: None if forced.read_text().startswith('{"kind"') else "not replaced"))
    for flag in ([], ["--force"]):
        cases.append(Case("writes", f"--trace the model {' '.join(flag)}", gen + ["--trace", str(model), *flag],
                          check=model_intact))
    real = work / "real.jsonl"
    real.write_text("target\n")
    link = work / "link.jsonl"
    link.symlink_to(real)
    cases.append(Case("writes", "--trace a symlink to a file", gen + ["--trace", str(link)],
                      check=lambda r: None if link.is_symlink() and real.read_text() == "target\n" else "replaced"))
    link2 = work / "link2.jsonl"
    real2 = work / "real2.jsonl"
    real2.write_text("target\n")
    link2.symlink_to(real2)
    cases.append(Case("writes", "--trace a symlink --force", gen + ["--trace", str(link2), "--force"], "ok",
                      check=lambda r: None if link2.is_symlink() and real2.read_text().startswith('{"kind"')
                      else "symlink replaced or target not written"))
    for node_name, minor in (("full", 7), ("null", 3)):
        node = work / f"dev-{node_name}"
        try:
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, minor))
        except PermissionError:
            continue
        expect = "error" if node_name == "full" else "ok"
        cases.append(Case("writes", f"--trace a {node_name} device", gen + ["--trace", str(node)], expect,
                          check=lambda r, node=node: None if stat.S_ISCHR(os.lstat(node).st_mode)
                          else "the device node was replaced by a file"))
    cases.append(Case("writes", "--trace -", gen + ["--trace", "-"], "ok",
                      check=lambda r: None if '"kind": "step"' in r.stdout else "no trace on stdout"))
    cases.append(Case("writes", "--trace /proc/self/fd/1", gen + ["--trace", "/proc/self/fd/1"], "ok",
                      check=lambda r: None if '"kind": "step"' in r.stdout else "no trace on stdout"))
    cases.append(Case("writes", "--trace into an unwritable folder", gen + ["--trace", "/proc/self/t.jsonl"]))
    cases.append(Case("writes", "--trace into a missing folder", gen + ["--trace", str(work / "no" / "t.jsonl")]))
    cases.append(Case("writes", "--trace a folder", gen + ["--trace", str(work)]))
    fifo = work / "fifo"
    os.mkfifo(fifo)
    cases.append(Case("writes", "--trace a FIFO with a reader", gen + ["--trace", str(fifo)], "ok",
                      check=lambda r: None if stat.S_ISFIFO(os.lstat(fifo).st_mode) else "FIFO replaced",
                      env={"_READER": str(fifo)}))
    prompts = work / "prompts.txt"
    prompts.write_text("hi\n")
    cases.append(Case("writes", "bench -o its prompt file --force",
                      ["bench", "-m", str(model), "--ar-model", str(ar), "--prompts", str(prompts), "--repeat", "1",
                       "-n", "4", "--steps", "2", "--no-speed-model", "-o", str(prompts), "--force"],
                      check=lambda r: None if prompts.read_text() == "hi\n" else "prompt file replaced"))
    term_dir = work / "sigterm"
    term_dir.mkdir()
    cases.append(Case("writes", "SIGTERM while writing --trace",
                      ["generate", "tell me a story", "-m", str(model), "-n", "4000", "--steps", "48", "--seed", "0",
                       "--threads", "1", "--trace", str(term_dir / "t.jsonl")], 143,
                      check=lambda r: None if not list(term_dir.iterdir()) else f"left {list(term_dir.iterdir())}",
                      signals=[(12, signal.SIGTERM)]))
    return cases


def convert_cases(work: Path) -> list[Case]:
    try:
        from dgcli.testing.reference import random_model, save_checkpoint, tiny_config
    except ImportError:
        return []
    ckpt = save_checkpoint(random_model(tiny_config(), seed=0), work / "ckpt", config_form="google")
    weights = sha(ckpt / "model.safetensors")
    intact = lambda r: None if sha(ckpt / "model.safetensors") == weights else "the checkpoint's weights were changed"  # noqa: E731
    cases = [Case("writes", "convert over its own weights --force",
                  ["convert", str(ckpt), str(ckpt / "model.safetensors"), "--outtype", "f32", "--force"], check=intact),
             Case("writes", "convert over its config --force",
                  ["convert", str(ckpt), str(ckpt / "config.json"), "--outtype", "f32", "--force"], check=intact)]
    out = work / "conv.gguf"
    cases.append(Case("writes", "convert --ar-twin = OUT",
                      ["convert", str(ckpt), str(out), "--ar-twin", str(work / "." / "conv.gguf"), "--outtype", "f32"],
                      check=lambda r: None if not out.exists() else "wrote the output"))
    # the malformed-checkpoint cases of the test suite, each on its own copy
    import test_convert_malformed as malformed

    for name, (mutate, _fragment) in malformed.CASES.items():
        copy = work / f"bad-{len(cases)}"
        shutil.copytree(ckpt, copy)
        mutate(copy)
        cases.append(Case("checkpoints", name, ["convert", str(copy), str(work / f"bad-{len(cases)}.gguf"),
                                                "--outtype", "f32"]))
    return cases


def bad_input_cases(work: Path, model: Path, ar: Path) -> list[Case]:
    base = ["generate", "hi", "-m", str(model), "-n", "4", "--steps", "2"]
    locked = work / "locked.gguf"
    locked.write_bytes(b"GGUF" + bytes(60))
    locked.chmod(0)
    fifo = work / "model-fifo.gguf"
    os.mkfifo(fifo)
    regdir = work / "regdir"
    regdir.mkdir()
    cases = [
        Case("command lines", "prompt not UTF-8 (argv)", ["generate", os.fsdecode(b"\xff\xfe hi"), "-m", str(model)]),
        Case("command lines", "prompt not UTF-8 (stdin)", ["generate", "-m", str(model)], stdin=b"hi \xfe"),
        Case("command lines", "--seed -1 (a random seed, as llama-cli's)", base + ["--seed", "-1"], "ok",
             check=lambda r: None if " seed " in r.output else "the seed it used is not shown"),
        Case("command lines", "--seed -2", base + ["--seed", "-2"]),
        Case("command lines", "--seed 2**64", base + ["--seed", str(2**64)]),
        Case("command lines", "compare --seed -2", ["compare", "hi", "-m", str(model), "--ar-model", str(ar), "--seed", "-2"]),
        Case("command lines", "bench --seed 2**32-1 --repeat 2", ["bench", "-m", str(model), "--ar-model", str(ar),
                                                                  "--seed", str(2**32 - 1), "--repeat", "2"]),
        Case("command lines", "--threads 2**31", base + ["--threads", str(2**31)]),
        Case("command lines", "--threads 0", base + ["--threads", "0"]),
        Case("command lines", "--gpu-layers 2**70", base + ["--gpu-layers", str(2**70)]),
        Case("command lines", "--gpu-layers -2", base + ["--gpu-layers", "-2"]),
        Case("command lines", "-m ''", ["generate", "hi", "-m", ""]),
        Case("command lines", "-m of 300 characters", ["generate", "hi", "-m", "a" * 300]),
        Case("command lines", "-m path of 300 characters", ["generate", "hi", "-m", "a" * 300 + ".gguf"]),
        Case("command lines", "info of 300 characters", ["info", "a" * 300 + ".gguf"]),
        Case("command lines", "-m /proc/self/mem", ["generate", "hi", "-m", "/proc/self/mem"]),
        Case("command lines", "info /proc/self/mem", ["info", "/proc/self/mem"]),
        Case("command lines", "-m /proc/self/clear_refs", ["generate", "hi", "-m", "/proc/self/clear_refs"]),
        Case("command lines", "-m /dev/zero", ["generate", "hi", "-m", "/dev/zero"]),
        Case("command lines", "-m a FIFO", ["generate", "hi", "-m", str(fifo)]),
        Case("command lines", "-m an unreadable file", ["generate", "hi", "-m", str(locked)]),
        Case("command lines", "registry is a folder", ["list"], env={"DG_REGISTRY": str(regdir)}),
        Case("command lines", "-n 0", base[:-4] + ["-n", "0"]),
        Case("command lines", "--steps -1", base[:-2] + ["--steps", "-1"]),
        Case("command lines", "empty prompt", ["generate", "", "-m", str(model)]),
    ]
    for i, text in enumerate(["models = 3", "[models.x]\nrole='diffusion'\nrepo='a/b'\nfiles=5",
                              "[models.x]\nrole='diffusion'\nrepo='a/b'\n[models.x.files]\nQ={file='f.gguf', size_gb='x'}",
                              "[models.x]\nrole='diffusion'\nrepo='a/b'\n[models.x.files]\nQ={file=7}",
                              "[models.x]\nrole='diffusion'\nrepo='../../x'\n[models.x.files]\nQ={file='f.gguf'}",
                              "[models.x]\nrole='diffusion'\nrepo='a/b'\n[models.x.files]\nQ={file='../../etc/passwd'}",
                              "[models.x]\nrole=5", "[models]\nx=1", "[models.x]\nrole='diffusion'\nshipped=3",
                              "[models.x]\nrole='diffusion'\nshipped='x.gguf'\npair=[]"]):
        reg = work / f"reg{i}.toml"
        reg.write_text(text)
        cases.append(Case("command lines", f"registry: {text.splitlines()[-1][:40]}", ["list"],
                          env={"DG_REGISTRY": str(reg)}))
    return cases


def context_cases(work: Path, model: Path, ar: Path) -> list[Case]:
    """The issue's reproducer (`generate --json --trace -n 2000` on the demo, which now ends that
    answer with a canvas of padding) on the random model, whose answers fill any context."""
    trace = work / "ctx.jsonl"
    small = ["-n", "100000", "-c", "256", "--steps", "2", "--seed", "0", "-m", str(model)]

    def kept(r):
        try:
            doc = json.loads(r.stdout)
        except ValueError:
            return "no JSON on stdout"
        if doc["result"]["stop_reason"] != "context_full":
            return f"stop_reason {doc['result']['stop_reason']}"
        return None if trace.exists() and trace.read_text().strip() else "no trace"

    def both_sides(r):
        doc = json.loads(r.stdout)
        stops = [doc[side]["result"]["stop_reason"] for side in ("diffusion", "autoregressive")]
        return None if stops == ["context_full"] * 2 else f"stop reasons {stops}"

    return [Case("context full", "generate --json --trace", ["generate", "--json", "--trace", str(trace), *small, "hi"],
                 "ok", check=kept),
            Case("context full", "generate piped", ["generate", *small, "hi"], "ok",
                 check=lambda r: None if "stop=context_full" in r.output else "no stop=context_full"),
            Case("context full", "compare --json", ["compare", "--json", *small, "--ar-model", str(ar), "hi"], "ok",
                 check=both_sides),
            Case("context full", "the demo, -n 2000 (the issue's command)",
                 ["generate", "--json", "-n", "2000", "--seed", "0",
                  "Tell me a long story about a dragon who lives in the mountains"], "ok",
                 check=lambda r: None if json.loads(r.stdout)["result"]["stop_reason"] in ("context_full", "pad_canvas")
                 else "neither context_full nor pad_canvas")]


def signal_cases(model: Path, ar: Path, repeats: int) -> list[Case]:
    cases = []
    sampler = ["--steps", "48", "--seed", "0", "--threads", "1"]
    commands = {
        "generate": ["generate", "tell me a story", "-m", str(model), "-n", "4000", *sampler],
        "compare": ["compare", "tell me a story", "-m", str(model), "--ar-model", str(ar), "-n", "4000", *sampler],
        "bench": ["bench", "-m", str(model), "--ar-model", str(ar), "-n", "16", "--steps", "4", "--repeat", "50",
                  "--threads", "1", "--no-speed-model"],
    }

    def produced(kind, mode):
        def check(r):
            if mode == "json":
                try:
                    doc = json.loads(r.stdout)
                except ValueError:
                    return "no JSON"
                ok = {"generate": lambda d: d["result"]["interrupted"],
                      "compare": lambda d: d["diffusion"]["result"]["interrupted"] or d["autoregressive"]["result"]["interrupted"],
                      "bench": lambda d: d["interrupted"]}[kind](doc)
                return None if ok else "JSON not marked interrupted"
            text = r.output + r.stdout
            marks = {"generate": "stop=interrupted", "compare": "interrupted", "bench": "interrupted (Ctrl-C)"}
            return None if marks[kind] in text else "no partial answer"
        return check

    for kind, args in commands.items():
        for mode in ("terminal", "piped", "json"):
            for i in range(repeats):
                at = (6, 12, 30, 60, 90)[i % 5] * (4 if kind == "bench" else 1)
                cases.append(Case("Ctrl-C", f"{kind} {mode} after {at} marks",
                                  args + (["--json"] if mode == "json" else []), "interrupted",
                                  check=produced(kind, mode), signals=[(at, signal.SIGINT)],
                                  terminal=mode == "terminal"))
    long_run = commands["generate"]
    cases.append(Case("Ctrl-C", "second Ctrl-C", long_run, "interrupted",
                      signals=[(12, signal.SIGINT), (12, signal.SIGINT)]))
    cases.append(Case("Ctrl-C", "SIGTERM on a terminal", long_run, 143, terminal=True, signals=[(12, signal.SIGTERM)],
                      check=lambda r: None if r.output.rfind("\x1b[?25h") > r.output.rfind("\x1b[?25l") else "cursor hidden"))
    cases.append(Case("Ctrl-C", "SIGHUP", long_run, 129, signals=[(12, signal.SIGHUP)]))
    return cases


HUB_RUN = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from hub_server import FakeHub
hub_srv = FakeHub(); hub_srv.thread.start()
os.environ.update(HF_ENDPOINT=hub_srv.url, HF_HUB_CACHE={cache!r}, NO_PROXY="127.0.0.1", HF_HUB_DISABLE_XET="1")
payload = bytes(range(256)) * 4096
hub_srv.files[("org/model-GGUF", "m.gguf")] = payload
for k, v in json.loads({knobs!r}).items():
    setattr(hub_srv, k, bytes(reversed(payload)) if k == "served" else v)  # served: the same size, other bytes
from dgcli import hub
from dgcli.errors import DgError
try:
    path = hub.download({repo!r}, {name!r})
    print("downloaded", Path(path).read_bytes() == payload)
except DgError as err:
    print("error:", err, file=sys.stderr)
    sys.exit(1)
"""


def hub_cases(work: Path, repeats: int) -> list[Case]:
    cases = []

    def outside(folder: Path):
        """Nothing written beside the cache but the user's own file."""
        allowed = {folder / "cache", folder / "x", folder / "x" / "m.gguf"}

        def check(r):
            stray = [p for p in folder.rglob("*") if p not in allowed and folder / "cache" not in p.parents]
            return f"wrote outside the cache: {stray}" if stray else None
        return check

    variants = {
        "ETag ../../../x/owned": ({"etag": "../../../x/owned"}, "ok"),
        "ETag not a sha256, bytes corrupted": ({"etag": "abc", "served": True}, "error"),
        "X-Repo-Commit ../../../x": ({"commit": "../../../x"}, "error"),
        "X-Repo-Commit empty": ({"commit": ""}, "error"),
        "metadata sha256 ../../x": ({"api_sha256": "../../x"}, "error"),
        "metadata sha256 of other bytes": ({"api_sha256": "0" * 64}, "error"),
        "ETag contradicts the metadata": ({"etag": "f" * 64}, "error"),
        "non-LFS file, bytes corrupted": ({"lfs": False, "served": True}, "error"),
        "non-LFS file": ({"lfs": False}, "ok"),
    }
    for name, (knobs, expect) in variants.items():
        folder = work / f"hub-{len(cases)}"
        (folder / "x").mkdir(parents=True)
        (folder / "x" / "m.gguf").write_text("user file")
        check_outside = outside(folder)

        def check(r, folder=folder, check_outside=check_outside, expect=expect):
            if expect == "ok" and "downloaded True" not in r.stdout:
                return "wrong bytes"
            user = folder / "x" / "m.gguf"
            if user.is_symlink() or user.read_text() != "user file":
                return "the user's file was replaced"
            return check_outside(r)
        code = HUB_RUN.format(tests=str(ROOT / "tests"), cache=str(folder / "cache"), knobs=json.dumps(knobs),
                              repo="org/model-GGUF", name="m.gguf")
        cases.append(Case("hostile hub", name, [], expect, check=check, python=code))
    for repo, name in (("../../x", "m.gguf"), ("org/model-GGUF", "../../../x.gguf"), ("org/model-GGUF", "/etc/passwd")):
        folder = work / f"hub-{len(cases)}"
        folder.mkdir()
        code = HUB_RUN.format(tests=str(ROOT / "tests"), cache=str(folder / "cache"), knobs="{}", repo=repo, name=name)
        cases.append(Case("hostile hub", f"repo {repo!r} file {name!r}", [], "error", check=outside(folder), python=code))
    for i in range(repeats):
        folder = work / f"pull-{i}"
        folder.mkdir()
        cases.append(Case("concurrent pull", f"two pulls at once #{i + 1}", [], "ok",
                          python=CONCURRENT.format(tests=str(ROOT / "tests"), cache=str(folder / "cache"))))
    return cases


CONCURRENT = """
import hashlib, os, subprocess, sys
sys.path.insert(0, {tests!r})
from hub_server import FakeHub
srv = FakeHub(); srv.thread.start()
big = bytes(range(256)) * 4096 * 4
srv.files[("org/model-GGUF", "m.gguf")] = big
srv.seconds_per_chunk = 0.01
env = dict(os.environ, HF_ENDPOINT=srv.url, HF_HUB_CACHE={cache!r}, NO_PROXY="127.0.0.1", HF_HUB_DISABLE_XET="1")
pull = "from dgcli import hub; print(hub.download('org/model-GGUF', 'm.gguf'))"
procs = [subprocess.Popen([sys.executable, "-c", pull], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
         for _ in range(2)]
outs = [p.communicate() for p in procs]
codes = [p.returncode for p in procs]
paths = {{o.strip() for o, _ in outs}}
ok = codes == [0, 0] and len(paths) == 1 and hashlib.sha256(open(paths.pop(), "rb").read()).hexdigest() == hashlib.sha256(big).hexdigest()
print("\\n".join(e for _, e in outs), file=sys.stderr)
sys.exit(0 if ok else 3)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="one category: writes, checkpoints, command lines, context full, Ctrl-C, "
                                   "hostile hub, concurrent pull")
    ap.add_argument("--repeat", type=int, default=5, help="trials per signal combination and of concurrent pulls")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    from dgcli.testing.tiny import write_tiny_random_gguf

    with tempfile.TemporaryDirectory(prefix="dg-fuzz-cli-") as tmp:
        work = Path(tmp)
        model = write_tiny_random_gguf(work / "tiny-diffusion.gguf", seed=0)
        ar = write_tiny_random_gguf(work / "tiny-ar.gguf", seed=0, arch="gemma4")
        # the write cases get models of their own: a dg that writes over its input must not spoil the rest
        (work / "writes").mkdir()
        victim, victim_ar = (Path(shutil.copy(m, work / "writes" / m.name)) for m in (model, ar))
        cases = (write_cases(work / "writes", victim, victim_ar) + convert_cases(work) + bad_input_cases(work, model, ar)
                 + context_cases(work, model, ar) + signal_cases(model, ar, args.repeat) + hub_cases(work, args.repeat))
        if args.only:
            cases = [c for c in cases if c.category == args.only]
        table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        failures = []
        for case in cases:
            reader = None
            if "_READER" in case.env:  # a FIFO's reader
                fifo = case.env["_READER"]
                reader = threading.Thread(target=lambda f=fifo: Path(f).read_bytes(), daemon=True)
                reader.start()
            outcome, why = classify(case, run(case))
            table[case.category][outcome] += 1
            if outcome != "clean":
                failures.append((case.category, case.name, outcome, why))
            if args.verbose:
                print(f"{outcome:9} {case.category}: {case.name} {why}", flush=True)
    print(f"{'category':16} {'tried':>5} " + " ".join(f"{o:>9}" for o in OUTCOMES))
    for category, counts in table.items():
        print(f"{category:16} {sum(counts.values()):5} " + " ".join(f"{counts[o]:9}" for o in OUTCOMES))
    total = collections.Counter()
    for counts in table.values():
        total.update(counts)
    print(f"{'all':16} {sum(total.values()):5} " + " ".join(f"{total[o]:9}" for o in OUTCOMES))
    for failure in failures:
        print("not clean:", *failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
