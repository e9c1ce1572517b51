"""Every real-data loader on the real files in the data directory, checked against SOURCE.txt counts."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from ibedl.training.data import data_dir, load_dataset

DATA = data_dir()
pytestmark = pytest.mark.skipif(
    not DATA.is_dir(), reason=f"real data directory {DATA} not found (set IBEDL_DATA_DIR to run these tests)"
)

# (dataset, split, questions) as stated in each dataset's SOURCE.txt
COUNTS = [
    ("arc_easy", "train", 2251),
    ("arc_easy", "validation", 570),
    ("arc_easy", "test", 2376),
    ("arc_challenge", "train", 1119),
    ("arc_challenge", "validation", 299),
    ("arc_challenge", "test", 1172),
    ("obqa", "train", 4957),
    ("obqa", "validation", 500),
    ("obqa", "test", 500),
    ("sciq", "train", 11679),
    ("sciq", "validation", 1000),
    ("sciq", "test", 1000),
]
RACE_COUNTS = {  # split -> (high, middle) questions
    "train": (62445, 25421),
    "validation": (3451, 1436),
    "test": (3498, 1436),
}
ARC_FILES = {
    ("arc_easy", "train"): "arc_easy/ARC-Easy-Train.jsonl",
    ("arc_easy", "validation"): "arc_easy/ARC-Easy-Dev.jsonl",
    ("arc_easy", "test"): "arc_easy/ARC-Easy-Test.jsonl",
    ("arc_challenge", "train"): "arc_challenge/ARC-Challenge-Train.jsonl",
    ("arc_challenge", "validation"): "arc_challenge/ARC-Challenge-Dev.jsonl",
    ("arc_challenge", "test"): "arc_challenge/ARC-Challenge-Test.jsonl",
    ("obqa", "train"): "obqa/train.jsonl",
    ("obqa", "validation"): "obqa/dev.jsonl",
    ("obqa", "test"): "obqa/test.jsonl",
}
SCIQ_FILES = {"train": "sciq/train.json", "validation": "sciq/valid.json", "test": "sciq/test.json"}
SCIQ_WITH_SUPPORT = {"train": 10481, "validation": 887, "test": 884}  # from SciQ's readme.txt


def _raw_jsonl(relative: str) -> list[dict]:
    with open(DATA / relative, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize(("name", "split", "count"), COUNTS)
def test_split_counts_and_valid_answers(name: str, split: str, count: int) -> None:
    questions = load_dataset(name, split)
    assert len(questions) == count
    assert all(q.answer is not None and 0 <= q.answer < q.num_options for q in questions)
    assert len({q.id for q in questions}) == count  # ids are unique within a split
    assert all(q.meta["dataset"] == name and q.meta["split"] == split for q in questions)


@pytest.mark.parametrize(("name", "split"), list(ARC_FILES))
def test_arc_format_matches_raw_records(name: str, split: str) -> None:
    raw = _raw_jsonl(ARC_FILES[(name, split)])
    questions = load_dataset(name, split)
    assert len(questions) == len(raw)
    for record, q in zip(raw, questions, strict=True):
        choices = record["question"]["choices"]
        assert q.id == record["id"]
        assert q.question == record["question"]["stem"]
        assert q.options == tuple(c["text"] for c in choices)  # file order of the choices
        assert choices[q.answer]["label"] == record["answerKey"]
        assert q.context is None


@pytest.mark.parametrize("name", ["arc_easy", "arc_challenge"])
def test_arc_has_three_and_five_options(name: str) -> None:
    sizes = Counter(q.num_options for split in ("train", "validation", "test") for q in load_dataset(name, split))
    assert sizes[3] > 0 and sizes[5] > 0
    assert set(sizes) == {3, 4, 5}


def test_arc_numeric_labels() -> None:
    raw = {r["id"]: r for r in _raw_jsonl(ARC_FILES[("arc_easy", "train")])}
    numeric = [q for q in load_dataset("arc_easy", "train") if q.meta["labels"][0] == "1"]
    assert len(numeric) > 50  # about 100 ARC-Easy train questions use "1".."4"
    for q in numeric:
        record = raw[q.id]
        assert record["question"]["choices"][0]["label"] == "1"
        assert q.answer == int(record["answerKey"]) - 1
        key_text = next(c["text"] for c in record["question"]["choices"] if c["label"] == record["answerKey"])
        assert q.options[q.answer] == key_text
    # and the answer is not always the first option
    assert len({q.answer for q in numeric}) == 4


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_sciq_correct_answer_placement(split: str) -> None:
    with open(DATA / SCIQ_FILES[split], encoding="utf-8") as f:
        raw = json.load(f)
    first = load_dataset("sciq", split)
    second = load_dataset("sciq", split)
    assert len(first) == len(raw)
    for i, (record, q, again) in enumerate(zip(raw, first, second, strict=True)):
        assert q.id == f"sciq-{split}-{i}"
        assert q.options[q.answer] == record["correct_answer"]
        fields = [record["distractor1"], record["distractor2"], record["distractor3"], record["correct_answer"]]
        assert sorted(q.options) == sorted(fields)
        assert (again.options, again.answer) == (q.options, q.answer)  # deterministic across loads
        assert q.context == (record["support"] or None)
    assert sum(q.context is not None for q in first) == SCIQ_WITH_SUPPORT[split]
    # the correct answer is spread over the four positions, not left last
    positions = Counter(q.answer for q in first)
    assert set(positions) == {0, 1, 2, 3}
    assert min(positions.values()) > 0.15 * len(first)


def test_sciq_placement_does_not_depend_on_limit() -> None:
    full = {q.id: q for q in load_dataset("sciq", "validation")}
    some = load_dataset("sciq", "validation", limit=40, seed=3)
    assert len(some) == 40
    for q in some:
        assert (q.options, q.answer) == (full[q.id].options, full[q.id].answer)


@pytest.fixture(scope="module")
def race() -> dict[str, list]:
    """All three RACE splits, read once for the module."""
    return {split: load_dataset("race", split) for split in RACE_COUNTS}


@pytest.mark.parametrize("split", list(RACE_COUNTS))
def test_race_counts(race: dict[str, list], split: str) -> None:
    questions = race[split]
    high, middle = RACE_COUNTS[split]
    assert len(questions) == high + middle
    assert Counter(q.meta["level"] for q in questions) == {"high": high, "middle": middle}
    assert all(q.num_options == 4 and 0 <= q.answer < 4 for q in questions)
    assert len({q.id for q in questions}) == len(questions)
    # every level's files come in sorted order: high first, then middle
    levels = [q.meta["level"] for q in questions]
    assert levels == sorted(levels)


def test_race_context_is_the_article(race: dict[str, list]) -> None:
    by_id = {q.id: q for q in race["validation"]}
    for path in sorted((DATA / "race/RACE/dev/middle").glob("*.txt"))[:20]:
        record = json.loads(path.read_text(encoding="utf-8"))
        for k, question in enumerate(record["questions"]):
            q = by_id[f"{record['id']}-{k}"]
            assert q.context == record["article"]
            assert q.question == question
            assert q.options == tuple(record["options"][k])
            assert "ABCD"[q.answer] == record["answers"][k]
