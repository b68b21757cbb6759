#pragma once
// Declarations of the native sampler (see src/diffusion-gemma-sampler.cpp).
