"""HF DiffusionGemma checkpoint -> GGUF in the published layout (`dg convert`), and the AR gemma4 twin.

No torch: safetensors are read with numpy memmaps (F32/F16/BF16), tensors are written one by
one (3-D expert tensors one expert at a time), so memory stays near one tensor's size.

Layout notes (checked against llama.cpp's gemma4 loader, src/models/gemma4.cpp, and the
Transformers reference):
- Linear weights keep the HF [out, in] order; ggml reads that as {in, out}. Expert tensors keep
  [E, 2*I, H] (gate rows first, then up, as both `chunk(2)` and llama.cpp's gate_up split expect)
  and [E, H, I].
- RMSNorm weights are copied as they are: the reference multiplies by the weight directly
  (no Gemma-3 style `1 + w`), and so does llama.cpp.
- The router's `scale` becomes `ffn_gate_inp.scale`; llama.cpp applies the 1/sqrt(n_embd) itself.
  `per_expert_scale` becomes `ffn_down_exps.scale`.
- Full layers have no v_proj (V = K), so `attn_v` exists on sliding layers only.
- Encoder and decoder share every weight except the per-layer scalar: the decoder's goes to
  `layer_output_scale`, the encoder's to `enc_layer_output_scale`. The AR twin (stock gemma4)
  takes the ENCODER scalar as its `layer_output_scale`.
- Proportional rope of the full layers is written as `rope_freqs`: 1.0 for the rotated pairs,
  1e30 (no rotation) for the rest.

The package: config.py (config.json -> LayoutParams), tensors.py (the tensor plan and each tensor's
source in the checkpoint), checkpoint.py (safetensors without torch), tokenizer.py (tokenizer.json ->
the GGUF vocabulary), writer.py (the GGUF itself); this module converts a checkpoint with them. The
names in __all__ are the converter's public API, importable from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from dgcli.convert.checkpoint import CheckpointReader, SafetensorsIndex, checkpoint_files, read_json
from dgcli.convert.config import OUTTYPES, LayoutParams, diffusion_params_from_generation, params_from_hf_config
from dgcli.convert.tensors import TensorSpec, tensor_plan
from dgcli.convert.tokenizer import (
    PUBLISHED_TOKEN_SCORE,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    GgufVocab,
    published_token_types,
    special_token_texts,
    vocab_from_hf_dir,
)
from dgcli.convert.writer import add_layout_keys, encode_as, gguf_output, storage_type, write_layout_gguf
from dgcli.errors import DgError
from dgcli.modelfile.hparams import AR_ARCH, DIFFUSION_ARCH
from dgcli.outputs import OutputFile, check_distinct
from dgcli.units import format_bytes

__all__ = [
    "CHECKPOINT_TEXT_FILES",
    "OUTTYPES",
    "PUBLISHED_TOKEN_SCORE",
    "TOKEN_BYTE",
    "TOKEN_CONTROL",
    "TOKEN_NORMAL",
    "TOKEN_UNKNOWN",
    "TOKEN_UNUSED",
    "TOKEN_USER_DEFINED",
    "CheckpointReader",
    "GgufVocab",
    "LayoutParams",
    "SafetensorsIndex",
    "TensorSpec",
    "add_layout_keys",
    "checkpoint_inputs",
    "convert_checkpoint",
    "convert_main",
    "diffusion_params_from_generation",
    "encode_as",
    "gguf_output",
    "params_from_hf_config",
    "published_token_types",
    "read_checkpoint_params",
    "special_token_texts",
    "storage_type",
    "tensor_plan",
    "vocab_from_hf_dir",
    "write_layout_gguf",
]


def read_checkpoint_params(hf_dir: str | Path) -> LayoutParams:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise DgError(f"checkpoint directory {hf_dir} does not exist")
    config = read_json(hf_dir / "config.json", required=True)
    generation = read_json(hf_dir / "generation_config.json", required=False)
    return params_from_hf_config(config, generation)


# what a conversion reads besides the safetensors shards: never an output
CHECKPOINT_TEXT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                         "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json")


def checkpoint_inputs(hf_dir: str | Path) -> list[Path]:
    """Every file a conversion of `hf_dir` reads (those that exist)."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        return []
    try:
        shards = checkpoint_files(hf_dir)
    except DgError:
        shards = sorted(hf_dir.glob("*.safetensors"))
    return shards + [hf_dir / name for name in CHECKPOINT_TEXT_FILES if (hf_dir / name).is_file()]


def convert_checkpoint(hf_dir: str | Path, out_path: str | Path | OutputFile, outtype: str = "f32",
                       arch: str = DIFFUSION_ARCH) -> Path:
    """Convert an HF DiffusionGemma checkpoint dir to a GGUF (arch "diffusion-gemma" or the AR twin "gemma4").

    A path is replaced if it exists, but never when it is one of the checkpoint's own files."""
    if outtype not in OUTTYPES:
        raise DgError(f"unknown outtype {outtype!r} (choose from {', '.join(OUTTYPES)})")
    if arch not in (DIFFUSION_ARCH, AR_ARCH):
        raise DgError(f"unknown architecture {arch!r} (expected {DIFFUSION_ARCH!r} or {AR_ARCH!r})")
    hf_dir = Path(hf_dir)
    out = out_path if isinstance(out_path, OutputFile) else gguf_output(out_path, force=True,
                                                                        inputs=checkpoint_inputs(hf_dir))
    params = read_checkpoint_params(hf_dir)
    vocab = vocab_from_hf_dir(hf_dir, params.vocab_size)
    reader = CheckpointReader(hf_dir, params)
    plan = tensor_plan(params, arch)
    for spec in plan:  # fail before writing anything if a tensor is missing
        if spec.role != "rope_freqs":
            reader.hf_name(spec)
    reader.check_tied_lm_head()
    return write_layout_gguf(out, params, arch, vocab.add_to_gguf, reader.chunks, outtype)


def _check_not_a_checkpoint_name(hf_dir: str | Path, path: Path, what: str) -> None:
    """A GGUF written into the checkpoint under a name a conversion reads (x.safetensors, and a text
    file it does not have yet, chat_template.jinja) would make the checkpoint fail to convert next time."""
    if not (path.suffix == ".safetensors" or path.name in CHECKPOINT_TEXT_FILES):
        return
    try:
        inside = path.absolute().parent.resolve() == Path(hf_dir).resolve()
    except OSError:
        return
    if inside:
        raise DgError(f"cannot write {what} {path}: a conversion of {hf_dir} reads that name as part of the "
                      "checkpoint (give the GGUF a .gguf name, or write it elsewhere)")


def convert_main(hf_dir: str | Path, out_path: str | Path, outtype: str = "bf16",
                 ar_twin: str | Path | None = None, echo: Callable[[str], None] | None = None,
                 force: bool = False) -> list[Path]:
    """`dg convert HF_DIR OUT.gguf [--outtype f32|f16|bf16|q8_0] [--ar-twin OUT2.gguf] [--force]`.

    Both outputs are checked before converting: never one of the checkpoint's files, never each
    other, an existing file only with `force`."""
    say = echo or (lambda _msg: None)
    inputs = checkpoint_inputs(hf_dir)
    outs = [gguf_output(out_path, force=force, inputs=inputs, what="OUT")]
    if ar_twin is not None:
        outs.append(gguf_output(ar_twin, force=force, inputs=inputs, what="--ar-twin"))
    check_distinct(outs)
    for path, what in ((out_path, "OUT"), (ar_twin, "--ar-twin")):  # after the checks of existing inputs
        if path is not None:
            _check_not_a_checkpoint_name(hf_dir, Path(path), what)
    written = [convert_checkpoint(hf_dir, outs[0], outtype, DIFFUSION_ARCH)]
    say(f"wrote {written[-1]} ({DIFFUSION_ARCH}, {outtype}, {format_bytes(written[-1].stat().st_size)})")
    if ar_twin is not None:
        written.append(convert_checkpoint(hf_dir, outs[1], outtype, AR_ARCH))
        say(f"wrote {written[-1]} ({AR_ARCH} AR twin, {outtype}, {format_bytes(written[-1].stat().st_size)})")
    return written
