"""An F32 demo GGUF back into the Transformers model: the inverse of `dg convert`'s tensor mapping.

Fine-tuning the shipped demo starts from its GGUF: the HF checkpoint it was exported from is not
committed. F32 tensors are the checkpoint's own bits (the converter copies them), so the model
built here is exactly the one that was converted; `roundtrip_mismatches` proves it by converting
the loaded model again and comparing every tensor bit for bit with the file it came from.

The mapping is the converter's (dgcli.convert.tensors): every layout role names a checkpoint tensor
under the encoder's prefix (the decoder shares those weights), the decoder's prefix (self-conditioning,
its layer scalars) or the encoder's layer scalar. `rope_freqs` is derived from the config, so it is
compared with what the config gives rather than loaded.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from dgcli.convert import convert_checkpoint, params_from_hf_config, tensor_plan
from dgcli.convert.tensors import HF_LAYER_SUFFIX, HF_SELF_COND, TensorSpec
from dgcli.errors import DgError
from dgcli.modelfile.hparams import DIFFUSION_ARCH

# The prefixes of Transformers' DiffusionGemmaForBlockDiffusion state dict (the first form
# dgcli.convert.checkpoint.CheckpointReader looks under).
ENCODER_PREFIX = "model.encoder.language_model."
DECODER_PREFIX = "model.decoder."


def hf_tensor_name(spec: TensorSpec) -> str | None:
    """The state-dict entry a layout tensor comes from; None for rope_freqs (derived from the config)."""
    i = spec.layer
    if spec.role == "rope_freqs":
        return None
    if spec.role == "token_embd":
        return ENCODER_PREFIX + "embed_tokens.weight"
    if spec.role == "output_norm":
        return ENCODER_PREFIX + "norm.weight"
    if spec.role in HF_SELF_COND:
        return DECODER_PREFIX + HF_SELF_COND[spec.role]
    if spec.role == "layer_scalar_decoder":
        return f"{DECODER_PREFIX}layers.{i}.layer_scalar"
    if spec.role == "layer_scalar_encoder":
        return f"{ENCODER_PREFIX}layers.{i}.layer_scalar"
    if spec.role in HF_LAYER_SUFFIX:
        return f"{ENCODER_PREFIX}layers.{i}.{HF_LAYER_SUFFIX[spec.role]}"
    raise DgError(f"no checkpoint tensor for {spec.name} (role {spec.role})")


def _gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of an F32 diffusion-gemma GGUF as a float32 array in the checkpoint's shape."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    if arch != DIFFUSION_ARCH:
        raise DgError(f"{path} is a {arch!r} GGUF; the weights load from the {DIFFUSION_ARCH!r} file")
    tensors = {}
    for tensor in reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise DgError(f"{path}: {tensor.name} is {tensor.tensor_type.name}, not F32: the checkpoint's weights "
                          "cannot be recovered exactly from it")
        shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml's ne, innermost first
        tensors[tensor.name] = np.asarray(tensor.data, dtype=np.float32).reshape(shape)
    return tensors


def load_gguf_weights(model, path: str | Path) -> None:
    """Set every weight (and layer scalar) of `model` from the F32 GGUF at `path`, which must hold
    exactly the tensors the converter writes for the model's config, in their shapes."""
    import torch

    path = Path(path)
    params = params_from_hf_config(model.config.to_dict())
    plan = tensor_plan(params, DIFFUSION_ARCH)
    tensors = _gguf_tensors(path)
    missing = sorted({s.name for s in plan} - set(tensors))
    extra = sorted(set(tensors) - {s.name for s in plan})
    if missing or extra:
        raise DgError(f"{path} does not hold this config's tensors (missing {missing[:3]}, unexpected {extra[:3]})")
    state = model.state_dict()
    with torch.no_grad():
        for spec in plan:
            data = tensors[spec.name]
            if data.shape != tuple(spec.shape):
                raise DgError(f"{path}: {spec.name} has shape {list(data.shape)}, expected {list(spec.shape)}")
            name = hf_tensor_name(spec)
            if name is None:
                if not np.array_equal(data, params.rope_freq_factors()):
                    raise DgError(f"{path}: {spec.name} is not what the config's proportional rope gives")
                continue
            target = state[name]
            if target.numel() != data.size:
                raise DgError(f"{path}: {spec.name} has {data.size} values, {name} holds {target.numel()}")
            target.copy_(torch.from_numpy(data.copy()).reshape(target.shape))


def load_model_from_gguf(path: str | Path, hidden_size: int = 64, seed: int | None = None):
    """The demo's Transformers model (training.train_demo.build_model's architecture) with the GGUF's
    weights. The vision tower, which the converter drops, keeps its seeded initialisation."""
    from training import train_demo

    model = train_demo.build_model(train_demo.SEED if seed is None else seed, hidden_size)
    load_gguf_weights(model, path)
    return model


def gguf_tensor_bytes(path: str | Path) -> dict[str, tuple[int, tuple[int, ...], bytes]]:
    """name -> (ggml type, ne, raw bytes) of every tensor in a GGUF."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: (int(t.tensor_type), tuple(int(d) for d in t.shape), bytes(t.data.tobytes()))
            for t in reader.tensors}


def roundtrip_mismatches(model, gguf_path: str | Path) -> list[str]:
    """Convert `model` as `dg convert --outtype f32` does and compare every tensor of the result with
    the GGUF at `gguf_path` (type, shape, bytes). Empty when the model holds exactly that file's weights."""
    from dgcli.testing.reference import save_checkpoint

    with tempfile.TemporaryDirectory(prefix="dg-roundtrip-") as tmp:
        checkpoint = Path(tmp) / "hf"
        save_checkpoint(model, checkpoint)
        again = convert_checkpoint(checkpoint, Path(tmp) / "again.gguf", "f32", DIFFUSION_ARCH)
        original, converted = gguf_tensor_bytes(gguf_path), gguf_tensor_bytes(again)
    problems = [f"{name}: only in {gguf_path}" for name in sorted(set(original) - set(converted))]
    problems += [f"{name}: only in the re-conversion" for name in sorted(set(converted) - set(original))]
    problems += [f"{name}: differs" for name in sorted(set(original) & set(converted))
                 if original[name] != converted[name]]
    return problems
