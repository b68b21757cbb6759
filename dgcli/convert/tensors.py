"""The tensor plan: every GGUF tensor of the layout with its shape and role, and which tensor of the
reference checkpoint each one comes from (the GGUF names themselves: dgcli.modelfile.layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from dgcli.convert.config import LayoutParams
from dgcli.errors import DgError
from dgcli.modelfile.hparams import AR_ARCH, DIFFUSION_ARCH
from dgcli.modelfile.layout import layout_tensors


@dataclass(frozen=True)
class TensorSpec:
    """One GGUF tensor. `shape` is the numpy shape (ggml's ne reversed); `role` says what it holds."""

    name: str
    shape: tuple[int, ...]
    role: str  # e.g. "attn_q", "layer_scalar_decoder", "token_embd"
    layer: int | None = None


# role (modelfile.layout: the GGUF's name) -> the reference checkpoint's tensor under a layer's prefix
HF_LAYER_SUFFIX = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "attn_output": "self_attn.o_proj.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "post_ffw_norm_1": "post_feedforward_layernorm_1.weight",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2.weight",
    "ffn_gate_inp": "router.proj.weight",
    "ffn_gate_inp_scale": "router.scale",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_down_exps": "experts.down_proj",
    "ffn_down_exps_scale": "router.per_expert_scale",
    "post_ffw_norm_2": "post_feedforward_layernorm_2.weight",
    "post_ffw_norm": "post_feedforward_layernorm.weight",
}
# role -> the reference checkpoint's tensor under the decoder's prefix
HF_SELF_COND = {
    "self_cond_pre_norm": "self_conditioning.pre_norm.weight",
    "self_cond_gate": "self_conditioning.gate_proj.weight",
    "self_cond_up": "self_conditioning.up_proj.weight",
    "self_cond_down": "self_conditioning.down_proj.weight",
}


def _layer_shapes(p: LayoutParams, i: int) -> dict[str, tuple[int, ...]]:
    hd = p.head_dim(i)
    kv = p.head_count_kv[i] * hd
    H = p.n_embd
    return {
        "attn_norm": (H,),
        "attn_q": (p.n_head * hd, H),
        "attn_k": (kv, H),
        "attn_v": (kv, H),
        "attn_q_norm": (hd,),
        "attn_k_norm": (hd,),
        "attn_output": (H, p.n_head * hd),
        "post_attention_norm": (H,),
        "ffn_norm": (H,),
        "ffn_gate": (p.n_ff, H),
        "ffn_up": (p.n_ff, H),
        "ffn_down": (H, p.n_ff),
        "post_ffw_norm_1": (H,),
        "pre_ffw_norm_2": (H,),
        "ffn_gate_inp": (p.n_expert, H),
        "ffn_gate_inp_scale": (H,),
        "ffn_gate_up_exps": (p.n_expert, 2 * p.n_ff_exp, H),
        "ffn_down_exps": (p.n_expert, H, p.n_ff_exp),
        "ffn_down_exps_scale": (p.n_expert,),
        "post_ffw_norm_2": (H,),
        "post_ffw_norm": (H,),
    }


def tensor_plan(p: LayoutParams, arch: str = DIFFUSION_ARCH) -> list[TensorSpec]:
    """Every tensor of the published layout (or of the AR twin), in file order."""
    if arch not in (DIFFUSION_ARCH, AR_ARCH):
        raise DgError(f"unknown architecture {arch!r} (expected {DIFFUSION_ARCH!r} or {AR_ARCH!r})")
    H = p.n_embd
    shapes = {"token_embd": (p.vocab_size, H), "rope_freqs": (p.head_dim_full // 2,), "output_norm": (H,),
              "layer_scalar_decoder": (1,), "layer_scalar_encoder": (1,),
              "self_cond_pre_norm": (H,), "self_cond_gate": (p.n_ff, H), "self_cond_up": (p.n_ff, H),
              "self_cond_down": (H, p.n_ff)}
    layer_shapes = [_layer_shapes(p, i) for i in range(p.n_layer)]
    return [TensorSpec(name, layer_shapes[i][role] if role in HF_LAYER_SUFFIX else shapes[role], role, i)
            for name, role, i in layout_tensors(p.is_swa, arch)]
