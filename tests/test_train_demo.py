"""training/train_demo.py's schedule and resumable state, on a few steps of batch 2."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from training import train_demo  # noqa: E402

RUN = dict(batch_size=2, lr=3e-3, ar_weight=0.5, seed=7, threads=1, hidden_size=64, log_every=1)


@pytest.fixture(autouse=True)
def one_warm_up_step(monkeypatch):
    """So that a few steps reach the constant rate and the decay (the real warm-up is 200 steps)."""
    monkeypatch.setattr(train_demo, "WARMUP_STEPS", 1)


def _weights(out_dir):
    return torch.load(out_dir / "train_state.pt", weights_only=False)["model"]


def test_a_killed_run_resumed_with_a_shorter_schedule_ends_as_a_fresh_run_with_it(tmp_path):
    fresh, resumed = tmp_path / "fresh", tmp_path / "resumed"
    train_demo.train(fresh, steps=4, save_every=4, decay_from=2, **RUN)
    # started for 10 steps (decay from 8), stopped after 2, resumed as a 4-step run decaying from 2
    train_demo.train(resumed, steps=10, save_every=2, stop_after=2, decay_from=8, **RUN)
    train_demo.train(resumed, steps=4, save_every=2, decay_from=2, **RUN)
    a, b = _weights(fresh), _weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = [line for line in (resumed / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 4  # the interrupted run's lines after its saved state are dropped, none doubled
    # and the schedule did change: the 10-step run would still be at the full rate at step 3
    other = tmp_path / "other"
    train_demo.train(other, steps=10, save_every=4, stop_after=4, decay_from=8, **RUN)
    c = _weights(other)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_a_state_past_its_decay_refuses_another_schedule(tmp_path):
    train_demo.train(tmp_path, steps=4, save_every=3, stop_after=3, decay_from=2, **RUN)
    with pytest.raises(SystemExit, match="--steps 4 --decay-from 2"):
        train_demo.train(tmp_path, steps=6, save_every=3, decay_from=2, **RUN)


def test_decay_from_outside_the_run_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--decay-from 5"):
        train_demo.train(tmp_path, steps=4, decay_from=5, **RUN)


# -- the shipped demo back into Transformers (training/gguf_weights.py) ---------------------------

SHIPPED = train_demo.Path(__file__).resolve().parents[1] / "dgcli" / "models"


def _convert(checkpoint, out_dir):
    from dgcli.convert import convert_checkpoint

    return [convert_checkpoint(checkpoint, out_dir / f"{arch}.gguf", "f32", arch)
            for arch in ("diffusion-gemma", "gemma4")]


def test_the_shipped_gguf_loads_back_exactly(tmp_path):
    """The F32 GGUF's weights loaded into the Transformers model and converted again give both shipped
    files byte for byte: the model is exactly the one that was exported, the start of a fine-tune."""
    from dgcli.testing.reference import save_checkpoint
    from training import gguf_weights

    model = gguf_weights.load_model_from_gguf(SHIPPED / "demo-diffusion.gguf")
    assert gguf_weights.roundtrip_mismatches(model, SHIPPED / "demo-diffusion.gguf") == []
    save_checkpoint(model, tmp_path / "hf")
    diffusion, ar = _convert(tmp_path / "hf", tmp_path)
    assert diffusion.read_bytes() == (SHIPPED / "demo-diffusion.gguf").read_bytes()
    assert ar.read_bytes() == (SHIPPED / "demo-ar.gguf").read_bytes()
    # and the comparison sees one changed value of a weight the decoder shares with the encoder
    with torch.no_grad():
        model.model.decoder.layers[3].experts.down_proj[2, 5, 7] += 1e-6
    assert gguf_weights.roundtrip_mismatches(model, SHIPPED / "demo-diffusion.gguf") == [
        "blk.3.ffn_down_exps.weight: differs"]


def test_a_gguf_that_is_not_f32_diffusion_is_refused(tmp_path):
    from dgcli.errors import DgError
    from training import gguf_weights

    model = train_demo.build_model(hidden_size=64)
    with pytest.raises(DgError, match="'gemma4' GGUF"):
        gguf_weights.load_gguf_weights(model, SHIPPED / "demo-ar.gguf")
    with pytest.raises(DgError, match="token_embd.weight has shape"):
        gguf_weights.load_gguf_weights(train_demo.build_model(hidden_size=32), SHIPPED / "demo-diffusion.gguf")


def test_a_fine_tune_starts_from_the_gguf_and_refuses_a_state_of_another_start(tmp_path):
    """At learning rate 0 a fine-tune's checkpoint is the GGUF it started from, byte for byte; its
    state remembers that start."""
    start = SHIPPED / "demo-diffusion.gguf"
    frozen = dict(RUN, lr=0.0)
    train_demo.train(tmp_path / "ft", steps=1, save_every=1, init_gguf=start, **frozen)
    diffusion, _ = _convert(tmp_path / "ft", tmp_path)
    assert diffusion.read_bytes() == start.read_bytes()
    with pytest.raises(SystemExit, match="another run"):
        train_demo.train(tmp_path / "ft", steps=2, save_every=1, **frozen)
