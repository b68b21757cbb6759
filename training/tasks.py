"""The demo model's tasks: short questions with one checkable answer and a difficulty knob.

Three tasks, each a chat turn whose answer fits one 32-token canvas:

    sort: DBCA          -> ABCD          (difficulty = number of letters, 1..8)
    reverse: HELLO      -> OLLEH         (difficulty = number of letters, 1..8)
    add: 123+45         -> 168           (difficulty = digits of the longer operand, 1..4)

Letters are upper case because dg-tiny has no merges for upper-case letters or digits (nor for a
space before them): every letter is one token, so the answer's tokens line up with the question's.
Lower-case letters merge ("er", "st", " d"...), which makes reversing and sorting a tokenization
puzzle that a model this small learns far more slowly.

Every answer token depends on the whole question, but once a few answer tokens are fixed the rest
become easier, so a bidirectional decoder can commit several tokens per step, and longer inputs
leave it less sure for longer: the room the diffusion sampler needs to show adaptive stopping.

Held-out split: a question belongs to the evaluation set when crc32(question) % 10 == 0; training
never samples those (short inputs included, so no evaluation question is ever seen in training).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from dgcli.tiny import TinyVocab, tiny_vocab

TASKS = ("sort", "reverse", "add")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MAX_DIFFICULTY = {"sort": 8, "reverse": 8, "add": 4}
CANVAS_LENGTH = 32


@dataclass(frozen=True)
class Example:
    task: str
    difficulty: int
    question: str
    answer: str


def is_held_out(question: str) -> bool:
    return zlib.crc32(question.encode("utf-8")) % 10 == 0


def _random_number(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def make_example(task: str, difficulty: int, rng: random.Random) -> Example:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if not 1 <= difficulty <= MAX_DIFFICULTY[task]:
        raise ValueError(f"{task} difficulty must be in 1..{MAX_DIFFICULTY[task]}, got {difficulty}")
    if task == "add":
        # The longer operand has `difficulty` digits; the other one is at most as long.
        a = _random_number(rng, difficulty)
        b = _random_number(rng, rng.randint(1, difficulty))
        if rng.random() < 0.5:
            a, b = b, a
        return Example(task, difficulty, f"add: {a}+{b}", str(a + b))
    letters = "".join(rng.choice(LETTERS) for _ in range(difficulty))
    answer = "".join(sorted(letters)) if task == "sort" else letters[::-1]
    return Example(task, difficulty, f"{task}: {letters}", answer)


def sample_example(rng: random.Random, held_out: bool, task: str | None = None,
                   difficulty: int | None = None) -> Example:
    """A random example from the training split (held_out=False) or the evaluation split."""
    while True:
        chosen_task = task or rng.choice(TASKS)
        chosen_difficulty = difficulty or rng.randint(1, MAX_DIFFICULTY[chosen_task])
        example = make_example(chosen_task, chosen_difficulty, rng)
        if is_held_out(example.question) == held_out:
            return example


def evaluation_set(task: str, difficulty: int, count: int, seed: int = 1234) -> list[Example]:
    """`count` held-out examples of one task and difficulty, the same ones for the same seed.

    Short inputs have few distinct held-out questions (1-letter sort has 26 questions, ~3 held out),
    so repeats are allowed there.
    """
    rng = random.Random(f"{seed}/{task}/{difficulty}")
    return [sample_example(rng, held_out=True, task=task, difficulty=difficulty) for _ in range(count)]


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


def canvas_ids(example: Example, canvas_length: int = CANVAS_LENGTH, vocab: TinyVocab | None = None) -> list[int]:
    """The clean canvas: answer, <eos>, then <pad> to the end (the reference pads after the end)."""
    vocab = vocab or tiny_vocab()
    ids = answer_ids(example, vocab)
    if len(ids) > canvas_length:
        raise ValueError(f"answer of {example.question!r} needs {len(ids)} tokens; canvas holds {canvas_length}")
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
