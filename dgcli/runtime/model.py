"""Step-level API over one GGUF: the forwards a diffusion (or autoregressive) loop is made of.

    with DiffusionModel("model.gguf") as m:
        m.prefill(m.chat_prompt("hi"))             # encoder: causal, appends to the KV cache
        logits = m.decode_canvas(canvas)           # decoder: [C, V] softcapped logits, cache unchanged
        logits = m.decode_canvas(canvas, sc_logits=processed_logits)   # later steps: self-conditioned (dense)
        logits = m.decode_canvas(canvas, sc_topk=(ids, probs))         # ... or the sampler's top-k
        [stats] = m.denoise_step(canvas[None], [t], uniforms[None], sc_topk=..., top_k=64)
                                                   # the whole step in one graph: per position only
                                                   # entropy, argmax, sample, next top-k (no logits)
        m.commit(final_canvas)                     # encoder over the canvas; n_past += C

Several generations share one model through KV-cache sequences (`n_seq_max` at load): prefill and
commit take `seq=`, and `decode_canvases(..., per_sequence=True)` decodes canvas s after sequence
s's own cache, all in one forward (the server's batch; see dgcli/server/scheduler.py). With
`kv_unified=False` each sequence has its own cache stream, laid out exactly as if it were alone,
so its logits are bit-identical to a single generation's.

`ArModel` is the same surface for a stock `gemma4` GGUF (the AR base): prefill / decode_token.

Files are checked here before llama.cpp sees them (modelfile/header.py: exists, GGUF magic, header
parses, tensor data inside the file; modelfile/hparams.py: every hyperparameter the architecture
uses), and a load llama.cpp refuses becomes a one-line ModelLoadError quoting llama.cpp's reason.
The inputs a forward takes are checked, and a step's results returned, as forward.py defines them.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from dgcli.errors import ContextFull, DgError, InvalidParameter, ModelLoadError
from dgcli.modelfile.header import END_TOKEN_TEXTS, VISIBLE_CONTROL_TEXTS, read_header
from dgcli.modelfile.hparams import AR_ARCH, DIFFUSION_ARCH, check_model_header, sampler_defaults
from dgcli.params import MAX_CANVAS_LENGTH, DiffusionParams
from dgcli.runtime import native
from dgcli.runtime.cpu import check_threads, cpu_flags, default_threads
from dgcli.runtime.forward import DecoderInputs, StepStats, check_tokens
from dgcli.runtime.offload import (
    LoadReport,
    check_offload,
    expert_override_pattern,
    expert_repack_pattern,
    tiled_weight_pattern,
)
from dgcli.runtime.self_cond import check_decoder_self_cond
from dgcli.templates.sandbox import start_renderer

if TYPE_CHECKING:
    from dgcli.templates.chat_template import ChatTemplate

DEFAULT_N_CTX = 4096
# Prompts go through the encoder in chunks of this many tokens (the default n_ubatch): a caller that
# wants the very same K/V as another run feeds prompts in chunks of this size too
ENCODE_CHUNK = 512

INT32_MAX = 2**31 - 1


def flash_attention_wanted(gpu_in_use: bool) -> bool:
    """Whether a context keeps llama.cpp's flash attention (its default): where a GPU may run it. On a CPU
    alone ggml's FLASH_ATTN_EXT takes a canvas's queries one row at a time (~14 G MAC/s), while without it
    the scores and their product with V are two matmuls over all of them: the real-size step 0.86x
    (docs/performance.md), for a [context x micro-batch x heads] float score buffer (info.py counts it).
    DG_FLASH_ATTN=1 / 0 forces it on / off (A/B runs)."""
    forced = os.environ.get("DG_FLASH_ATTN")
    if forced in ("0", "1"):
        return forced == "1"
    return gpu_in_use


def check_gpu_layers(n_gpu_layers: Any) -> None:
    """-1 (all) or 0..INT32_MAX (any count above the model's layers offloads them all)."""
    if isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, int) or not -1 <= n_gpu_layers <= INT32_MAX:
        raise InvalidParameter("gpu_layers", n_gpu_layers, f"-1 (all) or an integer from 0 to {INT32_MAX}")


def cpu_repack_enabled() -> bool:
    """Whether llama.cpp's CPU repack buffers (its extra buffer types) take the weights they can.
    Not on AMX CPUs: llama.cpp's AMX Q8_0 matmul there segfaults (stock gemma4 included, tiny and
    real shapes). DG_CPU_REPACK=1/0 overrides."""
    default = "0" if "amx_int8" in cpu_flags() else "1"
    return os.environ.get("DG_CPU_REPACK", default) != "0"


# -- models ---------------------------------------------------------------------------------------


class _LlamaModel:
    """Model + context + tokenizer + chat template: what both model kinds share."""

    architecture = ""

    def __init__(self, path: str | os.PathLike, n_threads: int | None = None, n_gpu_layers: int = 0,
                 exact: bool = False, n_ctx: int | None = None, n_seq_max: int = 1, n_ubatch: int = ENCODE_CHUNK,
                 n_cpu_moe: int = 0, kv_unified: bool = True, rpc_servers: Sequence[str] | None = None,
                 eval_callback: tuple | None = None):
        self._model = None
        self._ctx = None
        self.path = Path(path)
        self.exact = bool(exact)
        self.header = read_header(self.path)
        arch = self.header.architecture
        if arch != self.architecture:
            raise ModelLoadError(f"{self.path} is a {arch or 'unknown-architecture'} model; "
                                 f"{type(self).__name__} needs general.architecture = {self.architecture}")
        check_model_header(self.header)
        if isinstance(self.header.get("tokenizer.chat_template"), str):
            start_renderer()  # it starts while the model loads
        check_threads(n_threads)
        check_gpu_layers(n_gpu_layers)
        if not isinstance(n_seq_max, int) or n_seq_max < 1:
            raise InvalidParameter("n_seq_max", n_seq_max, "an integer >= 1")
        check_offload(n_gpu_layers, n_cpu_moe)
        n_layer = self.header.get(f"{arch}.block_count")
        override = expert_override_pattern(n_cpu_moe, n_layer if isinstance(n_layer, int) else 0)
        self._lib = native.lib()
        L = self._lib
        gpu_in_use = bool(rpc_servers) or bool(native.gpu_devices())
        # DG_Q4_K_TILE=0 leaves the Q4_K weights to ggml (its repack buffers where they are on; A/B runs)
        tiled = None if os.environ.get("DG_Q4_K_TILE") == "0" else tiled_weight_pattern(
            self.header, L._lib.dg_expert_kernel(), L._lib.dg_dense_kernel(), gpu_in_use=gpu_in_use)
        # the experts repacked while loading for dg's int8 GEMM (its own buffer type) where no GPU is in use
        own = []
        repack_kernel = 0 if gpu_in_use else L._lib.dg_expert_repack_kernel()
        if repack_kernel:
            pattern = expert_repack_pattern(
                self.header, lambda type_id, n_in: L._lib.dg_expert_repack_takes(repack_kernel, type_id, n_in))
            if pattern:
                own.append((pattern, L._lib.dg_expert_buffer_type(repack_kernel)))
        native.clear_log()

        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = int(n_gpu_layers)
        if not cpu_repack_enabled():
            mparams.use_extra_bufts = False
        overrides = native.buft_overrides([override] if override else [], plain=[tiled] if tiled else [], own=own)
        mparams.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        # RPC workers' devices instead of this machine's accelerators: n_gpu_layers layers go to them
        self.rpc_devices = None
        if rpc_servers:
            from dgcli.runtime import rpc  # noqa: PLC0415

            self.rpc_devices = rpc.rpc_devices(rpc_servers)
            mparams.devices = self.rpc_devices.pointer
        # Ctrl-C during the load is raised after it, with the model on self: a dropped half-built
        # object frees it (close() in __del__)
        with native.collect_log() as load_log, native.deferred_interrupts():
            model = self._model = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        # where llama.cpp put the weights, in its own words (offloaded layers, buffers, overrides)
        self.load_report = LoadReport.from_log(load_log)
        if tiled or own:  # only what --n-cpu-moe asked for is news: without a GPU every weight is in system memory
            asked = re.compile(override) if override else None
            self.load_report.overridden = [(t, b) for t, b in self.load_report.overridden if asked and asked.search(t)]
        if self.load_report.offloaded_layers is None:
            self.load_report.no_gpu_reason = native.no_gpu_reason()
        if not model:
            raise ModelLoadError(f"cannot load {self.path}: {native.last_error()}")
        self._vocab = L.llama_model_get_vocab(model)
        self.vocab_size = int(L.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(L.llama_model_n_ctx_train(model))
        self.n_embd = int(L.llama_model_n_embd(model))

        n_ctx = self._default_n_ctx() if n_ctx is None else n_ctx
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or not 0 <= n_ctx <= INT32_MAX:
            raise InvalidParameter("n_ctx", n_ctx, f"an integer from 0 to {INT32_MAX} (0: the model's training context)")
        cparams = L.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_ubatch
        cparams.n_seq_max = n_seq_max
        threads = n_threads or default_threads(path)
        cparams.n_threads = cparams.n_threads_batch = threads
        # unified: the sequences share one pool of cells (they may borrow each other's, as the bench's
        # shared-context batch does); not unified: one stream of n_ctx / n_seq_max cells per sequence
        cparams.kv_unified = bool(kv_unified)
        # a sliding-window cache of W + n_ubatch cells, as a long generation would use: the decoder
        # must then not disturb the cells it still needs (see diffusion-gemma-api.cpp)
        cparams.swa_full = False
        cparams.no_perf = True
        if eval_callback is not None:
            # llama.cpp's per-node callback (dgcli.runtime.profile.NodeProfiler.eval_callback)
            self._eval_callback = eval_callback  # the ctypes objects must outlive the context
            cparams.cb_eval, cparams.cb_eval_user_data = eval_callback
        if self.exact:
            cparams.type_k = cparams.type_v = native.GGML_TYPE_F32
            cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        elif not flash_attention_wanted(gpu_in_use):
            cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        native.clear_log()
        with native.collect_log() as context_log, native.deferred_interrupts():
            ctx = self._ctx = L.llama_init_from_model(model, cparams)
        self.load_report.buffers += LoadReport.from_log(context_log).buffers
        if not ctx:
            self.close()
            raise ModelLoadError(f"cannot create a context for {self.path}: {native.last_error()}")
        self.n_ctx = int(L.llama_n_ctx(ctx))
        self.n_ubatch = int(L.llama_n_ubatch(ctx))
        self.n_seq_max = n_seq_max
        self._mem = L.llama_get_memory(ctx)
        self.kv_unified = bool(kv_unified)
        self.n_ctx_seq = int(L.llama_n_ctx_seq(ctx))  # the cells one sequence may use
        # what each KV-cache sequence holds, position by position
        self._seq_tokens: list[list[int]] = [[] for _ in range(n_seq_max)]
        self.end_token_ids = [self.header.token_ids[t] for t in END_TOKEN_TEXTS if t in self.header.token_ids]
        self._visible_control_ids = {self.header.token_ids[t] for t in VISIBLE_CONTROL_TEXTS
                                     if t in self.header.token_ids}

    def _default_n_ctx(self) -> int:
        return min(self.n_ctx_train or DEFAULT_N_CTX, DEFAULT_N_CTX)

    # -- lifecycle

    def close(self) -> None:
        L = getattr(self, "_lib", None)
        if L is None:
            return
        with native.deferred_interrupts(check=False):  # a lost RPC worker's model is freed like any other
            if self._ctx:
                L.llama_free(self._ctx)
                self._ctx = None
            if self._model:
                L.llama_model_free(self._model)
                self._model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    def _require_open(self) -> None:
        if not self._ctx:
            raise DgError(f"model {self.path.name} is closed")

    # -- tokens and text

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        self._require_open()
        if add_bos and self._lib.llama_vocab_get_add_bos(self._vocab) and self._lib.llama_vocab_bos(self._vocab) < 0:
            raise DgError(f"{self.path.name} has no valid <bos> token (tokenizer.ggml.bos_token_id)")
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (self._lib.llama_token * cap)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_bos, special)
        if n < 0:
            cap = -n
            buf = (self._lib.llama_token * cap)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_bos, special)
        if n < 0:
            raise DgError(f"tokenization failed for a text of {len(data)} bytes")
        return list(buf[:n])

    def token_piece(self, token: int, special: bool = False) -> bytes:
        if not 0 <= token < self.vocab_size:  # llama.cpp indexes its table without a check
            raise InvalidParameter("token id", token, f"in [0, {self.vocab_size})")
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, int(token), buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, int(token), buf, len(buf), 0, special)
        return buf.raw[:max(n, 0)]

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str:
        self._require_open()
        ids = [int(t) for t in ids]
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise InvalidParameter("token id", t, f"in [0, {self.vocab_size})")
        return b"".join(self.token_piece(t, special or t in self._visible_control_ids)
                        for t in ids).decode("utf-8", errors="replace")

    @property
    def pad_token_id(self) -> int:
        """The padding token (tokenizer.ggml.padding_token_id; Gemma's 0 when the file does not say)."""
        pad = self.header.get("tokenizer.ggml.padding_token_id")
        return pad if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0

    @property
    def chat_template(self) -> "ChatTemplate | None":
        """The GGUF's tokenizer.chat_template, or None when it has none (use raw prompts then)."""
        if not hasattr(self, "_chat_template"):
            from dgcli.templates.chat_template import ChatTemplate  # noqa: PLC0415

            template = self.header.get("tokenizer.chat_template")
            self._chat_template = None
            if isinstance(template, str) and template.strip():
                self._chat_template = ChatTemplate(template, bos_token=self._special_text("bos"),
                                                   eos_token=self._special_text("eos"), name=self.path.name)
        return self._chat_template

    def _special_text(self, which: str) -> str:
        # the id llama.cpp resolved (an id the file gets wrong is never looked up)
        token = {"bos": self._lib.llama_vocab_bos, "eos": self._lib.llama_vocab_eos}[which](self._vocab)
        if not 0 <= token < self.vocab_size:
            return ""
        return self.token_piece(token, special=True).decode("utf-8", "replace")

    def chat_tokens(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    parse_special: bool = False, tools: Sequence[dict] | None = None) -> list[int]:
        """The chat template over `messages` ({"role", "content"}; roles system/user/assistant, and tool
        with tools, OpenAI's function tools, declared) as token ids. Control-token text in user,
        system and tool messages stays text unless parse_special."""
        from dgcli.templates.chat_template import tokenize_chat  # noqa: PLC0415

        template = self.chat_template
        if template is None:
            raise DgError(f"{self.path.name} has no chat template (tokenizer.chat_template): pass --raw to "
                          "send the prompt as it is")
        return tokenize_chat(template, messages, lambda text, special: self.tokenize(text, False, special),
                             add_generation_prompt=add_generation_prompt, parse_special=parse_special, tools=tools)

    def chat_prompt(self, user_text: str, parse_special: bool = False) -> list[int]:
        """The chat template for one user message, generation prompt appended, as token ids."""
        return self.chat_tokens([{"role": "user", "content": user_text}], parse_special=parse_special)

    # -- cache

    @property
    def cache_tokens(self) -> list[int]:
        """What sequence 0 (the one a single generation uses) holds, position by position."""
        return self._seq_tokens[0]

    @property
    def n_past(self) -> int:
        """Tokens cached in sequence 0."""
        return len(self._seq_tokens[0])

    @n_past.setter
    def n_past(self, value: int) -> None:
        del self._seq_tokens[0][value:]

    def cached_tokens(self, seq: int | None = None) -> int:
        """Tokens cached in sequence `seq`, or in all sequences together (None)."""
        if seq is None:
            return sum(len(t) for t in self._seq_tokens)
        return len(self._seq_tokens[self._check_seq(seq)])

    def _room(self, seq: int) -> tuple[int, int]:
        """(cells in use, cells available) for what sequence `seq` may add next."""
        if self.kv_unified:
            return self.cached_tokens(), self.n_ctx
        return len(self._seq_tokens[seq]), self.n_ctx_seq

    def _check_seq(self, seq: Any) -> int:
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or not 0 <= seq < self.n_seq_max:
            raise InvalidParameter("seq", seq, f"a KV-cache sequence in [0, {self.n_seq_max}) (n_seq_max, set at load)")
        return int(seq)

    def reset(self) -> None:
        """Empty the whole cache (every sequence)."""
        self._require_open()
        with native.deferred_interrupts():
            self._lib.llama_memory_clear(self._mem, True)
        self._seq_tokens = [[] for _ in range(self.n_seq_max)]

    def clear_sequence(self, seq: int) -> None:
        """Drop one sequence's cached tokens; the others keep theirs."""
        self._require_open()
        seq = self._check_seq(seq)
        self._lib.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._seq_tokens[seq] = []

    def move_sequence(self, src: int, dst: int) -> None:
        """Sequence `src`'s cache becomes sequence `dst`'s (dst's own is dropped; src ends empty).
        A unified cache relabels cells; separate streams copy src's whole stream, layout included."""
        self._require_open()
        src, dst = self._check_seq(src), self._check_seq(dst)
        if src == dst:
            return
        L = self._lib
        L.llama_memory_seq_rm(self._mem, dst, -1, -1)
        L.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        L.llama_memory_seq_rm(self._mem, src, -1, -1)
        self._seq_tokens[dst], self._seq_tokens[src] = self._seq_tokens[src], []

    def keep_cached_prefix(self, tokens: Sequence[int]) -> int:
        """Keep the longest start of the KV cache that equals the start of `tokens` and drop the rest
        of the cache; return its length. 0 (the cache cleared) when a sliding-window layer no longer
        holds the cells the kept prefix needs."""
        self._require_open()
        kept = 0
        for cached, token in zip(self.cache_tokens, tokens):
            if cached != int(token):
                break
            kept += 1
        if kept < len(self.cache_tokens):
            L = self._lib
            removed = kept > 0 and bool(L.llama_memory_seq_rm(self._mem, 0, kept, -1))
            # as llama-server: the window before the kept end must still be cached (a sliding-window
            # layer holds window + n_ubatch cells, so going back further finds them overwritten)
            window = max(int(L.llama_model_n_swa(self._model)), 1)
            first, last = L.llama_memory_seq_pos_min(self._mem, 0), L.llama_memory_seq_pos_max(self._mem, 0)
            if not removed or last != kept - 1 or not 0 <= first <= max(0, kept - window):
                self.reset()
                return 0
            del self.cache_tokens[kept:]
            self.n_past = kept
        return kept

    def _encode(self, tokens: Any, want_logits: bool, reserve: int = 0, seq: int = 0) -> np.ndarray | None:
        self._require_open()
        seq = self._check_seq(seq)
        arr = check_tokens(tokens, self.vocab_size, "tokens")
        used, room = self._room(seq)
        if used + arr.size + reserve > room:
            raise ContextFull(f"context full: {used} cached + {arr.size} new tokens"
                          + (f" + a {reserve}-token canvas" if reserve else "") + f" exceed n_ctx = {room}")
        out = np.empty(self.vocab_size, dtype=np.float32) if want_logits else None
        native.clear_log()
        with native.deferred_interrupts():
            rc = self._lib._lib.dg_encode(self._ctx, native.as_token_p(arr), arr.size, seq, self.exact,
                                          native.as_float_p(out) if out is not None else None)
        if rc != 0:
            raise DgError(f"encoder forward failed (status {rc}): {native.last_error('no detail logged')}")
        self._seq_tokens[seq].extend(int(t) for t in arr)
        return out


# ggml-metal's CUMSUM asserts a row of at most nth * nth entries, nth its kernel's threads per
# threadgroup (1024 on Apple's GPUs); the one-graph step's cumulative sum runs over the vocabulary.
METAL_CUMSUM_MAX_ROW = 1024 * 1024


class DiffusionModel(_LlamaModel):
    """A diffusion-gemma GGUF: encoder prefill/commit and the decoder's canvas forward."""

    architecture = DIFFUSION_ARCH

    def __init__(self, path: str | os.PathLike, n_threads: int | None = None, n_gpu_layers: int = 0,
                 exact: bool = False, n_ctx: int | None = None, n_seq_max: int = 1, n_ubatch: int | None = None,
                 n_cpu_moe: int = 0, kv_unified: bool = True, rpc_servers: Sequence[str] | None = None,
                 eval_callback: tuple | None = None):
        header = read_header(path)
        canvas = header.get("diffusion.canvas_length")
        canvas = canvas if isinstance(canvas, int) and 0 < canvas <= MAX_CANVAS_LENGTH else 0
        # a canvas must be one micro-batch (the decoder is non-causal over it); prompts are chunked
        need = canvas * (n_seq_max if isinstance(n_seq_max, int) else 1)
        # the default context gets a canvas's room for each further sequence: a unified cache holds
        # every canvas of a multi-canvas forward at once, on top of the prompt
        self._extra_default_cells = need - canvas if kv_unified else 0
        if n_ubatch is None:
            n_ubatch = max(ENCODE_CHUNK, need)
        elif not isinstance(n_ubatch, int) or n_ubatch < max(need, 1):
            raise InvalidParameter("n_ubatch", n_ubatch, f"an integer >= {max(need, 1)} (canvas_length x n_seq_max)")
        super().__init__(path, n_threads=n_threads, n_gpu_layers=n_gpu_layers, exact=exact, n_ctx=n_ctx,
                         n_seq_max=n_seq_max, n_ubatch=n_ubatch, n_cpu_moe=n_cpu_moe, kv_unified=kv_unified,
                         rpc_servers=rpc_servers, eval_callback=eval_callback)
        self.canvas_length = int(self._lib._lib.dg_canvas_length(self._model))
        if self.canvas_length <= 0:
            self.close()
            raise ModelLoadError(f"{self.path} has no valid diffusion.canvas_length")
        self.default_params = self._read_default_params()

    def _default_n_ctx(self) -> int:
        return super()._default_n_ctx() + self._extra_default_cells

    def _read_default_params(self) -> DiffusionParams:
        try:
            return sampler_defaults(self.header).validate(canvas_length=self.canvas_length)
        except InvalidParameter as err:
            raise ModelLoadError(f"{self.path}: bad diffusion.eb_* default: {err}") from None

    def prefill(self, tokens: Sequence[int], return_logits: bool = False, seq: int = 0) -> np.ndarray | None:
        """Encoder over `tokens` (causal), appended to sequence `seq`'s cache. Optionally the last token's logits."""
        return self._encode(tokens, return_logits, reserve=self.canvas_length, seq=seq)

    def commit(self, canvas: Sequence[int], seq: int = 0) -> None:
        """Encoder over a finished canvas right after sequence `seq`'s cached tokens (n_past += C)."""
        self._encode(canvas, False, reserve=self.canvas_length, seq=seq)

    def decode_canvas(self, canvas: Sequence[int], sc_logits: np.ndarray | None = None,
                      sc_topk: tuple[np.ndarray, np.ndarray] | None = None,
                      sc_soft: np.ndarray | None = None) -> np.ndarray:
        """Decoder forward: float32 [len(canvas), vocab] softcapped logits. The cache is unchanged.

        Self-conditioning input (at most one; none = a canvas's first step, zero signal; see
        dgcli.runtime.self_cond): sc_logits [C, V], the previous step's processed logits (dense:
        softmax over the whole vocabulary times E, the reference's computation), sc_topk = (ids [C, k],
        probs [C, k]), the k most probable tokens per position and their softmax probabilities (the
        sampler's top-k), or sc_soft [C, n_embd], a dense step's soft embedding."""
        arr = check_tokens(canvas, self.vocab_size, "canvas")
        sc = None if sc_logits is None else np.asarray(sc_logits)[None]
        topk = None if sc_topk is None else tuple(np.asarray(a)[None] for a in sc_topk)
        soft = None if sc_soft is None else np.asarray(sc_soft)[None]
        return self.decode_canvases(arr[None], sc, sc_topk=topk, sc_soft=soft)[0]

    def decode_canvases(self, canvases: Any, sc_logits: np.ndarray | None = None,
                        sc_topk: tuple[np.ndarray, np.ndarray] | None = None, per_sequence: bool = False,
                        sc_probs: np.ndarray | None = None, sc_soft: np.ndarray | None = None) -> np.ndarray:
        """Several canvases (rows) in ONE decoder forward: float32 [n, C, vocab]. Needs n <= n_seq_max
        (constructor). The cache is unchanged.

        per_sequence=False: every canvas sits after sequence 0's cached context (sequences 1..n-1
        must be empty; they borrow sequence 0's cells for the forward). per_sequence=True: canvas s
        sits after sequence s's own cached tokens (independent generations batched together).
        sc_logits [n, C, V], sc_topk = (ids [n, C, k], probs [n, C, k]) or sc_soft [n, C, n_embd]: see
        decode_canvas; sc_probs [n, C, V]: the dense form as probabilities. A row whose probabilities
        (or soft embedding) are all zero gets no self-conditioning signal, exactly as a first step does."""
        inputs = self._decoder_inputs(canvases, per_sequence, sc_logits=sc_logits, sc_topk=sc_topk,
                                      sc_probs=sc_probs, sc_soft=sc_soft)
        out = np.empty((inputs.n, inputs.length, self.vocab_size), dtype=np.float32)
        sc = inputs.self_cond.struct()
        rc = self._run_decoder(inputs, lambda L: L._lib.dg_decode_canvases(
            self._ctx, native.as_token_p(inputs.tokens), inputs.n, inputs.length,
            ctypes.byref(sc) if sc is not None else None, self.exact, native.as_float_p(out)))
        if rc != 0:
            raise DgError(f"decoder forward failed (status {rc}): {native.last_error('no detail logged')}")
        return out

    def graph_step_refused(self) -> str | None:
        """Why `denoise_step` cannot run with this model's placement, or None. The step's sampler pass
        runs where the logits are: on a Mac's GPU, ggml-metal would abort on a vocabulary row longer than
        its CUMSUM takes (the host sampler has no such bound)."""
        if self.vocab_size > METAL_CUMSUM_MAX_ROW and self.load_report.output_on(native.METAL_BACKEND):
            return (f"the one-graph step cannot run on Metal with a {self.vocab_size:,}-token vocabulary "
                    f"(ggml-metal's cumulative sum takes rows of at most {METAL_CUMSUM_MAX_ROW:,})")
        return None

    def denoise_step(self, canvases: Any, temperatures: Any, uniforms: Any, sc_logits: np.ndarray | None = None,
                     sc_topk: tuple[np.ndarray, np.ndarray] | None = None, top_k: int = 0,
                     return_values: bool = False, portable_ops: bool = False,
                     per_sequence: bool = False, sc_probs: np.ndarray | None = None,
                     sc_soft: np.ndarray | None = None, next_soft: bool = False) -> list[StepStats]:
        """One denoising step of n canvases in ONE graph: the decoder forward (as decode_canvases,
        same self-conditioning inputs and per_sequence), then, where the logits are, the sampler's pass over
        softmax(softcap(logits) / t). Only per-position results leave the graph: one StepStats per
        canvas with entropy, argmax, the inverse-CDF sample at `uniforms`, and the next step's
        self-conditioning input: with top_k > 0 in top-k form (topk_ids, topk_probs, dropped_mass),
        with next_soft in dense form (`soft`, [C, n_embd]: this step's probabilities times E, one
        product inside the graph). `processed` (logits / t, [C, V]) only with return_values=True
        (debugging; not with next_soft). temperatures: one per canvas (or one for all); uniforms
        [n, C] in [0, 1). portable_ops: the ggml-ops form of the step that non-CPU backends run
        (tests). The cache is unchanged."""
        refused = self.graph_step_refused()
        if refused:
            raise DgError(refused)
        inputs = self._decoder_inputs(canvases, per_sequence, sc_logits=sc_logits, sc_topk=sc_topk,
                                      sc_probs=sc_probs, sc_soft=sc_soft)
        n, length, vocab = inputs.n, inputs.length, self.vocab_size
        temps = np.broadcast_to(np.asarray(temperatures, dtype=np.float32), (n,)).copy() \
            if np.ndim(temperatures) == 0 else np.ascontiguousarray(temperatures, dtype=np.float32)
        if temps.shape != (n,) or not (np.isfinite(temps).all() and (temps > 0).all()):
            raise InvalidParameter("temperatures", temperatures, f"{n} finite temperatures > 0 (one per canvas)")
        unif = np.ascontiguousarray(uniforms, dtype=np.float64)
        if unif.shape != (n, length) or not ((unif >= 0) & (unif < 1)).all():
            raise InvalidParameter("uniforms", f"array of shape {unif.shape}", f"[{n}, {length}] values in [0, 1)")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 0 <= top_k <= vocab:
            raise InvalidParameter("top_k", top_k, f"an integer in [0, {vocab}]")
        if next_soft and return_values:
            raise DgError("denoise_step: next_soft and return_values exclude each other (the probabilities "
                          "take the values' place in the graph)")
        top_k = int(top_k)

        entropy = np.empty((n, length), dtype=np.float32)
        argmax = np.empty((n, length), dtype=np.int32)
        sampled = np.empty((n, length), dtype=np.int32)
        topk_ids = np.empty((n, length, top_k), dtype=np.int32)
        topk_probs = np.empty((n, length, top_k), dtype=np.float32)
        dropped = np.zeros((n, length), dtype=np.float32)
        values = np.empty((n, length, vocab), dtype=np.float32) if return_values else None
        soft = np.empty((n, length, self.n_embd), dtype=np.float32) if next_soft else None
        out = native.StepOutputs(
            native.as_float_p(entropy), native.as_token_p(argmax), native.as_token_p(sampled),
            native.as_token_p(topk_ids), native.as_float_p(topk_probs), native.as_float_p(dropped),
            native.as_float_p(values) if values is not None else None,
            native.as_float_p(soft) if soft is not None else None)
        flags = (native.DG_STEP_EXACT if self.exact else 0) | (native.DG_STEP_PORTABLE_OPS if portable_ops else 0)
        sc = inputs.self_cond.struct()
        rc = self._run_decoder(inputs, lambda L: L._lib.dg_denoise_step(
            self._ctx, native.as_token_p(inputs.tokens), n, length, ctypes.byref(sc) if sc is not None else None,
            native.as_float_p(temps), unif.ctypes.data_as(ctypes.POINTER(ctypes.c_double)), top_k, flags,
            ctypes.byref(out)))
        if rc == -3:
            raise DgError("decoder step failed: non-finite logits")
        if rc != 0:
            raise DgError(f"decoder step failed (status {rc}): {native.last_error('no detail logged')}")
        return [StepStats(entropy=entropy[i].astype(np.float64), argmax=argmax[i].astype(np.int64),
                          sampled=sampled[i].astype(np.int64),
                          processed=values[i] if values is not None else None,
                          topk_ids=topk_ids[i] if top_k else None, topk_probs=topk_probs[i] if top_k else None,
                          dropped_mass=dropped[i].astype(np.float64) if top_k else None,
                          soft=soft[i] if soft is not None else None)
                for i in range(n)]

    def self_cond_path(self, exact: bool | None = None) -> str:
        """The kernel of the dense self-conditioning product on the CPU ("avx512-vnni", "avx2",
        "emulated": the LM head's int8 GEMM on a Q8_0 copy of E^T; "ggml": ggml's MUL_MAT)."""
        self._require_open()
        exact = self.exact if exact is None else exact
        return self._lib._lib.dg_self_cond_path(self._model, exact).decode()

    def self_cond_bytes(self, exact: bool | None = None) -> int:
        """Bytes of the transposed embeddings the dense form holds (0 until a dense forward made them)."""
        self._require_open()
        exact = self.exact if exact is None else exact
        return int(self._lib._lib.dg_self_cond_bytes(self._model, exact))

    def _decoder_inputs(self, canvases: Any, per_sequence: bool, **self_cond: Any) -> "DecoderInputs":
        """The checked canvases and self-conditioning input of a decoder forward."""
        self._require_open()
        arr = np.asarray(canvases)
        if arr.ndim != 2 or arr.shape[0] < 1:
            raise InvalidParameter("canvases", f"array of shape {arr.shape}", "a 2-D [n, canvas_length] array")
        n, length = arr.shape
        if n > self.n_seq_max:
            raise InvalidParameter("canvases", f"{n} canvases", f"at most n_seq_max = {self.n_seq_max} (set at load)")
        if length < 1 or n * length > self.n_ubatch:
            raise InvalidParameter("canvas length", length, f"between 1 and {self.n_ubatch // n}")
        flat = check_tokens(arr.reshape(-1), self.vocab_size, "canvas")
        if not per_sequence and any(self._seq_tokens[1:n]):
            raise DgError("decode_canvases: sequences 1..n-1 hold their own tokens; pass per_sequence=True")
        for s in range(n if per_sequence else 1):
            used, room = self._room(s)
            # in a unified cache every canvas of the forward takes cells for its duration, borrowed
            # (shared context) or not; llama.cpp itself would only say "failed to find a memory slot"
            extra = length * (n if self.kv_unified else 1)
            if used + extra > room:
                what = f"{extra // length} canvases of {length} tokens" if extra > length else f"a {length}-token canvas"
                raise ContextFull(f"context full: {used} cached + {what} exceed n_ctx = {room}")
        sc = check_decoder_self_cond(n, length, self.vocab_size, self.n_embd, **self_cond)
        return DecoderInputs(tokens=flat, n=n, length=length, per_sequence=per_sequence, self_cond=sc)

    def _run_decoder(self, inputs: "DecoderInputs", call: Any) -> int:
        """`call(lib)`; without per_sequence, sequences 1..n-1 share sequence 0's cached cells for its
        duration. Ctrl-C waits until the call returns (see native.deferred_interrupts)."""
        L = self._lib
        # shared context: extra sequences borrow sequence 0's cached cells for the duration of the forward
        borrowed = range(0) if inputs.per_sequence else range(1, inputs.n)
        with native.deferred_interrupts():
            for s in borrowed:
                L.llama_memory_seq_cp(self._mem, 0, s, -1, -1)
            try:
                native.clear_log()
                return call(L)
            finally:
                for s in borrowed:
                    L.llama_memory_seq_rm(self._mem, s, -1, -1)


class ArModel(_LlamaModel):
    """A stock gemma4 GGUF (the AR base): causal prefill and one-token decodes."""

    architecture = AR_ARCH

    def __init__(self, path: str | os.PathLike, n_threads: int | None = None, n_gpu_layers: int = 0,
                 n_ctx: int | None = None, n_cpu_moe: int = 0, rpc_servers: Sequence[str] | None = None):
        super().__init__(path, n_threads=n_threads, n_gpu_layers=n_gpu_layers, exact=False, n_ctx=n_ctx,
                         n_cpu_moe=n_cpu_moe, rpc_servers=rpc_servers)
        self.default_params = None

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """Causal forward over `tokens`; returns the last token's logits [vocab]."""
        out = self._encode(tokens, True)
        assert out is not None
        return out

    def decode_token(self, token: int) -> np.ndarray:
        """One causal step: append `token`, return the next-token logits [vocab]."""
        out = self._encode([token], True)
        assert out is not None
        return out
