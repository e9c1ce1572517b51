"""CommonsenseQA (random split): five-choice commonsense questions in AI2's JSONL format.

Each line: ``{"id", "question": {"stem", "question_concept", "choices": [5 x {"label", "text"}]}, "answerKey"}``.
The official test set has no answers, so the official dev file serves as ``test``, and
``validation`` is held out of the official train file: every record whose 0-based position among
the file's records is ``9 mod 10`` (the 10th, 20th, ... record; ``n // 10`` of them), ``train`` being
the other 90%. The split depends only on record order, so it is the same on every machine.
"""

from __future__ import annotations

from pathlib import Path

from ibedl.core.prompt import MCQuestion
from ibedl.training.data.arc import parse_choice_record
from ibedl.training.data.reading import Where, iter_jsonl

CSQA_TRAIN_FILE = "csqa/train_rand_split.jsonl"
CSQA_DEV_FILE = "csqa/dev_rand_split.jsonl"
# canonical split -> file, relative to the data directory
CSQA_FILES = {
    "train": CSQA_TRAIN_FILE + " (records at positions i % 10 != 9)",
    "validation": CSQA_TRAIN_FILE + " (records at positions i % 10 == 9)",
    "test": CSQA_DEV_FILE,
}
HELD_OUT_EVERY = 10  # validation = every 10th record of the train file


def is_held_out(position: int) -> bool:
    """Whether the record at this 0-based position of the train file belongs to validation."""
    return position % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def read_csqa_file(path: str | Path, *, split: str | None = None, in_data_dir: bool = False) -> list[MCQuestion]:
    """Read a CommonsenseQA JSONL file, in file order.

    ``meta["concept"]`` holds ``question_concept`` when present.

    Args:
        path: the JSONL file.
        split: the canonical split name, stored in ``meta["split"]``.
        in_data_dir: whether the file was looked for in the data directory (for the message if missing).

    Returns:
        The questions.

    Raises:
        DatasetError: the file is missing or a line is malformed (the message gives the line).
    """
    path = Path(path)
    out = []
    for line, value in iter_jsonl(path, in_data_dir=in_data_dir):
        where = Where(path, line)
        question = parse_choice_record(value, where, meta={"dataset": "csqa", "split": split})
        concept = value["question"].get("question_concept")
        if isinstance(concept, str):
            question.meta["concept"] = concept
        out.append(question)
    return out


def load_csqa(root: Path, split: str) -> list[MCQuestion]:
    """CommonsenseQA from the data directory `root` (split: train, validation, test; see the module docstring)."""
    if split == "test":
        return read_csqa_file(root / CSQA_DEV_FILE, split=split, in_data_dir=True)
    questions = read_csqa_file(root / CSQA_TRAIN_FILE, split=split, in_data_dir=True)
    held_out = split == "validation"
    return [q for i, q in enumerate(questions) if is_held_out(i) == held_out]
