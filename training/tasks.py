"""The demo model's tasks: questions with one checkable answer, a difficulty knob, and a help reply.

    reverse: HELLO WORLD    -> DLROW OLLEH                      (difficulty = characters, 1..12)
    sort: DBCA              -> ABCD                             (difficulty = letters, 1..8)
    nato: DG                -> DELTA GOLF                       (difficulty = letters, 1..6)
    json: A=1 BC=22         -> {"A": 1, "BC": 22}               (difficulty = pairs, 1..3; values 0..999)
    anything else           -> HELP_REPLY, one line naming the tasks with an example prompt

Inputs and outputs are upper-case letters, digits and punctuation because dg-tiny has no merges for
them (nor for a space before them): every character is one token, so an answer's tokens line up with
the question's. Lower-case text merges ("er", "st", " d"...); it only appears in the help reply, a
memorised sentence, and in the prompts that get it.

Answers are long enough to fill most of a 32-token canvas (reverse of 12 characters is 12 tokens,
nato of 4 letters ~25, json of 3 pairs ~25), so a bidirectional decoder has many tokens to commit per
forward; nato answers of 5-6 letters and the help reply span two canvases, so generation commits a
canvas and continues from the KV cache. Harder inputs (more letters to sort) leave the model less
sure for longer: the room the sampler needs to show adaptive stopping.

Held-out split: a question belongs to the evaluation set when crc32(question) % 10 == 0; training
never samples those (short inputs included, so no evaluation question is ever seen in training).
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from typing import Callable

from dgcli.testing.tiny import TinyVocab, tiny_vocab

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
CANVAS_LENGTH = 32

NATO = dict(zip(LETTERS, (
    "ALFA", "BRAVO", "CHARLIE", "DELTA", "ECHO", "FOXTROT", "GOLF", "HOTEL", "INDIA", "JULIETT", "KILO",
    "LIMA", "MIKE", "NOVEMBER", "OSCAR", "PAPA", "QUEBEC", "ROMEO", "SIERRA", "TANGO", "UNIFORM", "VICTOR",
    "WHISKEY", "XRAY", "YANKEE", "ZULU")))

# What the model answers to anything that is not one of its tasks (trained, like every other answer).
HELP_REPLY = "I can reverse, sort, spell (NATO) and write JSON. Try: reverse: HELLO"


@dataclass(frozen=True)
class Example:
    task: str
    difficulty: int
    question: str
    answer: str


def is_held_out(question: str) -> bool:
    return zlib.crc32(question.encode("utf-8")) % 10 == 0


def _letters(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(count))


def _letters_and_spaces(rng: random.Random, count: int) -> str:
    """`count` characters: upper-case words separated by single spaces (none at either end)."""
    chars = []
    for i in range(count):
        can_space = 0 < i < count - 1 and chars[-1] != " "
        chars.append(" " if can_space and rng.random() < 0.15 else rng.choice(LETTERS))
    return "".join(chars)


def _reverse(rng: random.Random, difficulty: int) -> tuple[str, str]:
    text = _letters_and_spaces(rng, difficulty)
    return f"reverse: {text}", text[::-1]


def _sort(rng: random.Random, difficulty: int) -> tuple[str, str]:
    text = _letters(rng, difficulty)
    return f"sort: {text}", "".join(sorted(text))


def _nato(rng: random.Random, difficulty: int) -> tuple[str, str]:
    text = _letters(rng, difficulty)
    return f"nato: {text}", " ".join(NATO[c] for c in text)


# A value's digit count is drawn first, then the value within it: each of 0-9, 10-99 and 100-999 is a
# third of the values. Drawn uniformly from 0-999, one-digit values would be 1% of them, too few to
# learn (the model wrote `{"K": 55}` for `json: K=5`).
VALUE_DIGITS = (1, 2, 3)


def _value(rng: random.Random, digits: int | None = None) -> int:
    digits = digits or rng.choice(VALUE_DIGITS)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _json(rng: random.Random, difficulty: int, value_digits: int | None = None) -> tuple[str, str]:
    """`difficulty` pairs; every value of `value_digits` digits when given, else each drawn as above."""
    pairs: dict[str, int] = {}
    while len(pairs) < difficulty:
        pairs.setdefault(_letters(rng, rng.randint(1, 2)), _value(rng, value_digits))
    question = "json: " + " ".join(f"{k}={v}" for k, v in pairs.items())
    return question, json.dumps(pairs)


# -- prompts that are none of the tasks -------------------------------------------------------------

_WORDS = (
    "the a an is are was what who how why when where which can could would should do does did you your me my "
    "i we they it this that there here please tell write give show explain make find help say know want need "
    "story poem joke song letter email essay list summary recipe plan idea name word number time day week "
    "year today tomorrow weather sun moon star sky sea river mountain city country world people friend family "
    "cat dog bird fish horse tree flower food water coffee tea bread apple music book movie game code python "
    "computer phone car train bus school work money love life dream night morning hello hi hey thanks good "
    "bad big small new old long short hot cold happy sad fast slow red blue green about of for with in on to "
    "from and or but not all some many more most best first last next one two three ten hundred math "
    "capital france paris history science space robot model diffusion gemma canvas token answer question"
).split()
_OPENERS = ("hello", "hi", "hey", "tell me a story", "what can you do", "who are you", "help", "what is this",
            "thanks", "good morning", "how are you", "what is 3+5", "translate this", "write a poem",
            "summarize this", "explain diffusion", "what is your name", "are you there", "test", "ok")
_TASK_WORDS = ("reverse", "sort", "nato", "json")
_OTHER_TASKS = ("add", "count", "spell", "upper", "lower", "translate", "sum", "repeat", "echo", "solve",
                "define", "capitalize", "shuffle", "length", "what")
_PUNCTUATION = "?!.,"


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(1, 9))]
    text = " ".join(words)
    style = rng.random()
    if style < 0.4:
        text = text[:1].upper() + text[1:]
    elif style < 0.5:
        text = text.upper()
    return text + (rng.choice(_PUNCTUATION) if rng.random() < 0.5 else "")


def _junk(rng: random.Random) -> str:
    alphabet = LETTERS + LETTERS.lower() + "0123456789 +-*/=:;,.!?()'\"#@"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))).strip() or "?"


def _near_miss(rng: random.Random) -> str:
    """Looks like a task but is not one: a wrong task name, lower case, digits, no colon, no input."""
    task = rng.choice(_TASK_WORDS)
    kind = rng.randrange(6)
    if kind == 0:
        return f"{rng.choice(_OTHER_TASKS)}: {_letters(rng, rng.randint(1, 10))}"
    if kind == 1:
        return f"{task}: {_letters(rng, rng.randint(1, 10)).lower()}"
    if kind == 2:
        return f"{rng.choice(_OTHER_TASKS)}: {rng.randint(0, 999)}+{rng.randint(0, 999)}"
    if kind == 3:
        return f"{task} {_letters(rng, rng.randint(1, 10))}"
    if kind == 4:
        return f"{task}:" if rng.random() < 0.5 else task
    return f"{task}: {_sentence(rng)}"


def _unknown(rng: random.Random, difficulty: int) -> tuple[str, str]:
    kind = rng.random()
    if kind < 0.15:
        question = rng.choice(_OPENERS)
        question = question[:1].upper() + question[1:] if rng.random() < 0.5 else question
    elif kind < 0.55:
        question = _sentence(rng)
    elif kind < 0.7:
        question = _junk(rng)
    else:
        question = _near_miss(rng)
    if is_task_question(question):  # a generated near miss can happen to be a real question
        question = "hello"
    return question, HELP_REPLY


@dataclass(frozen=True)
class Task:
    name: str
    max_difficulty: int
    make: Callable[..., tuple[str, str]]  # (rng, difficulty[, variant]) -> (question, answer)
    weight: float  # share of training examples
    # A second knob whose values are evaluated one by one (json: the digits of every value). Training
    # draws it inside `make`; empty when the task has none.
    variants: tuple[int, ...] = ()
    variant_label: str = ""


TASK_LIST = (
    Task("reverse", 12, _reverse, 0.22),
    Task("sort", 8, _sort, 0.28),
    Task("nato", 6, _nato, 0.22),
    Task("json", 3, _json, 0.2, VALUE_DIGITS, "{}-digit values"),
    Task("help", 1, _unknown, 0.08),
)
TASK_BY_NAME = {t.name: t for t in TASK_LIST}
TASKS = tuple(TASK_BY_NAME)
MAX_DIFFICULTY = {t.name: t.max_difficulty for t in TASK_LIST}

# What the model card (dgcli/models/README.md) promises for each task, as the card words it:
# (phrase, knob, lowest, highest). `knob_values` measures the knobs of a question, so tests can
# check that training, the held-out sets and the bench set cover each range and stay inside it.
DOCUMENTED_RANGES = {
    "reverse": (("{}-{} characters", "characters", 1, 12),),
    "sort": (("{}-{} letters", "letters", 1, 8),),
    "nato": (("{}-{} letters", "letters", 1, 6),),
    "json": (("{}-{} pairs", "pairs", 1, 3), ("keys {}-{} letters", "key letters", 1, 2),
             ("values {}-{}", "value", 0, 999)),
}


def knob_values(example: Example) -> dict[str, list[int]]:
    """The documented knobs of a task question: its length, or a JSON question's pair count, every
    key's length and every value."""
    text = example.question.partition(": ")[2]
    if example.task == "reverse":
        return {"characters": [len(text)]}
    if example.task in ("sort", "nato"):
        return {"letters": [len(text)]}
    if example.task == "json":
        pairs = [p.partition("=") for p in text.split(" ")]
        return {"pairs": [len(pairs)], "key letters": [len(k) for k, _, _ in pairs],
                "value": [int(v) for _, _, v in pairs]}
    raise ValueError(f"{example.task!r} has no documented ranges")


def is_task_question(question: str) -> bool:
    """Whether `question` is in one of the task forms (so its answer is not the help reply)."""
    name, sep, text = question.partition(": ")
    if not sep or name not in _TASK_WORDS or not text:
        return False
    if name == "json":
        pairs = [p.partition("=") for p in text.split(" ")]
        return all(k and set(k) <= set(LETTERS) and eq and v.isdigit() for k, eq, v in pairs)
    allowed = set(LETTERS) | ({" "} if name == "reverse" else set())
    return set(text) <= allowed and text.strip() == text and "  " not in text


def make_example(task: str, difficulty: int, rng: random.Random, variant: int | None = None) -> Example:
    """An example of `task` at `difficulty`; `variant` fixes the task's second knob (Task.variants)."""
    if task not in TASK_BY_NAME:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    spec = TASK_BY_NAME[task]
    if not 1 <= difficulty <= spec.max_difficulty:
        raise ValueError(f"{task} difficulty must be in 1..{spec.max_difficulty}, got {difficulty}")
    if variant is None:
        question, answer = spec.make(rng, difficulty)
    elif variant in spec.variants:
        question, answer = spec.make(rng, difficulty, variant)
    else:
        raise ValueError(f"{task} has no variant {variant!r} (its variants: {spec.variants or 'none'})")
    return Example(task, difficulty, question, answer)


def sample_example(rng: random.Random, held_out: bool, task: str | None = None,
                   difficulty: int | None = None, variant: int | None = None) -> Example:
    """A random example from the training split (held_out=False) or the evaluation split."""
    while True:
        chosen = TASK_BY_NAME[task] if task else rng.choices(TASK_LIST, weights=[t.weight for t in TASK_LIST])[0]
        # harder inputs are drawn more often (weight = difficulty): short ones are learned from few examples
        levels = range(1, chosen.max_difficulty + 1)
        chosen_difficulty = difficulty or rng.choices(levels, weights=levels)[0]
        example = make_example(chosen.name, chosen_difficulty, rng, variant)
        if is_held_out(example.question) == held_out:
            return example


def evaluation_set(task: str, difficulty: int, count: int, seed: int = 1234,
                   variant: int | None = None) -> list[Example]:
    """`count` held-out examples of one task and difficulty (and variant, when given), the same ones
    for the same seed.

    Short inputs have few distinct held-out questions (1-letter sort has 26 questions, ~3 held out),
    so repeats are allowed there.
    """
    rng = random.Random(f"{seed}/{task}/{difficulty}" + ("" if variant is None else f"/{variant}"))
    return [sample_example(rng, held_out=True, task=task, difficulty=difficulty, variant=variant)
            for _ in range(count)]


def evaluation_cells(task: str) -> list[tuple[int, int | None]]:
    """(difficulty, variant) of every cell a task is evaluated in: each difficulty, crossed with each
    variant where the task has them, so every documented range is measured on its own."""
    spec = TASK_BY_NAME[task]
    return [(d, v) for d in range(1, spec.max_difficulty + 1) for v in (spec.variants or (None,))]


def cell_label(task: str, difficulty: int, variant: int | None) -> str:
    spec = TASK_BY_NAME[task]
    return str(difficulty) if variant is None else f"{difficulty}, {spec.variant_label.format(variant)}"


# dg-tiny's chat template for one user turn with the generation prompt, as plain text. Encoding it
# gives the same ids as `TinyVocab.chat_prompt_ids` (tests/test_demo_model.py checks) without a
# jinja render per example, which would dominate the data pipeline's time.
CHAT_PREFIX = "<bos><|turn>user\n"
CHAT_SUFFIX = "<turn|>\n<|turn>model\n"


def prompt_ids(example: Example, vocab: TinyVocab | None = None) -> list[int]:
    """The chat-templated question, as the engine's `chat_prompt` tokenizes it."""
    vocab = vocab or tiny_vocab()
    return vocab.encode(CHAT_PREFIX + example.question + CHAT_SUFFIX, add_bos=False, special=True)


def answer_ids(example: Example, vocab: TinyVocab | None = None) -> list[int]:
    """The answer's tokens followed by <eos>."""
    vocab = vocab or tiny_vocab()
    return vocab.encode(example.answer, add_bos=False) + [vocab.eos_id]


def canvas_count(example: Example, canvas_length: int = CANVAS_LENGTH, vocab: TinyVocab | None = None) -> int:
    """How many canvases the answer (with its <eos>) takes."""
    return -(-len(answer_ids(example, vocab)) // canvas_length)


def canvas_ids(example: Example, index: int = 0, canvas_length: int = CANVAS_LENGTH,
               vocab: TinyVocab | None = None) -> list[int]:
    """Clean canvas `index` of the answer: its slice of answer + <eos>, then <pad> to the end (the
    reference pads after the end). Canvases before it are committed context, as in generation."""
    vocab = vocab or tiny_vocab()
    ids = answer_ids(example, vocab)[index * canvas_length:(index + 1) * canvas_length]
    if not ids:
        raise ValueError(f"the answer of {example.question!r} has no canvas {index}")
    return ids + [vocab.pad_id] * (canvas_length - len(ids))


def parse_answer(generated_ids: list[int], vocab: TinyVocab | None = None) -> str:
    """The generated text up to the first end token, stripped: what is compared with `Example.answer`."""
    vocab = vocab or tiny_vocab()
    kept: list[int] = []
    for token in generated_ids:
        if token in vocab.end_token_ids:
            break
        if token != vocab.pad_id:
            kept.append(token)
    return vocab.decode(kept).strip()


# -- what dg bench measures the demo on (dgcli/data/demo-prompts.tsv) ------------------------------

# Held-out examples at these difficulties, 3 each (python -m training.evaluate --write-bench-prompts):
# both ends of every documented range. A task with variants (json) takes one prompt per variant at
# each level, so the bench holds values of one, two and three digits at every pair count.
BENCH_LEVELS = {"reverse": (1, 3, 6, 9, 12), "sort": (1, 2, 4, 6, 8), "nato": (1, 2, 4, 6), "json": (1, 2, 3),
                "help": (1,)}

# Hand-written prompts that are none of the tasks, as a new user types them. "Hello" and "Tell me a
# story" can also come out of the training generator; the others use words and forms it never makes.
UNKNOWN_PROMPTS = (
    "Hello",
    "Tell me a story",
    "Who are you?",
    "What's the weather like in Paris today?",
    "Write a haiku about autumn leaves",
    "reverse: hello",
)
