"""models.toml and `--model` resolution: names, quants, pairs, paths, clear errors."""

from __future__ import annotations


import pytest

from dgcli.errors import DgError, ModelLoadError
from dgcli.registry import DEFAULT_REGISTRY_PATH, Registry, UnknownModel, looks_like_path


def no_cache(repo, filename):
    return None


@pytest.fixture
def registry() -> Registry:
    return Registry.load(DEFAULT_REGISTRY_PATH)


def test_shipped_registry_lists_the_real_models_and_demo_pair(registry):
    dg = registry.get("diffusiongemma-26b")
    assert dg.role == "diffusion" and dg.repo == "unsloth/diffusiongemma-26B-A4B-it-GGUF"
    assert list(dg.files) == ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"] and dg.default_quant == "Q4_K_M"
    assert dg.files["Q4_K_M"].filename == "diffusiongemma-26B-A4B-it-Q4_K_M.gguf"
    assert 15 * 10**9 < dg.files["Q4_K_M"].approx_size_bytes < 17 * 10**9  # size_gb: the Hub's decimal GB
    ar = registry.get("gemma4-26b")
    assert ar.role == "ar" and ar.repo == "google/gemma-4-26B-A4B-it-qat-q4_0-gguf"
    assert dg.pair == "gemma4-26b" and ar.pair == "diffusiongemma-26b"
    demo = registry.get("demo")
    assert demo.shipped is not None and demo.shipped.name == "demo-diffusion.gguf" and demo.pair == "demo-ar"
    assert registry.get("demo-ar").role == "ar"


def test_resolve_name_and_quant(registry):
    default = registry.resolve("diffusiongemma-26b", locate=no_cache)
    assert default.quant == "Q4_K_M" and default.path is None and default.needs_pull
    q8 = registry.resolve("diffusiongemma-26b:Q8_0", locate=no_cache)
    assert q8.filename == "diffusiongemma-26B-A4B-it-Q8_0.gguf"
    assert registry.resolve("diffusiongemma-26b:q6_k", locate=no_cache).quant == "Q6_K"  # case-insensitive


def test_resolve_uses_the_cache_locator(registry, tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    r = registry.resolve("gemma4-26b", locate=lambda repo, name: f if name.endswith("q4_0.gguf") else None)
    assert r.path == f and not r.needs_pull


def test_unknown_name_lists_known_models(registry):
    with pytest.raises(UnknownModel) as err:
        registry.resolve("llama-7b", locate=no_cache)
    msg = str(err.value)
    assert "unknown model 'llama-7b'" in msg
    for name in ("demo", "diffusiongemma-26b", "gemma4-26b"):
        assert name in msg


def test_unknown_quant_lists_available_quants(registry):
    with pytest.raises(UnknownModel, match=r"unknown quant 'Q2_K' for diffusiongemma-26b; available: Q4_K_M, Q5_K_M, Q6_K, Q8_0"):
        registry.resolve("diffusiongemma-26b:Q2_K", locate=no_cache)
    with pytest.raises(UnknownModel, match="no quants"):
        registry.resolve("demo:Q4_K_M")


def test_paths(registry, tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    r = registry.resolve(str(f))
    assert r.path == f and r.entry is None and r.role is None
    with pytest.raises(ModelLoadError, match="model file not found"):
        registry.resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="directory"):
        registry.resolve(str(tmp_path) + "/")
    assert looks_like_path("./x") and looks_like_path("a/b") and looks_like_path("m.gguf")
    assert not looks_like_path("diffusiongemma-26b:Q8_0")


def test_pair_of(registry):
    pair = registry.pair_of(registry.resolve("diffusiongemma-26b:Q8_0", locate=no_cache), locate=no_cache)
    assert pair.entry.name == "gemma4-26b" and pair.quant == "Q4_0"


@pytest.mark.parametrize("body,message", [
    ('[models.x]\nrole = "both"\nshipped = "a.gguf"\n', "role must be one of"),
    ('[models.x]\nrole = "ar"\n', "exactly one of `repo` or `shipped`"),
    ('[models.x]\nrole = "ar"\nrepo = "o/r"\n', "needs [models.x.files]"),
    ('[models.x]\nrole = "ar"\nshipped = "a.gguf"\npair = "y"\n', "pair 'y' is not a registry entry"),
    ('[models.x\n', "invalid registry"),
])
def test_malformed_registry_is_a_clear_error(tmp_path, body, message):
    p = tmp_path / "models.toml"
    p.write_text(body)
    with pytest.raises(DgError, match=message.replace("[", r"\[").replace("(", r"\(")):
        Registry.load(p)
