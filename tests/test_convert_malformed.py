"""`dg convert` on malformed checkpoints: each is one `error:` line and exit 1, never a traceback,
never a huge allocation, never a GGUF of garbage weights, and no output file left behind.

Each case copies the reference checkpoint and breaks one thing in it."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from typer.testing import CliRunner

from dgcli import cli
pytestmark = pytest.mark.reference  # skipped without torch and transformers (conftest.py)
runner = CliRunner()


def _header(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def _write_header(ckpt, header, body):
    raw = json.dumps(header).encode()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def edit_header(edit):
    def apply(ckpt):
        header, body = _header(ckpt)
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        replaced = edit(header, names)
        _write_header(ckpt, header if replaced is None else replaced, body)
    return apply


def edit_json(filename, edit):
    def apply(ckpt):
        path = ckpt / filename
        doc = json.loads(path.read_text())
        doc = edit(doc) or doc
        path.write_text(json.dumps(doc))
    return apply


def edit_text_config(**values):
    def edit(config):
        config["text_config"].update(values)
    return edit_json("config.json", edit)


def write_index(weight_map):
    def apply(ckpt):
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return apply


def _offsets(new):
    def edit(header, names):
        header[names[1]]["data_offsets"] = new(header[names[1]]["data_offsets"])
    return edit


def _del(key):
    def edit(header, names):
        del header[names[0]][key]
    return edit


def _set_tokenizer_model(value):
    def edit(doc):
        doc["model"] = value
    return edit


def _add_token(token):
    def edit(doc):
        doc.setdefault("added_tokens", []).append(token)
    return edit


def _set(key, value):
    def edit(doc):
        doc[key] = value
    return edit


def _set_field(key, field, value):
    def edit(header, names):
        header[names[0]][field] = value
    return edit


CASES = {
    # safetensors header
    "header is a list": (edit_header(lambda h, n: []), "not a safetensors file"),
    "missing data_offsets": (edit_header(_del("data_offsets")), "invalid data_offsets None"),
    "reversed data_offsets": (edit_header(_offsets(lambda o: [o[1], o[0]])), "data_offsets"),
    "negative data_offsets": (edit_header(_offsets(lambda o: [-4, o[1] - o[0] - 4])), "invalid data_offsets"),
    "shifted data_offsets (same length)": (edit_header(_offsets(lambda o: [o[0] + 4, o[1] + 4])), "overlap"),
    "data_offsets of the wrong length": (edit_header(_offsets(lambda o: [o[0], o[1] - 4])), "do not hold"),
    "unknown dtype": (edit_header(_set_field("dtype", "dtype", "F99")), "unknown dtype 'F99'"),
    "negative shape": (edit_header(_set_field("shape", "shape", [-1, 4])), "invalid shape"),
    "shape of strings": (edit_header(_set_field("shape", "shape", ["4"])), "invalid shape"),
    # sharded index
    "weight_map of ints": (write_index({"model.decoder.norm.weight": 5}), "weight_map"),
    "weight_map a list": (write_index(["model.safetensors"]), "weight_map"),
    "weight_map escaping the checkpoint": (write_index({"x": "../../../etc/passwd"}), "weight_map"),
    # tokenizer
    'tokenizer.json {"model": 5}': (edit_json("tokenizer.json", _set_tokenizer_model(5)), "BPE model"),
    "tokenizer id a string": (edit_json("tokenizer.json", lambda d: d["model"]["vocab"].update({"zz": "x"})),
                              "expected an integer >= 0"),
    "tokenizer id 10**12": (edit_json("tokenizer.json", _add_token({"id": 10**12, "content": "<x>"})),
                            "but the model's vocab_size is"),
    "tokenizer id negative": (edit_json("tokenizer.json", _add_token({"id": -1, "content": "<x>"})),
                              "expected an integer >= 0"),
    "added token without id": (edit_json("tokenizer.json", _add_token({"content": "<x>"})), "the id None"),
    # the dict kept the last text: the other one silently left the GGUF's vocabulary
    "two vocab texts with one id": (edit_json("tokenizer.json", lambda d: d["model"]["vocab"].update({"zzq": 7})),
                                    "tokenizer.json gives id 7 to both"),
    "merges of ints": (edit_json("tokenizer.json", lambda d: d["model"].update(merges=[[1, 2]])), "merge"),
    "chat_template an int": (edit_json("tokenizer_config.json", _set("chat_template", 5)), "chat_template"),
    # a named special token the vocabulary lacks: was written as the default id (1, 4: some other token)
    "eos_token missing from the vocabulary": (edit_json("tokenizer_config.json", _set("eos_token", "<nope>")),
                                              "names eos_token '<nope>', which tokenizer.json does not have"),
    "mask_token missing from the vocabulary": (edit_json("tokenizer_config.json", _set("mask_token", {"content": "<m>"})),
                                               "names mask_token '<m>'"),
    # config
    "hidden_size 2**40": (edit_text_config(hidden_size=2**40), "n_embd = 1099511627776"),
    "num_hidden_layers -1": (edit_text_config(num_hidden_layers=-1), "for -1 layers"),
    # without layer_types: the default list was built first (10**9 layers: over a minute and 4 GB)
    "num_hidden_layers 10**7 without layer_types": (
        edit_json("config.json", lambda c: c["text_config"].update(num_hidden_layers=10**7, layer_types=None)),
        "num_hidden_layers = 10000000 is not an integer from 1 to 4096"),
    "num_hidden_layers 0 without layer_types": (
        edit_json("config.json", lambda c: c["text_config"].update(num_hidden_layers=0, layer_types=None)),
        "num_hidden_layers = 0 is not an integer from 1 to 4096"),
    "head_dim 2**40": (edit_text_config(head_dim=2**40, global_head_dim=2**40), "head_dim"),
    "vocab_size 0": (edit_text_config(vocab_size=0), "vocab_size = 0"),
    "layer_types a string": (edit_text_config(layer_types="full_attention"), "layer_types"),
    "rms_norm_eps NaN": (edit_text_config(rms_norm_eps=float("nan")), "rms_eps"),
    "max_position_embeddings Infinity": (edit_text_config(max_position_embeddings=float("inf")), "config.json"),
    "rope_parameters a list": (edit_text_config(rope_parameters=[1, 2]), "config.json"),
    # were converted by int(): "64" to 64, 64.5 to 64; a 0 was taken for "absent" (canvas_length 0 -> 256)
    "hidden_size a string": (edit_text_config(hidden_size="64"), "hidden_size = '64' is not an integer"),
    "hidden_size 64.5": (edit_text_config(hidden_size=64.5), "hidden_size = 64.5 is not an integer"),
    "canvas_length 0": (edit_json("config.json", _set("canvas_length", 0)), "canvas_length = 0 is not an integer"),
    "sliding_window 0": (edit_text_config(sliding_window=0), "sliding_window = 0 is not an integer"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_checkpoint_is_one_line(case, reference_checkpoint, tmp_path):
    mutate, fragment = CASES[case]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_checkpoint, ckpt)
    mutate(ckpt)
    out = tmp_path / "out.gguf"
    r = runner.invoke(cli.app, ["convert", str(ckpt), str(out), "--outtype", "f32"])
    assert r.exit_code == 1, (r.stdout, r.stderr, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert fragment in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no output, no temporary


# -- a write that fails part-way (a full disk; here the file size limit, which fails the same way) ---------


@pytest.mark.parametrize("limit", [20_000, 1_000_000, -1000])
@pytest.mark.subprocess
def test_a_failed_write_is_one_line_saying_why_and_leaves_nothing(reference_checkpoint, reference_gguf, tmp_path,
                                                                   limit):
    import os
    import resource
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    # in the header, in the tensors, in the last tensor (the same conversion without a limit is reference_gguf)
    limit = limit if limit > 0 else Path(reference_gguf).stat().st_size + limit

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG, as ENOSPC would
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "dgcli.cli", "convert", str(reference_checkpoint), str(out),
                           "--outtype", "f32"], capture_output=True, text=True, timeout=300, preexec_fn=small_files,
                          env=dict(os.environ, PYTHONPATH=str(repo)))
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    # was a traceback (the writer's close re-raised the error) or numpy's "6144 requested and 1936 written"
    assert lines == [f"error: cannot write {out}: {os.strerror(27)}"], proc.stderr[-2000:]
    assert list(out.parent.iterdir()) == []
