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
