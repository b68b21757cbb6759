"""models.toml and `--model` resolution: names, quants, pairs, paths, clear errors."""

from __future__ import annotations


import pytest

from dgcli.errors import DgError, ModelLoadError
from dgcli.registry import DEFAULT_REGISTRY_PATH, Registry, UnknownModel, looks_like_path


def no_cache(repo, filename, revision=None):
    return None


def no_listing(repo, revision):
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
    # the AR pair in every diffusion quant's own type, so that compare and bench time like against like
    ar = registry.get("gemma4-26b")
    assert ar.role == "ar" and ar.repo == "ggml-org/gemma-4-26B-A4B-it-GGUF" and list(ar.files) == list(dg.files)
    assert ar.files["Q4_K_M"].filename == "gemma-4-26B-A4B-it-Q4_K_M.gguf"
    assert ar.files["Q5_K_M"].repo == "bartowski/google_gemma-4-26B-A4B-it-GGUF"
    assert dg.pair == "gemma4-26b" and ar.pair == "diffusiongemma-26b"
    # Google's QAT Q4_0 under its own name, with the file name its repository has, at a pinned commit
    qat = registry.get("gemma4-26b-qat")
    assert qat.repo == "google/gemma-4-26B-A4B-it-qat-q4_0-gguf" and list(qat.files) == ["Q4_0"]
    assert qat.files["Q4_0"].filename == "gemma-4-26B_q4_0-it.gguf"
    assert qat.revision == qat.files["Q4_0"].revision == "d1c082be9cf3c8a514acf63b8761f4b41935842e"
    demo = registry.get("demo")
    assert demo.shipped is not None and demo.shipped.name == "demo-diffusion.gguf" and demo.pair == "demo-ar"
    assert registry.get("demo-ar").role == "ar"


def test_resolve_name_and_quant(registry):
    default = registry.resolve("diffusiongemma-26b", locate=no_cache, listings=no_listing)
    assert default.quant == "Q4_K_M" and default.path is None and default.needs_pull
    q8 = registry.resolve("diffusiongemma-26b:Q8_0", locate=no_cache, listings=no_listing)
    assert q8.filename == "diffusiongemma-26B-A4B-it-Q8_0.gguf"
    assert registry.resolve("diffusiongemma-26b:q6_k", locate=no_cache, listings=no_listing).quant == "Q6_K"  # case-insensitive


def test_resolve_uses_the_cache_locator(registry, tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    r = registry.resolve("gemma4-26b-qat", locate=lambda repo, name, rev: f if name.endswith("q4_0-it.gguf") else None,
                         listings=no_listing)
    assert r.path == f and not r.needs_pull


def test_unknown_name_lists_known_models(registry):
    with pytest.raises(UnknownModel) as err:
        registry.resolve("llama-7b", locate=no_cache, listings=no_listing)
    msg = str(err.value)
    assert "unknown model 'llama-7b'" in msg
    for name in ("demo", "diffusiongemma-26b", "gemma4-26b"):
        assert name in msg


def test_unknown_quant_lists_available_quants(registry):
    with pytest.raises(UnknownModel, match=r"unknown quant 'Q2_K' for diffusiongemma-26b; available: Q4_K_M, Q5_K_M, Q6_K, Q8_0"):
        registry.resolve("diffusiongemma-26b:Q2_K", locate=no_cache, listings=no_listing)
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


def test_the_pair_is_in_the_same_quant_when_it_has_it(registry):
    for quant in ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"):
        diff = registry.resolve(f"diffusiongemma-26b:{quant}", locate=no_cache, listings=no_listing)
        pair = registry.pair_of(diff, locate=no_cache, listings=no_listing)
        assert (pair.entry.name, pair.quant) == ("gemma4-26b", quant)
    # the QAT Q4_0 has no Q4_0 diffusion twin: its pair is the diffusion default (compare then says so)
    qat = registry.resolve("gemma4-26b-qat", locate=no_cache, listings=no_listing)
    assert registry.pair_of(qat, locate=no_cache, listings=no_listing).display_name == "diffusiongemma-26b:Q4_K_M"
    demo = registry.pair_of(registry.resolve("demo"))
    assert demo.entry.name == "demo-ar" and demo.path is not None


def test_a_cached_listing_decides_the_file_and_the_registry_name_is_only_a_preference(registry, tmp_path):
    from dgcli.hub_files import ListedFile, RepoListing

    commit = "c" * 40
    listing = RepoListing("google/gemma-4-26B-A4B-it-qat-q4_0-gguf", "d1c082be9cf3c8a514acf63b8761f4b41935842e",
                          commit, (ListedFile("gemma-4-26B-it-mmproj.gguf", 10, None),
                                   ListedFile("renamed_q4_0-it.gguf", 14_439_363_584, None)))
    seen = []

    def locate(repo, name, revision):
        seen.append((name, revision))
        return tmp_path / name if name == "renamed_q4_0-it.gguf" else None

    r = registry.resolve("gemma4-26b-qat", locate=locate, listings=lambda repo, rev: listing if rev == listing.revision else None)
    assert r.filename == "renamed_q4_0-it.gguf" and r.size_known and r.approx_size_bytes == 14_439_363_584
    assert r.path == tmp_path / "renamed_q4_0-it.gguf" and seen == [("renamed_q4_0-it.gguf", commit)]
    assert r.listing_commit == commit and r.listing_problem is None


@pytest.mark.parametrize("body,message", [
    ('[models.x]\nrole = "both"\nshipped = "a.gguf"\n', "role must be one of"),
    ('[models.x]\nrole = "ar"\n', "exactly one of `repo` or `shipped`"),
    ('[models.x]\nrole = "ar"\nrepo = "o/r"\n', "needs [models.x.files]"),
    ('[models.x]\nrole = "ar"\nrepo = "o/r"\nrevision = "main"\n[models.x.files]\nQ = {}\n', "must be a commit id"),
    ('[models.x]\nrole = "ar"\nrepo = "o/r"\n[models.x.files]\nQ = { revision = "ABC" }\n', "x.files.Q.revision must be"),
    ('[models.x]\nrole = "ar"\nrepo = "o/r"\n[models.x.files]\nQ = { repo = "../x" }\n', "x.files.Q.repo must be a Hub"),
    ('[models.x]\nrole = "ar"\nshipped = "a.gguf"\nrevision = "' + "a" * 40 + '"\n', "a shipped entry has no quants"),
    ('[models.x]\nrole = "ar"\nshipped = "a.gguf"\npair = "y"\n', "pair 'y' is not a registry entry"),
    ('[models.x\n', "invalid registry"),
])
def test_malformed_registry_is_a_clear_error(tmp_path, body, message):
    p = tmp_path / "models.toml"
    p.write_text(body)
    with pytest.raises(DgError, match=message.replace("[", r"\[").replace("(", r"\(")):
        Registry.load(p)
