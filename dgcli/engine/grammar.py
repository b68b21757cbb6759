"""Grammar-constrained autoregressive decoding on a diffusion model's encoder (its causal path).

A canvas is denoised all at once, so it cannot follow a grammar left to right; the same weights
also decode token by token (the encoder that prefills prompts and commits canvases returns the
next-token logits: `DiffusionModel.prefill(tokens, return_logits=True)`). Each step, llama.cpp's
grammar sampler (`llama_sampler_init_grammar`, over the model's own vocabulary) leaves only the
tokens the grammar allows; the most probable of them is taken (or one is sampled at a temperature).
Once the grammar is complete only end-of-generation tokens remain, so the text always parses,
unless the token budget (max_new_tokens) runs out first.

Only tokens that are text are offered to the grammar: a control token's name ("<pad>") would
match inside a JSON string, and detokenizing drops it. Near the end of the token budget the
decode closes what is open: among the tokens the grammar allows it takes the end of generation,
else a token with a quote (and only brackets, commas or colons besides), else one of closing
brackets, else of commas and colons, else of digits, else any without whitespace (the model's most probable within each class), so the text conforms within
max_new_tokens whenever the schema can be finished in the tokens kept for that.

Grammars come from JSON schemas through llama-cpp-python's `SchemaConverter` (llama.cpp's
json-schema-to-grammar, with integer bounds added here), with limits on the schema's size and
depth: a schema is a request's input. Bounds on non-integer numbers, multipleOf, uniqueItems and
the like are not part of the grammar.
"""

from __future__ import annotations

import ctypes
import json
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from dgcli.engine.rng import RngStream, inverse_cdf_sample
from dgcli.engine.types import GenerationResult, TokenEvent
from dgcli.errors import DgError

MAX_SCHEMA_CHARS = 32 << 10  # a schema's JSON text
MAX_SCHEMA_DEPTH = 32
MAX_GRAMMAR_CHARS = 256 << 10
CLOSING_RESERVE = 64  # tokens at the end of the budget spent closing (a quarter of a smaller budget)
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


INT_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_BOUND_DIGITS = 30


def _digits_between(a: str, b: str) -> list[str]:
    """GBNF sequences matching the decimal strings from a to b, both of the same length."""
    if a == b:
        return [literal(a)]
    common = 0
    while a[common] == b[common]:
        common += 1
    prefix = literal(a[:common]) + " " if common else ""
    a, b = a[common:], b[common:]
    rest = len(a) - 1
    if rest == 0:
        return [f"{prefix}[{a}-{b}]"]
    if a[1:] == "0" * rest and b[1:] == "9" * rest:
        return [f"{prefix}[{a[0]}-{b[0]}]" + " [0-9]" * rest]
    out = [f"{prefix}{literal(a[0])} ({' | '.join(_digits_between(a[1:], '9' * rest))})"]
    if int(b[0]) - int(a[0]) > 1:
        out.append(f"{prefix}[{int(a[0]) + 1}-{int(b[0]) - 1}]" + " [0-9]" * rest)
    out.append(f"{prefix}{literal(b[0])} ({' | '.join(_digits_between('0' * rest, b[1:]))})")
    return out


def _naturals(low: int, high: int | None) -> list[str]:
    """GBNF sequences matching the decimal form (no leading zeros) of every integer in [low, high]
    (high None: unbounded); low >= 0."""
    out: list[str] = []
    top = len(str(high)) if high is not None else len(str(low))
    for n in range(len(str(low)), top + 1):
        a, b = max(low, 10 ** (n - 1) if n > 1 else 0), 10 ** n - 1 if high is None else min(high, 10 ** n - 1)
        if a <= b:
            out += _digits_between(str(a), str(b))
    if high is None:  # every longer number
        out.append("[1-9]" + " [0-9]" * top + " [0-9]*")
    return out


def integer_range_rule(low: int | None, high: int | None) -> str:
    """A GBNF expression for the JSON integers in [low, high] (None: unbounded that way)."""
    parts = []
    if low is None or low < 0:  # the negative ones: "-" and a magnitude in [max(1, -high), -low]
        magnitude_low = 1 if high is None or high >= 0 else -high
        parts += [f'"-" ({alt})' for alt in [" | ".join(_naturals(magnitude_low, None if low is None else -low))]]
    if high is None or high >= 0:
        parts += _naturals(max(0, low if low is not None else 0), high)
    return " | ".join(f"({p})" for p in parts)


def _int_bounds(schema: dict) -> tuple[int | None, int | None]:
    values = {k: schema[k] for k in INT_BOUNDS if k in schema}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or abs(value) >= 10 ** MAX_BOUND_DIGITS:
            raise GrammarError(f"the schema's {key} must be a number of at most {MAX_BOUND_DIGITS} digits")
    low = high = None
    if "minimum" in values:
        low = math.ceil(values["minimum"])
    if "exclusiveMinimum" in values:
        low = max(low if low is not None else -math.inf, math.floor(values["exclusiveMinimum"]) + 1)
    if "maximum" in values:
        high = math.floor(values["maximum"])
    if "exclusiveMaximum" in values:
        high = min(high if high is not None else math.inf, math.ceil(values["exclusiveMaximum"]) - 1)
    if low is not None and high is not None and low > high:
        raise GrammarError("no integer lies within the schema's minimum and maximum")
    return (None if low is None else int(low)), (None if high is None else int(high))


def _converter() -> Any:
    """llama-cpp-python's SchemaConverter, with integer bounds (minimum, maximum and their exclusive
    forms) made part of the grammar, which it leaves out."""
    from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter  # noqa: PLC0415

    class BoundedIntegers(SchemaConverter):
        def visit(self, schema: Any, name: str) -> str:
            if isinstance(schema, dict) and schema.get("type") == "integer" and any(k in schema for k in INT_BOUNDS):
                low, high = _int_bounds(schema)
                rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
                return self._add_rule(rule_name, f"({integer_range_rule(low, high)}) space")
            return super().visit(schema, name)

    return BoundedIntegers(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _convert(converter: Any, schema: dict, name: str, what: str) -> str:
    """The schema's rules added to the converter; returns its rule name. Whatever the converter
    raises on a schema it cannot follow (a remote $ref, a bad pattern, a missing definition) is a
    GrammarError."""
    try:
        resolved = converter.resolve_refs(schema, "input")
        return converter.visit(resolved, name)
    except GrammarError:
        raise
    except RecursionError:
        raise GrammarError(f"{what} refers to itself too deeply") from None
    except Exception as err:  # noqa: BLE001 (the converter's errors are assertions, KeyErrors, ValueErrors)
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GrammarError(f"{what} cannot be turned into a grammar: {detail[:200]}") from None


# a JSON string's character: llama-cpp-python's converter allows any but a quote or backslash, which
# would let control characters through (JSON forbids them unescaped: the text would not parse)
JSON_CHAR_RULE = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4,4})'


def _format(converter: Any) -> str:
    if "char" in converter._rules:
        converter._rules["char"] = JSON_CHAR_RULE
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


# closing classes of a token's text, best first (see the module's docstring): a quote first (inside a
# string, where brackets are text, only a quote closes; outside one the grammar allows a quote only
# where a string must start), then brackets
QUOTE, CLOSERS, STRUCTURE, NUMERIC, OTHER, SPACED = 1, 2, 3, 4, 5, 6


def closing_class(text: str) -> int:
    if not text:
        return SPACED
    if '"' in text and all(c in '"}],:' for c in text):
        return QUOTE
    if all(c in '}]' for c in text):
        return CLOSERS
    if all(c in '"}],:' for c in text):
        return STRUCTURE
    if all(c in "0123456789-.eE+" for c in text):
        return NUMERIC
    return SPACED if any(c.isspace() for c in text) else OTHER


class TokenTable:
    """Per token of a model's vocabulary: whether it is text (not a control, unused or unknown token),
    whether it ends generation, and its closing class."""

    _lock = threading.Lock()

    def __init__(self, model: Any):
        import llama_cpp.llama_cpp as llama  # noqa: PLC0415

        vocab, n = model._vocab, int(model.vocab_size)
        not_text = llama.LLAMA_TOKEN_ATTR_CONTROL | llama.LLAMA_TOKEN_ATTR_UNKNOWN | llama.LLAMA_TOKEN_ATTR_UNUSED
        self.text = np.zeros(n, dtype=bool)
        self.end = np.zeros(n, dtype=bool)
        self.closing = np.full(n, SPACED, dtype=np.int8)
        for t in range(n):
            self.end[t] = bool(llama.llama_vocab_is_eog(vocab, t))
            if int(llama.llama_vocab_get_attr(vocab, t)) & not_text:
                continue
            self.text[t] = True
            self.closing[t] = closing_class(model.token_piece(t).decode("utf-8", "replace"))
        self.offered = self.text | self.end

    @classmethod
    def of(cls, model: Any) -> "TokenTable":
        """The model's table, made once (a pass over the vocabulary) and kept on the model."""
        with cls._lock:
            table = getattr(model, "_dg_token_table", None)
            if table is None:
                table = cls(model)
                model._dg_token_table = table
            return table


class GrammarSampler:
    """llama.cpp's grammar sampler over a model's vocabulary: masks the logits of every token the
    grammar does not allow next, and follows the tokens accepted."""

    def __init__(self, model: Any, grammar: str, root: str = "root"):
        import llama_cpp.llama_cpp as llama  # noqa: PLC0415

        self._llama = llama
        self.table = TokenTable.of(model)
        self._vocab = model._vocab
        self.vocab_size = int(model.vocab_size)
        self._sampler = llama.llama_sampler_init_grammar(self._vocab, grammar.encode(), root.encode())
        if not self._sampler:
            raise GrammarError("llama.cpp could not parse the grammar made from the schema")
        self._data = np.zeros(self.vocab_size, dtype=_TOKEN_DATA)
        self._data["id"] = np.arange(self.vocab_size, dtype=np.int32)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The logits with -inf for every token the grammar does not allow next (and every token
        that is not text)."""
        data = self._data
        data["logit"] = np.where(self.table.offered, np.asarray(logits, dtype=np.float32)[:self.vocab_size],
                                 -np.inf)
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
        return bool(self.table.end[int(token)])

    def closing_pick(self, masked: np.ndarray) -> int:
        """The token that best closes what is open: an end of generation if allowed, else the best
        closing class, the most probable within it."""
        allowed = np.isfinite(masked)
        ends = allowed & self.table.end
        if ends.any():
            return int(np.flatnonzero(ends)[0])
        classes = np.where(allowed, self.table.closing, 127)
        best = np.where(classes == classes.min(), masked, -np.inf)
        return int(np.argmax(best))

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
        # the last tokens of the budget close what is open
        self.closing_reserve = min(CLOSING_RESERVE, max(1, self.max_new_tokens // 4))

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
        if self.max_new_tokens - len(self.tokens) <= self.closing_reserve:
            token = self.sampler.closing_pick(masked)
        else:
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
