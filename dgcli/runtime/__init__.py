"""The llama.cpp runtime: our patched library through ctypes (native.py), a loaded GGUF's forwards
(model.py), RPC workers (rpc.py), weight placement (offload.py), per-node profiles (profile.py)
and this machine's CPU (cpu.py)."""
