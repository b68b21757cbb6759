"""Where a forward's time goes: every graph node timed through llama.cpp's per-node eval callback.

    profiler = NodeProfiler()
    with DiffusionModel(path, eval_callback=profiler.eval_callback) as m:
        profiler.enabled = True
        m.denoise_step(...)
        nodes = profiler.take()          # [NodeTime(name, op, src0_type, shapes, seconds), ...]

With the profiler enabled the scheduler computes the graph one node at a time (one thread-pool
round per node), so the sum of the nodes is a little above an uninterrupted forward; disabled, the
callback declines every node and the graph runs as usual. The timing itself is native
(dg_profile_* in native/patch/src/diffusion-gemma-profile.cpp).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from dgcli.runtime import native


@dataclass(frozen=True)
class NodeTime:
    name: str  # the graph's name for the node, e.g. "ffn_moe_gate_up-0", "result_output"
    op: str  # ggml's op description, e.g. "MUL_MAT", "MUL_MAT_ID", "TANH", "CUSTOM"
    src0_type: str  # the first source's type ("q8_0", "f32", ...; "-" without sources)
    shapes: tuple[tuple[int, int, int, int], ...]  # the node's ne, then its first three sources' (zeros if absent)
    seconds: float  # wall time
    cpu_seconds: float  # the process's CPU time over all threads (on a shared box: what the node cost)

    def multiply_adds(self) -> int:
        """Multiply-adds of the matrix ops (0 for the rest)."""
        dst, a, b, _ = self.shapes
        if self.op in ("MUL_MAT", "MUL_MAT_ID"):
            # MUL_MAT: dst [M, N, ...] from a [K, M]; MUL_MAT_ID: dst [M, n_used, tokens], a [K, M, experts]
            return a[0] * dst[0] * dst[1] * dst[2] * dst[3]
        if self.op == "OUT_PROD":
            # dst [M, N, B] = a [M, K, B] x b [N, K, B]: K multiply-adds per output
            return dst[0] * dst[1] * dst[2] * dst[3] * a[1]
        if self.op == "FLASH_ATTN_EXT":
            # q [D, n_q, H], k [D, n_kv, H_kv]: QK^T and PV, D multiply-adds per (query, key, head) each
            q, k = a, b
            return 2 * q[0] * q[1] * q[2] * k[1]
        return 0


class NodeProfiler:
    """A native per-node timer to pass to a model as its eval callback."""

    def __init__(self):
        self._lib = native.lib()._lib
        self._profile = self._lib.dg_profile_new()
        callback_type = native.lib().ggml_backend_sched_eval_callback
        self._callback = callback_type(ctypes.cast(self._lib.dg_profile_eval, ctypes.c_void_p).value)
        self._enabled = ctypes.c_bool(False)

    @property
    def eval_callback(self) -> tuple:
        """(callback, user data) for a model's context parameters (cb_eval, cb_eval_user_data)."""
        return self._callback, ctypes.c_void_p(self._profile)

    @property
    def enabled(self) -> bool:
        return bool(self._lib.dg_profile_enabled(self._profile))

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._lib.dg_profile_enable(self._profile, bool(value))

    def take(self) -> list[NodeTime]:
        """The nodes recorded since the last take(), in compute order; the record is cleared."""
        name, op, src = (ctypes.create_string_buffer(128) for _ in range(3))
        ne = (ctypes.c_int64 * 16)()
        seconds, cpu_seconds = ctypes.c_double(), ctypes.c_double()
        nodes = []
        for i in range(self._lib.dg_profile_count(self._profile)):
            self._lib.dg_profile_node(self._profile, i, name, 128, op, 128, src, 128, ne, ctypes.byref(seconds),
                                      ctypes.byref(cpu_seconds))
            shapes = tuple(tuple(int(v) for v in ne[4 * j:4 * j + 4]) for j in range(4))
            nodes.append(NodeTime(name.value.decode(), op.value.decode(), src.value.decode(), shapes, seconds.value,
                                  cpu_seconds.value))
        self._lib.dg_profile_reset(self._profile)
        return nodes

    def close(self) -> None:
        if self._profile:
            self._lib.dg_profile_free(self._profile)
            self._profile = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass
