"""The page `dg serve` serves at `/`, in headless Chromium at a 360-pixel-wide viewport: a chat box
whose answer shows the canvas denoising live from the server's step stream (accepted tokens on a
green ground, noisy ones dim, the step, temperature and mean entropy), then the final text. A
scripted model holds each denoising step until the test lets it go, so the screenshots catch the
canvas mid-denoise; they are compared by the pixels of accepted tokens. It works with --api-key.
The screenshots are kept in the test's tmp_path (DG_PAGE_SHOTS=DIR keeps a copy there)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from cdp import Browser, chromium_path
from serve_helpers import InProcessServer

SERVE_DEPS = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "PIL"))
pytestmark = [
    pytest.mark.skipif(not SERVE_DEPS, reason="dg serve's test dependencies are missing: pip install -e '.[test]'"),
    pytest.mark.skipif(chromium_path() is None, reason="headless Chromium is not installed (Debian's chromium "
                                                       "package: apt-get install chromium; .ci/run installs it)"),
]

WIDTH = 360
ACCEPTED_BG = (0x1F, 0x7A, 0x4D)  # style.css --accepted-bg
GATE_S = 60
SPECIAL = ["<pad>", "<eos>", "<bos>"]
WORDS = [" The", " canvas", " turns", " into", " text", " one", " step", " at", " a", " time", ".", " It", " shows",
         " here", " live", " Done", "!"]
FILLER = [f" w{i}" for i in range(24)]
PIECES = SPECIAL + WORDS + FILLER
CANVAS = [[PIECES.index(w) for w in WORDS[:15]] + [PIECES.index(".")],
          [PIECES.index(" Done"), PIECES.index("!"), 1] + [0] * 13]
SURE_PER_STEP = 3  # positions that become certain with each step of a canvas


class GatedModel:
    """A one-sequence step-level model whose canvas becomes certain three positions per step (the
    rest uniform noise over filler words), each forward held until the test releases it."""

    canvas_length, vocab_size, n_seq_max, n_ctx, n_ctx_seq, kv_unified = 16, len(PIECES), 1, 256, 256, False
    end_token_ids, pad_token_id = [1], 0

    def __init__(self):
        from dgcli.params import DiffusionParams

        self.default_params = DiffusionParams(max_denoising_steps=12)
        self.gate = threading.Semaphore(0)
        self.canvas_index = self.step = 0
        self.rng = np.random.default_rng(0)

    def chat_tokens(self, messages, add_generation_prompt=True, parse_special=False):
        return [2, 3, 4]

    def detokenize(self, ids):
        return "".join(PIECES[int(t)] for t in ids if int(t) > 2)

    def clear_sequence(self, seq):
        self.canvas_index = self.step = 0

    def prefill(self, tokens, seq=0):
        pass

    def commit(self, canvas, seq=0):
        self.canvas_index += 1
        self.step = 0

    def decode_canvas(self, canvas, sc_logits=None, sc_topk=None):
        assert self.gate.acquire(timeout=GATE_S), "the test never released this step"
        target = CANVAS[min(self.canvas_index, 1)]
        logits = np.full((16, self.vocab_size), -20.0, dtype=np.float32)
        sure = SURE_PER_STEP * (self.step + 1)
        for i in range(16):
            if i < sure:
                logits[i, target[i]] = 20.0
            else:
                logits[i, len(SPECIAL) + len(WORDS):] = self.rng.normal(0, 0.01, len(FILLER))
        self.step += 1
        return logits


def started_server(api_key=None):
    from dgcli.engine.diffusion import DiffusionEngine
    from dgcli.server.app import DgService, ServeConfig
    from dgcli.server.scheduler import BatchScheduler

    model = GatedModel()
    scheduler = BatchScheduler(DiffusionEngine(model, sampler="numpy"), slots=1)
    server = InProcessServer(DgService(scheduler, ServeConfig(model_name="gated", api_key=api_key),
                                       log=lambda line: None))
    server.model, server.scheduler = model, scheduler
    return server


@pytest.fixture
def browser():
    b = Browser(width=WIDTH, height=740)
    yield b
    b.close()


def green_pixels(png_path: Path, rect: dict) -> int:
    from PIL import Image

    image = np.asarray(Image.open(png_path).convert("RGB"))
    x0, y0 = max(int(rect["x"]), 0), max(int(rect["y"]), 0)
    crop = image[y0:y0 + int(rect["height"]) + 1, x0:x0 + int(rect["width"]) + 1]
    return int(np.all(crop == np.array(ACCEPTED_BG, dtype=np.uint8), axis=-1).sum())


def keep(shot: Path) -> None:
    target = os.environ.get("DG_PAGE_SHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(target) / shot.name)


def canvas_state(browser):
    return browser.evaluate("""(() => { const c = document.querySelector('.msg.model .canvas');
        const r = c.getBoundingClientRect();
        return {step: +c.dataset.step, accepted: +c.dataset.accepted, acc_spans: c.querySelectorAll('.tok.acc').length,
                noisy_spans: c.querySelectorAll('.tok.noisy').length, rect: {x: r.x, y: r.y, width: r.width,
                height: r.height}, status: document.querySelector('.msg.model .status').textContent,
                scroll_width: document.documentElement.scrollWidth}; })()""")


def send(browser, text):
    browser.evaluate(f"document.getElementById('prompt').value = {text!r}; "
                     "document.getElementById('ask').requestSubmit(); true")


def test_the_page_shows_the_canvas_denoise_live_then_the_answer_at_360_pixels(browser, tmp_path):
    server = started_server()
    try:
        browser.navigate(server.root + "/")
        browser.wait_for("document.getElementById('model').textContent.startsWith('gated')")
        assert browser.evaluate("document.getElementById('key-row').hidden")  # no key asked for
        send(browser, "Show me the canvas")
        shots = {}
        for step, more in ((1, 1), (3, 2)):
            server.model.gate.release(more)
            browser.wait_for(f"+(document.querySelector('.msg.model .canvas') || {{dataset: {{}}}}).dataset.step "
                             f"=== {step}")
            state = canvas_state(browser)
            shot = tmp_path / f"page-step{step}.png"
            browser.screenshot(str(shot))
            keep(shot)
            shots[step] = (shot, state)
            # the certain positions, and the first of the rest (the entropy bound always takes one more)
            assert state["acc_spans"] == state["accepted"] == SURE_PER_STEP * step + 1, state
            assert state["noisy_spans"] == 16 - state["accepted"]
            assert f"step {step}/12" in state["status"] and " t 0." in state["status"] \
                and "mean entropy" in state["status"], state["status"]
            assert state["scroll_width"] <= WIDTH, state  # nothing wider than the phone
        (shot1, state1), (shot3, state3) = shots[1], shots[3]
        green1, green3 = green_pixels(shot1, state1["rect"]), green_pixels(shot3, state3["rect"])
        assert 0 < green1 < green3, (green1, green3)  # more accepted tokens, more of them bright
        server.model.gate.release(100)
        browser.wait_for("!!document.querySelector('.msg.model[data-done]')")
        final = tmp_path / "page-final.png"
        browser.screenshot(str(final))
        keep(final)
        text = browser.evaluate("document.querySelector('.msg.model .text').textContent")
        assert text == "".join(WORDS[:15]) + "." + " Done!"
        assert browser.evaluate("getComputedStyle(document.querySelector('.msg.model .canvas')).display") == "none"
        assert green_pixels(final, state3["rect"]) < green3  # the canvas gave way to the answer
        assert browser.evaluate("document.documentElement.scrollWidth") <= WIDTH
    finally:
        server.model.gate.release(1000)
        server.stop()
        server.scheduler.close()


def test_the_page_works_with_an_api_key(browser, tmp_path):
    server = started_server(api_key="page-key-1")
    server.model.gate.release(1000)
    try:
        browser.navigate(server.root + "/")
        browser.wait_for("!document.getElementById('key-row').hidden")  # /health says a key is needed
        send(browser, "first, without the key")
        browser.wait_for("!!document.querySelector('.msg.model[data-done=\"error\"]')")
        assert "401" in browser.evaluate("document.querySelector('.msg.model .error').textContent")
        browser.evaluate("document.getElementById('api-key').value = 'page-key-1'; true")
        send(browser, "now with it")
        browser.wait_for("document.querySelectorAll('.msg.model[data-done=\"1\"]').length === 1")
        assert browser.evaluate("document.querySelectorAll('.msg.model .text')[1].textContent").endswith("Done!")
        shot = tmp_path / "page-api-key.png"
        browser.screenshot(str(shot))
        keep(shot)
    finally:
        server.stop()
        server.scheduler.close()
