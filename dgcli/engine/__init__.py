"""The dg engine: the generation loop over dgcli.runtime (our patched llama.cpp). The CLI, the server,
tests and benchmarks use it; the names below are its public API."""

from dgcli.engine.types import CanvasEvent, GenerationResult, StepEvent, TokenEvent
from dgcli.errors import DgError, InvalidParameter, ModelLoadError
from dgcli.params import DiffusionParams

# The engines and the sampler pieces import heavy modules only on use (runtime/model.py loads llama.cpp
# when a GGUF is opened), so importing them here stays cheap.
from dgcli.engine.autoregressive import AutoregressiveEngine
from dgcli.engine.diffusion import DiffusionEngine
from dgcli.engine.rng import RngStream
from dgcli.engine.sampler import NativeStepSampler, NumpyStepSampler, make_step_sampler

__all__ = [
    "AutoregressiveEngine",
    "DiffusionEngine",
    "NativeStepSampler",
    "NumpyStepSampler",
    "RngStream",
    "make_step_sampler",
    "CanvasEvent",
    "DgError",
    "DiffusionParams",
    "GenerationResult",
    "InvalidParameter",
    "ModelLoadError",
    "StepEvent",
    "TokenEvent",
]
