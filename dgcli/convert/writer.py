"""Writing a GGUF in the published layout: the keys, and each tensor streamed in the storage type
chosen for it (F32 / F16 / BF16 / Q8_0), so memory stays near one tensor's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from dgcli.convert.config import OUTTYPES, LayoutParams
from dgcli.convert.tensors import TensorSpec, tensor_plan
from dgcli.errors import DgError
from dgcli.modelfile.hparams import DIFFUSION_ARCH
from dgcli.outputs import OutputFile, writing
from dgcli.params import DIFFUSION_PARAM_KEYS, REFERENCE_DEFAULTS_KEY, DiffusionParams


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - gguf is a dependency
        raise DgError("the 'gguf' package is needed to write GGUF files (pip install gguf)") from None
    return gguf


def storage_type(spec: TensorSpec, outtype: str):
    """The ggml type a tensor is stored as: vectors, scalars and the router stay F32."""
    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    if outtype not in OUTTYPES:
        raise DgError(f"unknown outtype {outtype!r} (choose from {', '.join(OUTTYPES)})")
    if len(spec.shape) == 1 or spec.role in ("ffn_gate_inp", "rope_freqs"):
        return T.F32
    if outtype == "f32":
        return T.F32
    if outtype == "f16":
        return T.F16
    if outtype == "bf16":
        return T.BF16
    block = gguf.GGML_QUANT_SIZES[T.Q8_0][0]
    # llama.cpp's converters fall back the same way for rows that do not fill whole blocks
    return T.Q8_0 if spec.shape[-1] % block == 0 else T.F16


def encode_as(data: np.ndarray, qtype) -> np.ndarray:
    """float32 data -> the bytes/array written for `qtype` (F32, F16, BF16, Q8_0; Q5_0 for test models)."""
    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == T.F32:
        return data
    if qtype == T.F16:
        return data.astype(np.float16)
    if qtype in (T.BF16, T.Q8_0, T.Q5_0):
        try:
            return gguf.quants.quantize(data, qtype)
        except Exception as exc:  # gguf raises NotImplementedError/ValueError for unsupported types
            raise DgError(f"cannot quantize to {qtype.name} with this gguf package: {exc}") from None
    raise DgError(f"unsupported tensor type {qtype!r}")


def _nbytes(shape: Sequence[int], qtype) -> int:
    gguf = _gguf()
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    return n // block * type_size


def _byte_shape(shape: Sequence[int], qtype) -> tuple[int, ...]:
    gguf = _gguf()
    return tuple(gguf.quants.quant_shape_to_byte_shape(tuple(shape), qtype))


def _write_streamed(writer, nbytes: int, chunks: Iterable[np.ndarray]) -> None:
    """Write one tensor's data from chunks (same bookkeeping as GGUFWriter.write_tensor_data)."""
    from gguf.gguf_writer import WriterState

    fout = writer.fout[0]
    name = next(iter(writer.tensors[0]))
    info = writer.tensors[0].pop(name)
    if info.nbytes != nbytes:
        raise DgError(f"internal: tensor {name} expects {info.nbytes} bytes, got {nbytes}")
    writer.write_padding(fout, fout.tell())
    written = 0
    for chunk in chunks:
        chunk = np.ascontiguousarray(chunk)
        # through the file object, not ndarray.tofile: a failed write then says why (ENOSPC, EFBIG)
        # instead of numpy's '6144 requested and 1936 written'
        fout.write(chunk.data)
        written += chunk.nbytes
    if written != nbytes:
        raise DgError(f"internal: tensor {name} wrote {written} bytes, expected {nbytes}")
    writer.write_padding(fout, nbytes)
    writer.state = WriterState.WEIGHTS


# A tensor source yields a tensor's float32 data in row-major chunks (whole leading slices).
TensorSource = Callable[[TensorSpec], Iterable[np.ndarray]]
# Raw sources may yield already-encoded chunks for a given storage type (synthetic benchmarks).
RawTensorSource = Callable[[TensorSpec, Any], Iterable[np.ndarray]]


def add_layout_keys(writer, p: LayoutParams, arch: str) -> None:
    """The hyperparameter keys of the published layout (diffusion) or of a stock gemma4 file (AR twin)."""
    writer.add_block_count(p.n_layer)
    writer.add_context_length(p.context_length)
    writer.add_embedding_length(p.n_embd)
    writer.add_feed_forward_length(p.n_ff)
    writer.add_expert_feed_forward_length(p.n_ff_exp)
    writer.add_expert_count(p.n_expert)
    writer.add_expert_used_count(p.n_expert_used)
    writer.add_head_count(p.n_head)
    writer.add_head_count_kv([int(x) for x in p.head_count_kv])
    writer.add_key_length(p.head_dim_full)
    writer.add_value_length(p.head_dim_full)
    writer.add_key_length_swa(p.head_dim_swa)
    writer.add_value_length_swa(p.head_dim_swa)
    writer.add_sliding_window(p.sliding_window)
    writer.add_sliding_window_pattern([bool(x) for x in p.is_swa])
    writer.add_shared_kv_layers(0)
    writer.add_embedding_length_per_layer_input(0)
    writer.add_layer_norm_rms_eps(p.rms_eps)
    writer.add_rope_freq_base(p.rope_base_full)
    writer.add_rope_freq_base_swa(p.rope_base_swa)
    writer.add_rope_dimension_count(p.head_dim_full)
    writer.add_rope_dimension_count_swa(p.head_dim_swa)
    writer.add_final_logit_softcapping(p.softcap)
    key_of = {"softcap": f"{arch}.final_logit_softcapping"}
    if arch == DIFFUSION_ARCH:
        writer.add_causal_attention(False)
        d = p.diffusion
        writer.add_uint32("diffusion.canvas_length", p.canvas_length)
        for key, name in DIFFUSION_PARAM_KEYS.items():
            # step counts are integers in the published files, temperatures and thresholds floats
            value = getattr(d, name)
            if isinstance(getattr(DiffusionParams(), name), int):
                writer.add_uint32(key, int(value))
            else:
                writer.add_float32(key, float(value))
            key_of[name] = key
    # keys the published converter would leave out: say which so `dg info` can tell
    defaulted = [key_of[name] for name in p.reference_defaults if name in key_of]
    if defaulted:
        writer.add_array(REFERENCE_DEFAULTS_KEY, defaulted)


def write_layout_gguf(out_path: str | Path | OutputFile, p: LayoutParams, arch: str,
                      add_vocab: Callable[[Any], None], source: TensorSource | None = None, outtype: str = "f32",
                      raw_source: RawTensorSource | None = None,
                      storage: Callable[[TensorSpec], Any] | None = None, file_type: int | None = None) -> Path:
    """Write a GGUF in the published layout; tensors are pulled from `source` one at a time.
    `storage(spec)` chooses each tensor's type instead of `outtype` (synthetic quant mixes).
    `file_type` (a gguf.LlamaFileType) is declared as `general.file_type`, as llama.cpp's quantizer
    does in the published quants; None writes no such key, as the published converter does.

    A path is replaced if it exists (pass an OutputFile to refuse that or to protect inputs); the file
    appears only once complete."""
    gguf = _gguf()
    if outtype not in OUTTYPES:
        raise DgError(f"unknown outtype {outtype!r} (choose from {', '.join(OUTTYPES)})")
    p.validate()
    plan = tensor_plan(p, arch)
    out = out_path if isinstance(out_path, OutputFile) else gguf_output(out_path, force=True)
    with writing(out):
        writer = gguf.GGUFWriter(str(out.write_path), arch)
        try:
            add_layout_keys(writer, p, arch)
            if file_type is not None:
                writer.add_file_type(int(file_type))
            add_vocab(writer)
            types = [storage(spec) if storage else storage_type(spec, outtype) for spec in plan]
            for spec, qtype in zip(plan, types):
                writer.add_tensor_info(spec.name, _byte_shape(spec.shape, qtype), np.dtype(np.uint8),
                                       _nbytes(spec.shape, qtype), raw_dtype=qtype)
            writer.write_header_to_file(out.write_path)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for spec, qtype in zip(plan, types):
                if raw_source is not None:
                    chunks = raw_source(spec, qtype)
                else:
                    chunks = (encode_as(c, qtype) for c in _checked_chunks(spec, source(spec)))
                _write_streamed(writer, _nbytes(spec.shape, qtype), chunks)
            writer.close()  # flushes: a full disk may only show here
        except OSError as err:
            raise DgError(f"cannot write {out.path}: {err.strerror or err}") from None
        finally:
            try:
                writer.close()
            except OSError:
                pass  # after an error already raised above
    return out.path


def gguf_output(path: str | Path, *, force: bool, inputs: Sequence[Path] = (), what: str = "output") -> OutputFile:
    """A GGUF output: a regular file only (the writer seeks), checked before any work starts."""
    return OutputFile(path, force=force, inputs=inputs, what=what, binary=True, streams=False)


def _checked_chunks(spec: TensorSpec, chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    rows = 0
    for chunk in chunks:
        chunk = np.asarray(chunk, dtype=np.float32)
        if chunk.shape[1:] != spec.shape[1:] and not (len(spec.shape) == 1 and chunk.ndim == 1):
            raise DgError(f"tensor {spec.name}: got shape {chunk.shape}, expected rows of {spec.shape[1:]}")
        rows += chunk.shape[0]
        yield chunk
    if rows != spec.shape[0]:
        raise DgError(f"tensor {spec.name}: got {rows} rows, expected {spec.shape[0]}")
