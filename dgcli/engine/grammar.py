"""Grammar-constrained autoregressive decoding on a diffusion model's encoder (its causal path).

A canvas is denoised all at once, so it cannot follow a grammar left to right; the same weights
also decode token by token (the encoder that prefills prompts and commits canvases returns the
next-token logits: `DiffusionModel.prefill(tokens, return_logits=True)`). Each step, llama.cpp's
grammar sampler (`llama_sampler_init_grammar`, over the model's own vocabulary) leaves only the
tokens the grammar allows; the most probable of them is taken (or one is sampled at a temperature).
Once the grammar is complete only end-of-generation tokens remain, so the text always parses,
unless the token budget (max_new_tokens) runs out first.

Grammars come from JSON schemas through llama-cpp-python's `SchemaConverter` (llama.cpp's
json-schema-to-grammar), with limits on the schema's size and depth: a schema is a request's input.
"""

from __future__ import annotations

import ctypes
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from dgcli.engine.rng import RngStream, inverse_cdf_sample
from dgcli.engine.types import DgError, GenerationResult, TokenEvent

MAX_SCHEMA_CHARS = 32 << 10  # a schema's JSON text
MAX_SCHEMA_DEPTH = 32
MAX_GRAMMAR_CHARS = 256 << 10
# the whole of JSON: what response_format {"type": "json_object"} asks for
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

# llama_token_data: {int32 id; float logit; float p}
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)


class GrammarError(DgError):
    """A schema or grammar that cannot constrain decoding (the request's fault)."""


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counting no further than limit + 1."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_schema(schema: Any, what: str) -> None:
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object")
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"{what} is longer than {MAX_SCHEMA_CHARS} characters of JSON")
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{what} is nested deeper than {MAX_SCHEMA_DEPTH} levels")


def _converter() -> Any:
    from llama_cpp.llama_grammar import SchemaConverter  # noqa: PLC0415

    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _convert(converter: Any, schema: dict, name: str, what: str) -> str:
    """The schema's rules added to the converter; returns its rule name. Whatever the converter
    raises on a schema it cannot follow (a remote $ref, a bad pattern, a missing definition) is a
    GrammarError."""
    try:
        resolved = converter.resolve_refs(schema, "input")
        return converter.visit(resolved, name)
    except RecursionError:
        raise GrammarError(f"{what} refers to itself too deeply") from None
    except Exception as err:  # noqa: BLE001 (the converter's errors are assertions, KeyErrors, ValueErrors)
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GrammarError(f"{what} cannot be turned into a grammar: {detail[:200]}") from None


def _format(converter: Any) -> str:
    grammar = converter.format_grammar()
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the schema's grammar is longer than {MAX_GRAMMAR_CHARS} characters")
    return grammar


def json_schema_grammar(schema: dict, what: str = "the JSON schema") -> str:
    """A GBNF grammar (root rule `root`) for JSON text that conforms to `schema`."""
    _check_schema(schema, what)
    converter = _converter()
    _convert(converter, schema, "", what)
    return _format(converter)


def literal(text: str) -> str:
    """A GBNF string literal for text."""
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(tools: Sequence[tuple[str, dict]], open_text: str, name_prefix: str,
                      close_text: str) -> str:
    """A grammar for exactly one call of one of `tools` ((name, parameters schema) pairs):
    open_text + name_prefix + NAME + JSON arguments conforming to that tool's schema + close_text."""
    if not tools:
        raise GrammarError("no tool to call")
    converter = _converter()
    alternatives = []
    for i, (name, parameters) in enumerate(tools):
        what = f"the parameters of tool {name!r}"
        _check_schema(parameters, what)
        rule = _convert(converter, parameters, f"tool{i}-args", what)
        alternatives.append(f"{literal(name)} {rule}")
    converter._rules["root"] = (f"{literal(open_text)} {literal(name_prefix)} ( "
                                + " | ".join(alternatives) + f" ) {literal(close_text)}")
    return _format(converter)


class GrammarSampler:
    """llama.cpp's grammar sampler over a model's vocabulary: masks the logits of every token the
    grammar does not allow next, and follows the tokens accepted."""

    def __init__(self, model: Any, grammar: str, root: str = "root"):
        import llama_cpp.llama_cpp as llama  # noqa: PLC0415

        self._llama = llama
        self._vocab = model._vocab
        self.vocab_size = int(model.vocab_size)
        self._sampler = llama.llama_sampler_init_grammar(self._vocab, grammar.encode(), root.encode())
        if not self._sampler:
            raise GrammarError("llama.cpp could not parse the grammar made from the schema")
        self._data = np.zeros(self.vocab_size, dtype=_TOKEN_DATA)
        self._data["id"] = np.arange(self.vocab_size, dtype=np.int32)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The logits with -inf for every token the grammar does not allow next."""
        data = self._data
        data["logit"] = np.asarray(logits, dtype=np.float32)[:self.vocab_size]
        data["p"] = 0.0
        pointer = ctypes.cast(data.ctypes.data, self._llama.llama_token_data_p)
        array = self._llama.llama_token_data_array(pointer, self.vocab_size, -1, False)
        self._llama.llama_sampler_apply(self._sampler, ctypes.byref(array))
        if array.size != self.vocab_size or array.data[0].id != 0:
            raise DgError("the grammar sampler reordered the candidates")
        return data["logit"].copy()

    def accept(self, token: int) -> None:
        """Advance the grammar over `token`, which `mask` allowed."""
        self._llama.llama_sampler_accept(self._sampler, int(token))

    def is_end(self, token: int) -> bool:
        return bool(self._llama.llama_vocab_is_eog(self._vocab, int(token)))

    def close(self) -> None:
        if getattr(self, "_sampler", None):
            self._llama.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


def pick_token(masked: np.ndarray, temperature: float, rng: RngStream) -> int:
    """Greedy at temperature 0, else one inverse-CDF sample from softmax(masked / temperature)."""
    if temperature == 0.0:
        return int(np.argmax(masked))
    processed = masked / np.float32(temperature)
    weights = np.exp(processed - processed.max())
    return int(inverse_cdf_sample(weights[None, :], rng.multinomial_uniforms(1))[0])


@dataclass
class ConstrainedSequence:
    """One grammar-constrained generation's state, advanced a token at a time by whoever owns the
    model (`dg serve`'s scheduler): `next_token(logits)` picks a token from the logits of the last
    forward, or ends the generation; the caller then runs the encoder over that token."""

    model: Any
    prompt_ids: list[int]
    sampler: GrammarSampler
    max_new_tokens: int
    temperature: float = 0.0
    rng: RngStream = field(default_factory=RngStream)
    on_event: Callable[[Any], Any] | None = None
    tokens: list[int] = field(default_factory=list)
    stop_reason: str | None = None
    prefill_s: float = 0.0
    forward_s: float = 0.0
    sampling_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise DgError(f"invalid temperature {self.temperature}: must be a number >= 0")
        self._end_ids = {int(t) for t in getattr(self.model, "end_token_ids", ())}

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def next_token(self, logits: np.ndarray, forward_s: float = 0.0) -> int | None:
        """The next token (the caller runs the encoder over it), or None when the generation ends
        (stop_reason says why)."""
        self.forward_s += forward_s
        began = time.perf_counter()
        masked = self.sampler.mask(logits)
        if not np.isfinite(masked).any():
            self.stop_reason = "grammar_dead_end"  # no token continues the grammar: cannot happen for JSON
            return None
        token = pick_token(masked, self.temperature, self.rng)
        self.sampling_s += time.perf_counter() - began
        if token in self._end_ids or self.sampler.is_end(token):
            self.stop_reason = "end_token"
            return None
        self.sampler.accept(token)
        self.tokens.append(token)
        if self.on_event is not None:
            piece = self.model.detokenize([token])
            self.on_event(TokenEvent(index=len(self.tokens) - 1, token_id=token, piece=piece,
                                     forward_s=forward_s, sampling_s=time.perf_counter() - began))
        if len(self.tokens) >= self.max_new_tokens:
            self.stop_reason = "length"
            return None
        return token

    def result(self, stop_reason: str | None = None) -> GenerationResult:
        reason = stop_reason or self.stop_reason or "length"
        return GenerationResult(
            mode="autoregressive", text=self.model.detokenize(self.tokens), token_ids=list(self.tokens),
            n_prompt_tokens=len(self.prompt_ids), decoder_forwards=len(self.tokens),
            tokens_per_forward=1.0 if self.tokens else 0.0, prefill_s=self.prefill_s,
            total_s=time.perf_counter() - self.started, forward_s=self.forward_s, sampling_s=self.sampling_s,
            stop_reason=reason, interrupted=reason == "interrupted", seed=self.rng.seed)

    def close(self) -> None:
        self.sampler.close()
