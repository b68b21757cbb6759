"""Builders for tests, benchmarks and training: tiny GGUFs (tiny.py), the executable Transformers
reference (reference.py, needs torch) and the step-level API over it (torch_model.py). The CLI never
imports them."""
