"""Multiple-choice datasets as lists of `MCQuestion`: a registry of the known ones and `load_dataset`.

Files are read from the data directory: ``$IBEDL_DATA_DIR``, by default ``<repo root>/../shared/data``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from ibedl.core.prompt import MCQuestion
from ibedl.training.data.arc import (
    ARC_CHALLENGE_FILES,
    ARC_EASY_FILES,
    OBQA_FILES,
    load_arc_challenge,
    load_arc_easy,
    load_obqa,
)
from ibedl.training.data.csqa import CSQA_FILES, load_csqa
from ibedl.training.data.errors import DATA_DIR_ENV, DatasetError
from ibedl.training.data.jsonl import read_jsonl_file
from ibedl.training.data.mmlu import MMLU_DIRS, load_mmlu
from ibedl.training.data.noise import perturb_labels, subset
from ibedl.training.data.race import RACE_DIRS, load_race
from ibedl.training.data.sciq import SCIQ_FILES, load_sciq

__all__ = [
    "DATASETS",
    "DatasetError",
    "DatasetSpec",
    "SPLITS",
    "data_dir",
    "load_dataset",
    "perturb_labels",
    "subset",
]

SPLITS = ("train", "validation", "test")

# <repo root>/../shared/data, where <repo root> is the directory holding the `ibedl` package


@dataclass(frozen=True)
class DatasetSpec:
    """A known dataset.

    Attributes:
        name: the registry key.
        description: one line about it.
        splits: canonical split name -> where its questions come from, relative to the data
            directory (a file, or a directory for RACE and MMLU).
        load: ``load(source, split)`` -> questions; `source` is the data directory, or the
            user's file when `needs_path`.
        needs_path: whether the dataset is read from the `path` argument (the generic JSONL).
    """

    name: str
    description: str
    splits: Mapping[str, str]
    load: Callable[[Path, str], list[MCQuestion]]
    needs_path: bool = False


def _load_jsonl(path: Path, split: str) -> list[MCQuestion]:
    return read_jsonl_file(path)


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec("arc_easy", "ARC-Easy: grade-school science, 3-5 options", ARC_EASY_FILES, load_arc_easy),
        DatasetSpec(
            "arc_challenge", "ARC-Challenge: harder grade-school science, 3-5 options", ARC_CHALLENGE_FILES,
            load_arc_challenge,
        ),
        DatasetSpec("obqa", "OpenBookQA (main): elementary science, 4 options", OBQA_FILES, load_obqa),
        DatasetSpec("sciq", "SciQ: science questions with a support passage, 4 options", SCIQ_FILES, load_sciq),
        DatasetSpec("race", "RACE: reading comprehension (high + middle), 4 options", RACE_DIRS, load_race),
        DatasetSpec("csqa", "CommonsenseQA: commonsense questions, 5 options", CSQA_FILES, load_csqa),
        DatasetSpec("mmlu", "MMLU: 57 exam subjects, 4 options", MMLU_DIRS, load_mmlu),
        DatasetSpec(
            "jsonl", "your own JSONL file, given as path= (format: ibedl.training.data.jsonl)",
            {split: "<path>" for split in SPLITS}, _load_jsonl, needs_path=True,
        ),
    )
}


def data_dir() -> Path:
    """The directory holding the datasets: ``$IBEDL_DATA_DIR`` if set, else ``<repo root>/../shared/data``.

    The default is resolved from this package's location, not from the current directory.
    """
    return _configured_data_dir()


def _configured_data_dir() -> Path:  # load_dataset's `data_dir` argument hides `data_dir()`
    from ibedl.core.paths import data_dir as configured

    return configured()


def load_dataset(
    name: str,
    split: str,
    *,
    data_dir: str | Path | None = None,
    path: str | Path | None = None,
    limit: int | None = None,
    seed: int = 0,
    label_noise: float = 0.0,
    noise_seed: int = 0,
    exclude: Collection[str] = (),
) -> list[MCQuestion]:
    """Load one split of a dataset as multiple-choice questions.

    Args:
        name: a key of `DATASETS` ("arc_easy", "arc_challenge", "obqa", "sciq", "race", "csqa",
            "mmlu", "jsonl").
        split: "train", "validation" or "test" (for "jsonl" the split is checked but not used).
        data_dir: the data directory; by default `data_dir()`.
        path: the file to read, for "jsonl" only (required there).
        limit: keep a seeded random subset of this many questions (in file order; see `subset`);
            None keeps them all, in file order.
        seed: the seed of that subset.
        label_noise: the fraction of labels to move to a wrong option, after subsetting
            (see `perturb_labels`); 0 changes nothing.
        noise_seed: the seed of the label noise.
        exclude: ids of questions left out before the subset is drawn (a run's start's training questions,
            ``data.disjoint_from``); the subset is then drawn from the rest as `subset` draws it.

    Returns:
        The questions, each with ``answer`` the 0-based index of the correct option.

    Raises:
        ValueError: unknown dataset or split, a misplaced or missing `path`, a bad `limit` or `label_noise`.
        DatasetError: a file is missing or malformed (a ValueError too).
    """
    spec = DATASETS.get(name)
    if spec is None:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    if split not in spec.splits:
        raise ValueError(f"unknown split {split!r} for dataset {name!r}; valid splits: {', '.join(spec.splits)}")
    if isinstance(label_noise, bool) or not (isinstance(label_noise, numbers.Real) and 0 <= label_noise < 1):
        raise ValueError(f"label_noise must be a number in [0, 1), got {label_noise!r}")
    if spec.needs_path:
        if path is None:
            raise ValueError(f"dataset {name!r} reads the file given as path=..., and none was given")
        questions = spec.load(Path(path).expanduser(), split)
    else:
        if path is not None:
            raise ValueError(f"path= is only for the 'jsonl' dataset; for {name!r} set data_dir= or {DATA_DIR_ENV}")
        root = Path(data_dir).expanduser() if data_dir is not None else _configured_data_dir()
        questions = spec.load(root, split)
    if isinstance(exclude, str):  # a lone id would be read as a set of characters
        raise ValueError(f"exclude must be a collection of question ids, got the string {exclude!r}")
    if exclude:
        questions = [q for q in questions if q.id not in exclude]
    questions = subset(questions, limit, seed)
    if label_noise:
        questions = perturb_labels(questions, label_noise, noise_seed)
    return questions
