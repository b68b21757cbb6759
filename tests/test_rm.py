"""`dg rm NAME`: a downloaded registry model out of the huggingface-hub cache and nothing else (another
quant of its repository, dg's listing beside it, anything outside the cache)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run

from dgcli import hub

REPO = "org/tiny-GGUF"
Q8, Q4 = b"GGUF" + bytes(3000), b"GGUF" + bytes(2000) + b"q4"


@pytest.fixture
def pulled(fake_hub, tmp_path, monkeypatch):
    """tiny:Q8_0 and tiny:Q4_0, two files of one repository at one commit, both pulled."""
    fake_hub.files[(REPO, "tiny-Q8_0.gguf")] = Q8
    fake_hub.files[(REPO, "tiny-Q4_0.gguf")] = Q4
    reg = tmp_path / "models.toml"
    reg.write_text(f'[models.tiny]\nrole = "diffusion"\nrepo = "{REPO}"\n[models.tiny.files]\n'
                   'Q8_0 = { file = "tiny-Q8_0.gguf", size_gb = 0.001 }\nQ4_0 = { file = "tiny-Q4_0.gguf", size_gb = 0.001 }\n')
    monkeypatch.setenv("DG_REGISTRY", str(reg))
    for quant in ("Q8_0", "Q4_0"):
        r = run("pull", f"tiny:{quant}")
        assert r.exit_code == 0, r.stderr
    return fake_hub


def on_disk() -> dict:
    r = run("list", "--json")
    assert r.exit_code == 0, r.stderr
    return {x["quant"]: x["on_disk"] for x in json.loads(r.stdout)["models"] if x["name"] == "tiny"}


def scan():
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub.cache_dir())
    assert not info.warnings, info.warnings  # the cache is as huggingface-hub expects it
    return next((r for r in info.repos if r.repo_id == REPO), None)


def test_rm_takes_one_quant_and_leaves_the_other(pulled):
    q8, q4 = hub.cached_path(REPO, "tiny-Q8_0.gguf"), hub.cached_path(REPO, "tiny-Q4_0.gguf")
    assert q8 and q4 and on_disk() == {"Q8_0": True, "Q4_0": True}
    listing = next((hub.cache_dir() / f"models--{REPO.replace('/', '--')}" / "dg").glob("listing-*.json"))
    r = run("rm", "tiny:Q8_0", "--yes")
    assert r.exit_code == 0, r.stderr
    assert "removed tiny:Q8_0 (tiny-Q8_0.gguf, 3.0 kB)" in r.stderr
    assert hub.cached_path(REPO, "tiny-Q8_0.gguf") is None and not os.path.lexists(q8)
    assert Path(q4).read_bytes() == Q4 and listing.exists()
    assert on_disk() == {"Q8_0": False, "Q4_0": True}
    repo = scan()
    assert [sorted(f.file_name for f in rev.files) for rev in repo.revisions] == [["tiny-Q4_0.gguf"]]
    assert len(list(hub.blobs_dir(REPO).iterdir())) == 1  # Q8_0's blob went, Q4_0's stayed

    # the last file of the snapshot: the snapshot and refs/main go, the repository's folder and listing stay
    r = run("rm", "tiny:Q4_0", "-y")
    assert r.exit_code == 0, r.stderr
    assert on_disk() == {"Q8_0": False, "Q4_0": False} and listing.exists()
    repo = scan()
    assert repo is None or not repo.revisions
    assert not list(hub.blobs_dir(REPO).iterdir())
    # and it comes back with a pull
    assert run("pull", "tiny:Q4_0").exit_code == 0 and on_disk()["Q4_0"]


def test_rm_asks_first_and_without_a_terminal_needs_yes(pulled):
    assert_one_line_error(run("rm", "tiny:Q8_0"), "needs a yes: pass --yes")
    assert on_disk()["Q8_0"]


def test_rm_of_what_is_not_downloaded_or_not_a_download(pulled, tiny_gguf, monkeypatch):
    assert run("rm", "tiny:Q8_0", "--yes").exit_code == 0
    assert_one_line_error(run("rm", "tiny:Q8_0", "--yes"), "tiny:Q8_0 is not downloaded")
    monkeypatch.delenv("DG_REGISTRY")  # the shipped registry
    assert_one_line_error(run("rm", "demo", "--yes"), "demo is shipped with dg: nothing was downloaded to remove")
    assert_one_line_error(run("rm", tiny_gguf, "--yes"), "is a path: `dg rm` removes downloaded registry models")
    assert Path(tiny_gguf).exists()
    assert_one_line_error(run("rm", "nosuch", "--yes"), "unknown model 'nosuch'")


def test_rm_takes_the_models_partial_download_too(pulled):
    import hashlib

    assert run("rm", "tiny:Q8_0", "--yes").exit_code == 0
    partial = hub.blobs_dir(REPO) / (hashlib.sha256(Q8).hexdigest() + hub.PARTIAL_SUFFIX)
    other = hub.blobs_dir(REPO) / ("0" * 64 + hub.PARTIAL_SUFFIX)  # another file's: not this model's
    partial.write_bytes(Q8[:100])
    other.write_bytes(b"x")
    r = run("rm", "tiny:Q8_0", "--yes")
    assert r.exit_code == 0, r.stderr
    assert not partial.exists() and other.exists()


def test_rm_refuses_a_cache_whose_link_leads_outside_it(pulled, tmp_path):
    outside = tmp_path / "precious.gguf"
    outside.write_bytes(b"mine")
    link = Path(hub.cached_path(REPO, "tiny-Q8_0.gguf"))
    link.unlink()
    link.symlink_to(outside)
    assert_one_line_error(run("rm", "tiny:Q8_0", "--yes"), "nothing removed", "refusing to write outside the huggingface-hub cache")
    assert outside.read_bytes() == b"mine" and os.path.lexists(link)
    assert hub.cached_path(REPO, "tiny-Q4_0.gguf") is not None
