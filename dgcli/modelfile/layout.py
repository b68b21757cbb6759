"""The tensors of dg's GGUF layout (the published diffusion-gemma one, and its stock gemma4 AR twin):
names, roles and file order. The converter writes them (dgcli.convert); the pre-load check
(modelfile/info.py) names those a file lacks."""

from __future__ import annotations

from typing import Iterator, Sequence

from dgcli.modelfile.hparams import DIFFUSION_ARCH

# role -> the tensor's name under `blk.N.`, in a layer's file order
LAYER_TENSORS: tuple[tuple[str, str], ...] = (
    ("attn_norm", "attn_norm.weight"),
    ("attn_q", "attn_q.weight"),
    ("attn_k", "attn_k.weight"),
    ("attn_v", "attn_v.weight"),
    ("attn_q_norm", "attn_q_norm.weight"),
    ("attn_k_norm", "attn_k_norm.weight"),
    ("attn_output", "attn_output.weight"),
    ("post_attention_norm", "post_attention_norm.weight"),
    ("ffn_norm", "ffn_norm.weight"),
    ("ffn_gate", "ffn_gate.weight"),
    ("ffn_up", "ffn_up.weight"),
    ("ffn_down", "ffn_down.weight"),
    ("post_ffw_norm_1", "post_ffw_norm_1.weight"),
    ("pre_ffw_norm_2", "pre_ffw_norm_2.weight"),
    ("ffn_gate_inp", "ffn_gate_inp.weight"),
    ("ffn_gate_inp_scale", "ffn_gate_inp.scale"),
    ("ffn_gate_up_exps", "ffn_gate_up_exps.weight"),
    ("ffn_down_exps", "ffn_down_exps.weight"),
    ("ffn_down_exps_scale", "ffn_down_exps.scale"),
    ("post_ffw_norm_2", "post_ffw_norm_2.weight"),
    ("post_ffw_norm", "post_ffw_norm.weight"),
)

# diffusion-gemma's self-conditioning block, after the layers: role -> the tensor's name
SELF_COND_TENSORS: tuple[tuple[str, str], ...] = (
    ("self_cond_pre_norm", "self_cond_pre_norm.weight"),
    ("self_cond_gate", "self_cond_gate.weight"),
    ("self_cond_up", "self_cond_up.weight"),
    ("self_cond_down", "self_cond_down.weight"),
)


def layout_tensors(is_swa: Sequence[bool], arch: str = DIFFUSION_ARCH) -> Iterator[tuple[str, str, int | None]]:
    """(name, role, layer) of every tensor of the published layout (or of the AR twin), in file order,
    for layers of these kinds (True = sliding)."""
    yield "token_embd.weight", "token_embd", None
    yield "rope_freqs.weight", "rope_freqs", None
    for i, swa in enumerate(is_swa):
        for role, suffix in LAYER_TENSORS:
            if role == "attn_v" and not swa:
                continue  # k_eq_v
            yield f"blk.{i}.{suffix}", role, i
        if arch == DIFFUSION_ARCH:
            yield f"blk.{i}.layer_output_scale.weight", "layer_scalar_decoder", i
            yield f"blk.{i}.enc_layer_output_scale.weight", "layer_scalar_encoder", i
        else:
            yield f"blk.{i}.layer_output_scale.weight", "layer_scalar_encoder", i
    yield "output_norm.weight", "output_norm", None
    if arch == DIFFUSION_ARCH:
        for role, name in SELF_COND_TENSORS:
            yield name, role, None
