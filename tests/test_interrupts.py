"""Ctrl-C is never lost: llama.cpp logs through a Python ctypes callback during forwards, and a
KeyboardInterrupt raised inside that callback used to be dropped by ctypes ("Exception ignored on
calling ctypes callback function"). These tests put the SIGINT exactly there."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import pytest

from native_helpers import requires_native

pytestmark = requires_native


@contextmanager
def sigint_from_the_log_callback(when: str):
    """Send SIGINT to this process from inside llama.cpp's log callback, on the first line containing `when`."""
    from dgcli.runtime import native

    L = native.lib()
    sent = []

    def on_log(level, text, user_data):
        if not sent and when.encode() in (text or b""):
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        native._on_log(level, text, user_data)

    callback = L.llama_log_callback(on_log)
    L.llama_log_set(callback, None)
    try:
        yield sent
    finally:
        L.llama_log_set(native._log_callback, None)


def test_ctrl_c_inside_a_forward_raises_when_the_forward_returns(tiny_gguf):
    import numpy as np

    from dgcli.runtime.model import DiffusionModel

    with DiffusionModel(tiny_gguf, n_threads=1, n_ctx=128) as m:
        m.prefill(m.chat_prompt("hi"))
        canvas = np.zeros(m.canvas_length, np.int32)
        # the decoder forward logs (set_causal_attn) from inside the native call
        with sigint_from_the_log_callback("set_causal_attn") as sent:
            with pytest.raises(KeyboardInterrupt):
                m.decode_canvas(canvas)
        assert sent
        m.decode_canvas(canvas)  # nothing left pending: the next forward runs


def test_ctrl_c_during_generation_returns_what_was_produced(tiny_gguf):
    from dgcli.engine.diffusion import DiffusionEngine
    from dgcli.params import DiffusionParams

    with DiffusionEngine(tiny_gguf, n_threads=1, n_ctx=256) as engine:
        with sigint_from_the_log_callback("set_causal_attn") as sent:
            result = engine.generate("hi", params=DiffusionParams(max_denoising_steps=4), max_new_tokens=64, seed=0)
    assert sent
    assert result.interrupted and result.stop_reason == "interrupted"


def test_ctrl_c_while_loading_frees_the_model_and_raises(tiny_gguf):
    from dgcli.runtime.model import DiffusionModel

    with sigint_from_the_log_callback("llama_model_loader") as sent:
        with pytest.raises(KeyboardInterrupt):
            DiffusionModel(tiny_gguf, n_threads=1, n_ctx=128)
    assert sent


def test_a_handler_the_application_installed_is_left_alone(tiny_gguf):
    from dgcli.runtime import native

    seen = []
    previous = signal.signal(signal.SIGINT, lambda *a: seen.append(True))
    try:
        with native.deferred_interrupts():
            assert signal.getsignal(signal.SIGINT) is not native._record_interrupt
            os.kill(os.getpid(), signal.SIGINT)
        assert seen == [True]
    finally:
        signal.signal(signal.SIGINT, previous)
