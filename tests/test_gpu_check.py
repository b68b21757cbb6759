"""benchmarks/gpu_check.py's pieces that need no GPU (the whole check runs with --cpu-dry-run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("dg_gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_check  # its dataclasses look their module up while being defined
_spec.loader.exec_module(gpu_check)


def test_partial_offload_settings_fit_the_model():
    # the real-size model: as asked
    assert gpu_check.partial_settings("15,-1", 30) == [15, -1]
    assert gpu_check.partial_settings("30", 30) == [30]
    # the dry run's two layers: 15 would be refused by the loader's check, half the layers is timed
    assert gpu_check.partial_settings("15,-1", 2) == [1, -1]
    assert gpu_check.partial_settings("", 2) == []
