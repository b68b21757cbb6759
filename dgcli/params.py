"""The block-diffusion sampler's parameters: DiffusionParams, its defaults (the reference's) and the
bounds that keep a run finite, and the GGUF keys that carry a model's own defaults.

Below everything that reads or writes those keys (modelfile, convert, runtime) and the engines
that take them; `from dgcli.engine import DiffusionParams` re-exports it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dgcli.errors import InvalidParameter


# The reference's defaults (DiffusionGemmaGenerationConfig._get_default_generation_params).
DEFAULT_MAX_DENOISING_STEPS = 48
DEFAULT_T_MIN = 0.4
DEFAULT_T_MAX = 0.8
DEFAULT_ENTROPY_BOUND = 0.1
DEFAULT_STABILITY_THRESHOLD = 1
DEFAULT_CONFIDENCE_THRESHOLD = 0.005

# What is meaningful, so that a flag or a GGUF key cannot make a run go on for ever: a canvas up to
# 4x the published 256 tokens; up to 4 denoising steps per canvas position (every step accepts at
# least one; the reference's 48 on 256 positions is 0.19 per position), never fewer than the
# reference's 48; a stability threshold within the steps (beyond them the stop can never fire).
MAX_CANVAS_LENGTH = 1024
MAX_STEPS_PER_CANVAS_POSITION = 4
# The sampler computes in float32 (as the reference): a temperature outside [1e-30, 1e30] becomes 0 or
# inf there (1e-320 and 1e308 are finite doubles), and a bound beyond 1e30 overflows its cast.
# t_max >= 1e-30 keeps the schedule's smallest temperature, t_max / max_steps at t_min = 0, > 0.
MIN_T_MAX = 1e-30
MAX_SAMPLER_FLOAT = 1e30


def max_denoising_steps_for(canvas_length: int | None) -> int:
    """The largest meaningful max_denoising_steps for a canvas of `canvas_length` tokens."""
    canvas = canvas_length if canvas_length else MAX_CANVAS_LENGTH
    return max(MAX_STEPS_PER_CANVAS_POSITION * canvas, DEFAULT_MAX_DENOISING_STEPS)


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and math.isfinite(value)


# The published files' sampler keys (unprefixed, optional) -> DiffusionParams field.
DIFFUSION_PARAM_KEYS = {
    "diffusion.eb_max_steps": "max_denoising_steps",
    "diffusion.eb_t_min": "t_min",
    "diffusion.eb_t_max": "t_max",
    "diffusion.eb_entropy_bound": "entropy_bound",
    "diffusion.eb_stability_threshold": "stability_threshold",
    "diffusion.eb_confidence_threshold": "confidence_threshold",
}

# The GGUF keys a dg-written file filled with the reference's defaults because the checkpoint had no
# value (a string array; absent when every value came from the checkpoint). The published converter
# leaves such keys out, and every loader falls back to the same defaults; `dg info` says which they are.
REFERENCE_DEFAULTS_KEY = "dg.reference_defaults"


@dataclass(frozen=True)
class DiffusionParams:
    """The block-diffusion sampler's knobs (GGUF `diffusion.eb_*` keys give a model's defaults)."""

    max_denoising_steps: int = DEFAULT_MAX_DENOISING_STEPS
    t_min: float = DEFAULT_T_MIN
    t_max: float = DEFAULT_T_MAX
    entropy_bound: float = DEFAULT_ENTROPY_BOUND
    stability_threshold: int = DEFAULT_STABILITY_THRESHOLD
    confidence_threshold: float = DEFAULT_CONFIDENCE_THRESHOLD

    def validate(self, canvas_length: int | None = None) -> "DiffusionParams":
        """Raise InvalidParameter naming the first bad value and its allowed range. The step
        bound depends on the canvas (`max_denoising_steps_for`); without one, the largest canvas's."""
        max_steps = max_denoising_steps_for(canvas_length)
        if not is_int(self.max_denoising_steps) or not 1 <= self.max_denoising_steps <= max_steps:
            where = f"a {canvas_length}-token canvas" if canvas_length else "any canvas"
            raise InvalidParameter("max_denoising_steps", self.max_denoising_steps,
                                   f"an integer between 1 and {max_steps} (the most that is meaningful for {where})")
        if not is_real(self.t_min) or not 0 <= self.t_min <= MAX_SAMPLER_FLOAT:
            raise InvalidParameter("t_min", self.t_min, f"a number >= 0 and at most {MAX_SAMPLER_FLOAT:g}")
        if not is_real(self.t_max) or not MIN_T_MAX <= self.t_max <= MAX_SAMPLER_FLOAT:
            raise InvalidParameter("t_max", self.t_max,
                                   f"a number between {MIN_T_MAX:g} and {MAX_SAMPLER_FLOAT:g}")
        # equal ends are a constant temperature (--temp); the reference refuses them, for no reason
        # its schedule needs (t_min + (t_max - t_min) * n / N is then t_min at every step)
        if self.t_max < self.t_min:
            raise InvalidParameter("t_max", self.t_max, f"at least t_min ({self.t_min})")
        if not is_real(self.entropy_bound) or not 0 < self.entropy_bound <= MAX_SAMPLER_FLOAT:
            raise InvalidParameter("entropy_bound", self.entropy_bound,
                                   f"a number > 0 and at most {MAX_SAMPLER_FLOAT:g}")
        if not is_int(self.stability_threshold) or not 0 <= self.stability_threshold <= self.max_denoising_steps:
            raise InvalidParameter("stability_threshold", self.stability_threshold,
                                   f"an integer between 0 and max_denoising_steps ({self.max_denoising_steps})")
        if not is_real(self.confidence_threshold) or not 0 < self.confidence_threshold <= MAX_SAMPLER_FLOAT:
            raise InvalidParameter("confidence_threshold", self.confidence_threshold,
                                   f"a number > 0 and at most {MAX_SAMPLER_FLOAT:g}")
        return self

    def replace(self, **overrides: Any) -> "DiffusionParams":
        """A copy with the given fields replaced; None values are ignored (CLI flags left unset)."""
        values = asdict(self)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return DiffusionParams(**values)
