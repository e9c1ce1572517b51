"""benchmarks/feedback_store.py on a small store: the full replay and the starts from the checkpoint report the same
guarantees (the script asserts it), what it writes (the command, the CPU, the times), and bad arguments refused."""

import json

import pytest

from benchmarks.feedback_store import label_rows, main
from ibedl.engine.feedback_store import COLUMNS


def test_a_small_run_on_sqlite(tmp_path, capsys):
    out = tmp_path / "feedback_store.json"
    assert main(["--labels", "300", "--tail", "20", "--repeats", "2", "--stores", "sqlite", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"] == "python -m benchmarks.feedback_store --labels 300 --tail 20 --repeats 2 --stores " \
        f"sqlite --output {out}"
    assert result["cpu"]["model"] and result["started"] <= result["finished"]
    store = result["stores"]["sqlite"]
    assert store["labels"] == 300 and store["series"] == 3 and len(store["ready_s"]["each"]) == 2
    assert store["within_target"] and store["ready_s"]["max"] < store["full_replay_s"]
    share = {g["guarantee"]: g for g in store["guarantees"]}["answered_share"]
    assert share["labels"] == 300 and 0 <= share["lower"] <= share["hits"] / 300 <= share["upper"] <= 1


def test_rows_are_stored_labels():
    rows = label_rows(50, 1000, seed=0, now=2000.0)
    assert len(rows) == 50 and all(len(r) == len(COLUMNS) for r in rows)
    named = [dict(zip(COLUMNS, r, strict=True)) for r in rows]
    assert len({r["receipt_id"] for r in named}) == 50 and named[0]["receipt_id"] == f"{1000:032x}"
    assert all((r["target"] is None) == (not r["answered"]) for r in named)


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        main(["--labels", "0", "--stores", "sqlite"])
