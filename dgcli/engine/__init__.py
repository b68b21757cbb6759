"""The dg engine: a library over our patched llama.cpp. The CLI, tests and benchmarks use it."""

from dgcli.engine.types import (
    CanvasEvent,
    DgError,
    DiffusionParams,
    GenerationResult,
    InvalidParameter,
    ModelLoadError,
    StepEvent,
    TokenEvent,
)

__all__ = [
    "CanvasEvent",
    "DgError",
    "DiffusionParams",
    "GenerationResult",
    "InvalidParameter",
    "ModelLoadError",
    "StepEvent",
    "TokenEvent",
]
