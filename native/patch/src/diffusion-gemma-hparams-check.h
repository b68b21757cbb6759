#pragma once
// Internal: the diffusion-gemma hyperparameter checks run by load_arch_hparams
// (models/diffusion-gemma.cpp), so that a bad file is refused with the key's name instead of
// aborting later (diffusion-gemma-hparams-check.cpp).

#include <cstdint>

struct llama_hparams;
struct llama_model_loader;

// Throws std::runtime_error naming the first key whose value llama.cpp cannot run.
void dg_check_hparams(const llama_hparams & hparams, uint32_t canvas_length, const llama_model_loader & ml);
