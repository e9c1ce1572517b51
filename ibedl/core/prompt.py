"""Multiple-choice questions, their prompt text, and the tokenizer ids of the option letters."""

from __future__ import annotations

import string
from dataclasses import dataclass, field

LETTERS = string.ascii_uppercase  # A..Z: at most 26 options
MIN_OPTIONS = 2
MAX_OPTIONS = len(LETTERS)

# The template is part of the artifact's manifest: training and serving format questions the same way.
DEFAULT_TEMPLATE = "plain-v1"


@dataclass(frozen=True)
class MCQuestion:
    """One multiple-choice question.

    Attributes:
        question: the stem.
        options: 2..26 option texts, in letter order (A, B, ...).
        context: an optional passage the question is about (SciQ support, RACE article).
        answer: index of the correct option, when known (training and evaluation data).
        id: an identifier carried through to predictions.
    """

    question: str
    options: tuple[str, ...]
    context: str | None = None
    answer: int | None = None
    id: str | None = None
    meta: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.question, str) or not self.question.strip():
            raise ValueError(f"question must be a non-empty string, got {self.question!r}")
        if not isinstance(self.options, tuple):
            object.__setattr__(self, "options", tuple(self.options))
        n = len(self.options)
        if not MIN_OPTIONS <= n <= MAX_OPTIONS:
            raise ValueError(f"a question needs {MIN_OPTIONS}..{MAX_OPTIONS} options, got {n}")
        for i, text in enumerate(self.options):
            if not isinstance(text, str):
                raise ValueError(f"option {LETTERS[i]} must be a string, got {type(text).__name__}")
        if self.answer is not None and not (isinstance(self.answer, int) and 0 <= self.answer < n):
            raise ValueError(f"answer must be an option index in 0..{n - 1}, got {self.answer!r}")

    @property
    def num_options(self) -> int:
        return len(self.options)


TEMPLATES = ("plain-v1", "chat-v1")
INSTRUCTION = "Answer with the letter of the correct option."


def option_letters(num_options: int) -> str:
    """The first ``num_options`` letters: A, B, ..."""
    if not MIN_OPTIONS <= num_options <= MAX_OPTIONS:
        raise ValueError(f"num_options must be in {MIN_OPTIONS}..{MAX_OPTIONS}, got {num_options}")
    return LETTERS[:num_options]


def question_body(q: MCQuestion, context: str | None = None) -> str:
    """Context (if any), the stem, and one "X. text" line per option."""
    ctx = q.context if context is None else context
    lines = [f"{ctx.strip()}\n"] if ctx and ctx.strip() else []
    lines.append(f"Question: {q.question.strip()}")
    lines += [f"{letter}. {text.strip()}" for letter, text in zip(LETTERS, q.options, strict=False)]
    return "\n".join(lines) + "\n"


def format_prompt(q: MCQuestion, template: str = DEFAULT_TEMPLATE, tokenizer=None, context: str | None = None) -> str:
    """Prompt text whose next token is the answer letter (" A", " B", ...).

    Args:
        q: the question.
        template: ``plain-v1`` (body + "Answer:") or ``chat-v1`` (the tokenizer's chat template around
            body + instruction, then "Answer:" in the assistant turn).
        tokenizer: needed for ``chat-v1``.
        context: overrides ``q.context`` (used to fit a truncated passage).
    """
    body = question_body(q, context)
    if template == "plain-v1":
        return body + "Answer:"
    if template == "chat-v1":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("template 'chat-v1' needs a tokenizer with a chat template")
        messages = [{"role": "user", "content": body + INSTRUCTION}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + "Answer:"
    raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")


def option_token_ids(tokenizer, num_options: int = MAX_OPTIONS) -> list[int]:
    """Token ids of " A", " B", ... for the first ``num_options`` letters.

    Raises:
        ValueError: when a letter does not encode to exactly one token; scoring it as one row of the
            LM head would then be wrong.
    """
    ids = []
    for letter in option_letters(num_options):
        encoded = tokenizer.encode(" " + letter, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"option letter {letter!r} (as ' {letter}') is {len(encoded)} tokens {encoded} for this "
                "tokenizer; option heads need single-token letters"
            )
        ids.append(encoded[0])
    if len(set(ids)) != len(ids):
        raise ValueError(f"option letters share token ids: {ids}")
    return ids
