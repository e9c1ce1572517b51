"""MMLU (Hendrycks et al.): four-choice exam questions in 57 subjects, one headerless CSV per subject and split.

Layout: ``mmlu/{dev,val,test}/<subject>_{dev,val,test}.csv``; columns ``question, A, B, C, D, answer letter``.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from ibedl.core.prompt import MCQuestion
from ibedl.training.data.errors import DatasetError, missing_file
from ibedl.training.data.reading import Where, letter_index, read_text

# canonical split -> directory, relative to the data directory (dev: the 5 few-shot examples per subject)
MMLU_DIRS = {
    "train": "mmlu/dev",
    "validation": "mmlu/val",
    "test": "mmlu/test",
}
NUM_OPTIONS = 4


def read_mmlu_file(
    path: str | Path, *, subject: str | None = None, split: str | None = None, in_data_dir: bool = False
) -> list[MCQuestion]:
    """Read one MMLU CSV file (no header; quoted fields may hold commas and newlines).

    Ids are ``f"mmlu-{file stem}-{row}"`` (row: 0-based record index); ``meta["subject"]`` is the subject.

    Args:
        path: the CSV file.
        subject: the subject; by default the file name without its ``_{dev,val,test}.csv`` suffix.
        split: the canonical split name, stored in ``meta["split"]``.
        in_data_dir: whether the file was looked for in the data directory (for the message if missing).

    Returns:
        The questions, in file order.

    Raises:
        DatasetError: the file is missing or a row is malformed (the message gives the line the row starts on).
    """
    path = Path(path)
    if subject is None:
        subject = _subject(path)
    reader = csv.reader(io.StringIO(read_text(path, in_data_dir=in_data_dir), newline=""))
    out = []
    row_index = 0
    while True:
        start = reader.line_num + 1
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            raise DatasetError(path, f"malformed CSV: {e}", line=start) from None
        if not row or all(not cell.strip() for cell in row):
            continue
        where = Where(path, start, item=f"row {row_index}")
        if len(row) != NUM_OPTIONS + 2:
            raise where.error(f"expected {NUM_OPTIONS + 2} columns (question, A, B, C, D, answer), got {len(row)}")
        letter = row[-1].strip()
        answer = letter_index(letter, NUM_OPTIONS)
        if answer is None:
            raise where.error(f"answer {row[-1]!r} is not one of A, B, C, D")
        meta = {"dataset": "mmlu", "split": split, "subject": subject}
        out.append(where.question(row[0], row[1:-1], answer, id=f"mmlu-{path.stem}-{row_index}", meta=meta))
        row_index += 1
    return out


def read_mmlu_dir(directory: str | Path, *, split: str | None = None, in_data_dir: bool = False) -> list[MCQuestion]:
    """Read every ``*.csv`` in one split directory, subjects in sorted file-name order.

    Raises:
        DatasetError: the directory is missing or holds no CSV file, or a row is malformed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise missing_file(directory, in_data_dir=in_data_dir)
    files = sorted(directory.glob("*.csv"))
    if not files:
        raise DatasetError(directory, "no *.csv files in this directory")
    out: list[MCQuestion] = []
    for path in files:
        out.extend(read_mmlu_file(path, split=split))
    return out


def load_mmlu(root: Path, split: str) -> list[MCQuestion]:
    """MMLU, all subjects, from the data directory `root` (split: train = dev, validation = val, test)."""
    return read_mmlu_dir(root / MMLU_DIRS[split], split=split, in_data_dir=True)


def _subject(path: Path) -> str:
    stem = path.stem
    for suffix in ("_dev", "_val", "_test"):
        if stem.endswith(suffix):
            return stem[: -len(suffix)]
    return stem
