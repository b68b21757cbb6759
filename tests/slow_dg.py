"""`dg` over models as slow as the real one on a CPU: `python tests/slow_dg.py SECONDS dg-args...`.

Loading, each prefill, each denoising step, commit and AR decode of the demo models take SECONDS
more (the real 26B model takes tens of seconds for each on a CPU), so the terminal tests and a
person trying dg in tmux see what shows while dg works. The sleep is interruptible, as a native
forward is not: a Ctrl-C is deferred to its end, as dgcli.runtime.native.deferred_interrupts does.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _slow(seconds: float):
    from dgcli.runtime import native

    def wait() -> None:
        with native.deferred_interrupts():
            time.sleep(seconds)
    return wait


def install(seconds: float) -> None:
    from dgcli.runtime import model

    wait = _slow(seconds)

    def slowed(cls, name: str) -> None:
        original = getattr(cls, name)

        def method(self, *args, **kwargs):
            wait()
            return original(self, *args, **kwargs)
        setattr(cls, name, method)

    for cls, names in ((model.DiffusionModel, ("prefill", "commit", "denoise_step", "decode_canvas")),
                       (model.ArModel, ("prefill", "decode_token"))):
        for name in names:
            slowed(cls, name)
    init = model._LlamaModel.__init__

    def load(self, *args, **kwargs):
        wait()
        init(self, *args, **kwargs)
    model._LlamaModel.__init__ = load


if __name__ == "__main__":
    install(float(sys.argv.pop(1)))
    from dgcli.cli import main

    sys.argv[0] = "dg"
    main()
