"""Which file of a repository a registry quant is (dgcli.hub_files): the listing from the fake Hub,
checked and cached, and the choice among renamed files, several candidates, split parts and projectors."""

from __future__ import annotations

import json

import pytest

from dgcli import hub, hub_files
from dgcli.hub_files import ListedFile, NoSingleModelFile, RepoListing, choose_model_file, quant_matches
from hub_server import COMMIT

REPO = "org/model-GGUF"


def listing(*paths: str, size: int = 10) -> RepoListing:
    return RepoListing(REPO, None, COMMIT, tuple(ListedFile(p, size, None) for p in sorted(paths)))


# ------------------------------------------------------------------------------------------ the choice


@pytest.mark.parametrize("name,quant,matches", [
    ("diffusiongemma-26B-A4B-it-Q4_K_M.gguf", "Q4_K_M", True),
    ("diffusiongemma-26B-A4B-it-Q4_K_M.gguf", "q4_k_m", True),
    ("gemma-4-26B_q4_0-it.gguf", "Q4_0", True),  # Google's QAT name: the quant in the middle, lower case
    ("gemma-4-26B-A4B-it-Q4_K_M.gguf", "Q4_K", False),  # Q4_K is not Q4_K_M
    ("google_gemma-4-26B-A4B-it-Q6_K_L.gguf", "Q6_K", False),
    ("m-Q4_0_4_4.gguf", "Q4_0", False),
    ("m-BF16.gguf", "F16", False),
    ("m-UD-Q4_K_XL.gguf", "Q4_K_M", False),
    ("BF16/m-BF16-00001-of-00002.gguf", "BF16", True),  # a split part: the name before the part number
    ("m-Q8_0.gguf", "Q4_0", False),
])
def test_a_file_name_says_its_quant_on_token_boundaries(name, quant, matches):
    assert quant_matches(name, quant) is matches


def test_a_renamed_file_is_found_by_its_quant_and_the_preferred_name_only_breaks_ties():
    files = listing("gemma-4-26B_q4_0-it.gguf", "gemma-4-26B-it-mmproj.gguf")
    # the registry's old name is gone: the quant finds the file
    assert choose_model_file(files, "Q4_0", "gemma-4-26B-A4B-it-qat-q4_0.gguf").filename == "gemma-4-26B_q4_0-it.gguf"
    both = listing("m-Q4_K_M.gguf", "m-UD-Q4_K_M.gguf")
    assert choose_model_file(both, "Q4_K_M", "m-UD-Q4_K_M.gguf").filename == "m-UD-Q4_K_M.gguf"
    assert choose_model_file(both, "Q4_K_M", "m-Q4_K_M.gguf").filename == "m-Q4_K_M.gguf"


def test_several_candidates_without_a_preference_among_them_list_the_repository_files():
    both = listing("m-Q4_K_M.gguf", "m-UD-Q4_K_M.gguf", "mmproj-F16.gguf")
    with pytest.raises(NoSingleModelFile) as err:
        choose_model_file(both, "Q4_K_M", "gone-Q4_K_M.gguf")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{REPO} at {COMMIT[:12]} has 2 model .gguf files for Q4_K_M")
    assert "its .gguf files: m-Q4_K_M.gguf, m-UD-Q4_K_M.gguf, mmproj-F16.gguf" in msg


def test_no_match_lists_the_files_and_a_projector_or_draft_is_never_the_model():
    # the projector of a Q8_0 model says Q8_0 too; the MTP draft head of ggml-org/unsloth repos as well
    files = listing("mmproj-gemma-4-26B-A4B-it-Q8_0.gguf", "MTP/gemma-4-26B-A4B-it-Q8_0-MTP.gguf",
                    "mtp-gemma-4-26B-A4B-it.gguf", "gemma-4-26B-A4B-it-Q4_K_M.gguf")
    with pytest.raises(NoSingleModelFile, match="has no model .gguf for Q8_0; its .gguf files: MTP/"):
        choose_model_file(files, "Q8_0")
    with pytest.raises(NoSingleModelFile):  # named by the registry, but not a model
        choose_model_file(files, "Q8_0", "mmproj-gemma-4-26B-A4B-it-Q8_0.gguf")
    files = listing("mmproj-gemma-4-26B-A4B-it-Q8_0.gguf", "gemma-4-26B-A4B-it-Q8_0.gguf")
    assert choose_model_file(files, "Q8_0").filename == "gemma-4-26B-A4B-it-Q8_0.gguf"
    with pytest.raises(NoSingleModelFile, match="it has no .gguf files"):
        choose_model_file(listing(), "Q8_0")


def test_a_split_model_is_one_candidate_of_all_its_parts_and_an_incomplete_one_none():
    parts = [f"BF16/m-BF16-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    choice = choose_model_file(listing(*parts, "m-Q8_0.gguf", size=7), "BF16")
    assert [p.path for p in choice.parts] == parts and choice.filename == parts[0] and choice.size == 21
    # a part is never a model of its own, even when the registry names it
    with pytest.raises(NoSingleModelFile, match=r"m-BF16-\*-of-00003.gguf \(2 of 3 parts\)"):
        choose_model_file(listing(parts[0], parts[2]), "BF16", parts[0])


# ------------------------------------------------------------------------------------------ the listing


def test_listing_from_the_fake_hub_is_checked_cached_and_read_back(fake_hub):
    fake_hub.files[(REPO, "m-Q8_0.gguf")] = b"GGUF" + bytes(100)
    fake_hub.files[(REPO, "sub/mmproj-m-f16.gguf")] = b"GGUF"
    fake_hub.files[(REPO, "README.md")] = b"# m"
    got = hub_files.fetch_listing(REPO)
    assert got.commit == COMMIT and [f.path for f in got.files] == ["m-Q8_0.gguf", "sub/mmproj-m-f16.gguf"]
    assert got.file("m-Q8_0.gguf").size == 104 and len(got.file("m-Q8_0.gguf").sha256) == 64
    assert hub_files.cached_listing(REPO) == got
    assert hub_files.cached_listing(REPO, COMMIT) is None  # a pinned commit's listing is kept apart
    # huggingface-hub's own cache scan still reads the repository folder
    from huggingface_hub import scan_cache_dir

    assert not scan_cache_dir(hub.cache_dir()).warnings


def test_a_pinned_revision_must_be_the_commit_the_hub_answers_for(fake_hub):
    fake_hub.files[(REPO, "m-Q8_0.gguf")] = b"GGUF"
    assert hub_files.fetch_listing(REPO, COMMIT).commit == COMMIT
    with pytest.raises(hub.HubError, match=f"revision {'f' * 40} not found in {REPO}"):
        hub_files.fetch_listing(REPO, "f" * 40)
    with pytest.raises(hub.HubError, match="repository not found on the Hub: org/nothing"):
        hub_files.fetch_listing("org/nothing")
    with pytest.raises(hub.HubError, match="not a commit id: '../../x'"):  # it would name the cached listing's file
        hub_files.fetch_listing(REPO, "../../x")
    assert hub_files.cached_listing(REPO, "../../x") is None


def _sibling(path="m-Q8_0.gguf", size=4, sha="a" * 64):
    return {"rfilename": path, "size": size, "lfs": {"sha256": sha, "size": size, "pointerSize": 134}}


@pytest.mark.parametrize("answer,message", [
    ({"sha": COMMIT, "siblings": [_sibling("../../../evil.gguf")]}, "unusable file (an empty, '.' or '..' part)"),
    ({"sha": COMMIT, "siblings": [_sibling("/etc/evil.gguf")]}, "an absolute path"),
    ({"sha": COMMIT, "siblings": [_sibling("a\\..\\evil.gguf")]}, "a backslash"),
    ({"sha": COMMIT, "siblings": [_sibling("m-\x1b[2J.gguf")]}, "a control character"),
    ({"sha": COMMIT, "siblings": [_sibling("m\u202egguf.gguf")]}, "a control character"),
    ({"sha": COMMIT, "siblings": [_sibling(size="big")]}, "an invalid size: 'big'"),
    ({"sha": COMMIT, "siblings": [_sibling(size=-1)]}, "an invalid size: '-1'"),
    ({"sha": COMMIT, "siblings": [_sibling(size=True)]}, "an invalid size: 'True'"),
    ({"sha": COMMIT, "siblings": [_sibling(size=1 << 60)]}, "an invalid size"),
    ({"sha": COMMIT, "siblings": [_sibling(sha="../x")]}, "an invalid sha256"),
    ({"sha": COMMIT, "siblings": [_sibling(), _sibling()]}, "lists a file twice"),
    ({"sha": "main", "siblings": []}, "no valid commit id"),
    ({"sha": COMMIT, "siblings": "all"}, "no usable `siblings` list"),
    ({"sha": COMMIT, "siblings": [5]}, "an entry that is not an object"),
    ([1, 2], "is not a JSON object"),
])
def test_a_hostile_or_broken_listing_is_one_clear_error_and_never_cached(fake_hub, answer, message):
    fake_hub.files[(REPO, "m-Q8_0.gguf")] = b"GGUF"
    fake_hub.listing = answer
    with pytest.raises(hub.HubError) as err:
        hub_files.fetch_listing(REPO)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert hub_files.cached_listing(REPO) is None
    assert not (hub.cache_dir() / "etc").exists() and not (hub.cache_dir().parent / "evil.gguf").exists()


def test_a_listing_past_its_size_limit_is_not_read(fake_hub, monkeypatch):
    fake_hub.files[(REPO, "m-Q8_0.gguf")] = b"GGUF"
    fake_hub.listing = {"sha": COMMIT, "siblings": [_sibling(f"f{i}.bin") for i in range(2000)]}
    monkeypatch.setattr(hub_files, "MAX_LISTING_BYTES", 64 << 10)
    with pytest.raises(hub.HubError, match="is over 0 MB; not read"):
        hub_files.fetch_listing(REPO)


def test_a_tampered_cached_listing_is_ignored(fake_hub):
    fake_hub.files[(REPO, "m-Q8_0.gguf")] = b"GGUF"
    hub_files.fetch_listing(REPO)
    path = hub_files._listing_path(REPO, None)
    doc = json.loads(path.read_text())
    doc["files"][0]["path"] = "../../m-Q8_0.gguf"
    path.write_text(json.dumps(doc))
    assert hub_files.cached_listing(REPO) is None
    path.write_text("{not json")
    assert hub_files.cached_listing(REPO) is None
    path.unlink()
    path.symlink_to("/dev/zero")
    assert hub_files.cached_listing(REPO) is None  # not a regular file: never read
