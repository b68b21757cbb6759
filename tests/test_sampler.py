"""Each sampler rule alone, on hand-made numbers, and the native pass against the numpy reference."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dgcli.engine import sampler as S
from dgcli.engine.rng import RngStream, inverse_cdf_sample
from dgcli.errors import InvalidParameter
from dgcli.params import DiffusionParams

REPO = Path(__file__).resolve().parents[1]
NATIVE_SOURCE = REPO / "native/patch/src/diffusion-gemma-sampler.cpp"
NATIVE_INCLUDE = REPO / "native/patch/include"


def entropy_of(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    return -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=-1)


# ---- temperature ----------------------------------------------------------------------------------


def test_temperature_is_t_max_at_first_step_and_near_t_min_at_last():
    assert S.schedule_temperature(48, 48, 0.4, 0.8) == np.float32(0.8)
    assert S.schedule_temperature(1, 48, 0.4, 0.8) == pytest.approx(0.4 + 0.4 / 48, rel=1e-6)
    assert S.schedule_temperature(10, 20, 0.2, 1.0) == pytest.approx(0.6, rel=1e-6)


def test_temperature_matches_the_reference_processor_bit_for_bit():
    torch = pytest.importorskip("torch", reason="compares against the torch reference")
    gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma",
                              reason="compares against the Transformers reference")
    scores = torch.full((1, 1, 1), 1.0)
    for max_steps, t_min, t_max in ((48, 0.4, 0.8), (7, 0.1, 1.3), (3, 0.0, 2.5)):
        processor = gen.LinearTemperatureScheduleLogitsProcessor(t_min, t_max, max_steps)
        for step in range(1, max_steps + 1):
            reference = processor(None, scores, torch.tensor(step, dtype=torch.int32))
            ours = np.float32(1.0) / S.schedule_temperature(step, max_steps, t_min, t_max)
            assert ours == reference.item(), (max_steps, t_min, t_max, step)


# ---- acceptance -----------------------------------------------------------------------------------


def test_acceptance_takes_the_low_entropy_prefix_within_the_bound():
    entropy = np.array([0.5, 0.01, 0.03, 0.2, 0.05])
    # sorted: 0.01, 0.03, 0.05, 0.2, 0.5 -> cumsum - H: 0, 0.01, 0.04, 0.09, 0.29
    mask = S.entropy_bound_accept_mask(entropy, 0.1)
    assert mask.tolist() == [False, True, True, True, True]
    mask = S.entropy_bound_accept_mask(entropy, 0.05)
    assert mask.tolist() == [False, True, True, False, True]


def test_acceptance_always_takes_at_least_one_position():
    entropy = np.array([6.0, 5.5, 6.2])
    mask = S.entropy_bound_accept_mask(entropy, 1e-9)
    assert mask.tolist() == [False, True, False]


def test_acceptance_takes_everything_when_all_are_certain():
    assert S.entropy_bound_accept_mask(np.zeros(8), 0.1).all()


def test_renoise_keeps_accepted_samples_and_replaces_the_rest():
    sampled = np.array([10, 11, 12, 13])
    noise = np.array([90, 91, 92, 93])
    mask = np.array([True, False, True, False])
    assert S.renoise_canvas(sampled, mask, noise).tolist() == [10, 91, 12, 93]


# ---- adaptive stop ---------------------------------------------------------------------------------


def test_stop_needs_both_stable_and_confident():
    stop = S.StableAndConfidentStop(stability_threshold=1, confidence_threshold=0.005)
    canvas = np.array([3, 4, 5])
    assert not stop(canvas, np.zeros(3))  # first step: the -1 history never matches
    assert not stop(canvas, np.full(3, 0.01))  # stable but not confident
    assert stop(canvas, np.full(3, 0.001))  # stable and confident
    assert not stop(np.array([3, 4, 6]), np.zeros(3))  # confident but changed


def test_stop_with_stability_threshold_zero_only_needs_confidence():
    stop = S.StableAndConfidentStop(stability_threshold=0, confidence_threshold=0.005)
    assert stop(np.array([1, 2]), np.array([0.001, 0.002]))
    assert not stop(np.array([1, 2]), np.array([0.001, 0.02]))


def test_stop_with_stability_threshold_two_needs_two_equal_predecessors():
    stop = S.StableAndConfidentStop(stability_threshold=2, confidence_threshold=0.005)
    a, b = np.array([1, 2]), np.array([1, 3])
    certain = np.zeros(2)
    assert not stop(a, certain)
    assert not stop(a, certain)  # history [-1, a]
    assert stop(a, certain)  # history [a, a]
    assert not stop(b, certain)
    assert not stop(b, certain)  # history [a, b]
    assert stop(b, certain)
    stop.reset()
    assert not stop(b, certain)


def reference_stability(threshold: int, canvases: list) -> list[bool]:
    """The reference's rule, literally: the last `threshold` argmax canvases kept, each compared."""
    history: list = []
    stable = []
    for canvas in canvases:
        stable.append(len(history) == threshold and all(np.array_equal(h, canvas) for h in history)
                      if threshold else True)
        history = (history + [canvas])[-threshold:] if threshold else []
    return stable


@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 5])
def test_stop_rule_matches_the_reference_history_on_random_sequences(threshold):
    rng = np.random.default_rng(threshold)
    # few distinct canvases, so runs of equal ones of every length occur
    pool = [rng.integers(0, 50, 6) for _ in range(3)]
    canvases = [pool[i] for i in rng.choice(3, size=400, p=[0.7, 0.2, 0.1])]
    stop = S.StableAndConfidentStop(stability_threshold=threshold, confidence_threshold=0.5)
    ours = [stop(c, np.zeros(6)) for c in canvases]
    assert ours == reference_stability(threshold, canvases)
    assert any(ours) and not all(ours) or threshold == 0


def test_stop_rule_bookkeeping_does_not_grow_with_the_threshold():
    """O(canvas) per step whatever the threshold: a threshold of a billion steps allocates nothing
    of its size (the history form would need a [threshold, canvas] array: 2 TB here)."""
    import tracemalloc

    stop = S.StableAndConfidentStop(stability_threshold=10**9, confidence_threshold=0.5)
    canvas = np.arange(256)
    tracemalloc.start()
    try:
        for _ in range(50):
            assert not stop(canvas, np.zeros(256))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_confidence_threshold_is_strict():
    stop = S.StableAndConfidentStop(stability_threshold=0, confidence_threshold=0.5)
    assert not stop(np.array([1]), np.array([0.5]))


# ---- end tokens ------------------------------------------------------------------------------------


def test_finalize_pads_after_the_first_end_token_and_keeps_it():
    canvas, finished = S.finalize_canvas(np.array([7, 8, 106, 9, 1, 10]), end_token_ids=[1, 106], pad_token_id=0)
    assert finished
    assert canvas.tolist() == [7, 8, 106, 0, 0, 0]
    assert S.count_valid_tokens(canvas, 0) == 3


def test_finalize_without_end_token_changes_nothing():
    canvas, finished = S.finalize_canvas(np.array([7, 8, 9]), end_token_ids=[1, 106], pad_token_id=0)
    assert not finished and canvas.tolist() == [7, 8, 9]


def test_valid_tokens_exclude_generated_pad_ids_like_the_reference():
    assert S.count_valid_tokens(np.array([5, 0, 6, 0]), 0) == 2
    assert S.count_valid_tokens(np.array([5, 0, 6, 0]), None) == 4


# ---- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, fragment", [
    ("confidence_threshold", 0.0, "confidence_threshold=0.0: must be a number > 0"),
    ("max_denoising_steps", 0, "max_denoising_steps=0: must be an integer between 1 and"),
    ("max_denoising_steps", 10**9, "max_denoising_steps=1000000000: must be an integer between 1 and 4096"),
    ("stability_threshold", 49, "stability_threshold=49: must be an integer between 0 and max_denoising_steps (48)"),
    ("entropy_bound", -1.0, "entropy_bound=-1.0"),
    ("stability_threshold", -1, "stability_threshold=-1"),
    ("t_max", 0.3, "t_max=0.3: must be at least t_min"),
    # finite doubles that float32, the sampler's type, turns into a temperature of 0 or inf
    ("t_max", 1e-320, "t_max=1e-320: must be a number between 1e-30 and 1e+30"),
    ("t_max", 1e308, "t_max=1e+308: must be a number between 1e-30 and 1e+30"),
    ("entropy_bound", 1e300, "entropy_bound=1e+300: must be a number > 0 and at most 1e+30"),
    ("confidence_threshold", 1e300, "confidence_threshold=1e+300"),
])
def test_bad_parameters_name_themselves_and_their_range(field, value, fragment):
    with pytest.raises(InvalidParameter) as info:
        DiffusionParams().replace(**{field: value}).validate()
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


# ---- the logits pass: numpy reference ---------------------------------------------------------------


def test_numpy_pass_entropy_argmax_and_processed_logits():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 50)).astype(np.float32) * 4
    temperature = np.float32(0.7)
    stats = S.NumpyStepSampler().process_logits(logits.copy(), temperature, rng.random(6))
    processed = logits / temperature
    assert np.array_equal(stats.processed, processed)
    assert stats.argmax.tolist() == processed.argmax(axis=1).tolist()
    np.testing.assert_allclose(stats.entropy, entropy_of(processed), rtol=1e-5, atol=1e-9)


def test_inverse_cdf_picks_the_first_index_past_the_uniform():
    weights = np.array([[0.0, 1.0, 0.0, 3.0], [2.0, 0.0, 0.0, 2.0]], dtype=np.float32)
    assert inverse_cdf_sample(weights, np.array([0.0, 0.49])).tolist() == [1, 0]
    assert inverse_cdf_sample(weights, np.array([0.25, 0.5])).tolist() == [3, 3]
    assert inverse_cdf_sample(weights, np.array([0.999999, 0.999999])).tolist() == [3, 3]


def test_sampling_frequencies_follow_softmax():
    logits = np.log(np.array([[0.1, 0.2, 0.7]], dtype=np.float32))
    uniforms = RngStream(1)
    counts = np.zeros(3)
    for _ in range(3000):
        stats = S.NumpyStepSampler().process_logits(logits.copy(), np.float32(1.0), uniforms.multinomial_uniforms(1))
        counts[stats.sampled[0]] += 1
    np.testing.assert_allclose(counts / counts.sum(), [0.1, 0.2, 0.7], atol=0.03)


def test_rng_stream_is_seeded_and_records_call_order():
    a, b = RngStream(5), RngStream(5)
    assert a.canvas_init(4, 100).tolist() == b.canvas_init(4, 100).tolist()
    a.multinomial_uniforms(3)
    a.renoise(4, 100)
    assert a.calls == ["canvas_init", "multinomial", "renoise"]
    assert not np.array_equal(RngStream(6).canvas_init(8, 1000), RngStream(5).canvas_init(8, 1000))


def test_unknown_sampler_backend_is_a_clear_error():
    from dgcli.errors import DgError

    with pytest.raises(DgError, match="invalid sampler backend 'gpu'"):
        S.make_step_sampler("gpu")


# ---- the logits pass: native against numpy -----------------------------------------------------------


def build_native_sampler(tmp_path_factory) -> S.NativeStepSampler:
    """The installed library's dg_sampler_step if built, else the source compiled here."""
    lib = S.native_library()
    if lib is None:
        compiler = shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            pytest.skip("no patched llama.cpp installed and no C++ compiler to build the sampler source")
        out = tmp_path_factory.mktemp("native") / "libdgsampler.so"
        subprocess.run([compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{NATIVE_INCLUDE}",
                        str(NATIVE_SOURCE), "-o", str(out), "-lpthread"], check=True)
        lib = ctypes.CDLL(str(out))
    return S.NativeStepSampler(lib, n_threads=2)


@pytest.fixture(scope="module")
def native_sampler(tmp_path_factory):
    return build_native_sampler(tmp_path_factory)


@pytest.mark.parametrize("rows, vocab, scale", [(16, 500, 3.0), (7, 4099, 30.0), (3, 64, 0.01)])
def test_native_pass_agrees_with_numpy(native_sampler, rows, vocab, scale):
    rng = np.random.default_rng(rows * vocab)
    logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    uniforms = rng.random(rows)
    temperature = S.schedule_temperature(5, 9, 0.4, 0.8)
    reference = S.NumpyStepSampler().process_logits(logits.copy(), temperature, uniforms)
    native = native_sampler.process_logits(logits.copy(), temperature, uniforms)
    assert np.array_equal(native.processed, reference.processed)
    assert native.argmax.tolist() == reference.argmax.tolist()
    assert native.sampled.tolist() == reference.sampled.tolist()
    np.testing.assert_allclose(native.entropy, reference.entropy, rtol=1e-5, atol=1e-7)


def test_native_pass_samples_across_the_distribution(native_sampler):
    logits = np.tile(np.log(np.array([0.25, 0.25, 0.5], dtype=np.float32)), (4, 1))
    stats = native_sampler.process_logits(logits, np.float32(1.0), np.array([0.0, 0.3, 0.6, 0.99]))
    assert stats.sampled.tolist() == [0, 1, 2, 2]


def test_native_pass_rejects_non_finite_logits(native_sampler):
    from dgcli.errors import DgError

    logits = np.zeros((2, 5), dtype=np.float32)
    logits[1, 3] = np.nan
    with pytest.raises(DgError, match="non-finite"):
        native_sampler.process_logits(logits, np.float32(1.0), np.zeros(2))


# ---- the next step's self-conditioning input in top-k form ----------------------------------------


def test_numpy_top_k_keeps_the_most_probable_ids_with_their_softmax_probabilities():
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.4, 0.1]], dtype=np.float32))
    stats = S.NumpyStepSampler().process_logits(logits, np.float32(1.0), np.zeros(2), top_k=2)
    # most probable first; the tie in row 1 goes to the lower id
    assert stats.topk_ids.tolist() == [[1, 3], [2, 0]]
    np.testing.assert_allclose(stats.topk_probs, [[0.4, 0.3], [0.4, 0.25]], rtol=1e-6)
    np.testing.assert_allclose(stats.dropped_mass, [0.3, 0.35], rtol=1e-6)


def test_numpy_top_k_of_the_whole_vocabulary_is_the_softmax():
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((3, 50)) * 2).astype(np.float32)
    temperature = np.float32(0.7)
    stats = S.NumpyStepSampler().process_logits(logits.copy(), temperature, rng.random(3), top_k=50)
    z = logits.astype(np.float64) / float(temperature)
    softmax = np.exp(z - z.max(axis=1, keepdims=True))
    softmax /= softmax.sum(axis=1, keepdims=True)
    dense = np.zeros_like(softmax)
    np.put_along_axis(dense, stats.topk_ids.astype(np.int64), stats.topk_probs.astype(np.float64), axis=1)
    np.testing.assert_allclose(dense, softmax, rtol=1e-5, atol=1e-9)
    assert np.all(stats.dropped_mass < 1e-6)


def test_top_k_width_is_checked():
    from dgcli.errors import DgError

    with pytest.raises(DgError, match="top_k"):
        S.NumpyStepSampler().process_logits(np.zeros((1, 4), np.float32), np.float32(1.0), np.zeros(1), top_k=5)


@pytest.mark.parametrize("rows, vocab, scale, k", [(16, 500, 3.0, 8), (7, 4099, 30.0, 64), (3, 64, 0.5, 64),
                                                   (5, 1000, 4.0, 1)])
def test_native_top_k_agrees_with_numpy(native_sampler, rows, vocab, scale, k):
    rng = np.random.default_rng(rows * vocab + k)
    logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    uniforms = rng.random(rows)
    temperature = S.schedule_temperature(5, 9, 0.4, 0.8)
    reference = S.NumpyStepSampler().process_logits(logits.copy(), temperature, uniforms, top_k=k)
    native = native_sampler.process_logits(logits.copy(), temperature, uniforms, top_k=k)
    assert native.topk_ids.shape == native.topk_probs.shape == (rows, k)
    for r in range(rows):
        assert set(native.topk_ids[r].tolist()) == set(reference.topk_ids[r].tolist()), r
        ours = dict(zip(native.topk_ids[r].tolist(), native.topk_probs[r].tolist()))
        theirs = dict(zip(reference.topk_ids[r].tolist(), reference.topk_probs[r].tolist()))
        assert max(abs(ours[i] - theirs[i]) for i in ours) < 1e-6
    np.testing.assert_allclose(native.dropped_mass, reference.dropped_mass, atol=1e-6)
    # the reported dropped mass is what the kept probabilities leave out
    kept = native.topk_probs.astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(native.dropped_mass, 1.0 - kept, atol=1e-6)
    # most probable first
    assert np.all(np.diff(native.topk_probs, axis=1) <= 0)
    # and the rest of the pass is unchanged by the top-k
    assert native.argmax.tolist() == reference.argmax.tolist()
    assert native.sampled.tolist() == reference.sampled.tolist()


def test_native_top_k_rejects_a_width_beyond_the_vocabulary(native_sampler):
    from dgcli.errors import DgError

    with pytest.raises(DgError, match="top_k"):
        native_sampler.process_logits(np.zeros((2, 5), np.float32), np.float32(1.0), np.zeros(2), top_k=6)


def test_native_sample_walk_equals_the_sequential_cumsum_at_exact_ties(native_sampler):
    """The sample walks block sums and then one block, and falls back to the sequential float64 cumsum
    when the target is within rounding of a partial sum: equal weights make every partial sum exact and
    u * sum land on one (u = 0.5 of an even width), where the first index strictly past it is n / 2;
    also u = 0 (the first index) and a u whose target falls past the last block's start."""
    rows, vocab = 4, 4096
    logits = np.zeros((rows, vocab), np.float32)
    uniforms = np.array([0.5, 0.0, 0.999999, 0.25])
    reference = S.NumpyStepSampler().process_logits(logits.copy(), np.float32(1.0), uniforms)
    native = native_sampler.process_logits(logits.copy(), np.float32(1.0), uniforms)
    assert native.sampled.tolist() == reference.sampled.tolist() == [vocab // 2, 0, vocab - 1, vocab // 4]


def test_native_pass_is_the_same_in_every_vector_width(native_sampler, monkeypatch):
    """The AVX-512 copy of the pass and the AVX2 one (DG_CPU_KERNELS=avx2, read at every row) give the
    same values bit for bit (x / t correctly rounded in both; softcap's tanh is not in the host pass) and
    the same decisions, on a CPU that runs both; elsewhere the one copy agrees with itself."""
    rng = np.random.default_rng(31)
    logits = (rng.standard_normal((6, 70001)) * 6.0).astype(np.float32)
    uniforms = rng.random(6)
    runs = []
    for family in ("avx512-vnni", "avx2"):
        monkeypatch.setenv("DG_CPU_KERNELS", family)
        runs.append(native_sampler.process_logits(logits.copy(), np.float32(0.55), uniforms, top_k=16))
    wide, narrow = runs
    assert np.array_equal(wide.processed, narrow.processed)
    assert wide.argmax.tolist() == narrow.argmax.tolist()
    assert wide.sampled.tolist() == narrow.sampled.tolist()
    assert wide.topk_ids.tolist() == narrow.topk_ids.tolist()
    np.testing.assert_allclose(wide.entropy, narrow.entropy, rtol=1e-12)
