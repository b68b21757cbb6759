"""AutoregressiveEngine: token-by-token generation on a stock gemma4 GGUF (the AR base), for comparison.

Same result shape as the diffusion engine (GenerationResult, mode="autoregressive"): one decoder
forward per new token, so tokens_per_forward is 1. Greedy by default; temperature > 0 samples
from softmax(logits / temperature) with a seeded RngStream (inverse CDF, as the diffusion engine).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Sequence

import numpy as np

from dgcli.engine.diffusion import GEMMA_PAD_TOKEN_ID, TimedEvents, prompt_token_ids, validate_max_new_tokens
from dgcli.engine.rng import RngStream, inverse_cdf_sample, resolve_seed
from dgcli.engine.types import GenerationResult, TokenEvent
from dgcli.errors import WORKER_LOST, ContextFull, DgError, InvalidParameter, WorkerLost

EventCallback = Callable[[Any], Any]


class _StopRequested(Exception):
    """on_event returned False."""


def validate_temperature(temperature: Any) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise InvalidParameter("temperature", temperature, "a number >= 0 (0 = greedy)")
    return float(temperature)


def select_token(logits: np.ndarray, temperature: float, rng: RngStream) -> int:
    """Greedy argmax at temperature 0, else one inverse-CDF sample from softmax(logits / temperature)."""
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    if not np.isfinite(logits).all():
        raise DgError("the model returned non-finite logits")
    if temperature == 0.0:
        return int(np.argmax(logits))
    processed = logits / np.float32(temperature)
    weights = np.exp(processed - processed.max())
    return int(inverse_cdf_sample(weights[None, :], rng.multinomial_uniforms(1))[0])


class AutoregressiveEngine:
    """Greedy (or seeded sampling) AR decoding over a gemma4 GGUF, or any object with ArModel's API."""

    def __init__(self, model: str | os.PathLike | Any, n_threads: int | None = None, n_gpu_layers: int = 0,
                 n_ctx: int | None = None, n_cpu_moe: int = 0, rpc_servers: Sequence[str] | None = None):
        if isinstance(model, (str, os.PathLike)):
            from dgcli.runtime.model import ArModel

            self.model = ArModel(os.fspath(model), n_threads=n_threads, n_gpu_layers=n_gpu_layers, n_ctx=n_ctx,
                                 n_cpu_moe=n_cpu_moe, rpc_servers=rpc_servers)
            self._owns_model = True
        else:
            self.model = model
            self._owns_model = False

    def close(self) -> None:
        if self._owns_model and hasattr(self.model, "close"):
            self.model.close()

    def __enter__(self) -> "AutoregressiveEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 256, seed: int | None = None,
                 chat: bool = True, temperature: float = 0.0, on_event: EventCallback | None = None,
                 parse_special: bool = False, ignore_eos: bool = False) -> GenerationResult:
        """Greedy (temperature 0) or sampled decoding. The answer (`answer_token_ids`): tokens before
        the end token, pads dropped, at most max_new_tokens decoded. ignore_eos: an end token is an
        answer token like any other."""
        started = time.perf_counter()
        max_new_tokens = validate_max_new_tokens(max_new_tokens)
        temperature = validate_temperature(temperature)
        seed = resolve_seed(seed)
        rng = RngStream(seed)
        events = TimedEvents(on_event)
        end_ids = set() if ignore_eos else set(int(t) for t in self.model.end_token_ids)
        pad_id = getattr(self.model, "pad_token_id", GEMMA_PAD_TOKEN_ID)
        prompt_ids: list[int] = []
        new_tokens: list[int] = []
        forwards = decodes = from_prefill = 0
        forward_s = sampling_s = prefill_s = 0.0
        stop_reason = "length"
        try:
            prompt_ids = prompt_token_ids(self.model, prompt, chat, parse_special)
            # the clock starts here: the chat template and the tokenizer are not generation time
            started = began = time.perf_counter()
            self.model.reset()
            logits = self.model.prefill(prompt_ids)
            prefill_s = time.perf_counter() - began
            step_forward_s = 0.0  # the prefill produced the first token's logits
            for index in range(max_new_tokens):
                began = time.perf_counter()
                token = select_token(logits, temperature, rng)
                step_sampling_s = time.perf_counter() - began
                sampling_s += step_sampling_s
                if token in end_ids:
                    stop_reason = "end_token"
                    break
                forwards += 1
                if token != pad_id:
                    new_tokens.append(token)
                    if index == 0:  # its logits came from the prefill
                        from_prefill = 1
                    event = TokenEvent(index=len(new_tokens) - 1, token_id=token, piece=self._piece(token),
                                       forward_s=step_forward_s, sampling_s=step_sampling_s)
                    if events(event) is False:
                        raise _StopRequested
                if index + 1 == max_new_tokens:
                    break  # no forward for a token nobody will read
                began = time.perf_counter()
                try:
                    logits = self.model.decode_token(token)
                except ContextFull:  # the answer so far is kept
                    stop_reason = "context_full"
                    break
                step_forward_s = time.perf_counter() - began
                forward_s += step_forward_s
                decodes += 1
        except (KeyboardInterrupt, _StopRequested):
            stop_reason = "interrupted"
        except WorkerLost:  # the worker's error is the caller's to report (rpc.check_workers raises it again)
            stop_reason = WORKER_LOST
        return GenerationResult(
            mode="autoregressive",
            text=self.model.detokenize(new_tokens),
            token_ids=new_tokens,
            n_prompt_tokens=len(prompt_ids),
            decoder_forwards=forwards,
            tokens_per_forward=len(new_tokens) / forwards if forwards else 0.0,
            prefill_s=prefill_s,
            total_s=time.perf_counter() - started - events.seconds,
            forward_s=forward_s,
            timed_forwards=decodes,
            sampling_s=sampling_s,
            stop_reason=stop_reason,
            interrupted=stop_reason in ("interrupted", WORKER_LOST),
            seed=seed,
            display_s=events.seconds,
            prefill_answer_tokens=from_prefill,
        )

    def _piece(self, token: int) -> str:
        return self.model.detokenize([token])
