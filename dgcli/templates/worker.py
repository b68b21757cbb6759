"""Renders chat templates for sandbox.py in a child process, under a memory limit.

Run as `python -I -c <this file's text> MEMORY_BYTES LIMIT [DIR...]`: it imports nothing from dgcli,
and the parent's folders that hold llama_cpp and Jinja come after its own standard library (so nothing
of the parent's path can shadow the standard library). LIMIT "address-space": it limits its own
address space (Linux enforces RLIMIT_AS); "parent": it sets none, and the parent watches its memory
(macOS accepts RLIMIT_AS and ignores it, and has no /proc). It renders with llama-cpp-python's
Jinja2ChatFormatter, as dg always has (chat_template.py). One JSON request per line on stdin, one
JSON answer per line on stdout: {"text": ...} or {"error": kind, "detail": ...}; its first line
says it is ready. It ends at the end of its input.
"""

import json
import resource
import signal
import sys

CPU_SECONDS = 120  # renders take milliseconds; this bounds a child left looping by a parent that died
MAX_FORMATTERS = 8


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the parent's to handle
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS + 5))

    sys.path.extend(d for d in sys.argv[3:] if d not in sys.path)
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    if sys.argv[2] == "address-space":
        # what the imports mapped (the native library among them), plus what a render may use
        limit = _address_space() + int(sys.argv[1])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    formatters = {}
    _answer({"ready": True})
    for line in sys.stdin:
        _answer(render(formatters, Jinja2ChatFormatter, json.loads(line)))


def render(formatters, formatter_class, request):
    key = (request["template"], request["bos_token"], request["eos_token"], request["add_generation_prompt"])
    try:
        formatter = formatters.get(key)
        if formatter is None:
            try:
                formatter = formatter_class(request["template"], eos_token=request["eos_token"],
                                            bos_token=request["bos_token"],
                                            add_generation_prompt=request["add_generation_prompt"])
            except Exception as err:  # noqa: BLE001 - a template that does not parse
                return {"error": "parse", "detail": f"{err}"[:300]}
            if len(formatters) >= MAX_FORMATTERS:
                formatters.clear()
            formatters[key] = formatter
        text = formatter(messages=request["messages"], tools=request.get("tools")).prompt
        if len(text) > request["max_chars"]:
            return {"error": "output", "detail": ""}
        return {"text": text}
    except MemoryError:
        return {"error": "memory", "detail": ""}
    except RecursionError:
        return {"error": "template", "detail": "infinite recursion"}
    except Exception as err:  # noqa: BLE001 - anything a template can make Python raise
        return {"error": "template", "detail": f"{err}"[:300] or type(err).__name__}


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _answer(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


main()
