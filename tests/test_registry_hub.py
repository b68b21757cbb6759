"""`dg pull`, `dg list` and `dg info` of registry models against the fake Hub: the file a quant is comes
from the repository's listing (renamed files, several candidates, split parts, a projector beside the
model, a pinned revision), and `dg info` describes a file not downloaded from the Hub's metadata and
the first bytes of its GGUF header."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dgcli import cli, hub, remote_gguf
from hub_server import COMMIT, closed_port

runner = CliRunner()
REPO = "org/tiny-GGUF"


def run(*args):
    return runner.invoke(cli.app, [str(a) for a in args])


def one_line_error(result, *fragments):
    assert result.exit_code != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """Write a models.toml with a `tiny` diffusion entry (QUANT = {spec}) in REPO and point dg at it."""
    def write(files: str, extra: str = "") -> Path:
        reg = tmp_path / "models.toml"
        reg.write_text(f'[models.tiny]\nrole = "diffusion"\nrepo = "{REPO}"\n{extra}\n[models.tiny.files]\n{files}\n')
        monkeypatch.setenv("DG_REGISTRY", str(reg))
        return reg
    return write


def list_rows() -> dict:
    r = run("list", "--json")
    assert r.exit_code == 0, r.stderr
    return {(x["name"], x["quant"]): x for x in json.loads(r.stdout)["models"]}


def test_a_renamed_file_is_pulled_by_its_quant_not_the_registrys_name(fake_hub, registry, monkeypatch):
    model = b"GGUF" + bytes(3000)
    fake_hub.files[(REPO, "tiny-it-Q8_0.gguf")] = model
    fake_hub.files[(REPO, "mmproj-tiny-it-Q8_0.gguf")] = b"GGUF" + bytes(10)  # says Q8_0 too: a projector
    fake_hub.files[(REPO, "README.md")] = b"# tiny"
    registry('Q8_0 = { file = "tiny-Q8_0.gguf", size_gb = 0.001 }')
    before = list_rows()[("tiny", "Q8_0")]
    assert before["file"] == "tiny-Q8_0.gguf" and before["checked"] is False and before["size_exact"] is False

    r = run("pull", "tiny")
    assert r.exit_code == 0, r.stderr
    path = Path(r.stdout.strip().split(": ", 1)[1])
    assert path.name == "tiny-it-Q8_0.gguf" and path.read_bytes() == model
    assert [p for _, p, _ in fake_hub.gets() if "mmproj" in p] == []  # the projector was never fetched
    row = list_rows()[("tiny", "Q8_0")]
    assert row["file"] == "tiny-it-Q8_0.gguf" and row["checked"] and row["on_disk"] and row["size"] == len(model)
    assert row["commit"] == COMMIT and row["size_exact"]
    # offline afterwards: the cached listing still says which file it is
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    again = run("pull", "tiny:Q8_0")
    assert again.exit_code == 0 and "already downloaded" in again.stdout and str(path) in again.stdout
    r = run("list")
    assert r.exit_code == 0 and "tiny-it-Q8_0.gguf" in r.stdout and "tiny-Q8_0.gguf" not in r.stdout


def test_several_candidates_are_one_line_listing_the_repositorys_gguf_files(fake_hub, registry):
    fake_hub.files[(REPO, "tiny-Q4_K_M.gguf")] = b"GGUF1"
    fake_hub.files[(REPO, "tiny-UD-Q4_K_M.gguf")] = b"GGUF2"
    fake_hub.files[(REPO, "mmproj-F16.gguf")] = b"GGUF3"
    registry('Q4_K_M = { file = "old-name-Q4_K_M.gguf" }')
    line = one_line_error(run("pull", "tiny"), f"{REPO} at {COMMIT[:12]} has 2 model .gguf files for Q4_K_M",
                          "its .gguf files: mmproj-F16.gguf, tiny-Q4_K_M.gguf, tiny-UD-Q4_K_M.gguf")
    assert "Traceback" not in line and fake_hub.gets() == []
    # the registry's preference settles it
    registry('Q4_K_M = { file = "tiny-UD-Q4_K_M.gguf" }')
    r = run("pull", "tiny")
    assert r.exit_code == 0, r.stderr
    assert Path(r.stdout.strip().split(": ", 1)[1]).read_bytes() == b"GGUF2"
    # no file for a quant at all
    registry('Q4_K_M = { file = "tiny-Q4_K_M.gguf" }\nQ8_0 = {}')
    one_line_error(run("pull", "tiny:Q8_0"), "has no model .gguf for Q8_0; its .gguf files:")
    # and dg list says so without failing
    r = run("list")
    assert r.exit_code == 0 and "tiny:Q8_0: " in r.stderr and "no model .gguf for Q8_0" in r.stderr


def test_a_split_model_is_pulled_whole_and_loaded_from_its_first_part(fake_hub, registry, tiny_gguf, tmp_path):
    from native_helpers import split_gguf

    parts = split_gguf(tiny_gguf, tmp_path / "split", "tiny-BF16", n_parts=3)
    for p in parts:
        fake_hub.files[(REPO, f"BF16/{p.name}")] = p.read_bytes()
    fake_hub.files[(REPO, "tiny-Q8_0.gguf")] = b"GGUF"
    registry('BF16 = { size_gb = 0.001 }')
    r = run("pull", "tiny:BF16")
    assert r.exit_code == 0, r.stderr
    first = Path(r.stdout.strip().split(": ", 1)[1])
    assert first.name == "tiny-BF16-00001-of-00003.gguf"
    assert [(first.parent / p.name).read_bytes() for p in parts] == [p.read_bytes() for p in parts]
    row = list_rows()[("tiny", "BF16")]
    assert row["parts"] == 3 and row["on_disk"] and row["size"] == sum(p.stat().st_size for p in parts)
    # dg reads the model whole from its parts, as llama.cpp loads it
    from dgcli.modelfile import info

    whole, split = info.read_info(tiny_gguf), info.read_info(first)
    assert split.tensor_count == whole.tensor_count and split.parameter_count == whole.parameter_count
    assert split.problem is None and split.file_size == row["size"]
    # a part missing on disk: the model is not there, and pull fetches the part again
    (first.parent / parts[1].name).unlink()
    assert list_rows()[("tiny", "BF16")]["on_disk"] is False
    assert run("pull", "tiny:BF16").exit_code == 0 and (first.parent / parts[1].name).exists()


def test_a_pinned_revision_is_fetched_at_that_commit_and_leaves_refs_main_alone(fake_hub, registry):
    fake_hub.files[(REPO, "tiny-Q8_0.gguf")] = b"GGUF" + bytes(50)
    registry('Q8_0 = {}', extra=f'revision = "{COMMIT}"')
    r = run("pull", "tiny")
    assert r.exit_code == 0, r.stderr
    assert f"/snapshots/{COMMIT}/tiny-Q8_0.gguf" in r.stdout
    assert not (hub.cache_dir() / "models--org--tiny-GGUF" / "refs" / "main").exists()
    assert all(f"/resolve/{COMMIT}/" in p for _, p, _ in fake_hub.gets())
    row = list_rows()[("tiny", "Q8_0")]
    assert row["on_disk"] and row["revision"] == COMMIT
    registry('Q8_0 = {}', extra=f'revision = "{"e" * 40}"')
    one_line_error(run("pull", "tiny"), f"revision {'e' * 40} not found in {REPO}")
    registry('Q8_0 = {}', extra='revision = "main"')
    one_line_error(run("list"), "tiny.revision must be a commit id")


def test_a_file_whose_metadata_contradicts_the_listing_is_not_downloaded(fake_hub, registry):
    fake_hub.files[(REPO, "tiny-Q8_0.gguf")] = b"GGUF" + bytes(50)
    fake_hub.api_sha256 = fake_hub.etag = "b" * 64  # the file's metadata now disagrees with the model API's listing
    registry('Q8_0 = {}')
    one_line_error(run("pull", "tiny"), "is not what its file list gave")
    assert [g for g in fake_hub.gets()] == []


def test_list_refresh_reads_every_repository_and_says_which_it_could_not(fake_hub, registry, monkeypatch):
    fake_hub.files[(REPO, "tiny-it-Q8_0.gguf")] = b"GGUF" + bytes(7)
    registry('Q8_0 = { file = "tiny-Q8_0.gguf" }\n[models.other]\nrole = "ar"\nrepo = "org/absent"\n'
             '[models.other.files]\nQ4_0 = {}')
    r = run("list", "--refresh", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    row = {(x["name"], x["quant"]): x for x in doc["models"]}[("tiny", "Q8_0")]
    assert row["file"] == "tiny-it-Q8_0.gguf" and row["checked"] and row["size"] == 11 and not row["on_disk"]
    assert len(doc["refresh_problems"]) == 1 and "repository not found on the Hub: org/absent" in doc["refresh_problems"][0]


# ------------------------------------------------------------------------------------------ dg info


def test_info_of_a_model_not_downloaded_reads_its_header_from_the_hub(fake_hub, registry, tiny_gguf, monkeypatch):
    data = Path(tiny_gguf).read_bytes()
    fake_hub.files[(REPO, "tiny-Q8_0.gguf")] = data
    registry('Q8_0 = {}')
    monkeypatch.setattr(remote_gguf, "FIRST_REQUEST_BYTES", 4096)  # the header is ~23 kB: three requests
    r = run("info", "tiny", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["architecture"] == "diffusion-gemma" and doc["canvas_length"] == 16 and doc["path"] is None
    assert doc["file_size"] == len(data) and doc["tensor_count"] > 100
    assert doc["hub"] == {"repo": REPO, "revision": None, "commit": COMMIT, "file": "tiny-Q8_0.gguf",
                          "parts": ["tiny-Q8_0.gguf"], "size": len(data),
                          "sha256": __import__("hashlib").sha256(data).hexdigest(), "downloaded": False}
    ranges = [rng for _, _, rng in fake_hub.gets()]
    assert ranges == ["bytes=0-4095", "bytes=4096-8191", "bytes=8192-16383", "bytes=16384-32767"]
    assert not list(hub.cache_dir().glob("models--*/blobs/*"))  # nothing downloaded
    text = run("info", "tiny")
    assert text.exit_code == 0, text.stderr
    for fragment in ("tiny-Q8_0.gguf", "not downloaded", "dg pull tiny:Q8_0", COMMIT, "the first bytes of the file on the Hub",
                     "diffusion-gemma", "sampler defaults"):
        assert fragment in text.stdout, text.stdout


def test_info_from_the_hub_when_the_header_cannot_be_read_still_gives_the_hubs_metadata(fake_hub, registry,
                                                                                         tiny_gguf, monkeypatch):
    fake_hub.files[(REPO, "tiny-Q8_0.gguf")] = Path(tiny_gguf).read_bytes()
    registry('Q8_0 = {}')
    monkeypatch.setattr(remote_gguf, "MAX_HEADER_BYTES", 8192)
    r = run("info", "tiny")
    assert r.exit_code == 0, r.stderr
    assert "not read: the GGUF header of org/tiny-GGUF/tiny-Q8_0.gguf is longer than" in " ".join(r.stdout.split())
    doc = json.loads(run("info", "tiny", "--json").stdout)
    assert "architecture" not in doc and doc["hub"]["size"] == Path(tiny_gguf).stat().st_size
    assert "longer than" in doc["header_error"]
    # a server that ignores Range: its answer is read only as far as was asked
    monkeypatch.setattr(remote_gguf, "MAX_HEADER_BYTES", 64 << 20)
    monkeypatch.setattr(remote_gguf, "FIRST_REQUEST_BYTES", 4096)
    fake_hub.ignore_range = True
    doc = json.loads(run("info", "tiny", "--json").stdout)
    assert doc["architecture"] == "diffusion-gemma" and doc["tensor_count"] > 100
    # a file that is not a GGUF
    fake_hub.files[(REPO, "tiny-Q8_0.gguf")] = b"<html>not a model</html>" * 10
    doc = json.loads(run("info", "tiny", "--json").stdout)
    assert "not a GGUF file (bad magic" in doc["header_error"]


def test_info_from_the_hub_refuses_a_range_answer_for_other_bytes(fake_hub, registry, tiny_gguf, monkeypatch):
    from dgcli.hub import RemoteFile

    fake_hub.files[(REPO, "tiny-Q8_0.gguf")] = Path(tiny_gguf).read_bytes()
    remote = RemoteFile(REPO, "tiny-Q8_0.gguf", 10**6, COMMIT, "a" * 64,
                        f"{fake_hub.url}/{REPO}/resolve/main/tiny-Q8_0.gguf")
    with pytest.raises(hub.HubError, match="with another range"):  # the server's size is not the metadata's
        remote_gguf._fetch_range(remote, 0, 100)


def test_a_file_main_still_holds_is_not_downloaded_again_when_main_moves_on(fake_hub, registry):
    fake_hub.files[(REPO, "tiny-Q8_0.gguf")] = b"GGUF" + bytes(50)
    registry('Q8_0 = {}')
    first = run("pull", "tiny")
    assert first.exit_code == 0, first.stderr
    fake_hub.commit = "9" * 40  # a README edit upstream: a new commit, the same file
    fake_hub.files[(REPO, "README.md")] = b"# new"
    assert run("list", "--refresh").exit_code == 0  # the cached listing is now of the new commit
    n_gets = len(fake_hub.gets())
    again = run("pull", "tiny")
    assert again.exit_code == 0 and "already downloaded" in again.stdout, again.stdout
    assert len(fake_hub.gets()) == n_gets
    # the file changed upstream: the listing's sha256 no longer names the blob main's snapshot links
    fake_hub.commit = "8" * 40
    fake_hub.files[(REPO, "tiny-Q8_0.gguf")] = b"GGUF" + bytes(60)
    assert run("list", "--refresh").exit_code == 0
    assert list_rows()[("tiny", "Q8_0")]["on_disk"] is False
    r = run("pull", "tiny")
    assert r.exit_code == 0 and Path(r.stdout.strip().split(": ", 1)[1]).read_bytes() == b"GGUF" + bytes(60)
