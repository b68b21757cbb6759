"""`dg list`, `dg info` and `dg pull` driven for real: the registry's models, what a GGUF holds, and
downloads through a fake Hub (conftest.py's fake_hub). One `error:` line for every bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, run


# ------------------------------------------------------------------------------------------ list / info


def test_list_shows_every_registry_entry_size_and_presence():
    r = run("list")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    # piped at 120 columns the table would need folding: a line per model and one for its file, under a
    # line naming the repository where it changes
    at = lines.index("diffusiongemma-26b:Q4_K_M *  diffusion, pair gemma4-26b  ~16.8 GB  not on disk")
    assert lines[at - 1:at + 2] == ["from unsloth/diffusiongemma-26B-A4B-it-GGUF:", lines[at],
                                    "  diffusiongemma-26B-A4B-it-Q4_K_M.gguf ?"]
    assert "gemma4-26b:Q8_0  ar, pair diffusiongemma-26b  ~26.9 GB  not on disk" in lines
    at = lines.index("gemma4-26b:Q5_K_M  ar, pair diffusiongemma-26b  ~19.3 GB  not on disk")
    assert lines[at - 1] == "from bartowski/google_gemma-4-26B-A4B-it-GGUF:"
    at = lines.index("gemma4-26b-qat:Q4_0 *  ar, pair diffusiongemma-26b  ~14.4 GB  not on disk")
    assert lines[at - 1:at + 2] == ["from google/gemma-4-26B-A4B-it-qat-q4_0-gguf@d1c082be9cf3:", lines[at],
                                    "  gemma-4-26B_q4_0-it.gguf ?"]
    rows = json.loads(run("list", "--json").stdout)["models"]
    assert {row["name"] for row in rows} == {"demo", "demo-ar", "diffusiongemma-26b", "gemma4-26b", "gemma4-26b-qat"}
    by_name = {(x["name"], x["quant"]): x for x in rows}
    assert by_name[("diffusiongemma-26b", "Q4_K_M")]["default"] is True
    assert by_name[("gemma4-26b", "Q5_K_M")]["repo"] == "bartowski/google_gemma-4-26B-A4B-it-GGUF"
    assert by_name[("gemma4-26b-qat", "Q4_0")]["file"] == "gemma-4-26B_q4_0-it.gguf"
    assert by_name[("gemma4-26b-qat", "Q4_0")]["checked"] is False  # no listing fetched here
    assert by_name[("gemma4-26b", "Q4_K_M")]["pair"] == "diffusiongemma-26b"
    assert by_name[("demo", None)]["on_disk"] is True and Path(by_name[("demo", None)]["path"]).exists()


def test_list_piped_prints_its_footer_as_one_unwrapped_line():
    # as the table's caption it was wrapped at the table's width, mid-sentence, and padded with spaces
    r = run("list")
    assert r.exit_code == 0, r.stderr
    legend, usage = r.stdout.splitlines()[-2:]
    assert legend.startswith("* default quant; ~ size from the registry; ? the registry's file name"), r.stdout
    assert legend.endswith("(`dg pull` or `dg list --refresh` reads it)."), r.stdout
    assert usage == "`dg pull NAME[:QUANT]` downloads; --model takes NAME, NAME:QUANT or a .gguf path.", r.stdout


@pytest.mark.subprocess
def test_list_as_a_table_names_every_repository_in_its_caption(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dgcli.cli", "list"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, COLUMNS="160", HF_HUB_CACHE=str(tmp_path)),
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in r.stdout.splitlines() if line.startswith("│")]
    assert ["gemma4-26b-qat", "Q4_0 *", "ar", "diffusiongemma-26b", "gemma-4-26B_q4_0-it.gguf ?", "~14.4 GB", "no"] in rows
    legend, sources, usage = r.stdout.splitlines()[-3:]
    assert sources.startswith("Files from demo: shipped with dg;"), r.stdout
    assert ("gemma4-26b: ggml-org/gemma-4-26B-A4B-it-GGUF (Q5_K_M, Q6_K: bartowski/google_gemma-4-26B-A4B-it-GGUF);"
            in sources), r.stdout
    assert "gemma4-26b-qat: google/gemma-4-26B-A4B-it-qat-q4_0-gguf@d1c082be9cf3." in sources, r.stdout


def test_list_marks_downloaded_models(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = cache / "models--unsloth--diffusiongemma-26B-A4B-it-GGUF" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "diffusiongemma-26B-A4B-it-Q8_0.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    (cache / "models--unsloth--diffusiongemma-26B-A4B-it-GGUF" / "refs").mkdir()
    (cache / "models--unsloth--diffusiongemma-26B-A4B-it-GGUF" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    rows = {(x["name"], x["quant"]): x for x in json.loads(run("list", "--json").stdout)["models"]}
    assert rows[("diffusiongemma-26b", "Q8_0")]["on_disk"] is True
    assert rows[("diffusiongemma-26b", "Q8_0")]["size"] == 64
    assert rows[("diffusiongemma-26b", "Q4_K_M")]["on_disk"] is False


def test_info_table_and_json(tiny_gguf):
    r = run("info", tiny_gguf)
    assert r.exit_code == 0, r.stderr
    for text in ("diffusion-gemma", "canvas length", "16", "sampler defaults", "max_denoising_steps",
                 "entropy_bound", "tensor types", "F32", "context length", "4096", "memory"):
        assert text in r.stdout
    # the keys beyond the published converter's, which dg filled with the reference's defaults
    assert "logit softcap" in r.stdout and "30  (reference default, added by dg)" in r.stdout
    assert "added by dg" in r.stdout and "the six diffusion.eb_* keys" in r.stdout
    assert "published converter leaves these keys out" in " ".join(r.stdout.split())
    assert r.stdout.count("gguf: reference default") == 6
    doc = json.loads(run("info", tiny_gguf, "--json").stdout)
    assert doc["architecture"] == "diffusion-gemma" and doc["canvas_length"] == 16
    assert doc["final_logit_softcapping"] == 30.0 and len(doc["reference_default_keys"]) == 7
    assert doc["parameter_count"] == sum(t["parameters"] for t in doc["tensor_types"])
    assert isinstance(doc["fits_ram"], bool) and doc["file_size"] == Path(tiny_gguf).stat().st_size


def test_info_piped_rows_are_one_line_each_without_padding(tiny_gguf):
    # the summary grid padded every row with spaces out to the width and wrapped the long ones
    lines = run("info", tiny_gguf).stdout.splitlines()
    summary = lines[:lines.index(next(line for line in lines if "sampler defaults" in line))]
    assert [line.split("  ")[0] for line in summary[:2]] == ["file", "architecture"], summary
    assert all(line == line.rstrip() for line in summary), summary
    added = next(line for line in summary if line.startswith("added by dg  "))
    assert added.endswith("(the published converter leaves these keys out)"), summary


def test_info_of_a_registry_name_not_yet_downloaded_asks_the_hub(tmp_path, monkeypatch):
    # described from the Hub (tests/test_registry_hub.py); offline, one line saying so
    from hub_server import closed_port

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    assert_one_line_error(run("info", "diffusiongemma-26b"), "cannot reach the Hugging Face Hub",
                          "the file list of unsloth/diffusiongemma-26B-A4B-it-GGUF")


# ------------------------------------------------------------------------------------------ pull


def test_pull_through_fake_hub_then_list_shows_it(tmp_path, monkeypatch, fake_hub):
    fake_hub.files[("org/tiny-GGUF", "tiny-Q8_0.gguf")] = b"GGUF" + bytes(2000)
    reg = tmp_path / "models.toml"
    reg.write_text('[models.tiny]\nrole = "diffusion"\nrepo = "org/tiny-GGUF"\n'
                   '[models.tiny.files]\nQ8_0 = { file = "tiny-Q8_0.gguf", size_gb = 0.001 }\n')
    monkeypatch.setenv("DG_REGISTRY", str(reg))
    r = run("pull", "tiny")
    assert r.exit_code == 0, r.stderr
    path = Path(r.stdout.strip().split(": ", 1)[1])
    assert path.read_bytes() == fake_hub.files[("org/tiny-GGUF", "tiny-Q8_0.gguf")]
    assert "already downloaded" in run("pull", "tiny:Q8_0").stdout
    rows = json.loads(run("list", "--json").stdout)["models"]
    assert rows[0]["on_disk"] is True and rows[0]["size"] == 2004
    assert_one_line_error(run("pull", str(path)), "is a path")


def test_pull_missing_file_and_offline(tmp_path, monkeypatch, fake_hub):
    reg = tmp_path / "models.toml"
    reg.write_text('[models.tiny]\nrole = "ar"\nrepo = "org/tiny-GGUF"\n[models.tiny.files]\nQ8_0 = { file = "x.gguf" }\n')
    monkeypatch.setenv("DG_REGISTRY", str(reg))
    fake_hub.files[("org/tiny-GGUF", "other.gguf")] = b"GGUF"
    assert_one_line_error(run("pull", "tiny"), "org/tiny-GGUF at", "has no model .gguf for Q8_0; its .gguf files: other.gguf")
    from hub_server import closed_port

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    assert_one_line_error(run("pull", "tiny"), "cannot reach the Hugging Face Hub")


LONG_FILE = "diffusiongemma-26B-A4B-it-Q4_K_M.gguf"  # the registry's longest file name


def _pull_with_fake_download(tmp_path, monkeypatch, download, file: str = LONG_FILE):
    from dgcli import hub, pull
    from dgcli.hub_files import ListedFile, RepoListing

    # the repository's listing names the file; its bytes come from `download`
    monkeypatch.setattr(pull, "fetch_listing",
                        lambda repo, revision: RepoListing(repo, revision, "0" * 40, (ListedFile(file, 16 * 10**9, None),)))
    reg = tmp_path / "models.toml"
    reg.write_text(f'[models.big]\nrole = "diffusion"\nrepo = "org/big-GGUF"\n'
                   f'[models.big.files]\nQ4_K_M = {{ file = "{file}", size_gb = 16 }}\n')
    monkeypatch.setenv("DG_REGISTRY", str(reg))
    monkeypatch.setattr(hub, "download", download)
    return run("pull", "big")


def test_pull_waiting_for_another_pull_is_one_line_when_piped(tmp_path, monkeypatch):
    # the wait line went through Rich at 80 columns: "... waiting \nfor it to finish" in a log
    done = tmp_path / "done.gguf"
    done.write_bytes(b"GGUF")

    def download(repo, filename, *, on_wait=None, **_):
        on_wait(f"another download of {filename} is running; waiting for it to finish")
        return done

    r = _pull_with_fake_download(tmp_path, monkeypatch, download)
    assert r.exit_code == 0, r.stderr
    assert f"another download of {LONG_FILE} is running; waiting for it to finish\n" in r.stderr, r.stderr


@pytest.mark.parametrize("columns", [80, 40])
def test_pull_progress_bars_fit_the_width(tmp_path, monkeypatch, columns):
    # at 80 columns a 16 GB file's bar wrapped its unit onto a line of its own ("16.0/16.0" / "GB")
    done = tmp_path / "done.gguf"
    done.write_bytes(b"GGUF")
    total = 16 * 10**9

    def download(repo, filename, *, on_progress=None, on_verify=None, **_):
        on_progress(total // 2, total)
        on_progress(total, total)
        on_verify(total, total)
        return done

    monkeypatch.setenv("COLUMNS", str(columns))
    r = _pull_with_fake_download(tmp_path, monkeypatch, download)
    assert r.exit_code == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 2, r.stderr  # one line per bar: the transfer and the sha256 pass
    assert all(len(line.rstrip()) <= columns for line in lines), r.stderr
    assert all("16.0/16.0 GB" in line for line in lines), r.stderr
    assert lines[1].startswith("sha256 check"), r.stderr


def test_pull_progress_bar_shows_a_file_name_as_text(tmp_path, monkeypatch):
    # the bar's name column read the registry's file name as Rich markup: "[/x]" ended the pull in a
    # MarkupError, "[b]" vanished
    done = tmp_path / "done.gguf"
    done.write_bytes(b"GGUF")

    def download(repo, filename, *, on_progress=None, **_):
        on_progress(10, 10)
        return done

    monkeypatch.setenv("COLUMNS", "120")
    r = _pull_with_fake_download(tmp_path, monkeypatch, download, file="m[/x][b]-Q4_K_M.gguf")
    assert r.exit_code == 0, (r.stderr, r.exception)
    assert "m[/x][b]-Q4_K_M.gguf" in r.stderr, r.stderr
