"""The loaders on small synthetic files: CSQA, MMLU, the generic JSONL, and errors for malformed records."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from ibedl.training.data import DATASETS, DatasetError, data_dir, load_dataset
from ibedl.training.data.race import read_race_dir
from ibedl.training.data.sciq import read_sciq_file


def _write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _ai2(qid: str, stem: str, texts: list[str], key: str, labels: str = "ABCDE", **extra) -> str:
    choices = [{"label": label, "text": text} for label, text in zip(labels, texts, strict=False)]
    return json.dumps({"id": qid, "question": {"stem": stem, "choices": choices, **extra}, "answerKey": key})


# ---------------------------------------------------------------- data directory and registry


def test_data_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("IBEDL_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path
    _write(tmp_path / "obqa/test.jsonl", [_ai2("x", "Why?", ["a", "b", "c", "d"], "C")])
    assert [q.answer for q in load_dataset("obqa", "test")] == [2]


def test_default_data_dir_is_relative_to_the_repo_not_the_cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("IBEDL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    repo_root = Path(__file__).resolve().parents[3]  # tests/training/data/<this file>
    assert data_dir() == repo_root.parent / "shared" / "data"


def test_registry_names() -> None:
    assert set(DATASETS) == {"arc_easy", "arc_challenge", "obqa", "sciq", "race", "csqa", "mmlu", "jsonl"}
    for spec in DATASETS.values():
        assert set(spec.splits) == {"train", "validation", "test"}


def test_unknown_dataset_and_split_list_the_valid_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dataset 'arc'.*arc_easy.*mmlu.*jsonl"):
        load_dataset("arc", "train", data_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown split 'dev'.*train, validation, test"):
        load_dataset("arc_easy", "dev", data_dir=tmp_path)


def test_missing_file_names_path_and_env_var(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as info:
        load_dataset("arc_challenge", "validation", data_dir=tmp_path)
    message = str(info.value)
    assert str(tmp_path / "arc_challenge" / "ARC-Challenge-Dev.jsonl") in message
    assert "IBEDL_DATA_DIR" in message
    with pytest.raises(DatasetError, match=r"race.RACE.test.high: not found"):
        load_dataset("race", "test", data_dir=tmp_path)


def test_path_is_for_jsonl_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="path= is only for the 'jsonl' dataset"):
        load_dataset("sciq", "test", path=tmp_path / "x.json")
    with pytest.raises(ValueError, match="path="):
        load_dataset("jsonl", "test")


def test_dataset_error_pickles() -> None:
    error = DatasetError("a/b.jsonl", "missing key 'id'", line=7)
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) == "a/b.jsonl:7: missing key 'id'"
    assert isinstance(again, ValueError) and again.line == 7


# ---------------------------------------------------------------- CommonsenseQA


def _csqa_line(i: int) -> str:
    texts = [f"option {i}.{k}" for k in range(5)]
    return _ai2(f"cs{i}", f"question {i}?", texts, "ABCDE"[i % 5], question_concept=f"concept{i}")


def test_csqa_splits(tmp_path: Path) -> None:
    _write(tmp_path / "csqa/train_rand_split.jsonl", [_csqa_line(i) for i in range(25)])
    _write(tmp_path / "csqa/dev_rand_split.jsonl", [_csqa_line(100 + i) for i in range(7)])
    train = load_dataset("csqa", "train", data_dir=tmp_path)
    validation = load_dataset("csqa", "validation", data_dir=tmp_path)
    test = load_dataset("csqa", "test", data_dir=tmp_path)
    # validation = the 10th, 20th, ... record of the train file; train = the rest, in file order
    assert [q.id for q in validation] == ["cs9", "cs19"]
    assert [q.id for q in train] == [f"cs{i}" for i in range(25) if i not in (9, 19)]
    assert [q.id for q in test] == [f"cs{100 + i}" for i in range(7)]
    q = train[3]
    assert q.question == "question 3?"
    assert q.options == tuple(f"option 3.{k}" for k in range(5))
    assert q.answer == 3 and q.options[q.answer] == "option 3.3"
    assert q.meta["concept"] == "concept3" and q.meta["split"] == "train"


# ---------------------------------------------------------------- MMLU


def test_mmlu_csv_and_split_mapping(tmp_path: Path) -> None:
    _write(
        tmp_path / "mmlu/test/astronomy_test.csv",
        [
            '"What is 1,5 in ""decimal""?",1.5,15,"one, five","a\nb",A',
            'Which planet?,Mars,Venus,Earth,"Jupiter, the big one",D',
        ],
    )
    _write(tmp_path / "mmlu/test/anatomy_test.csv", ["Bones?,206,100,12,3,A"])
    _write(tmp_path / "mmlu/dev/anatomy_dev.csv", ["Few-shot?,x,y,z,w,C"])
    test = load_dataset("mmlu", "test", data_dir=tmp_path)
    # subjects in sorted file order, rows in file order
    assert [q.meta["subject"] for q in test] == ["anatomy", "astronomy", "astronomy"]
    assert [q.id for q in test] == ["mmlu-anatomy_test-0", "mmlu-astronomy_test-0", "mmlu-astronomy_test-1"]
    q = test[1]
    assert q.question == 'What is 1,5 in "decimal"?'
    assert q.options == ("1.5", "15", "one, five", "a\nb")
    assert q.answer == 0
    assert test[2].answer == 3 and test[2].options[3] == "Jupiter, the big one"
    train = load_dataset("mmlu", "train", data_dir=tmp_path)  # train reads mmlu/dev
    assert [(q.question, q.answer, q.meta["split"]) for q in train] == [("Few-shot?", 2, "train")]
    with pytest.raises(DatasetError, match=r"mmlu.val: not found.*IBEDL_DATA_DIR"):
        load_dataset("mmlu", "validation", data_dir=tmp_path)


@pytest.mark.parametrize(
    ("bad_row", "problem"),
    [
        ("Q?,a,b,c,d", "expected 6 columns"),
        ("Q?,a,b,c,d,E", "answer 'E' is not one of A, B, C, D"),
        (" ,a,b,c,d,A", "the question is empty"),
    ],
)
def test_mmlu_malformed_row_gives_its_line(tmp_path: Path, bad_row: str, problem: str) -> None:
    # the first record spans lines 1-2, so the bad record (row 1) starts on line 3
    path = _write(tmp_path / "mmlu/val/law_val.csv", ['"Two\nlines?",a,b,c,d,B', bad_row])
    with pytest.raises(DatasetError) as info:
        load_dataset("mmlu", "validation", data_dir=tmp_path)
    assert str(info.value).startswith(f"{path}:3: row 1: ")
    assert problem in str(info.value)


# ---------------------------------------------------------------- generic JSONL


def test_jsonl_list_and_map_options_letter_and_int_answers(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "mine.jsonl",
        [
            json.dumps({"question": "Q1?", "options": ["a", "b", "c"], "answer": "B"}),
            "",
            json.dumps({"question": "Q2?", "options": {"B": "bee", "A": "ay"}, "answer": 1, "id": "second"}),
            json.dumps(
                {"question": "Q3?", "options": {"A": "x", "B": "y", "C": "z"}, "answer": "C", "context": "Text."}
            ),
            json.dumps({"question": "Q4?", "options": ["p", "q"], "answer": 0, "context": "", "meta": {"k": 1}}),
        ],
    )
    questions = load_dataset("jsonl", "test", path=path)
    assert [(q.question, q.options, q.answer) for q in questions] == [
        ("Q1?", ("a", "b", "c"), 1),
        ("Q2?", ("ay", "bee"), 1),  # map options are ordered by letter
        ("Q3?", ("x", "y", "z"), 2),
        ("Q4?", ("p", "q"), 0),
    ]
    assert [q.id for q in questions] == ["mine-0", "second", "mine-2", "mine-3"]
    assert [q.context for q in questions] == [None, None, "Text.", None]
    assert questions[3].meta == {"k": 1}
    assert load_dataset("jsonl", "train", path=path) == questions  # the split is not used


# ---------------------------------------------------------------- malformed records, every format

GOOD_JSONL = json.dumps({"question": "Fine?", "options": ["a", "b"], "answer": "A"})
GOOD_ARC = _ai2("ok", "Fine?", ["a", "b", "c", "d"], "A")


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"question": "Q?", "options": ["a", "b"], "answer": "A"', "invalid JSON"),
        (json.dumps({"options": ["a", "b"], "answer": "A"}), "missing key 'question'"),
        (json.dumps({"question": "Q?", "answer": "A"}), "missing key 'options'"),
        (json.dumps({"question": "Q?", "options": ["a", "b"]}), "missing key 'answer'"),
        (json.dumps({"question": "Q?", "options": ["a", "b"], "answer": "C"}), "answer 'C' is not the letter"),
        (json.dumps({"question": "Q?", "options": ["a", "b"], "answer": 2}), "answer 2 is not a 0-based index"),
        (json.dumps({"question": "Q?", "options": ["a", "b"], "answer": "1"}), "an integer answer is a 0-based"),
        (json.dumps({"question": "Q?", "options": ["a", "b"], "answer": True}), "'answer' must be a string or"),
        (json.dumps({"question": "Q?", "options": {"A": "a", "C": "c"}, "answer": "A"}), "consecutive capital"),
        (json.dumps({"question": "Q?", "options": ["a"], "answer": "A"}), "at least 2 options, got 1"),
        (json.dumps({"question": "Q?", "options": ["a", 3], "answer": "A"}), "option B must be a string"),
        (json.dumps({"question": "  ", "options": ["a", "b"], "answer": "A"}), "the question is empty"),
        (json.dumps(["not", "an", "object"]), "record must be a JSON object"),
    ],
)
def test_jsonl_malformed_line(tmp_path: Path, bad_line: str, problem: str) -> None:
    path = _write(tmp_path / "user.jsonl", [GOOD_JSONL, "", GOOD_JSONL, bad_line, GOOD_JSONL])
    with pytest.raises(DatasetError) as info:
        load_dataset("jsonl", "test", path=path)
    assert str(info.value).startswith(f"{path}:4: ")
    assert problem in str(info.value)
    assert info.value.line == 4 and info.value.path == path


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"id": "x", "question": {"stem": "Q?", "choices": []', "invalid JSON"),
        (json.dumps({"id": "x", "question": {"choices": []}, "answerKey": "A"}), "missing key 'question.stem'"),
        (json.dumps({"question": {"stem": "Q?", "choices": []}, "answerKey": "A"}), "missing key 'id'"),
        (_ai2("x", "Q?", ["a", "b", "c", "d"], "E"), "answerKey 'E' is not one of the choice labels"),
        (_ai2("x", "Q?", ["a", "b", "c"], "4", labels="123"), "answerKey '4' is not one of the choice labels"),
        (_ai2("x", "Q?", ["a"], "A"), "at least 2 options, got 1"),
        (_ai2("x", "", ["a", "b", "c"], "A"), "the question is empty"),
        (_ai2("x", "Q?", ["a", "b"], "A", labels="AA"), "choice labels are not unique"),
    ],
)
def test_arc_format_malformed_line(tmp_path: Path, bad_line: str, problem: str) -> None:
    path = _write(tmp_path / "arc_easy/ARC-Easy-Test.jsonl", [GOOD_ARC, GOOD_ARC, bad_line])
    with pytest.raises(DatasetError) as info:
        load_dataset("arc_easy", "test", data_dir=tmp_path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert problem in str(info.value)


def test_arc_numeric_labels_synthetic(tmp_path: Path) -> None:
    _write(tmp_path / "obqa/train.jsonl", [_ai2("n", "Q?", ["one", "two", "three"], "3", labels="123")])
    [q] = load_dataset("obqa", "train", data_dir=tmp_path)
    assert (q.answer, q.options[q.answer], q.meta["labels"]) == (2, "three", ("1", "2", "3"))


def test_csqa_malformed_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "csqa/dev_rand_split.jsonl", [_csqa_line(0), _ai2("z", "Q?", ["a", "b"], "C")])
    with pytest.raises(DatasetError, match=rf"^{path}:2: answerKey 'C' is not one of the choice labels"):
        load_dataset("csqa", "test", data_dir=tmp_path)


def _sciq(question: str = "Q?", **changes) -> dict:
    record = {"question": question, "distractor1": "a", "distractor2": "b", "distractor3": "c"}
    record.update(correct_answer="right", support="")
    record.update(changes)
    return record


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({"question": "Q?", "distractor1": "a", "distractor2": "b", "distractor3": "c"},
         "missing key 'correct_answer'"),
        (_sciq(question=""), "the question is empty"),
        (_sciq(distractor2=None), "'distractor2' must be a string, got null"),
    ],
)
def test_sciq_malformed_element_gives_its_index(tmp_path: Path, bad: dict, problem: str) -> None:
    path = tmp_path / "sciq/test.json"
    path.parent.mkdir()
    path.write_text(json.dumps([_sciq(), _sciq(), bad]), encoding="utf-8")
    with pytest.raises(DatasetError) as info:
        load_dataset("sciq", "test", data_dir=tmp_path)
    assert str(info.value) == f"{path}: element 2: {problem}"


def test_sciq_invalid_json_gives_its_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "valid.json", ["[", json.dumps(_sciq()) + ",", '{"question": }', "]"])
    with pytest.raises(DatasetError, match=rf"^{path}:3: invalid JSON"):
        read_sciq_file(path, split="validation")


def test_sciq_synthetic_placement(tmp_path: Path) -> None:
    path = tmp_path / "test.json"
    path.write_text(json.dumps([_sciq(f"Q{i}?", support="S." if i % 2 else "") for i in range(40)]), encoding="utf-8")
    questions = read_sciq_file(path, split="test")
    assert all(q.options[q.answer] == "right" and sorted(q.options) == ["a", "b", "c", "right"] for q in questions)
    assert {q.answer for q in questions} == {0, 1, 2, 3}  # not always in the same place
    assert [q.context for q in questions[:2]] == [None, "S."]
    assert [(q.options, q.answer) for q in read_sciq_file(path, split="test")] == [
        (q.options, q.answer) for q in questions
    ]


def _race_record(**changes) -> dict:
    record = {
        "article": "A story.",
        "questions": ["First?", "Second?"],
        "options": [["a", "b", "c", "d"], ["e", "f", "g", "h"]],
        "answers": ["B", "D"],
        "id": "middle7.txt",
    }
    record.update(changes)
    return record


def _race_passage(directory: Path, name: str) -> Path:
    """The path of high-school passage ``name`` in the RACE split directory ``directory`` (both levels made)."""
    (directory / "middle").mkdir(parents=True, exist_ok=True)
    (directory / "high").mkdir(exist_ok=True)
    return directory / "high" / name


def test_race_synthetic(tmp_path: Path) -> None:
    for level, name in [("middle", "7.txt"), ("high", "2.txt"), ("high", "10.txt")]:
        path = tmp_path / "race/RACE/dev" / level / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_race_record(id=f"{level}{name}")), encoding="utf-8")
    questions = load_dataset("race", "validation", data_dir=tmp_path)
    # high before middle, file names sorted as strings
    assert [q.id for q in questions] == [
        "high10.txt-0", "high10.txt-1", "high2.txt-0", "high2.txt-1", "middle7.txt-0", "middle7.txt-1"
    ]
    assert [q.answer for q in questions[:2]] == [1, 3]
    assert all(q.context == "A story." for q in questions)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"answers": ["B", "E"]}, "question 1: answer 'E' is not the letter of one of its 4 options"),
        ({"options": [["a", "b", "c", "d"], ["e"]]}, "question 1: a question needs at least 2 options, got 1"),
        ({"questions": ["First?", ""]}, "question 1: the question is empty"),
        ({"answers": ["B"]}, "2 questions, 2 option lists and 1 answers: counts differ"),
    ],
)
def test_race_malformed_question_gives_file_and_index(tmp_path: Path, changes: dict, problem: str) -> None:
    path = _race_passage(tmp_path, "5.txt")
    path.write_text(json.dumps(_race_record(**changes)), encoding="utf-8")
    with pytest.raises(DatasetError) as info:
        read_race_dir(tmp_path)
    assert str(info.value) == f"{path}: {problem}"


def test_race_missing_key_and_invalid_json(tmp_path: Path) -> None:
    path = _race_passage(tmp_path, "6.txt")
    record = _race_record()
    del record["article"]
    path.write_text(json.dumps(record), encoding="utf-8")
    with pytest.raises(DatasetError, match=rf"^{path}: missing key 'article'$"):
        read_race_dir(tmp_path)
    path.write_text('{"article": "x",\n "questions": [,]}', encoding="utf-8")
    with pytest.raises(DatasetError, match=rf"^{path}:2: invalid JSON"):
        read_race_dir(tmp_path)
