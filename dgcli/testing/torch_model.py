"""The step-level model API (as dgcli.runtime.model.DiffusionModel) over a Transformers DiffusionGemma.

It exists so the block-diffusion loop can be checked against the reference with the very same
forward: prefill and commit run the encoder into a DynamicCache, decode_canvas runs the decoder,
each called exactly as `DiffusionGemmaGenerationMixin.generate` calls them (same masks, same
position ids, same self-conditioning input). Needs torch and transformers (test extras).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dgcli.errors import DgError
from dgcli.params import DiffusionParams


def _reference_defaults(generation_config: Any) -> DiffusionParams:
    """The generation config's diffusion values, the reference's global defaults where unset."""
    params = DiffusionParams()
    if generation_config is None:
        return params
    sampler_config = getattr(generation_config, "sampler_config", None)
    return params.replace(
        max_denoising_steps=getattr(generation_config, "max_denoising_steps", None),
        t_min=getattr(generation_config, "t_min", None),
        t_max=getattr(generation_config, "t_max", None),
        entropy_bound=getattr(sampler_config, "entropy_bound", None),
        stability_threshold=getattr(generation_config, "stability_threshold", None),
        confidence_threshold=getattr(generation_config, "confidence_threshold", None),
    )


class TorchDiffusionModel:
    """DiffusionModel's step-level API over a `DiffusionGemmaForBlockDiffusion` (batch 1, CPU or GPU)."""

    def __init__(self, hf_model: Any, tokenizer: Any = None, end_token_ids: Sequence[int] | None = None,
                 pad_token_id: int | None = None):
        import torch

        self._torch = torch
        self.hf_model = hf_model.eval()
        self.tokenizer = tokenizer
        config = hf_model.config
        generation_config = getattr(hf_model, "generation_config", None)
        self.vocab_size = int(config.text_config.vocab_size)
        self.canvas_length = int(config.canvas_length)
        if end_token_ids is None:
            eos = getattr(generation_config, "eos_token_id", None)
            end_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.end_token_ids = [int(t) for t in end_token_ids]
        if pad_token_id is None:
            pad_token_id = getattr(generation_config, "pad_token_id", None)
        self.pad_token_id = pad_token_id
        self.default_params = _reference_defaults(generation_config)
        self._device = next(hf_model.parameters()).device
        self.reset()

    # ---- tokens ----------------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise DgError("this torch model has no tokenizer: pass token ids instead of text")
        return list(self.tokenizer.encode(text, add_special_tokens=add_bos))

    def detokenize(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(int(t)) for t in ids)
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)

    def chat_prompt(self, user_text: str) -> list[int]:
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise DgError("this torch model has no chat template: pass token ids, or chat=False with a tokenizer")
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=True,
                                                 add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    # ---- the step-level API ----------------------------------------------------------------------

    def reset(self) -> None:
        from transformers import DynamicCache

        self._cache = DynamicCache(config=self.hf_model.config.get_text_config(decoder=True))
        self.n_past = 0

    def prefill(self, tokens: Sequence[int]) -> None:
        self._encode(tokens)

    def commit(self, canvas: Sequence[int] | np.ndarray) -> None:
        if len(canvas) != self.canvas_length:
            raise DgError(f"commit needs a canvas of {self.canvas_length} tokens, got {len(canvas)}")
        self._encode(canvas)

    def decode_canvas(self, canvas: Sequence[int] | np.ndarray, sc_logits: np.ndarray | None = None,
                      sc_topk: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """As DiffusionModel.decode_canvas: dense sc_logits go to the reference unchanged; sc_topk =
        (ids [C, k], probs [C, k]) replaces the reference's soft embeddings by sum_j probs_j * E[ids_j]."""
        torch = self._torch
        if sc_logits is not None and sc_topk is not None:
            raise DgError("pass sc_logits or sc_topk, not both")
        if self.n_past == 0:
            raise DgError("decode_canvas before prefill: the decoder needs a context")
        canvas_ids = torch.as_tensor(np.asarray(canvas, dtype=np.int64), device=self._device)[None, :]
        position_ids = torch.arange(self.n_past, self.n_past + self.canvas_length, dtype=torch.int32,
                                    device=self._device)[None, :]
        decoder_attention_mask = torch.ones((1, self.n_past + self.canvas_length), dtype=torch.bool,
                                            device=self._device)
        mask_mapping = self.hf_model.model.decoder.create_diffusion_decoder_attention_mask(
            config=self.hf_model.config,
            inputs_embeds=canvas_ids.unsqueeze(-1),
            past_key_values=self._cache,
            decoder_attention_mask=decoder_attention_mask,
        )
        sc = None
        if sc_logits is not None:
            dtype = self.hf_model.model.decoder.embed_tokens.weight.dtype
            sc = torch.from_numpy(np.ascontiguousarray(sc_logits, dtype=np.float32))[None].to(self._device, dtype)
        hook = None
        if sc_topk is not None:
            soft = self._sparse_soft_embeddings(*sc_topk)
            # the reference has no sparse input: its soft embeddings (zeros without logits) are
            # swapped for ours on their way into the self-conditioning block
            hook = self.hf_model.model.decoder.self_conditioning.register_forward_pre_hook(
                lambda _module, args: (args[0], soft.to(args[0].dtype)))
        try:
            with torch.no_grad():
                out = self.hf_model(
                    decoder_input_ids=canvas_ids,
                    self_conditioning_logits=sc,
                    decoder_attention_mask=mask_mapping,
                    past_key_values=self._cache,
                    decoder_position_ids=position_ids,
                )
        finally:
            if hook is not None:
                hook.remove()
        return out.logits[0].to(torch.float32).cpu().numpy()

    def _sparse_soft_embeddings(self, ids: np.ndarray, probs: np.ndarray) -> Any:
        torch = self._torch
        embed = self.hf_model.model.decoder.embed_tokens
        ids_t = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self._device)
        probs_t = torch.as_tensor(np.asarray(probs, dtype=np.float32), device=self._device)
        if ids_t.ndim != 2 or ids_t.shape[0] != self.canvas_length or ids_t.shape != probs_t.shape:
            raise DgError(f"sc_topk needs two [{self.canvas_length}, k] arrays, got {tuple(ids_t.shape)} "
                          f"and {tuple(probs_t.shape)}")
        with torch.no_grad():
            rows = embed.weight[ids_t].to(torch.float32)  # [C, k, hidden]
            soft = torch.einsum("ck,ckh->ch", probs_t, rows) * embed.embed_scale.to(torch.float32)
        return soft[None]

    def close(self) -> None:
        self._cache = None

    def _encode(self, tokens: Sequence[int] | np.ndarray) -> None:
        torch = self._torch
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=self._device)[None, :]
        if ids.shape[1] == 0:
            raise DgError("nothing to encode: empty token list")
        total = self.n_past + ids.shape[1]
        attention_mask = torch.ones((1, total), dtype=torch.bool, device=self._device)
        position_ids = torch.arange(self.n_past, total, dtype=torch.int32, device=self._device)[None, :]
        with torch.no_grad():
            ids, mask_mapping = self.hf_model._prepare_encoder_inputs(
                input_ids=ids,
                attention_mask=attention_mask,
                encoder_position_ids=position_ids,
                past_key_values=self._cache,
                is_prefill=True,  # encode every given token (the reference slices the last canvas itself)
                canvas_length=self.canvas_length,
                batch_size=1,
            )
            out = self.hf_model.model.encoder(
                input_ids=ids,
                attention_mask=mask_mapping,
                past_key_values=self._cache,
                position_ids=position_ids,
            )
        self._cache = out.past_key_values
        self.n_past = total
