// The native block-diffusion sampler (entropy, argmax, sampling over the logits buffer).
// Placeholder so the CMake list is stable; filled in by the engine work.
