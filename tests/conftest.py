"""Shared fixtures: tiny GGUFs (torch-free) and the tiny Transformers reference with its conversions.

Session-scoped and built lazily, so a test that does not ask for the reference never imports torch.

- tiny_vocab_obj           the dg-tiny tokenizer
- tiny_gguf                torch-free tiny diffusion-gemma GGUF (f32, seed 0)
- tiny_ar_gguf             its AR gemma4 twin (same weights, encoder scalars)
- reference_model          tiny random DiffusionGemmaForBlockDiffusion (skips without torch/transformers)
- reference_checkpoint     its checkpoint dir (Google's config form)
- reference_gguf           that checkpoint converted to f32 in the published layout
- reference_ar_gguf        the AR gemma4 twin of it
"""

from __future__ import annotations

import importlib.util
import signal

import pytest

from dgcli.testing.tiny import tiny_vocab, write_tiny_random_gguf

HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
NO_TORCH_REASON = "torch/transformers not installed (the Transformers reference needs them)"

# A suite started with `&` from a shell without job control (or under nohup) inherits SIGINT/SIGHUP
# as ignored, and so would every dg the tests start: the Ctrl-C and SIGHUP tests would then test
# nothing but the disposition. Give the children the defaults a terminal gives them.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


# A test that takes one of these fixtures needs torch and transformers: it is a `reference` test.
REFERENCE_FIXTURES = frozenset({"reference_model", "reference_checkpoint", "reference_gguf", "reference_ar_gguf"})


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items) -> None:
    """The markers (pyproject.toml) that follow from a test's fixtures, and the skips of `reference`
    tests without torch and transformers and of `native` tests where the patched llama.cpp is not built."""
    for item in items:
        if REFERENCE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.reference)
        if not HAVE_TORCH and item.get_closest_marker("reference") is not None:
            item.add_marker(pytest.mark.skip(reason=NO_TORCH_REASON))
    native_items = [item for item in items if item.get_closest_marker("native") is not None]
    if native_items:
        from native_helpers import NATIVE_OK, NATIVE_REASON  # loads the library: only when a test needs it

        if not NATIVE_OK:
            for item in native_items:
                item.add_marker(pytest.mark.skip(reason=f"native library unavailable: {NATIVE_REASON}"))


def _require_reference() -> None:
    if not HAVE_TORCH:
        pytest.skip(NO_TORCH_REASON)


@pytest.fixture(scope="session")
def tiny_vocab_obj():
    return tiny_vocab()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    return write_tiny_random_gguf(tmp_path_factory.mktemp("tiny") / "tiny-diffusion.gguf", seed=0)


@pytest.fixture(scope="session")
def tiny_ar_gguf(tmp_path_factory):
    return write_tiny_random_gguf(tmp_path_factory.mktemp("tiny-ar") / "tiny-ar.gguf", seed=0, arch="gemma4")


@pytest.fixture(scope="session")
def reference_model():
    _require_reference()
    import torch

    from dgcli.testing.reference import random_model, tiny_config

    torch.set_num_threads(1)
    return random_model(tiny_config(), seed=0)


@pytest.fixture(scope="session")
def reference_checkpoint(reference_model, tmp_path_factory):
    from dgcli.testing.reference import save_checkpoint

    return save_checkpoint(reference_model, tmp_path_factory.mktemp("ckpt") / "google", config_form="google")


@pytest.fixture(scope="session")
def reference_gguf(reference_checkpoint, tmp_path_factory):
    from dgcli.convert import convert_checkpoint

    return convert_checkpoint(reference_checkpoint, tmp_path_factory.mktemp("conv") / "ref-f32.gguf", "f32")


@pytest.fixture(scope="session")
def reference_ar_gguf(reference_checkpoint, tmp_path_factory):
    from dgcli.convert import convert_checkpoint

    return convert_checkpoint(reference_checkpoint, tmp_path_factory.mktemp("conv-ar") / "ref-ar-f32.gguf", "f32",
                              arch="gemma4")


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A fake Hub on 127.0.0.1 with huggingface-hub pointed at it and a private cache."""
    from hub_server import FakeHub

    server = FakeHub()
    server.thread.start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    yield server
    server.server.shutdown()
    server.server.server_close()
